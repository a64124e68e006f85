-- The columns stay: on a table 0001 made they are 0001's, and plain SQL
-- cannot drop them only where 0005's Run steps added them. 0001's down
-- drops the table with them.
-- acemq_outbox_sequences stays: it holds each key's last number, and a key
-- numbered from 1 again after an up would send numbers its consumers have
-- applied already, which their ordered inbox drops as duplicates. 0001's
-- down, which drops the outbox, drops it too.
DROP INDEX IF EXISTS acemq_outbox_aggregate_seq;
