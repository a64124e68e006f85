-- +goose Up
-- Wakes the relay the moment a transaction that wrote outbox rows commits:
-- PostgreSQL delivers a NOTIFY at commit and drops it on rollback, so the
-- relay hears of committed rows only, in milliseconds rather than a poll
-- interval. Once per statement, and a transaction's identical notifications
-- are folded into one, so a busy service pays little for it. Rows written by
-- any library, in any language, wake the relay alike.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION acemq_outbox_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('acemq_outbox', TG_TABLE_SCHEMA || '.' || TG_TABLE_NAME);
    RETURN NULL;
END
$$;
-- +goose StatementEnd

DROP TRIGGER IF EXISTS acemq_outbox_notify ON acemq_outbox;

CREATE TRIGGER acemq_outbox_notify
    AFTER INSERT ON acemq_outbox
    FOR EACH STATEMENT EXECUTE FUNCTION acemq_outbox_notify();
