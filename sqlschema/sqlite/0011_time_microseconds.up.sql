-- +goose Up
-- Nothing here: SQLite has no precision to raise (see postgres/0011 and
-- mysql/0011). A column keeps the value written into it as it was sent,
-- whatever its declared type: this library's created_at is text with
-- microseconds, and a DATETIME, TEXT, NUMERIC, INTEGER or REAL column
-- (another library's) stores that text unchanged, so the publisher finds
-- its own rows by it. Another library's values (whole seconds, Unix
-- numbers) are read by the same rule and only ever need to be not ours.
-- This version exists so that every dialect has the same numbered steps.
SELECT 1;
