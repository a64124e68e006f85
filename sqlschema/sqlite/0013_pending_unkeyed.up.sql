-- +goose Up
-- A claim walks the pending index in order and takes each key's first
-- pending record only: one key's backlog (20,000 records of one aggregate
-- after an outage) made every claim walk it. Past a window the claim finds
-- each key's head through 0007's index, and the rows no key orders through
-- this one, which holds only those (see the relay's windowed claim). Each
-- unkeyed record is one more index entry while it is pending. Its WHERE is
-- the claim's, word for word: the planner matches them as written. It
-- needs 0005's columns: on a table 0001 did not make, a tool that skipped
-- 0005's Run steps left them out, and this statement fails, naming them,
-- as 0007's does (run those steps once yourself, and this file again).
CREATE INDEX IF NOT EXISTS acemq_outbox_pending_unkeyed
    ON acemq_outbox (created_at, id) WHERE published_at IS NULL AND (aggregate_id IS NULL OR seq IS NULL);
