-- acemq_outbox is the estate's table: services in other languages write it
-- too. Its rows not yet published are events nobody has sent, theirs as
-- well as ours, so the table is not dropped while it holds any; publish or
-- delete them first. On a shared table, never migrate below version 1.
--
-- Plain SQL has no IF: an insert into a temporary table whose trigger
-- raises the refusal is the check. The CREATE first lets the check read a
-- table that is gone already (and is dropped again below).
CREATE TABLE IF NOT EXISTS acemq_outbox (published_at);
DROP TABLE IF EXISTS temp.acemq_outbox_drop_guard;
CREATE TEMP TABLE acemq_outbox_drop_guard (pending INTEGER);
CREATE TEMP TRIGGER acemq_outbox_drop_guard BEFORE INSERT ON acemq_outbox_drop_guard BEGIN SELECT RAISE(ABORT, 'refused: acemq_outbox holds rows not yet published, the other services'' too; publish or delete them first (on a table other services share, never migrate below version 1)'); END;
INSERT INTO acemq_outbox_drop_guard SELECT 1 FROM acemq_outbox WHERE published_at IS NULL LIMIT 1;
DROP TABLE acemq_outbox_drop_guard;

DROP TABLE IF EXISTS acemq_outbox_sequences;
DROP TABLE IF EXISTS acemq_outbox;
