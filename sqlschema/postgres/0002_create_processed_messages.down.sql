-- acemq_inbox_held holds the ordered inbox's early arrivals: messages the
-- broker was told were handled and whose handlers have not run, kept until
-- their predecessor is applied. The table is their only copy, so it is not
-- dropped while it holds any; let the inbox apply them first (outboxctl
-- held shows what each key waits for).
DO $$
BEGIN
    -- Two IFs: the query of one would be planned whole, and fail on a
    -- table that is gone already.
    IF to_regclass('acemq_inbox_held') IS NOT NULL THEN
        IF EXISTS (SELECT 1 FROM acemq_inbox_held) THEN
            RAISE EXCEPTION 'refused: acemq_inbox_held holds messages not yet handled'
                USING HINT = 'They were acked to the broker and this table is their only copy: let the inbox apply them first (outboxctl held shows what each key waits for).';
        END IF;
    END IF;
END
$$;

DROP TABLE IF EXISTS acemq_inbox_held;
DROP TABLE IF EXISTS acemq_inbox_sequences;
DROP TABLE IF EXISTS processed_messages;
