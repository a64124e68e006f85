-- +goose Up
-- Nothing here: see postgres/0013, an index of the pending records no key
-- orders, for the windowed claim of PostgreSQL and SQLite. MySQL's claims
-- are not windowed, and it has no partial index. This version exists so
-- that every dialect has the same numbered steps.
SELECT 1;
