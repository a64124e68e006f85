-- +goose Up
-- See postgres/0014: the inbox's dedupe needs a unique key over
-- (consumer_name, message_id).
SET @acemq_ddl = (SELECT IF(COUNT(*) = 0, 'CREATE UNIQUE INDEX processed_messages_key ON processed_messages (consumer_name, message_id)', 'DO 0')
    FROM (SELECT INDEX_NAME FROM information_schema.STATISTICS
          WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'processed_messages' AND NON_UNIQUE = 0
          GROUP BY INDEX_NAME
          HAVING COUNT(*) = 2 AND SUM(COLUMN_NAME IN ('consumer_name', 'message_id')) = 2) u);
PREPARE acemq_ddl FROM @acemq_ddl;
EXECUTE acemq_ddl;
DEALLOCATE PREPARE acemq_ddl;
SET @acemq_ddl = NULL;
