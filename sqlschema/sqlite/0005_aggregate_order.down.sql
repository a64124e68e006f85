-- The columns stay: SQLite's tools cannot drop them only where the Run steps
-- added them, and 0001's down drops the table with them.
DROP TABLE IF EXISTS acemq_outbox_sequences;
DROP INDEX IF EXISTS acemq_outbox_aggregate_seq;
