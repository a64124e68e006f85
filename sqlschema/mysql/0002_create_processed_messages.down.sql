-- acemq_inbox_held holds the ordered inbox's early arrivals: messages the
-- broker was told were handled and whose handlers have not run, kept until
-- their predecessor is applied. The table is their only copy, so it is not
-- dropped while it holds any; let the inbox apply them first (outboxctl
-- held shows what each key waits for).
--
-- The check and the refusal are 0001's down's: a statement read into a
-- variable and run prepared, and a statement naming a column that cannot
-- exist, whose error carries the reason.
SET @acemq_guard = (SELECT IF(COUNT(*) = 0, 'SET @acemq_held = 0',
        'SET @acemq_held = EXISTS (SELECT 1 FROM acemq_inbox_held)')
    FROM information_schema.TABLES
    WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'acemq_inbox_held');
PREPARE acemq_guard FROM @acemq_guard;
EXECUTE acemq_guard;
DEALLOCATE PREPARE acemq_guard;
SET @acemq_guard = IF(@acemq_held, 'SELECT `refused: acemq_inbox_held holds messages not yet handled`', 'DO 0');
PREPARE acemq_guard FROM @acemq_guard;
EXECUTE acemq_guard;
DEALLOCATE PREPARE acemq_guard;
SET @acemq_guard = NULL, @acemq_held = NULL;

DROP TABLE IF EXISTS acemq_inbox_held;
DROP TABLE IF EXISTS acemq_inbox_sequences;
DROP TABLE IF EXISTS processed_messages;
