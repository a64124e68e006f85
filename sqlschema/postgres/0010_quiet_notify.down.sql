-- The trigger's function of 0003, which notifies at every commit.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION acemq_outbox_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('acemq_outbox', TG_TABLE_SCHEMA || '.' || TG_TABLE_NAME);
    RETURN NULL;
END
$$;
-- +goose StatementEnd

DROP SEQUENCE IF EXISTS acemq_outbox_quiet;
