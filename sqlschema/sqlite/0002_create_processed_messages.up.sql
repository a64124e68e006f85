-- +goose Up
-- The inbox: one row per (consumer, message id) a consumer has processed,
-- written in the same transaction as the consumer's effect.
CREATE TABLE IF NOT EXISTS processed_messages (
    consumer_name TEXT     NOT NULL,
    message_id    TEXT     NOT NULL,
    processed_at  DATETIME NOT NULL DEFAULT (strftime('%Y-%m-%d %H:%M:%f000', 'now')),
    PRIMARY KEY (consumer_name, message_id)
);

-- Retention deletes by age.
CREATE INDEX IF NOT EXISTS processed_messages_processed_at
    ON processed_messages (processed_at);
