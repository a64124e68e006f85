DROP TABLE IF EXISTS acemq_inbox_held;
DROP TABLE IF EXISTS acemq_inbox_sequences;
