-- +goose Up
-- The relay's claim admits a keyed record only when no earlier record of its
-- key is pending. That probe looks for pending rows of one key: this index
-- holds only those, so it finds the answer in an entry or two, however many
-- of the key's records are published. (Through 0005's index alone, the
-- planner ANDs it with the pending index's bitmap, which reads every pending
-- entry for each candidate row: 0.5 ms a probe over 20,000 pending rows.)
CREATE INDEX IF NOT EXISTS acemq_outbox_pending_key
    ON acemq_outbox (aggregate_id, seq) WHERE published_at IS NULL AND aggregate_id IS NOT NULL;
