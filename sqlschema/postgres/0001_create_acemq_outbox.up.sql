-- +goose Up
-- The AceMQ outbox: one row per message, written in the caller's transaction.
-- Column names and meanings are shared with the AceMQ libraries of other
-- languages, so one "what is stuck" query serves the whole estate.
CREATE TABLE IF NOT EXISTS acemq_outbox (
    id            varchar(64)    PRIMARY KEY,
    exchange_name varchar(255)   NOT NULL,
    routing_key   varchar(255)   NOT NULL,
    body          text           NOT NULL,
    body_encoding varchar(16)    NOT NULL DEFAULT 'utf-8',
    content_type  varchar(255)   NOT NULL DEFAULT '',
    headers       text           NOT NULL DEFAULT '{}',
    created_at    timestamptz(6) NOT NULL DEFAULT now(),
    published_at  timestamptz(6),
    attempts      integer        NOT NULL DEFAULT 0,
    last_error    varchar(1000),
    locked_by     varchar(64),
    locked_until  timestamptz(6),
    processed_at  timestamptz(6)
);

-- The relay's query reads only pending rows. A partial index holds only them,
-- so the claim stays as fast with a million published rows as with none.
CREATE INDEX IF NOT EXISTS acemq_outbox_pending
    ON acemq_outbox (created_at, id) WHERE published_at IS NULL;

-- Purge and republish select published rows by age.
CREATE INDEX IF NOT EXISTS acemq_outbox_published
    ON acemq_outbox (published_at) WHERE published_at IS NOT NULL;
