-- +goose Up
-- Per-aggregate order. A message with an ordering key (its aggregate's id)
-- gets that key's next sequence number in the publishing transaction; the
-- relay sends a key's records in sequence order, and the headers aggregateId
-- and seq carry both to consumers (the names of the reference design, so a
-- consumer written for it reads ours). Unkeyed rows, and rows other AceMQ
-- libraries write, leave both columns NULL and are untouched.
--
-- MySQL 8 has no ADD COLUMN IF NOT EXISTS: each step reads
-- information_schema into a statement, as 0004 does.
--
-- aggregate_id takes the binary collation of the table's character set
-- (utf8mb4_bin on 0001's table): keys differing in case or accent are two
-- keys, as acemq_outbox_sequences numbers them. The character set stays
-- the table's (a table of the binary character set gets varbinary), and
-- the unique index below takes the whole column: 255 characters of up to 4
-- bytes in utf8mb4, more than the 767 bytes a key column may have in a
-- table of ROW_FORMAT COMPACT or REDUNDANT (Error 1709; MySQL 5.6 made
-- tables COMPACT, and an upgrade keeps them so). utf8mb3 (765 bytes) and
-- single-byte sets fit.
--
-- Such a table is refused here, before any change: MySQL's DDL is not
-- transactional, and the columns added before the index failed would have
-- stayed, every boot failing at the index again. The remedy is the
-- operator's, a rebuild of the estate's table: ALTER TABLE acemq_outbox
-- ROW_FORMAT=DYNAMIC. The refusal is a statement naming a column that
-- cannot exist, whose error carries the reason, as in 0001's down.
SET @acemq_guard = COALESCE((SELECT IF(t.ROW_FORMAT IN ('Compact', 'Redundant') AND 255 * cs.MAXLEN > 767
            AND NOT EXISTS (SELECT 1 FROM information_schema.STATISTICS s
                            WHERE s.TABLE_SCHEMA = DATABASE() AND s.TABLE_NAME = 'acemq_outbox' AND s.INDEX_NAME = 'acemq_outbox_aggregate_seq'),
        CONCAT('SELECT `refused: acemq_outbox is ', t.ROW_FORMAT, ', needs ROW_FORMAT=DYNAMIC`'), 'DO 0')
    FROM information_schema.TABLES t
    JOIN information_schema.CHARACTER_SETS cs ON cs.CHARACTER_SET_NAME = SUBSTRING_INDEX(t.TABLE_COLLATION, '_', 1)
    WHERE t.TABLE_SCHEMA = DATABASE() AND t.TABLE_NAME = 'acemq_outbox'), 'DO 0');
PREPARE acemq_guard FROM @acemq_guard;
EXECUTE acemq_guard;
DEALLOCATE PREPARE acemq_guard;
SET @acemq_guard = NULL;

SET @acemq_ddl = (SELECT IF(COUNT(*) = 0, CONCAT('ALTER TABLE acemq_outbox ADD COLUMN aggregate_id ',
        (SELECT IF(TABLE_COLLATION IS NULL OR TABLE_COLLATION = 'binary', 'varbinary(255)',
                   CONCAT('varchar(255) COLLATE ', SUBSTRING_INDEX(TABLE_COLLATION, '_', 1), '_bin'))
         FROM information_schema.TABLES WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'acemq_outbox'),
        ' NULL, ADD COLUMN seq bigint NULL'), 'DO 0')
    FROM information_schema.COLUMNS
    WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'acemq_outbox' AND COLUMN_NAME = 'aggregate_id');
PREPARE acemq_ddl FROM @acemq_ddl;
EXECUTE acemq_ddl;
DEALLOCATE PREPARE acemq_ddl;

-- One row per (key, sequence) (NULLs do not collide), and a key's earlier
-- pending records are found through it.
SET @acemq_ddl = (SELECT IF(COUNT(*) = 0, 'CREATE UNIQUE INDEX acemq_outbox_aggregate_seq ON acemq_outbox (aggregate_id, seq)', 'DO 0')
    FROM information_schema.STATISTICS
    WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'acemq_outbox' AND INDEX_NAME = 'acemq_outbox_aggregate_seq');
PREPARE acemq_ddl FROM @acemq_ddl;
EXECUTE acemq_ddl;
DEALLOCATE PREPARE acemq_ddl;
SET @acemq_ddl = NULL;

-- The last sequence number handed out per key. The publishing transaction
-- increments it, so two transactions on one key serialise on its row and
-- commit in sequence order, a rollback gives the number back, and purging
-- published rows never resets a key.
CREATE TABLE IF NOT EXISTS acemq_outbox_sequences (
    aggregate_id varchar(255) NOT NULL PRIMARY KEY,
    last_seq     bigint       NOT NULL
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;
