-- +goose Up
-- Nothing here: only MySQL's columns have a collation that can fold case
-- and accents (see mysql/0008). This version exists so that every dialect
-- has the same numbered steps.
SELECT 1;
