-- acemq_inbox_held holds the ordered inbox's early arrivals: messages the
-- broker was told were handled and whose handlers have not run, kept until
-- their predecessor is applied. The table is their only copy, so it is not
-- dropped while it holds any; let the inbox apply them first (outboxctl
-- held shows what each key waits for).
--
-- The check is 0001's down's: an insert into a temporary table whose
-- trigger raises the refusal. The CREATE first lets the check read a table
-- that is gone already (and is dropped again below).
CREATE TABLE IF NOT EXISTS acemq_inbox_held (seq);
DROP TABLE IF EXISTS temp.acemq_inbox_held_drop_guard;
CREATE TEMP TABLE acemq_inbox_held_drop_guard (held INTEGER);
CREATE TEMP TRIGGER acemq_inbox_held_drop_guard BEFORE INSERT ON acemq_inbox_held_drop_guard BEGIN SELECT RAISE(ABORT, 'refused: acemq_inbox_held holds messages not yet handled; they were acked to the broker and this table is their only copy: let the inbox apply them first (outboxctl held shows what each key waits for)'); END;
INSERT INTO acemq_inbox_held_drop_guard SELECT 1 FROM acemq_inbox_held LIMIT 1;
DROP TABLE acemq_inbox_held_drop_guard;

DROP TABLE IF EXISTS acemq_inbox_held;
DROP TABLE IF EXISTS acemq_inbox_sequences;
DROP TABLE IF EXISTS processed_messages;
