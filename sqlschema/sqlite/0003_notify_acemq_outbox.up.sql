-- +goose Up
-- Nothing here: only PostgreSQL has LISTEN/NOTIFY. This version exists so
-- that every dialect has the same numbered steps. On this database the relay
-- wakes on its poll interval, or at once through Forwarder.Notify in the
-- process that committed.
SELECT 1;
