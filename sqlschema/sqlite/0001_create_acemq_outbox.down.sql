DROP TABLE IF EXISTS acemq_outbox;
