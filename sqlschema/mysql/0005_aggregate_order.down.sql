-- acemq_outbox_sequences stays: it holds each key's last number, and a key
-- numbered from 1 again after an up would send numbers its consumers have
-- applied already, which their ordered inbox drops as duplicates. 0001's
-- down, which drops the outbox, drops it too.
SET @acemq_ddl = (SELECT IF(COUNT(*) = 0, 'DO 0', 'ALTER TABLE acemq_outbox DROP INDEX acemq_outbox_aggregate_seq, DROP COLUMN seq, DROP COLUMN aggregate_id')
    FROM information_schema.COLUMNS
    WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'acemq_outbox' AND COLUMN_NAME = 'aggregate_id');
PREPARE acemq_ddl FROM @acemq_ddl;
EXECUTE acemq_ddl;
DEALLOCATE PREPARE acemq_ddl;
SET @acemq_ddl = NULL;
