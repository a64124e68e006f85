-- +goose Up
-- See postgres/0014: the inbox's dedupe needs a unique key over
-- (consumer_name, message_id).
-- +acemq Unless SELECT 1 FROM pragma_index_list('processed_messages') l WHERE l."unique" = 1 AND l.partial = 0 AND (SELECT COUNT(*) FROM pragma_index_info(l.name)) = 2 AND (SELECT COUNT(*) FROM pragma_index_info(l.name) c WHERE c.name IN ('consumer_name', 'message_id')) = 2
-- +acemq Run CREATE UNIQUE INDEX processed_messages_key ON processed_messages (consumer_name, message_id)
SELECT 1;
