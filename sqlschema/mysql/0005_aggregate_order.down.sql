DROP TABLE IF EXISTS acemq_outbox_sequences;
SET @acemq_ddl = (SELECT IF(COUNT(*) = 0, 'DO 0', 'ALTER TABLE acemq_outbox DROP INDEX acemq_outbox_aggregate_seq, DROP COLUMN seq, DROP COLUMN aggregate_id')
    FROM information_schema.COLUMNS
    WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'acemq_outbox' AND COLUMN_NAME = 'aggregate_id');
PREPARE acemq_ddl FROM @acemq_ddl;
EXECUTE acemq_ddl;
DEALLOCATE PREPARE acemq_ddl;
SET @acemq_ddl = NULL;
