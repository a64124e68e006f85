-- +goose Up
-- Republish looks for the published records of its tracked routing keys
-- that no consumer marked processed, oldest published first. MySQL has no
-- partial index: without this one it walked every published record in the
-- pending index and read each row for its processed_at and routing_key, so
-- its cost grew with the history kept. On MariaDB, 1,000,000 processed
-- records (about a week at 2 a second) took 100-112 s a boot, beyond the
-- plugin's 30 s Timeout: the router never started. Here the unprocessed
-- records sit together after the processed ones' NULLs, by routing key,
-- then in the order Republish walks them, so it reads those of its tracked
-- keys only, not the processed history, nor the records of topics no
-- consumer of this database marks (another service's). A routing_key that
-- an index cannot hold whole (another library's TEXT, or longer than the
-- table's row format allows in a key) is left out of it: the walk then
-- reads every unprocessed record. As in 0005, a statement read from
-- information_schema makes it only where it is missing.
SET @acemq_ddl = (SELECT IF(COUNT(*) = 0, (SELECT CONCAT('CREATE INDEX acemq_outbox_unprocessed ON acemq_outbox (processed_at, ',
            IF(c.DATA_TYPE IN ('varchar', 'char', 'varbinary', 'binary')
                AND (c.CHARACTER_OCTET_LENGTH <= 767 OR t.ROW_FORMAT NOT IN ('Compact', 'Redundant') AND c.CHARACTER_OCTET_LENGTH <= 3000),
                'routing_key, ', ''), 'published_at)')
        FROM information_schema.COLUMNS c
        JOIN information_schema.TABLES t ON t.TABLE_SCHEMA = c.TABLE_SCHEMA AND t.TABLE_NAME = c.TABLE_NAME
        WHERE c.TABLE_SCHEMA = DATABASE() AND c.TABLE_NAME = 'acemq_outbox' AND c.COLUMN_NAME = 'routing_key'), 'DO 0')
    FROM information_schema.STATISTICS
    WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'acemq_outbox' AND INDEX_NAME = 'acemq_outbox_unprocessed');
PREPARE acemq_ddl FROM @acemq_ddl;
EXECUTE acemq_ddl;
DEALLOCATE PREPARE acemq_ddl;
SET @acemq_ddl = NULL;
