SET @acemq_ddl = (SELECT IF(COUNT(*) = 0, 'DO 0', 'DROP INDEX processed_messages_key ON processed_messages')
    FROM information_schema.STATISTICS
    WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'processed_messages' AND INDEX_NAME = 'processed_messages_key');
PREPARE acemq_ddl FROM @acemq_ddl;
EXECUTE acemq_ddl;
DEALLOCATE PREPARE acemq_ddl;
SET @acemq_ddl = NULL;
