-- +goose Up
-- The inbox: one row per (consumer, message id) a consumer has processed,
-- written in the same transaction as the consumer's effect.
CREATE TABLE IF NOT EXISTS processed_messages (
    consumer_name varchar(255)   NOT NULL,
    message_id    varchar(64)    NOT NULL,
    processed_at  timestamptz(6) NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer_name, message_id)
);

-- Retention deletes by age.
CREATE INDEX IF NOT EXISTS processed_messages_processed_at
    ON processed_messages (processed_at);
