-- processed_at stays: it holds what consumers recorded, and a table 0001
-- made has had it from the start. Only the index 0004 may have added goes
-- (MySQL 8 has no DROP INDEX IF EXISTS).
SET @acemq_ddl = (SELECT IF(COUNT(*) = 0, 'DO 0', 'DROP INDEX acemq_outbox_pending_claim ON acemq_outbox')
    FROM information_schema.STATISTICS
    WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'acemq_outbox' AND INDEX_NAME = 'acemq_outbox_pending_claim');
PREPARE acemq_ddl FROM @acemq_ddl;
EXECUTE acemq_ddl;
DEALLOCATE PREPARE acemq_ddl;
SET @acemq_ddl = NULL;
