-- acemq_outbox_sequences stays: it holds each key's last number, and a key
-- numbered from 1 again after an up would send numbers its consumers have
-- applied already, which their ordered inbox drops as duplicates. 0001's
-- down, which drops the outbox, drops it too.
--
-- Refused while a keyed row is pending, before any change: without its
-- aggregate_id and seq it would go out unkeyed, and its key's ordered
-- consumers would wait for ever for the number it carried.
DO $$
BEGIN
    -- Two IFs: the query of one would be planned whole, and fail on a
    -- table whose column is gone already.
    IF EXISTS (SELECT 1 FROM pg_attribute
               WHERE attrelid = to_regclass('acemq_outbox') AND attname = 'aggregate_id' AND NOT attisdropped) THEN
        IF EXISTS (SELECT 1 FROM acemq_outbox WHERE aggregate_id IS NOT NULL AND published_at IS NULL) THEN
            RAISE EXCEPTION 'refused: acemq_outbox holds keyed rows not yet published'
                USING HINT = 'Without aggregate_id and seq they would go out unkeyed, and their keys'' ordered consumers would wait for ever; let the relay publish them first.';
        END IF;
    END IF;
END
$$;

DROP INDEX IF EXISTS acemq_outbox_aggregate_seq;
ALTER TABLE acemq_outbox DROP COLUMN IF EXISTS seq;
ALTER TABLE acemq_outbox DROP COLUMN IF EXISTS aggregate_id;
