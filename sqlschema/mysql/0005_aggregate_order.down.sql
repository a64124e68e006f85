-- acemq_outbox_sequences stays: it holds each key's last number, and a key
-- numbered from 1 again after an up would send numbers its consumers have
-- applied already, which their ordered inbox drops as duplicates. 0001's
-- down, which drops the outbox, drops it too.
--
-- Refused while a keyed row is pending, before any change: without its
-- aggregate_id and seq it would go out unkeyed, and its key's ordered
-- consumers would wait for ever for the number it carried. The check and
-- the refusal are 0001's down's.
SET @acemq_guard = (SELECT IF(COUNT(*) = 0, 'SET @acemq_pending = 0',
        'SET @acemq_pending = EXISTS (SELECT 1 FROM acemq_outbox WHERE aggregate_id IS NOT NULL AND published_at IS NULL)')
    FROM information_schema.COLUMNS
    WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'acemq_outbox' AND COLUMN_NAME = 'aggregate_id');
PREPARE acemq_guard FROM @acemq_guard;
EXECUTE acemq_guard;
DEALLOCATE PREPARE acemq_guard;
SET @acemq_guard = IF(@acemq_pending, 'SELECT `refused: acemq_outbox holds keyed rows not yet published`', 'DO 0');
PREPARE acemq_guard FROM @acemq_guard;
EXECUTE acemq_guard;
DEALLOCATE PREPARE acemq_guard;
SET @acemq_guard = NULL, @acemq_pending = NULL;

SET @acemq_ddl = (SELECT IF(COUNT(*) = 0, 'DO 0', 'ALTER TABLE acemq_outbox DROP INDEX acemq_outbox_aggregate_seq, DROP COLUMN seq, DROP COLUMN aggregate_id')
    FROM information_schema.COLUMNS
    WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'acemq_outbox' AND COLUMN_NAME = 'aggregate_id');
PREPARE acemq_ddl FROM @acemq_ddl;
EXECUTE acemq_ddl;
DEALLOCATE PREPARE acemq_ddl;
SET @acemq_ddl = NULL;
