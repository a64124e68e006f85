DROP INDEX IF EXISTS acemq_outbox_pending_unkeyed;
