-- +goose Up
-- The ordered inbox's keys compare byte for byte. 0006 made aggregate_id a
-- varchar in utf8mb4_bin, and MySQL's _bin collations ignore trailing
-- spaces (PAD SPACE): a message keyed "k " (from a publisher on PostgreSQL
-- or SQLite, where it is a key of its own) was key "k" here, its seq 1 a
-- duplicate of "k"'s seq 1, acked without running. varbinary compares the
-- bytes as they are, on MySQL 8 and MariaDB alike, and its index entry
-- takes 255 bytes, not 1,020. A column that is varbinary already is left
-- alone. The keys the inbox writes are at most 255 bytes (it refuses
-- longer ones), so nothing is cut.
SET @acemq_ddl = (SELECT IF(COUNT(*) = 0, 'DO 0', 'ALTER TABLE acemq_inbox_sequences MODIFY COLUMN aggregate_id varbinary(255) NOT NULL')
    FROM information_schema.COLUMNS
    WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'acemq_inbox_sequences' AND COLUMN_NAME = 'aggregate_id'
      AND DATA_TYPE <> 'varbinary');
PREPARE acemq_ddl FROM @acemq_ddl;
EXECUTE acemq_ddl;
DEALLOCATE PREPARE acemq_ddl;

SET @acemq_ddl = (SELECT IF(COUNT(*) = 0, 'DO 0', 'ALTER TABLE acemq_inbox_held MODIFY COLUMN aggregate_id varbinary(255) NOT NULL')
    FROM information_schema.COLUMNS
    WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'acemq_inbox_held' AND COLUMN_NAME = 'aggregate_id'
      AND DATA_TYPE <> 'varbinary');
PREPARE acemq_ddl FROM @acemq_ddl;
EXECUTE acemq_ddl;
DEALLOCATE PREPARE acemq_ddl;
SET @acemq_ddl = NULL;
