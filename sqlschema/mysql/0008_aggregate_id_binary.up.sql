-- +goose Up
-- aggregate_id compares byte for byte, as the ids do (0001) and as
-- acemq_outbox_sequences numbers the keys. 0005 added it in the table's
-- default collation, which on a table another library created
-- (utf8mb4_general_ci, say) ignores case and accents: "Order-1" and
-- "order-1" were two keys to the counters and one to the unique
-- (aggregate_id, seq) index and the relay's key-head probe, so the second
-- key's publishes failed and one key's failure held the other back. A table
-- whose column is utf8mb4_bin already is left alone.
SET @acemq_ddl = (SELECT IF(COUNT(*) = 0, 'DO 0', 'ALTER TABLE acemq_outbox MODIFY COLUMN aggregate_id varchar(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NULL')
    FROM information_schema.COLUMNS
    WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'acemq_outbox' AND COLUMN_NAME = 'aggregate_id'
      AND COLLATION_NAME <> 'utf8mb4_bin');
PREPARE acemq_ddl FROM @acemq_ddl;
EXECUTE acemq_ddl;
DEALLOCATE PREPARE acemq_ddl;
SET @acemq_ddl = NULL;
