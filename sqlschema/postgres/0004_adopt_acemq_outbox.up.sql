-- +goose Up
-- Brings an acemq_outbox that another AceMQ library created up to date, in
-- place. Rails' migration makes it with timestamp (without time zone)
-- columns, an index acemq_outbox_pending on (published_at, created_at), and
-- no processed_at; 0001 left such a table as it found it (CREATE TABLE IF
-- NOT EXISTS, and the index name was taken) and 0003 gave it the trigger.
-- Each statement adds only what is missing: on a table 0001 made, and on a
-- second run, it changes nothing, and it never rewrites or drops a row. The
-- column types stay as they are: every time this library writes or compares
-- is UTC, in a timestamp column as in a timestamptz one.

-- processed_at: the inbox marks a record processed, and republish leaves it
-- alone. Nullable, no default: adding it rewrites no row.
ALTER TABLE acemq_outbox ADD COLUMN IF NOT EXISTS processed_at timestamptz(6);

-- The relay's claim walks the pending rows in (created_at, id) order, the
-- partial index 0001 makes. Unless the table has one like it, it gets one
-- under a name of its own; an index the other library made is kept.
-- +goose StatementBegin
DO $$
BEGIN
    IF NOT EXISTS (
        SELECT 1 FROM pg_index i
        WHERE i.indrelid = 'acemq_outbox'::regclass
          AND pg_get_indexdef(i.indexrelid, 1, true) = 'created_at'
          AND pg_get_expr(i.indpred, i.indrelid) = '(published_at IS NULL)'
    ) THEN
        CREATE INDEX acemq_outbox_pending_claim
            ON acemq_outbox (created_at, id) WHERE published_at IS NULL;
    END IF;
END
$$;
-- +goose StatementEnd
