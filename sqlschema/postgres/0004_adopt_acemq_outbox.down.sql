-- processed_at stays: it holds what consumers recorded, and a table 0001
-- made has had it from the start. Only the index 0004 may have added goes.
DROP INDEX IF EXISTS acemq_outbox_pending_claim;
