-- +goose Up
-- The relay's claim admits a keyed record only when no earlier record of its
-- key is pending. That probe looks for pending rows of one key: this index
-- holds only those, so it does not read the key's published records. It
-- needs 0005's columns: on a table 0001 did not make, a tool that skipped
-- 0005's Run steps left them out, and this statement fails, naming them.
CREATE INDEX IF NOT EXISTS acemq_outbox_pending_key
    ON acemq_outbox (aggregate_id, seq) WHERE published_at IS NULL AND aggregate_id IS NOT NULL;
