-- +goose Up
-- Raises acemq_outbox's times to microseconds where another library made
-- them coarser: Rails before 7.0 made t.datetime a timestamp(0), and any
-- timestamp(p) with p below 6 rounds what is written into it. The
-- publisher tells the rows its call inserted from those already there by
-- their created_at, a stamp unique to the microsecond: rounded, none of
-- its rows looked like its own, a retried keyed call gave back the
-- numbers of rows it had written (the key's counter then fell behind the
-- table, and every later publish on the key failed), and a call refused
-- for a conflict left its new rows in the transaction. The relay's claim
-- ordered a second's rows by id, not as they were written, and leases
-- were rounded.
--
-- created_at, published_at, locked_until and processed_at of the table the
-- unqualified name acemq_outbox resolves to: each timestamp or timestamptz
-- (p < 6) becomes timestamp(6) or timestamptz(6), the same family, its
-- nullability and default kept. A column at 6 already (or without a
-- precision, which is 6) is left alone, so on a table 0001 made, and on a
-- second run, nothing happens. Raising the precision rewrites no row, and
-- keeps the plain indexes (Rails' acemq_outbox_pending among them); but
-- PostgreSQL builds again every partial index over these columns: the
-- pending ones, small, and 0001's acemq_outbox_published, over every
-- published row. That runs under the table's ACCESS EXCLUSIVE lock, held
-- until Migrate commits, and the services' writes wait meanwhile: on a
-- table of many published rows, purge them first (outboxctl purge), or
-- migrate at a quiet time. PostgreSQL refuses to change a column a view
-- (or a materialized view, or a rule) reads: this migration then fails at
-- once naming them, before it changes anything, and again at every run
-- until they are gone. Drop them, migrate, and make them again (or raise
-- the columns to (6) yourself, views and all: this then does nothing).
--
-- processed_messages.processed_at is left as it is: the inbox tells no row
-- by it, only compares it with now (retention, the at-most-once lease),
-- where a rounded half second makes a copy wait or a purge run that much
-- early or late.
-- +goose StatementBegin
DO $$
DECLARE
    alters  text;
    columns smallint[];
    views   text;
BEGIN
    SELECT string_agg(format('ALTER COLUMN %I TYPE %s', a.attname,
               CASE WHEN a.atttypid = 'timestamptz'::regtype THEN 'timestamptz(6)' ELSE 'timestamp(6)' END),
           ', ' ORDER BY a.attnum),
           array_agg(a.attnum)
      INTO alters, columns
      FROM pg_catalog.pg_attribute a
     WHERE a.attrelid = to_regclass('acemq_outbox')
       AND a.attname IN ('created_at', 'published_at', 'locked_until', 'processed_at')
       AND NOT a.attisdropped
       AND a.atttypid IN ('timestamp'::regtype, 'timestamptz'::regtype)
       AND a.atttypmod BETWEEN 0 AND 5;
    IF alters IS NULL THEN
        RETURN;
    END IF;
    SELECT string_agg(DISTINCT CASE WHEN r.rulename = '_RETURN' THEN r.ev_class::regclass::text
                                    ELSE format('rule %I on %s', r.rulename, r.ev_class::regclass) END, ', ')
      INTO views
      FROM pg_catalog.pg_depend d
      JOIN pg_catalog.pg_rewrite r ON r.oid = d.objid
     WHERE d.classid = 'pg_catalog.pg_rewrite'::regclass
       AND d.refclassid = 'pg_catalog.pg_class'::regclass
       AND d.refobjid = to_regclass('acemq_outbox')
       AND d.refobjsubid = ANY (columns);
    IF views IS NOT NULL THEN
        RAISE EXCEPTION 'acemq_outbox''s times are to become microseconds (timestamp(6)), and PostgreSQL changes no column that a view or rule reads: % read them; drop them, migrate, and create them again (or ALTER those columns TYPE timestamp(6) or timestamptz(6) yourself, views and all: this migration then does nothing)', views
            USING ERRCODE = '0A000';
    END IF;
    EXECUTE format('ALTER TABLE %s %s', to_regclass('acemq_outbox'), alters);
END
$$;
-- +goose StatementEnd
