-- +goose Up
-- The inbox dedupes on a unique key over (consumer_name, message_id): its
-- insert is ON CONFLICT DO NOTHING. A processed_messages another library
-- created (a surrogate id, the two columns under a plain index) has none,
-- 0002 left it as it was, and every redelivery ran its handler again. A
-- table that holds a message twice already fails here, naming the key:
-- remove the copies (keep the oldest processed_at), then migrate again.
-- +goose StatementBegin
DO $$
BEGIN
    IF NOT EXISTS (
        SELECT 1 FROM pg_index i
        WHERE i.indrelid = 'processed_messages'::regclass AND i.indisunique AND i.indpred IS NULL AND i.indexprs IS NULL
          AND i.indnkeyatts = 2
          AND (SELECT array_agg(a.attname::text ORDER BY a.attname) FROM pg_attribute a
               WHERE a.attrelid = i.indrelid AND a.attnum IN (i.indkey[0], i.indkey[1])) = ARRAY['consumer_name', 'message_id']
    ) THEN
        IF EXISTS (SELECT 1 FROM processed_messages GROUP BY consumer_name, message_id HAVING COUNT(*) > 1) THEN
            RAISE EXCEPTION 'processed_messages holds a message twice for one consumer: it has no unique key over (consumer_name, message_id), which the inbox needs to find a duplicate; delete the copies (keep the oldest processed_at), then migrate again';
        END IF;
        CREATE UNIQUE INDEX processed_messages_key ON processed_messages (consumer_name, message_id);
    END IF;
END
$$;
-- +goose StatementEnd
