-- +goose Up
-- The ordered inbox (InboxConfig.Ordered). Per (consumer, key) the last
-- sequence number applied, and how many of its messages acemq_inbox_held
-- holds (0 lets the next message be applied by one statement that reads
-- this row alone); the transaction that applies a keyed message
-- locks its row (INSERT … ON DUPLICATE KEY UPDATE), so two deliveries of one
-- key serialise, and advances it.
CREATE TABLE IF NOT EXISTS acemq_inbox_sequences (
    consumer_name varchar(255) NOT NULL,
    aggregate_id  varchar(255) NOT NULL,
    last_seq      bigint       NOT NULL,
    held          bigint       NOT NULL DEFAULT 0,
    PRIMARY KEY (consumer_name, aggregate_id)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;

-- Messages that arrived before their predecessor, held until it is applied
-- (then each runs in a transaction of its own) or an operator skips the gap.
-- payload and payload_encoding as acemq_outbox's body and body_encoding;
-- metadata a JSON object of strings. The index on held_at finds gaps by age.
CREATE TABLE IF NOT EXISTS acemq_inbox_held (
    consumer_name    varchar(255) NOT NULL,
    aggregate_id     varchar(255) NOT NULL,
    seq              bigint       NOT NULL,
    message_id       varchar(64)  NOT NULL,
    payload          longtext     NOT NULL,
    payload_encoding varchar(16)  NOT NULL DEFAULT 'utf-8',
    metadata         longtext     NOT NULL,
    held_at          datetime(6)  NOT NULL,
    PRIMARY KEY (consumer_name, aggregate_id, seq),
    KEY acemq_inbox_held_held_at (held_at)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;
