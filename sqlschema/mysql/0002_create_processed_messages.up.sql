-- +goose Up
-- The inbox: one row per (consumer, message id) a consumer has processed,
-- written in the same transaction as the consumer's effect.
CREATE TABLE IF NOT EXISTS processed_messages (
    consumer_name varchar(255) NOT NULL,
    message_id    varchar(64)  NOT NULL,
    processed_at  datetime(6)  NOT NULL,
    PRIMARY KEY (consumer_name, message_id),
    KEY processed_messages_processed_at (processed_at)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;
