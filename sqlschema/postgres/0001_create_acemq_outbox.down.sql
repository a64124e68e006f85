-- acemq_outbox is the estate's table: services in other languages write it
-- too. Its rows not yet published are events nobody has sent, theirs as
-- well as ours, so the table is not dropped while it holds any; publish or
-- delete them first. On a shared table, never migrate below version 1.
DO $$
BEGIN
    -- Two IFs: the query of one would be planned whole, and fail on a
    -- table that is gone already.
    IF to_regclass('acemq_outbox') IS NOT NULL THEN
        IF EXISTS (SELECT 1 FROM acemq_outbox WHERE published_at IS NULL) THEN
            RAISE EXCEPTION 'refused: acemq_outbox holds rows not yet published, the other services'' too'
                USING HINT = 'Publish or delete them first; on a table other services share, never migrate below version 1.';
        END IF;
    END IF;
END
$$;

DROP TABLE IF EXISTS acemq_outbox_sequences;
DROP TABLE IF EXISTS acemq_outbox;
