SET @acemq_ddl = (SELECT IF(COUNT(*) = 0, 'DO 0', 'DROP INDEX acemq_outbox_unprocessed ON acemq_outbox')
    FROM information_schema.STATISTICS
    WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'acemq_outbox' AND INDEX_NAME = 'acemq_outbox_unprocessed');
PREPARE acemq_ddl FROM @acemq_ddl;
EXECUTE acemq_ddl;
DEALLOCATE PREPARE acemq_ddl;
SET @acemq_ddl = NULL;
