DROP TABLE IF EXISTS acemq_inbox_held;
DROP TABLE IF EXISTS acemq_inbox_sequences;
DROP TABLE IF EXISTS processed_messages;
