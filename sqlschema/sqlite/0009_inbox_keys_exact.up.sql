-- +goose Up
-- Nothing here: only MySQL's collations ignore trailing spaces (see
-- mysql/0009). This version exists so that every dialect has the same
-- numbered steps.
SELECT 1;
