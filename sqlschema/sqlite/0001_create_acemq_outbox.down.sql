DROP TABLE IF EXISTS acemq_outbox_sequences;
DROP TABLE IF EXISTS acemq_outbox;
