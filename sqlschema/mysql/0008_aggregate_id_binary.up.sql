-- +goose Up
-- aggregate_id takes the binary collation of its character set, as 0005
-- now says: keys differing in case or accent are two keys, as
-- acemq_outbox_sequences numbers them. 0005 added it in the table's
-- default collation, which on a table another library created
-- (utf8mb4_general_ci, say) folds case and accents: "Order-1" and
-- "order-1" were two keys to the counters and one to the unique
-- (aggregate_id, seq) index and the relay's key-head probe, so the second
-- key's publishes failed and one key's failure held the other back. The
-- character set stays (the index must still fit the table's row format); a
-- column whose collation is binary already is left alone. (Binary here is
-- MySQL's _bin, which ignores trailing spaces: "k" and "k " are one key.)
SET @acemq_ddl = (SELECT IF(COUNT(*) = 0, 'DO 0',
        CONCAT('ALTER TABLE acemq_outbox MODIFY COLUMN aggregate_id varchar(255) CHARACTER SET ', MAX(CHARACTER_SET_NAME),
               ' COLLATE ', MAX(CHARACTER_SET_NAME), '_bin NULL'))
    FROM information_schema.COLUMNS
    WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'acemq_outbox' AND COLUMN_NAME = 'aggregate_id'
      AND RIGHT(COLLATION_NAME, 4) <> '_bin');
PREPARE acemq_ddl FROM @acemq_ddl;
EXECUTE acemq_ddl;
DEALLOCATE PREPARE acemq_ddl;
SET @acemq_ddl = NULL;
