DROP TRIGGER IF EXISTS acemq_outbox_notify ON acemq_outbox;
DROP FUNCTION IF EXISTS acemq_outbox_notify();
