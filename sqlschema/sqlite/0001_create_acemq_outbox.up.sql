-- +goose Up
-- The AceMQ outbox: one row per message, written in the caller's transaction.
--
-- Timestamps are stored as fixed-width UTC text, "2006-01-02 15:04:05.000000",
-- so that text order is time order and comparisons in SQL are correct. The
-- DATETIME type name makes mattn/go-sqlite3 read them back as time.Time.
--
-- aggregate_id and seq are 0005's (per-aggregate order). They are made here
-- with the table because goose and golang-migrate skip the steps by which
-- 0005 adds them to an older table (see 0004): a table they made without
-- them would leave the relay's claim failing on every sweep. On a table
-- that existed before, this statement does nothing, and 0005 adds them in
-- the same place, after processed_at, so both end alike.
CREATE TABLE IF NOT EXISTS acemq_outbox (
    id            TEXT     NOT NULL PRIMARY KEY CHECK (length(id) BETWEEN 1 AND 64),
    exchange_name TEXT     NOT NULL CHECK (length(exchange_name) <= 255),
    routing_key   TEXT     NOT NULL CHECK (length(routing_key) <= 255),
    body          TEXT     NOT NULL,
    body_encoding TEXT     NOT NULL DEFAULT 'utf-8',
    content_type  TEXT     NOT NULL DEFAULT '',
    headers       TEXT     NOT NULL DEFAULT '{}',
    created_at    DATETIME NOT NULL DEFAULT (strftime('%Y-%m-%d %H:%M:%f000', 'now')),
    published_at  DATETIME,
    attempts      INTEGER  NOT NULL DEFAULT 0,
    last_error    TEXT     CHECK (length(last_error) <= 1000),
    locked_by     TEXT     CHECK (length(locked_by) <= 64),
    locked_until  DATETIME,
    processed_at  DATETIME,
    aggregate_id  TEXT,
    seq           INTEGER
);

-- A partial index holds only the pending rows, so the relay's claim stays as
-- fast with a million published rows as with none.
CREATE INDEX IF NOT EXISTS acemq_outbox_pending
    ON acemq_outbox (created_at, id) WHERE published_at IS NULL;

-- Purge and republish select published rows by age.
CREATE INDEX IF NOT EXISTS acemq_outbox_published
    ON acemq_outbox (published_at) WHERE published_at IS NOT NULL;
