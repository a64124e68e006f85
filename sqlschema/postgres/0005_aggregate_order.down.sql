-- acemq_outbox_sequences stays: it holds each key's last number, and a key
-- numbered from 1 again after an up would send numbers its consumers have
-- applied already, which their ordered inbox drops as duplicates. 0001's
-- down, which drops the outbox, drops it too.
DROP INDEX IF EXISTS acemq_outbox_aggregate_seq;
ALTER TABLE acemq_outbox DROP COLUMN IF EXISTS seq;
ALTER TABLE acemq_outbox DROP COLUMN IF EXISTS aggregate_id;
