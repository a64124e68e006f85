-- +goose Up
-- The ordered inbox (InboxConfig.Ordered). Per (consumer, key) the last
-- sequence number applied, and how many of its messages acemq_inbox_held
-- holds (0 lets the next message be applied by one statement that reads
-- this row alone); the transaction that applies a keyed message
-- locks its row, so two deliveries of one key serialise, and advances it.
CREATE TABLE IF NOT EXISTS acemq_inbox_sequences (
    consumer_name varchar(255) NOT NULL,
    aggregate_id  varchar(255) NOT NULL,
    last_seq      bigint       NOT NULL,
    held          bigint       NOT NULL DEFAULT 0,
    PRIMARY KEY (consumer_name, aggregate_id)
);

-- Messages that arrived before their predecessor, held until it is applied
-- (then each runs in a transaction of its own) or an operator skips the gap.
-- payload and payload_encoding as acemq_outbox's body and body_encoding;
-- metadata a JSON object of strings.
CREATE TABLE IF NOT EXISTS acemq_inbox_held (
    consumer_name    varchar(255)   NOT NULL,
    aggregate_id     varchar(255)   NOT NULL,
    seq              bigint         NOT NULL,
    message_id       varchar(64)    NOT NULL,
    payload          text           NOT NULL,
    payload_encoding varchar(16)    NOT NULL DEFAULT 'utf-8',
    metadata         text           NOT NULL DEFAULT '{}',
    held_at          timestamptz(6) NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer_name, aggregate_id, seq)
);

-- Gaps are found by age.
CREATE INDEX IF NOT EXISTS acemq_inbox_held_held_at
    ON acemq_inbox_held (held_at);
