DROP TABLE IF EXISTS acemq_outbox_sequences;
DROP INDEX IF EXISTS acemq_outbox_aggregate_seq;
ALTER TABLE acemq_outbox DROP COLUMN IF EXISTS seq;
ALTER TABLE acemq_outbox DROP COLUMN IF EXISTS aggregate_id;
