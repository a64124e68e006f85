DROP INDEX IF EXISTS processed_messages_key;
