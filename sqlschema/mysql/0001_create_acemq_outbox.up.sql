-- +goose Up
-- The AceMQ outbox: one row per message, written in the caller's transaction.
-- Serves MySQL 8 and MariaDB 10.6+.
--
-- utf8mb4_bin: ids and names compare byte for byte. Under a case-insensitive
-- collation the ids "a1" and "A1" would collide and the second message would
-- be dropped as a duplicate.
-- longtext: a body of many megabytes fits; text (64 KiB) would refuse it.
-- The indexes live inside CREATE TABLE because MySQL 8 has no
-- CREATE INDEX IF NOT EXISTS, and this file must be safe to apply twice.
CREATE TABLE IF NOT EXISTS acemq_outbox (
    id            varchar(64)   NOT NULL,
    exchange_name varchar(255)  NOT NULL,
    routing_key   varchar(255)  NOT NULL,
    body          longtext      NOT NULL,
    body_encoding varchar(16)   NOT NULL DEFAULT 'utf-8',
    content_type  varchar(255)  NOT NULL DEFAULT '',
    headers       longtext      NOT NULL,
    created_at    datetime(6)   NOT NULL,
    published_at  datetime(6)   NULL,
    attempts      int           NOT NULL DEFAULT 0,
    last_error    varchar(1000) NULL,
    locked_by     varchar(64)   NULL,
    locked_until  datetime(6)   NULL,
    processed_at  datetime(6)   NULL,
    PRIMARY KEY (id),
    -- Pending rows (published_at NULL) sit together at the head of this
    -- index, in claim order, so the relay's query is a short range scan
    -- however many published rows follow them. Purge uses the same index.
    KEY acemq_outbox_pending (published_at, created_at, id)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;
