-- +goose Up
-- Lets a relay in a flow keep the NOTIFY trigger quiet. PostgreSQL holds a
-- database-wide lock from a notifying transaction's commit until its
-- commit is flushed, so the services' transactions that notify commit one
-- per WAL flush, however many commit at once. A relay whose claims find a
-- flow polls anyway and needs no wake-up: while it does, it keeps
-- acemq_outbox_quiet at a time (milliseconds since the epoch, on this
-- server's clock) a second or so ahead, and the trigger sends nothing
-- until then. An idle relay sets it to 0, and one that dies leaves it to
-- expire: commits notify again.
--
-- A transaction that stays quiet holds a shared advisory lock (key
-- 'acmq' << 32 | the table's oid) until it ends. A relay leaving its flow
-- sets the time to 0, then takes the lock exclusively (without waiting,
-- as often as it polls) before it counts on NOTIFY again: so no commit
-- that stayed quiet is left to the poll's safety net.
--
-- The sequence is the table's name and "_quiet", in the table's schema (a
-- table without one, or whose name is too long for one, notifies as
-- before). It is read without a snapshot, as sequences are, so a
-- REPEATABLE READ transaction sees the relay's latest value too. Every role may read it (the services' inserts run the
-- trigger); a relay needs UPDATE on it to keep the trigger quiet. Rows
-- written by any library, in any language, see the same trigger; while it
-- is quiet, the table's other relays (of any library) get no NOTIFY and
-- find rows at their poll.
-- +goose StatementBegin
DO $$ BEGIN
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_class WHERE oid = to_regclass('acemq_outbox_quiet') AND relkind <> 'S') THEN
        RAISE EXCEPTION 'acemq_outbox_quiet is there and is not a sequence: the NOTIFY trigger would fail every insert; rename it, then migrate again';
    END IF;
END $$;
-- +goose StatementEnd

CREATE SEQUENCE IF NOT EXISTS acemq_outbox_quiet AS bigint MINVALUE 0 START WITH 0;

GRANT SELECT ON SEQUENCE acemq_outbox_quiet TO PUBLIC;

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION acemq_outbox_notify() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    quiet regclass;
BEGIN
    -- The table's name and "_quiet", in the table's schema: a table whose
    -- name is too long for one, or a role that may not look in the schema
    -- by name (one writing through a view), notifies as before.
    IF length(TG_TABLE_NAME) <= 57 AND has_schema_privilege(TG_TABLE_SCHEMA, 'USAGE') THEN
        quiet := to_regclass(quote_ident(TG_TABLE_SCHEMA) || '.' || quote_ident(TG_TABLE_NAME || '_quiet'));
    END IF;
    IF quiet IS NOT NULL AND has_sequence_privilege(quiet, 'SELECT')
       AND pg_sequence_last_value(quiet) > (extract(epoch FROM clock_timestamp()) * 1000)::bigint THEN
        PERFORM pg_advisory_xact_lock_shared((1633906033::bigint << 32) | TG_RELID::bigint);
        -- Read again under the lock: a relay that cleared the time before
        -- the lock was taken may have found the lock free already.
        IF pg_sequence_last_value(quiet) > (extract(epoch FROM clock_timestamp()) * 1000)::bigint THEN
            RETURN NULL;
        END IF;
    END IF;
    PERFORM pg_notify('acemq_outbox', TG_TABLE_SCHEMA || '.' || TG_TABLE_NAME);
    RETURN NULL;
END
$$;
-- +goose StatementEnd
