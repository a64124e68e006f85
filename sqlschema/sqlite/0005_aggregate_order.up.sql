-- +goose Up
-- Per-aggregate order. A message with an ordering key (its aggregate's id)
-- gets that key's next sequence number in the publishing transaction; the
-- relay sends a key's records in sequence order, and the headers aggregateId
-- and seq carry both to consumers (the names of the reference design, so a
-- consumer written for it reads ours). Unkeyed rows, and rows other AceMQ
-- libraries write, leave both columns NULL and are untouched.
--
-- A table 0001 made has both columns already. One made before 0001 had
-- them, or by another library, does not, and SQLite cannot add a column
-- only if it is missing in plain SQL: as in 0004, outbox.Migrate runs each
-- Run unless its Unless finds the column. goose and golang-migrate skip
-- them, and the index below then fails, naming the column: run the two Run
-- statements once yourself, and this file again. A relay on the table
-- without them could claim nothing.
-- +acemq Unless SELECT 1 FROM pragma_table_info('acemq_outbox') WHERE name = 'aggregate_id'
-- +acemq Run ALTER TABLE acemq_outbox ADD COLUMN aggregate_id TEXT
-- +acemq Unless SELECT 1 FROM pragma_table_info('acemq_outbox') WHERE name = 'seq'
-- +acemq Run ALTER TABLE acemq_outbox ADD COLUMN seq INTEGER

-- One row per (key, sequence), and a key's earlier pending records are found
-- through it.
CREATE UNIQUE INDEX IF NOT EXISTS acemq_outbox_aggregate_seq
    ON acemq_outbox (aggregate_id, seq) WHERE aggregate_id IS NOT NULL;

-- The last sequence number handed out per key. The publishing transaction
-- increments it, a rollback gives the number back, and purging published
-- rows never resets a key.
CREATE TABLE IF NOT EXISTS acemq_outbox_sequences (
    aggregate_id TEXT    NOT NULL PRIMARY KEY,
    last_seq     INTEGER NOT NULL
);
