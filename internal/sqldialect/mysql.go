package sqldialect

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"
)

// mysql holds all SQL text for MySQL 8 and MariaDB 10.6+.
type mysql struct{}

func (mysql) Name() string       { return "mysql" }
func (mysql) DriverName() string { return "mysql" }

func (mysql) quoteIdent(part string) string { return "`" + part + "`" }

// TimeArg sends UTC text rather than a time.Time: go-sql-driver/mysql would
// convert a time.Time into the DSN's loc, and a DSN with loc=Local would then
// store local wall-clock times in a table other services read as UTC.
func (mysql) TimeArg(t time.Time) any { return t.UTC().Format(timeLayout) }

// fromDriver: a DATETIME has no zone, and go-sql-driver/mysql (parseTime)
// returns its wall clock in the DSN's loc: with loc=Local, 10:00 stored is
// 10:00 local, hours from the 10:00 UTC that was written. The wall clock is
// what counts, and it is UTC.
func (mysql) fromDriver(t time.Time) time.Time { return wallClock(t) }

func (mysql) rebind(q string) string { return q }

func (mysql) Listens() bool { return false }

func (mysql) WatchesFile() bool { return false }

// Leases: MySQL 8 and MariaDB 10.6 have FOR UPDATE SKIP LOCKED, so a claim
// is a row lock held by the relay's transaction, released at once if the
// relay dies.
func (mysql) Leases() bool { return false }

// LocksPassedOver: InnoDB releases the locks of rows a READ COMMITTED
// locking read rejects when it scans the clustered index, not when it scans
// a secondary one, as the claim scans the pending index (seen on MariaDB
// 10.11: a claim's keyed rows that were not key heads stayed locked until
// its batch was marked).
func (mysql) LocksPassedOver() bool { return true }

func (mysql) GapLocks() bool { return true }

// PadsKeys: acemq_outbox.aggregate_id and acemq_outbox_sequences are
// varchar in a _bin collation, which MySQL 8 and MariaDB compare PAD SPACE.
// (The ordered inbox's keys are varbinary since 0009: exact.)
func (mysql) PadsKeys() bool { return true }

func (mysql) TextKeys() bool { return false }

func (mysql) BlobIDs() bool { return false }

// Conflict: a deadlock (1213), or MariaDB's "Record has changed since last
// read" (1020) under innodb_snapshot_isolation (on by default from
// 11.6.2): a write to a row another transaction changed after this one's
// snapshot; both roll the whole transaction back. A lock wait timeout
// (1205) has waited for innodb_lock_wait_timeout already.
func (mysql) Conflict(err error) bool {
	if err == nil {
		return false
	}
	s := err.Error()
	return strings.Contains(s, "Error 1213") || strings.Contains(s, "Error 1020")
}

// ConnLost: go-sql-driver's invalid connection (the server closed it:
// KILL CONNECTION, a restart), the server shutting down (1053), a
// statement or connection killed (1317, 1927), or database/sql's bad or
// done connection.
func (mysql) ConnLost(err error) bool {
	if err == nil {
		return false
	}
	if errors.Is(err, driver.ErrBadConn) || errors.Is(err, sql.ErrConnDone) {
		return true
	}
	s := err.Error()
	return strings.Contains(s, "invalid connection") || strings.Contains(s, "Error 1053") ||
		strings.Contains(s, "Error 1317") || strings.Contains(s, "Error 1927")
}

// MissingTable: no such table (1146). Not an unknown database (1049),
// which only a DSN naming one that is not there gives, and which no
// migration makes.
func (mysql) MissingTable(err error) bool {
	return err != nil && strings.Contains(err.Error(), "Error 1146")
}

// MissingColumn: unknown column (1054).
func (mysql) MissingColumn(err error) bool {
	return err != nil && strings.Contains(err.Error(), "Error 1054")
}

// CannotHold: an illegal mix of collations (1267, 1270, 1271), MySQL's
// refusal to compare a utf8mb3 or latin1 column with a value holding a
// character it lacks.
func (mysql) CannotHold(err error) bool {
	if err == nil {
		return false
	}
	s := err.Error()
	return strings.Contains(s, "Error 1267") || strings.Contains(s, "Error 1270") || strings.Contains(s, "Error 1271")
}

func (mysql) CommitRolledBack(error) bool { return false }

// TimeoutEnds: a lock wait timeout (1205) rolls back the whole transaction
// only when innodb_rollback_on_timeout is on (off by default).
func (mysql) TimeoutEnds(err error) (Query, bool) {
	if err == nil || !strings.Contains(err.Error(), "Error 1205") {
		return Query{}, false
	}
	return Query{SQL: "SELECT @@innodb_rollback_on_timeout"}, true
}

func (mysql) AsksByBegin() bool { return false }

func (mysql) SilentRollbacks() bool { return true }

// EndsTransaction: InnoDB rolls the whole transaction back on a deadlock
// (1213), on MariaDB's snapshot isolation conflict (1020), and on a lock
// wait timeout (1205) when innodb_rollback_on_timeout is on: all count
// here, and a caller that must know asks TimeoutEnds. Matched on
// go-sql-driver's text ("Error 1213 (40001): …"), as the library imports
// no driver.
func (mysql) EndsTransaction(err error) bool {
	if err == nil {
		return false
	}
	s := err.Error()
	return strings.Contains(s, "Error 1213") || strings.Contains(s, "Error 1205") || strings.Contains(s, "Error 1020")
}

// PreparesRelay: go-sql-driver prepares, executes and closes a statement for
// every query with arguments (unless the DSN sets interpolateParams), two
// round trips and a parse of a hundred placeholders for each claim and mark.
// Prepared once per connection, each is one round trip. With the database
// on loopback the drain gained a few percent (outbox-bench -scenario relay,
// 0.67 to 0.69 of the broker's rate over eleven runs side by side); across a
// network each round trip saved counts for more.
func (mysql) PreparesRelay() bool { return true }

func (mysql) insertOutbox(table, cols string, n, rows int) string {
	var b strings.Builder
	b.Grow(64 + rows*n*3)
	b.WriteString("INSERT INTO " + table + " (" + cols + ") VALUES ")
	valuesList(&b, rows, n, questionMark)
	b.WriteString(" ON DUPLICATE KEY UPDATE " + flagSkipped("id"))
	return b.String()
}

// flagSkipped is the update clause of an insert that skips a row whose
// unique key another row holds, leaving that row as it is, and says so
// through the result's LastInsertId (see insertedAll): a skip sets
// LAST_INSERT_ID to skippedFlag, which no AUTO_INCREMENT reaches. A
// statement that skips nothing reports 0, or the first id an AUTO_INCREMENT
// column of the table generated (a processed_messages or acemq_outbox
// another library created with a surrogate key: Rails' create_table adds
// one), never skippedFlag.
//
// Not INSERT IGNORE, whose affected-row count told a skip the same way:
// IGNORE also turns every error of a value into a warning, and stores what
// the column makes of it. A table another library created in utf8mb3 or
// latin1 stored an emoji as "?", and a narrower column cut a value, where
// strict mode, the default, now refuses the statement and the caller sees
// the error. Nor the count of ON DUPLICATE KEY UPDATE alone: under the
// DSN's clientFoundRows=true a row left as it is counts 1, as an insert.
//
// The price: after a skip (a retried transaction's message, a duplicate
// delivery), the connection's LAST_INSERT_ID() reads skippedFlag until its
// next AUTO_INCREMENT insert; the result of the caller's own insert, where
// drivers take the id from, is not touched.
func flagSkipped(col string) string {
	return col + " = IF(LAST_INSERT_ID(" + strconv.FormatInt(skippedFlag, 10) + ") <> 0, " + col + ", " + col + ")"
}

// skippedFlag is the LastInsertId of a statement that skipped a row.
const skippedFlag = math.MaxInt64

// insertedAll: a skipped row sets the result's LastInsertId to skippedFlag
// (flagSkipped), and counts 0 affected, or 1 under clientFoundRows. But a
// statement of several rows into a table with an AUTO_INCREMENT column
// that inserted some and skipped others reports the first id it generated,
// and under clientFoundRows counts every row: so such a statement (an id
// neither 0 nor skippedFlag) reports false, and the caller reads back what
// it inserted. A result that hides LastInsertId (a watermill-sql Tx of
// another kind than its database/sql adapter) leaves the count, right under
// the driver's default clientFoundRows=false.
func (mysql) insertedAll(res Result, n int) (bool, error) {
	if r, ok := res.(interface{ LastInsertId() (int64, error) }); ok {
		id, err := r.LastInsertId()
		if err != nil || id == skippedFlag || (id != 0 && n > 1) {
			return false, err
		}
	}
	affected, err := res.RowsAffected()
	return affected == int64(n), err
}

// raiseSeqs: MySQL's upsert refers to the row it would have inserted
// through VALUES(), which MySQL 8.0.20 deprecates, or a row alias, which
// MariaDB lacks; so each key's n goes again, in a CASE on the key (a call
// of one key, the common one, needs no CASE). Rows are inserted in the
// order of the list, and the lock of each row's update, or insert, is held
// to the end of the transaction, as on the other databases.
func (mysql) raiseSeqs(sequences string, keys []KeyCount) Query {
	var b strings.Builder
	args := make([]any, 0, 4*len(keys))
	b.WriteString("INSERT INTO " + sequences + " (aggregate_id, last_seq) VALUES ")
	for i, k := range keys {
		if i > 0 {
			b.WriteString(", ")
		}
		b.WriteString("(?, ?)")
		args = append(args, k.Key, k.N)
	}
	if len(keys) == 1 {
		b.WriteString(" ON DUPLICATE KEY UPDATE last_seq = last_seq + ?")
		return Query{SQL: b.String(), Args: append(args, keys[0].N)}
	}
	b.WriteString(" ON DUPLICATE KEY UPDATE last_seq = last_seq + CASE aggregate_id")
	for _, k := range keys {
		b.WriteString(" WHEN ? THEN ?")
		args = append(args, k.Key, k.N)
	}
	b.WriteString(" END")
	return Query{SQL: b.String(), Args: args}
}

// insertNumbered: the raise, then the insert reading the raised counters
// back; MySQL has neither RETURNING nor data-modifying CTEs. The read sees
// this transaction's own raise, whatever the isolation level.
func (d mysql) insertNumbered(o *Outbox, rows []Row, keys []KeyCount) []Query {
	insert, args := o.numberedInsert("INSERT INTO", rows, keys, o.sequences)
	return []Query{d.raiseSeqs(o.sequences, keys), {SQL: insert + " ON DUPLICATE KEY UPDATE " + flagSkipped("id"), Args: args}}
}

// claim walks p.Index when it is set (see pendingIndex).
//
// It takes only rows of the statement's snapshot (keyHead's COUNT(*)
// probe), and it does not walk past the newest pending row of that
// snapshot. A locking read sees each row as it is when the walk reaches
// it, so a transaction that committed during the walk showed the claim its
// later rows, its earlier ones still locked by their writer when the walk
// passed them (SKIP LOCKED): the claim took the transaction's tail, the
// drain's cursor moved past its head, and the relay sent it tail first
// (Watermill's TestPublishSubscribeInOrder failed so about once in 70 runs;
// a claim racing the commit of 20,000 rows took 1,000 of them from row 86
// to 6,673 on in 10 of 12 tries). In the snapshot a transaction has
// committed whole or not at all. The bound is an uncorrelated subquery,
// which MariaDB answers before the walk: the snapshot is taken then
// (without it, it was taken at the first row's subquery, during the walk,
// and TestStore_MySQL_ClaimRacingACommit_… still failed), and the walk
// stops before the rows committed since, which it would otherwise lock and
// reject, holding them from the next claims until its batch is marked.
// Verified on MariaDB 10.11; MySQL 8 is untested.
//
// The price, measured on MariaDB with outbox-bench -scenario latency (the
// relay in its own process, two runs): commit to broker 2.2–2.3 / 14.6–15.9
// ms (p50 / p99) at 500 msg/s against 1.5–1.7 / 8.6–9.1 before, and 22–30 /
// 101–139 ms at 2,000 msg/s against 8–11 / 38–47. The rows a service
// stamped before the bound and committed after the snapshot are still
// reached, rejected and held until the claim's batch is marked.
//
// Narrowed, not closed: one run of Watermill's suite in 150 afterwards sent
// a transaction's first row, alone, after its last (a lock its writer had
// not released yet when the claim reached the row, presumably: an earlier
// claim's walk made the writer's implicit lock on it explicit, and InnoDB
// releases explicit locks after it takes the transaction out of the active
// list, while rows under implicit locks only are free from that moment).
func (d mysql) claim(table string, p ClaimParams, where string, args []any) Query {
	hint := ""
	if p.Index != "" {
		hint = " FORCE INDEX (" + d.quoteIdent(p.Index) + ")"
	}
	// A row without a created_at (another library's nullable column) is
	// taken as before, to fail alone as malformed.
	where = "(created_at IS NULL OR created_at <= (SELECT MAX(created_at) FROM " + table + hint + " WHERE published_at IS NULL)) AND " + where
	from := table + " " + claimAlias + hint // the alias comes before the hint
	return Query{SQL: lockingClaim(mysqlClaimed, from, where), Args: append(args, p.Limit)}
}

// keyHead: a keyed row is claimable when it is its key's first pending
// row, the condition of keyHeadNotExists, asked the way MySQL answers
// cheaply. The subquery reads the key's lowest pending seq, one entry of
// 0007's (aggregate_id, published_at, seq) in index order. MySQL cannot
// end a range at the claimed row's seq, which comes from the outer row,
// so NOT EXISTS read every pending entry of the key to find none below
// it: a key with 10,000 pending records cost 10,000 entries per probe of
// its head. And the probe names the index (p.KeyIndex, looked up as the
// pending index is): MariaDB, left to choose, walked 0005's unique
// (aggregate_id, seq), whose entries of published records each cost a
// read of the row (2-3 ms of a claim's 3-4 ms halfway through a drain of
// 20 records per key, growing with the key's published records). A row
// without a seq passes, as it does NOT EXISTS; NULL seqs, which sort
// first, are stepped over. Should the subquery find no pending row (the
// claimed row was published after the statement's snapshot), COALESCE
// lets the outer row's own check decide, as NOT EXISTS would.
//
// The rows the relay has in flight (p.InFlight) are left out of the
// subquery, as keyHeadNotExists leaves them out. InnoDB keeps the locks of
// the rows a claim scanned through the pending index and passed over until
// its transaction ends (a scan of the clustered index releases them; one of
// a secondary index does not): a key's next record that the claim of its
// predecessor passed over is locked until that batch is marked, and the
// next claim skips it as it would without InFlight.
//
// Every row, keyed or not, must also be in the statement's snapshot (the
// COUNT(*) probe; see claim for when the snapshot is taken). InnoDB's
// locking scan reads rows as they are now, and the subqueries as they
// were when the snapshot was taken: a key's seq 1 and seq 2
// committed while a claim scans (a backlog, rows skipped or stuck) were
// seen as seq 2 alone, and seq 2 was claimed while seq 1 was pending. Seq
// 1 commits before seq 2 (its counter's row lock), so a snapshot that
// holds seq 2 holds seq 1; a row committed since is left to the next
// claim. Written as scalar subqueries, which MySQL does not fold into the
// locking join: they stay reads of the snapshot.
func (d mysql) keyHead(table, alias string, p ClaimParams) string {
	from := table + " p"
	if p.KeyIndex != "" {
		from += " FORCE INDEX (" + d.quoteIdent(p.KeyIndex) + ")"
	}
	notOurs := ""
	if len(p.InFlight) > 0 {
		// Compared as bytes: JSON_TABLE's column has a collation of its
		// own, which the table's need not match, and the relay names only
		// UTF-8 ids, which a utf8mb4 column holds as the same bytes. An id
		// that does not match (another charset, longer than the column,
		// NULL on an error) only makes its key wait for its mark.
		notOurs = d.notOurs("p")
	}
	return "((SELECT COUNT(*) FROM " + table + " v WHERE v.id = " + alias + ".id) = 1 AND (" +
		alias + ".aggregate_id IS NULL OR " + alias + ".seq IS NULL OR " +
		"COALESCE((SELECT p.seq FROM " + from +
		" WHERE p.aggregate_id = " + alias + ".aggregate_id AND p.published_at IS NULL AND p.seq IS NOT NULL" + notOurs + " ORDER BY p.seq LIMIT 1), " +
		alias + ".seq) >= " + alias + ".seq))"
}

func (mysql) notOurs(alias string) string {
	return " AND CAST(" + alias + ".id AS BINARY) NOT IN (SELECT j.id FROM JSON_TABLE(?, '$[*]' COLUMNS (id VARBINARY(512) PATH '$')) j WHERE j.id IS NOT NULL)"
}

// windows: MySQL's claims are not windowed. Its key-head probe reads a
// key's lowest pending seq, one index entry, but its walk still passes
// every record of a key's backlog; its claim's snapshot rules (see claim
// and keyHead) would need their own proof for a claim of several parts.
func (mysql) windows() bool { return false }

func (mysql) latest() string { return "NULL" } // never asked for (windows)

// pointsInIndex: a claim that reached a row through the primary key locks
// its clustered record alone (see pendingIndex).
func (mysql) pointsInIndex() bool { return true }

// windowClaim: never asked for (windows).
func (d mysql) windowClaim(o *Outbox, p ClaimParams, where string, args []any) Query {
	return d.claim(o.table, p, where, args)
}

func (mysql) claimSetup() string { return "" }

// busyTimeout: the server queues writers.
func (mysql) busyTimeout() string { return "" }

// pendingIndex: every claim names the index of pending rows (FORCE INDEX),
// whatever the optimizer would pick for a small table. A claim that reached
// a row through the primary key instead locked only its clustered record;
// the next claim, walking the index, then locked that row's index record
// before it skipped the row, and kept the lock. The first claim's mark,
// which must rewrite that index record, waited for a transaction its own
// relay holds open until the mark is done: a wait InnoDB's deadlock detector
// cannot see, ended by innodb_lock_wait_timeout (seen: 50 s stalls).
// Through the index, the second claim finds the record locked and skips it
// holding nothing, so a relay may claim the next batch while the one before
// is in flight. The index is looked up rather than named: sqlschema calls it
// acemq_outbox_pending, and a table made with CREATE TABLE … LIKE keeps that
// name, one made from edited SQL may not. Only an index on (published_at,
// created_at, …) will do: it holds the pending rows in the claim's order,
// so the claim locks the rows it takes and stops. Through one on
// published_at alone the claim sorts every pending row, and locks them all
// before the sort: a second relay then claimed nothing while the first held
// its batch. A table with no such index is claimed unnamed (sqlschema's
// 0004 adds acemq_outbox_pending_claim to it). Arguments: the table's
// schema (or NULL for the current one), its name.
func (mysql) pendingIndex() string {
	return "SELECT s1.INDEX_NAME FROM information_schema.STATISTICS s1" +
		" JOIN information_schema.STATISTICS s2 ON s2.TABLE_SCHEMA = s1.TABLE_SCHEMA AND s2.TABLE_NAME = s1.TABLE_NAME" +
		" AND s2.INDEX_NAME = s1.INDEX_NAME AND s2.SEQ_IN_INDEX = 2 AND s2.COLUMN_NAME = 'created_at'" +
		" WHERE s1.TABLE_SCHEMA = COALESCE(?, DATABASE()) AND s1.TABLE_NAME = ? AND s1.SEQ_IN_INDEX = 1" +
		" AND s1.COLUMN_NAME = 'published_at' ORDER BY s1.INDEX_NAME LIMIT 1"
}

// createdAtPrecision: DATETIME_PRECISION of a datetime or timestamp.
func (mysql) createdAtPrecision() string {
	return "SELECT DATETIME_PRECISION FROM information_schema.COLUMNS WHERE TABLE_SCHEMA = COALESCE(?, DATABASE())" +
		" AND TABLE_NAME = ? AND COLUMN_NAME = 'created_at' AND DATA_TYPE IN ('datetime', 'timestamp')"
}

// zonedTimes: TIMESTAMP is converted, DATETIME is not.
func (mysql) zonedTimes() string {
	return "SELECT COALESCE((SELECT GROUP_CONCAT(COLUMN_NAME ORDER BY COLUMN_NAME) FROM information_schema.COLUMNS" +
		" WHERE TABLE_SCHEMA = COALESCE(?, DATABASE()) AND TABLE_NAME = ? AND DATA_TYPE = 'timestamp'" +
		" AND COLUMN_NAME IN ('created_at', 'published_at', 'locked_until', 'processed_at')), '')," +
		" TIMESTAMPDIFF(SECOND, UTC_TIMESTAMP(), NOW())"
}

// idType: DATA_TYPE, followed by " unsigned" and " zerofill" where
// COLUMN_TYPE says so.
func (mysql) idType() string {
	return "SELECT COALESCE((SELECT CONCAT(LOWER(DATA_TYPE), IF(LOWER(COLUMN_TYPE) LIKE '% unsigned%', ' unsigned', '')," +
		" IF(LOWER(COLUMN_TYPE) LIKE '% zerofill%', ' zerofill', ''))" +
		" FROM information_schema.COLUMNS" +
		" WHERE TABLE_SCHEMA = COALESCE(?, DATABASE()) AND TABLE_NAME = ? AND COLUMN_NAME = 'id'), '')"
}

// mysqlClaimed is the claim's select list (see claimed).
var mysqlClaimed = claimed(mysql{})

// keyIndex: the index keyHead names, looked up as pendingIndex's is: one
// on (aggregate_id, published_at, seq), 0007's acemq_outbox_pending_key
// under whatever name. None found, the probe goes unnamed. Arguments: the
// table's schema (or NULL for the current one), its name.
func (mysql) keyIndex() string {
	return "SELECT s1.INDEX_NAME FROM information_schema.STATISTICS s1" +
		" JOIN information_schema.STATISTICS s2 ON s2.TABLE_SCHEMA = s1.TABLE_SCHEMA AND s2.TABLE_NAME = s1.TABLE_NAME" +
		" AND s2.INDEX_NAME = s1.INDEX_NAME AND s2.SEQ_IN_INDEX = 2 AND s2.COLUMN_NAME = 'published_at'" +
		" JOIN information_schema.STATISTICS s3 ON s3.TABLE_SCHEMA = s1.TABLE_SCHEMA AND s3.TABLE_NAME = s1.TABLE_NAME" +
		" AND s3.INDEX_NAME = s1.INDEX_NAME AND s3.SEQ_IN_INDEX = 3 AND s3.COLUMN_NAME = 'seq'" +
		" WHERE s1.TABLE_SCHEMA = COALESCE(?, DATABASE()) AND s1.TABLE_NAME = ? AND s1.SEQ_IN_INDEX = 1" +
		" AND s1.COLUMN_NAME = 'aggregate_id' ORDER BY s1.INDEX_NAME LIMIT 1"
}

func (d mysql) timeCmp(col, op string, t time.Time) (string, []any) {
	return timeColumnCmp(d, col, op, t)
}

func (d mysql) instantCmp(col, op string, t time.Time) (string, []any) {
	return timeColumnCmp(d, col, op, t)
}

func (mysql) timeOf(col string) string { return col }

// timeText: a DATETIME read as its text. With parseTime in the DSN,
// go-sql-driver/mysql builds a time.Time of the stored wall clock in the
// DSN's loc, and with loc=Local (or any zone with daylight saving) a wall
// clock in the hour the clocks skip does not exist there: Go moves it an
// hour on, and no reading of the result can tell it from the hour after
// (fromDriver's wall clock was then an hour late). A keyed publish retried
// in that hour took its own row for another's, gave its numbers back under
// it, and every later publish of the key failed. Text is what the column
// holds, whatever the DSN.
func (mysql) timeText(expr string) string { return "CAST(" + expr + " AS CHAR)" }

// stored: as its text (see timeText), passed back as text that MySQL reads
// as the column's type.
func (d mysql) stored(col string) string { return d.timeText(col) }

// purgePublished: MySQL refuses LIMIT in an IN subquery, and has DELETE …
// LIMIT instead.
func (mysql) purgePublished(table, before string) string {
	return "DELETE FROM " + table + " WHERE published_at IS NOT NULL AND " + before + " ORDER BY published_at LIMIT ?"
}

// insertProcessed skips a key that is there as the outbox insert skips an
// id (flagSkipped): a processed_messages another library created in
// utf8mb3, or with a message_id narrower than the Inbox's 255, would have
// stored two ids as one under INSERT IGNORE ("?" for an emoji, or the
// first characters of a long id), and the second message was acked as a
// duplicate without running. Strict mode refuses such an id instead, and
// the delivery fails with the error.
func (mysql) insertProcessed(table string) string {
	return "INSERT INTO " + table + " (consumer_name, message_id, processed_at) VALUES (?, ?, ?) ON DUPLICATE KEY UPDATE " + flagSkipped("message_id")
}

func (mysql) purgeProcessed(table, before string) string {
	return "DELETE FROM " + table + " WHERE " + before + " ORDER BY processed_at LIMIT ?"
}

// insertInboxSequence locks the key's row exclusively, new or not: INSERT
// IGNORE would take a shared lock on a row that is there, and two
// deliveries of a key, both holding it, deadlock on the FOR UPDATE that
// follows (seen at once with six concurrent deliveries).
func (mysql) insertInboxSequence() string {
	return "INSERT INTO " + InboxSequencesTable + " (consumer_name, aggregate_id, last_seq) VALUES (?, ?, 0) ON DUPLICATE KEY UPDATE last_seq = last_seq"
}

// insertInboxHeld uses INSERT IGNORE for its affected-row count: the table
// is this library's own (0006, utf8mb4), and every value was checked
// against its column first, so IGNORE's other effect, storing a value the
// column alters, cannot reach it.
func (mysql) insertInboxHeld() string {
	return "INSERT IGNORE INTO " + InboxHeldTable + " (" + inboxHeldColumns + ") VALUES (" + placeholders(inboxHeldColumnCount) + ")"
}

func (mysql) lockInboxSequence() string { return selectInboxSequence + " FOR UPDATE" }

// applyInOrder: MySQL has neither RETURNING nor data-modifying CTEs, so
// the advance and the dedupe key are two statements. The advance is an
// INSERT … ON DUPLICATE KEY UPDATE, which locks the key's row exclusively,
// new or not, as insertInboxSequence does (an UPDATE of a missing row would
// take a gap lock, and two first deliveries of new keys deadlock on their
// inserts). It says what it did through its result: a row it changes counts
// 2 affected whatever clientFoundRows says; a new row counts 1. An existing
// row left alone counts 0, or 1 under clientFoundRows, so the update branch
// also sets LAST_INSERT_ID (the result's LastInsertId) to last_seq + 1,
// never 0, where an insert into this table, without AUTO_INCREMENT, reports
// 0. A new row moved the key only for seq 1, written at 1.
//
// Each goes in one round trip, its arguments in its text (see inline; the
// inbox sends every statement of a message's transaction so), as a
// statement prepared once per connection would, but with nothing prepared
// for a proxy to lose or a server to run out of. The in-order path is the
// plain inbox's statements and this one more (CHANGELOG has the figures).
func (mysql) applyInOrder(in *Inbox, m InOrder) []ApplyStep {
	advance := ApplyStep{
		Query: Query{
			SQL: "INSERT INTO " + InboxSequencesTable + " (consumer_name, aggregate_id, last_seq, held) VALUES (?, ?, ?, 0)" +
				" ON DUPLICATE KEY UPDATE last_seq = IF(LAST_INSERT_ID(last_seq + 1) = ? AND held = 0, ?, last_seq)",
			Args: []any{m.Consumer, m.Key, firstSeq(m.Seq), m.Seq, m.Seq},
		},
		Done: func(res sql.Result) (bool, error) {
			n, err := res.RowsAffected()
			if err != nil || n == 2 {
				return n == 2, err
			}
			id, err := res.LastInsertId()
			return n == 1 && id == 0 && m.Seq == 1, err
		},
	}
	key := func(res sql.Result) (bool, error) { return mysql{}.insertedAll(res, 1) }
	return []ApplyStep{advance, {Query: in.Insert(m.Consumer, m.MessageID, m.At), Done: key}}
}

// migrationLockTimeout is how long a second migrating process waits for the
// first, in seconds; past it Migrate fails rather than hanging a deploy.
const migrationLockTimeout = 60

// migrationLockName names the migration lock after the database: its name
// and ".acemq_migrate", as earlier versions do, where that fits the 64
// characters MySQL 8 allows a lock name, else a hash of it (a database
// name over 50 characters failed Migrate there).
const migrationLockName = "IF(CHAR_LENGTH(DATABASE()) <= 50, CONCAT(DATABASE(), '.acemq_migrate'), CONCAT('acemq_migrate.', MD5(DATABASE())))"

func (mysql) WithMigrationLock(ctx context.Context, conn *sql.Conn, fn func(Execer) error) (err error) {
	// A migration that failed part way leaves its session as it stopped:
	// its user variables, and a setting a file changes for its own ALTER
	// and sets back at its end (0011's explicit_defaults_for_timestamp).
	// The connection is discarded rather than handed to the application's
	// next statement.
	defer func() {
		if err != nil {
			_ = conn.Raw(func(any) error { return driver.ErrBadConn })
		}
	}()
	// DDL commits implicitly on MySQL, so a transaction cannot hold the
	// lock: a named lock on this connection does, scoped to the database.
	// The lock is named after the database: without one (a DSN that names
	// none) GET_LOCK(NULL) is NULL on MariaDB, an error on MySQL, and the
	// wait was reported as another process's.
	var (
		noDatabase bool
		got        sql.NullInt64
	)
	if err := conn.QueryRowContext(ctx, "SELECT DATABASE() IS NULL, IF(DATABASE() IS NULL, NULL, GET_LOCK("+migrationLockName+", ?))",
		migrationLockTimeout).Scan(&noDatabase, &got); err != nil {
		return err
	}
	if noDatabase {
		return errors.New("the connection has no database selected: name one in the DSN (user@tcp(host:3306)/database), where the tables are to be")
	}
	if !got.Valid || got.Int64 != 1 {
		return fmt.Errorf("another process held the migration lock for %ds", migrationLockTimeout)
	}
	defer func() {
		_, relErr := conn.ExecContext(context.WithoutCancel(ctx), "SELECT RELEASE_LOCK("+migrationLockName+")")
		err = errors.Join(err, relErr)
	}()
	// A step's wait for a table's metadata lock is cut short and tried
	// again (see retryTableLocks); the session's own setting comes back
	// before the connection returns to the pool.
	var own int64
	if err := conn.QueryRowContext(ctx, "SELECT @@SESSION.lock_wait_timeout").Scan(&own); err != nil {
		return err
	}
	if _, err := conn.ExecContext(ctx, fmt.Sprintf("SET SESSION lock_wait_timeout = %d", int(migrationTableLockWait.Seconds()))); err != nil {
		return err
	}
	defer func() {
		_, setErr := conn.ExecContext(context.WithoutCancel(ctx), fmt.Sprintf("SET SESSION lock_wait_timeout = %d", own))
		err = errors.Join(err, setErr)
	}()
	return fn(retryingExecer{conn: conn, deadline: time.Now().Add(migrationLockTimeout * time.Second)})
}

// retryingExecer runs each migration step again while it fails for a lock
// wait cut short, until deadline, one for every step. MySQL's DDL commits
// on its own, and every step is safe to run again (the guards of 0004 on),
// so a step is the unit of a try.
type retryingExecer struct {
	conn     *sql.Conn
	deadline time.Time
}

func (r retryingExecer) ExecContext(ctx context.Context, query string, args ...any) (res sql.Result, err error) {
	err = retryTableLocks(ctx, r.deadline, func() error {
		res, err = r.conn.ExecContext(ctx, query, args...)
		return err
	}, func(err error) bool { return strings.Contains(err.Error(), "Error 1205") })
	return res, err
}

func (r retryingExecer) QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error) {
	return r.conn.QueryContext(ctx, query, args...)
}

func (mysql) createMigrationsTable() string {
	return `CREATE TABLE IF NOT EXISTS acemq_schema_migrations (
    version    int          NOT NULL PRIMARY KEY,
    name       varchar(255) NOT NULL,
    applied_at datetime(6)  NOT NULL DEFAULT CURRENT_TIMESTAMP(6)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin`
}

func (mysql) insertMigration() string {
	return "INSERT INTO acemq_schema_migrations (version, name) VALUES (?, ?)"
}

// bytes: an acemq_outbox another library created (Rails') has the
// database's default collation, utf8mb4_general_ci or utf8mb4_0900_ai_ci,
// under which "orders" equals "Orders", "ÓRDERS" and (PAD SPACE, as
// utf8mb4_bin is too) "orders ": Republish sent another topic's records
// again at every boot. As binary strings they compare byte for byte; the
// conversion to utf8mb4 first keeps that right for a column of another
// character set (the arguments are utf8mb4). An index cannot serve the
// conversion: RepublishPick also compares routing_key as it is, for 0012's
// index, and the conversion costs each row it then filters a copy of two
// short strings.
func (mysql) bytes(col string) string { return "CAST(CONVERT(" + col + " USING utf8mb4) AS BINARY)" }

func (mysql) keepCreatedAt() string { return "created_at = created_at, " }

// text: MySQL strips a CHAR column's padding as it reads it.
func (mysql) text(col string) string { return col }

// currentRead: under REPEATABLE READ, MySQL's default, a plain SELECT reads
// the snapshot of the transaction's first read, while an insert skips ids
// committed since. A locking read sees them. LOCK IN SHARE MODE, which
// MariaDB and MySQL 8 both take (FOR SHARE is MySQL's only).
func (mysql) currentRead() string { return " LOCK IN SHARE MODE" }
