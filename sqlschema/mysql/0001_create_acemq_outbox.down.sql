-- acemq_outbox is the estate's table: services in other languages write it
-- too. Its rows not yet published are events nobody has sent, theirs as
-- well as ours, so the table is not dropped while it holds any; publish or
-- delete them first. On a shared table, never migrate below version 1.
--
-- Plain SQL has no IF: the check is a statement read into a variable and
-- run prepared (as in 0004), and the refusal a statement naming a column
-- that cannot exist, whose error carries the reason.
SET @acemq_guard = (SELECT IF(COUNT(*) = 0, 'SET @acemq_pending = 0',
        'SET @acemq_pending = EXISTS (SELECT 1 FROM acemq_outbox WHERE published_at IS NULL)')
    FROM information_schema.TABLES
    WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'acemq_outbox');
PREPARE acemq_guard FROM @acemq_guard;
EXECUTE acemq_guard;
DEALLOCATE PREPARE acemq_guard;
SET @acemq_guard = IF(@acemq_pending, 'SELECT `refused: acemq_outbox holds rows not yet published`', 'DO 0');
PREPARE acemq_guard FROM @acemq_guard;
EXECUTE acemq_guard;
DEALLOCATE PREPARE acemq_guard;
SET @acemq_guard = NULL, @acemq_pending = NULL;

DROP TABLE IF EXISTS acemq_outbox_sequences;
DROP TABLE IF EXISTS acemq_outbox;
