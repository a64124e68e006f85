-- +goose Up
-- Republish looks for the published records no consumer marked processed,
-- oldest published first. MySQL has no partial index: without this one it
-- walked every published record in the pending index and read each row for
-- its processed_at, so its cost grew with the history kept. On MariaDB,
-- 1,000,000 processed records (about a week at 2 a second) took 100-112 s
-- a boot, beyond the plugin's 30 s Timeout: the router never started. In
-- this index the published, unprocessed records sit together after the
-- pending ones (processed_at NULL, then published_at), in the order
-- Republish walks them, so it reads those only: 0.01 s. As in 0005, a
-- statement read from information_schema makes it only where it is
-- missing.
SET @acemq_ddl = (SELECT IF(COUNT(*) = 0, 'CREATE INDEX acemq_outbox_unprocessed ON acemq_outbox (processed_at, published_at)', 'DO 0')
    FROM information_schema.STATISTICS
    WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'acemq_outbox' AND INDEX_NAME = 'acemq_outbox_unprocessed');
PREPARE acemq_ddl FROM @acemq_ddl;
EXECUTE acemq_ddl;
DEALLOCATE PREPARE acemq_ddl;
SET @acemq_ddl = NULL;
