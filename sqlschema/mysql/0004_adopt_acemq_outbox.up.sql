-- +goose Up
-- Brings an acemq_outbox that another AceMQ library created up to date, in
-- place. Rails' migration makes it with datetime(6) columns, an index
-- acemq_outbox_pending on (published_at, created_at), and no processed_at;
-- 0001 left such a table as it found it (CREATE TABLE IF NOT EXISTS). Each
-- step adds only what is missing: on a table 0001 made, and on a second
-- run, it changes nothing, and it never rewrites or drops a row.
--
-- MariaDB has ADD COLUMN IF NOT EXISTS and MySQL 8 has not, so each step
-- reads information_schema into a statement, the addition or DO 0 (nothing),
-- and runs it prepared: plain SQL both accept. (golang-migrate runs a file
-- of several statements with multiStatements=true in the DSN.)

-- processed_at: the inbox marks a record processed, and republish leaves it
-- alone. Nullable, no default: an instant change on InnoDB.
SET @acemq_ddl = (SELECT IF(COUNT(*) = 0, 'ALTER TABLE acemq_outbox ADD COLUMN processed_at datetime(6) NULL', 'DO 0')
    FROM information_schema.COLUMNS
    WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'acemq_outbox' AND COLUMN_NAME = 'processed_at');
PREPARE acemq_ddl FROM @acemq_ddl;
EXECUTE acemq_ddl;
DEALLOCATE PREPARE acemq_ddl;

-- The relay's claim names an index on (published_at, created_at, …), the
-- claim's order (see the relay's pending-index lookup); Rails'
-- acemq_outbox_pending is one. One on published_at alone is not: the claim
-- would lock every pending row before sorting them, and a second relay
-- would claim nothing while the first holds its batch. A table without
-- such an index gets one under a name of its own, beside any it has.
SET @acemq_ddl = (SELECT IF(COUNT(*) = 0, 'CREATE INDEX acemq_outbox_pending_claim ON acemq_outbox (published_at, created_at, id)', 'DO 0')
    FROM information_schema.STATISTICS s1
    JOIN information_schema.STATISTICS s2 ON s2.TABLE_SCHEMA = s1.TABLE_SCHEMA AND s2.TABLE_NAME = s1.TABLE_NAME
        AND s2.INDEX_NAME = s1.INDEX_NAME AND s2.SEQ_IN_INDEX = 2 AND s2.COLUMN_NAME = 'created_at'
    WHERE s1.TABLE_SCHEMA = DATABASE() AND s1.TABLE_NAME = 'acemq_outbox' AND s1.SEQ_IN_INDEX = 1 AND s1.COLUMN_NAME = 'published_at');
PREPARE acemq_ddl FROM @acemq_ddl;
EXECUTE acemq_ddl;
DEALLOCATE PREPARE acemq_ddl;
SET @acemq_ddl = NULL;
