-- +goose Up
-- Per-aggregate order. A message with an ordering key (its aggregate's id)
-- gets that key's next sequence number in the publishing transaction; the
-- relay sends a key's records in sequence order, and the headers aggregateId
-- and seq carry both to consumers (the names of the reference design, so a
-- consumer written for it reads ours). Unkeyed rows, and rows other AceMQ
-- libraries write, leave both columns NULL and are untouched.
ALTER TABLE acemq_outbox ADD COLUMN IF NOT EXISTS aggregate_id varchar(255);
ALTER TABLE acemq_outbox ADD COLUMN IF NOT EXISTS seq bigint;

-- One row per (key, sequence): a second allocation of a number is a bug the
-- database refuses. It also finds a key's earlier pending records.
CREATE UNIQUE INDEX IF NOT EXISTS acemq_outbox_aggregate_seq
    ON acemq_outbox (aggregate_id, seq) WHERE aggregate_id IS NOT NULL;

-- The last sequence number handed out per key. The publishing transaction
-- increments it, so two transactions on one key serialise on its row and
-- commit in sequence order, a rollback gives the number back, and purging
-- published rows never resets a key.
CREATE TABLE IF NOT EXISTS acemq_outbox_sequences (
    aggregate_id varchar(255) PRIMARY KEY,
    last_seq     bigint       NOT NULL
);
