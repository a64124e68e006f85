-- +goose Up
-- Nothing here: see mysql/0012, an index for Republish's walk of the
-- published records no consumer marked processed. Without it MariaDB read
-- every published row for its processed_at: 1,000,000 processed records
-- took 100 s a boot. Without one either, PostgreSQL's scan of the same
-- 1,000,000 rows takes 0.15 s and SQLite's Republish 0.5 s (2026-12-03),
-- so neither pays for one more index on every mark. This version exists
-- so that every dialect has the same numbered steps.
SELECT 1;
