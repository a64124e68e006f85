-- +goose Up
-- The relay's claim admits a keyed record only when no earlier record of its
-- key is pending. MySQL has no partial index: this one puts a key's pending
-- records (published_at NULL) together, so the probe reads those only, not
-- every published record of the key. As in 0005, a statement read from
-- information_schema makes it only where it is missing.
SET @acemq_ddl = (SELECT IF(COUNT(*) = 0, 'CREATE INDEX acemq_outbox_pending_key ON acemq_outbox (aggregate_id, published_at, seq)', 'DO 0')
    FROM information_schema.STATISTICS
    WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'acemq_outbox' AND INDEX_NAME = 'acemq_outbox_pending_key');
PREPARE acemq_ddl FROM @acemq_ddl;
EXECUTE acemq_ddl;
DEALLOCATE PREPARE acemq_ddl;
SET @acemq_ddl = NULL;
