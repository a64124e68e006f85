-- +goose Up
-- Nothing here: only PostgreSQL has a NOTIFY trigger to keep quiet (see
-- postgres/0010). This version exists so that every dialect has the same
-- numbered steps.
SELECT 1;
