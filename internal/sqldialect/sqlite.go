package sqldialect

import (
	"context"
	"database/sql"
	"fmt"
	"strings"
	"time"
)

// sqlite holds all SQL text for SQLite (mattn/go-sqlite3).
type sqlite struct{}

func (sqlite) Name() string       { return "sqlite" }
func (sqlite) DriverName() string { return "sqlite3" }

func (sqlite) quoteIdent(part string) string { return `"` + part + `"` }

// TimeArg sends fixed-width UTC text (timeLayout), so text order is time
// order. The driver's own time.Time encoding trims trailing zeros and would
// not sort.
func (sqlite) TimeArg(t time.Time) any { return t.UTC().Format(timeLayout) }

// fromDriver: mattn/go-sqlite3 parses zoneless text as UTC, text with an
// offset at its offset, and then moves the time to the DSN's _loc, keeping
// the instant.
func (sqlite) fromDriver(t time.Time) time.Time { return instant(t) }

func (sqlite) inline(q Query) (Query, bool) { return q, false }

func (sqlite) rebind(q string) string { return q }

func (sqlite) Listens() bool { return false }

func (sqlite) WatchesFile() bool { return true }

// Leases: SQLite has no row locks, so a claim writes a lease into
// locked_by/locked_until and commits before publishing. A relay that dies
// leaves its rows until the lease expires.
func (sqlite) Leases() bool { return true }

// LocksPassedOver: the lease is written on the rows the claim takes only.
func (sqlite) LocksPassedOver() bool { return false }

func (sqlite) GapLocks() bool { return false }

func (sqlite) PadsKeys() bool { return false }

func (sqlite) TextKeys() bool { return false }

func (sqlite) BlobIDs() bool { return true }

// Conflict: SQLite runs one writer at a time; a writer that waited past
// busy_timeout is not one to try again at once.
func (sqlite) Conflict(error) bool { return false }

// ConnLost: a file has no connection to lose, but SQLITE_BUSY past the
// busy timeout is the database not answering all the same: another
// connection (another process's transaction, a VACUUM, a migration) holds
// the write lock, no fault of the statement's. The inbox waits it out as it
// waits out a lost connection (not a handler's own: see the inbox's
// notWaitedOut): a review's third process that held the lock 23 s had
// PoisonQueue set a sound message aside, acked, never applied, once
// Retry's tries ran out.
func (sqlite) ConnLost(err error) bool { return Busy(err) }

func (sqlite) CannotHold(error) bool { return false } // TEXT holds any bytes

// MissingTable: SQLite's code for it is the generic SQLITE_ERROR; its
// message says it (an attached database that is not there: "no such
// table" too, under its schema's name).
func (sqlite) MissingTable(err error) bool {
	return err != nil && strings.Contains(err.Error(), "no such table")
}

// MissingColumn: as MissingTable, by its message.
func (sqlite) MissingColumn(err error) bool {
	return err != nil && strings.Contains(err.Error(), "no such column")
}

func (sqlite) TimeoutEnds(error) (Query, bool) { return Query{}, false }

func (sqlite) AsksByBegin() bool { return true }

func (sqlite) SilentRollbacks() bool { return false }

// BeginRefused reports whether err, a BEGIN's, says a transaction is open
// on the connection (SQLite's text, through mattn/go-sqlite3).
func BeginRefused(err error) bool {
	return err != nil && strings.Contains(err.Error(), "cannot start a transaction within a transaction")
}

func (sqlite) CommitRolledBack(error) bool { return false }

// EndsTransaction: SQLite may roll a transaction back on SQLITE_FULL,
// SQLITE_IOERR, SQLITE_BUSY and SQLITE_NOMEM ("Response To Errors Within A
// Transaction"), matched on mattn/go-sqlite3's text, sqlite3_errstr's.
func (sqlite) EndsTransaction(err error) bool {
	if err == nil {
		return false
	}
	s := err.Error()
	return Busy(err) || strings.Contains(s, "database or disk is full") || strings.Contains(s, "disk I/O error") || strings.Contains(s, "out of memory")
}

// PreparesRelay: compiling a statement in process costs no round trip.
func (sqlite) PreparesRelay() bool { return false }

func (sqlite) insertedAll(res Result, n int) (bool, error) { return affectedAll(res, n) }

func (sqlite) insertOutbox(table, cols string, n, rows int) string {
	return insertOutboxOnConflict(table, cols, n, rows, questionMark)
}

func (sqlite) raiseSeqs(sequences string, keys []KeyCount) Query {
	sql, args := raiseSeqsOnConflict(sequences, keys)
	return Query{SQL: sql, Args: args}
}

// insertNumbered: the raise, then the insert reading the raised counters
// back from the table. Two statements in process cost less than one
// RETURNING read through database/sql's rows.
func (d sqlite) insertNumbered(o *Outbox, rows []Row, keys []KeyCount) []Query {
	insert, args := o.numberedInsert("INSERT INTO", rows, keys, o.sequences)
	return []Query{d.raiseSeqs(o.sequences, keys), {SQL: insert + " ON CONFLICT (id) DO NOTHING", Args: args}}
}

// claim leases the rows: the update is conditional on the rows still being
// free, so of two relays the second claims other rows, or none. RETURNING
// promises no order: the caller sorts.
func (sqlite) claim(table string, p ClaimParams, where string, args []any) Query {
	lease := []any{p.RelayID, sqlite{}.TimeArg(p.LeaseUntil)}
	return Query{
		SQL: "UPDATE " + table + " SET locked_by = ?, locked_until = ? WHERE id IN (SELECT id FROM " + table + " " + claimAlias +
			" WHERE " + where + " ORDER BY created_at, id LIMIT ?) RETURNING " + claimColumns,
		Args: append(append(lease, args...), p.Limit),
	}
}

// keyHead: InFlight's ids are a json array, read by json_each (without
// NULLs: see postgres's).
func (d sqlite) keyHead(table, alias string, p ClaimParams) string {
	notOurs := ""
	if len(p.InFlight) > 0 {
		notOurs = d.notOurs("p")
	}
	return keyHeadNotExists(table, alias, notOurs)
}

func (sqlite) windows() bool { return true }

// pointsInIndex: never asked for (no floor on SQLite).
func (sqlite) pointsInIndex() bool { return false }

// latest: a blob sorts after every number and text, whichever way a
// library wrote its times.
func (sqlite) latest() string { return "x'ff'" }

func (sqlite) notOurs(alias string) string {
	return " AND " + alias + ".id NOT IN (SELECT value FROM json_each(?) WHERE value IS NOT NULL)"
}

// windowClaim leases what near and far choose in one UPDATE, as claim
// does: SQLite's one writer has nothing to skip. far: the oldest of the
// claimable heads and unkeyed rows (through 0013's index), up to what near
// left.
func (sqlite) windowClaim(o *Outbox, p ClaimParams, where string, args []any) Query {
	var b sqlBuilder
	b.add("UPDATE "+o.table+" SET locked_by = ?, locked_until = ? WHERE id IN (WITH RECURSIVE ", p.RelayID, sqlite{}.TimeArg(p.LeaseUntil))
	o.windowNear(&b, p, where, args, "id, created_at", "")
	b.add(", ")
	o.windowKeys(&b, p)
	b.add(", ")
	o.windowHeadIDs(&b, p)
	b.add(", cand AS (SELECT " + claimAlias + ".id, " + claimAlias + ".created_at FROM " + o.table + " " + claimAlias + " WHERE " + claimAlias + ".id IN (SELECT id FROM heads) AND ")
	o.farWhere(&b, p, "id")
	b.add(" UNION ALL SELECT * FROM (SELECT " + claimAlias + ".id, " + claimAlias + ".created_at FROM " + o.table + " " + claimAlias + " WHERE " + unkeyedRows + " AND ")
	o.farWhere(&b, p, "id")
	limit, largs := farLimit(p)
	b.add(" ORDER BY created_at, id LIMIT "+limit+"))", largs...)
	b.add(" SELECT id FROM near UNION ALL SELECT id FROM (SELECT id, created_at FROM cand ORDER BY created_at, id LIMIT "+limit+")) RETURNING "+claimColumns, largs...)
	return Query{SQL: b.sql, Args: b.args}
}

func (sqlite) claimSetup() string { return "" }

// busyTimeout: a write that finds the database locked by another
// connection fails with SQLITE_BUSY unless the connection's busy handler
// waits. The handler SQLite installs for busy_timeout (which the driver's
// _busy_timeout sets, 5 s by default) sleeps 1, 2, 5, 10, 15, 20, 25, 25,
// 25, 50, 50 and then 100 ms between tries: under a steady flow of commits
// a waiter that misses the lock a few times sleeps tens of milliseconds
// while the lock is free most of that time.
func (sqlite) busyTimeout() string { return "PRAGMA busy_timeout" }

// Busy reports whether err is SQLite's SQLITE_BUSY, "database is locked"
// (mattn/go-sqlite3 gives the text of sqlite3_errstr; its extended codes,
// BUSY_SNAPSHOT among them, keep it): another connection holds the write
// lock, and a new transaction may get it.
func Busy(err error) bool {
	return err != nil && strings.Contains(err.Error(), "database is locked")
}

func (sqlite) pendingIndex() string { return "" }

func (sqlite) keyIndex() string { return "" }

func (sqlite) zonedTimes() string { return "" }

func (sqlite) idType() string { return "" }

// createdAtPrecision: SQLite keeps the text it is sent, whatever the
// column's declared type.
func (sqlite) createdAtPrecision() string { return "" }

// purgePublished: see timeCmp for how its cutoff compares.
func (sqlite) purgePublished(table, before string) string {
	return "DELETE FROM " + table + " WHERE id IN (SELECT id FROM " + table +
		" WHERE published_at IS NOT NULL AND " + before + " ORDER BY published_at LIMIT ?)"
}

// timeCmp is instantCmp (a number, ISO 8601 text of another library, an
// offset: each compared as the instant it is) behind a text range the
// index serves. Compared as text alone, a record another library marked
// published in ISO 8601 text ("…T…" sorts above this library's "… …" on
// the same day) an hour ago was not resent nor purged until the UTC date
// changed, and one with a -05:00 offset published a minute ago was resent
// (or purged) at once. The range is widened by the largest offset
// julianday() reads (±14:59) and to whole days, so that it holds every
// text whose instant meets the comparison; numbers sort below every text,
// so "< bound" holds them, and "col < ”" is their range for ">=". The
// cost: "<" also walks the index entries of up to 15 hours and a day past
// t, each one checked by instantCmp (for Republish, whose t is now less
// Grace, only the rows published within Grace; for a purge, those
// published in that span after its cutoff), and ">=" as many before t.
// Text that is no time keeps its text comparison's answer outside the
// range ('garbage' is never before t) and is before any t within it.
func (d sqlite) timeCmp(col, op string, t time.Time) (string, []any) {
	exact, args := d.instantCmp(col, op, t)
	if op == "<" {
		bound := t.UTC().Add(maxOffset).AddDate(0, 0, 1).Format(time.DateOnly)
		return "(" + col + " < ? AND " + exact + ")", append([]any{bound}, args...)
	}
	bound := t.UTC().Add(-maxOffset).Format(time.DateOnly)
	return "((" + col + " >= ? OR " + col + " < '') AND " + exact + ")", append([]any{bound}, args...)
}

// maxOffset is the largest UTC offset julianday() reads (its parser takes
// hours up to 14 and minutes up to 59): text with a larger one is no time
// to it.
const maxOffset = 14*time.Hour + 59*time.Minute

// instantCmp: a time written as ISO 8601 text by another library (Rust's
// sqlx writes RFC 3339, "2026-12-03T03:30:45.179+00:00"; JavaScript's
// toISOString "…Z") compares as text above this library's
// "2026-12-03 03:30:45" on the same day ("T" sorts above the space), and
// one with an offset is not in UTC: a lease expired a minute ago looked
// live until midnight, and a live one with a negative offset expired. Text
// compares through julianday(), which reads every one of those forms; a
// number as in timeCmp. Text julianday() does not read falls back to a
// text comparison when it starts with a date (modernc.org/sqlite's default,
// Go's time.String(), "2026-12-03 03:30:45.179 +0000 UTC", whose zone
// julianday() refuses), and is otherwise no time at all ('garbage', a
// month 13, a BLOB): it compares as earlier than any t. As text it sorted
// above every time, so a lease nobody can read was live for ever, and its
// row was never published, nor retried, nor listed as anything but leased.
func (d sqlite) instantCmp(col, op string, t time.Time) (string, []any) {
	text := d.TimeArg(t)
	numeric := unixSeconds(col) + " " + op + " ?"
	noTime := "0"
	if op == "<" {
		noTime = "1"
	}
	asText := "COALESCE(julianday(" + col + ") " + op + " julianday(?), CASE WHEN julianday(substr(" + col + ", 1, 10)) IS NULL THEN " +
		noTime + " ELSE " + col + " " + op + " ? END)"
	return "(CASE WHEN typeof(" + col + ") IN ('integer', 'real') THEN " + numeric + " ELSE " + asText + " END)",
		[]any{float64(t.UnixNano()) / 1e9, text, text}
}

// bytes: a column's default collation, BINARY, compares bytes; read as
// TEXT, since TEXT and BLOB never compare equal, and another library may
// have stored the text as a BLOB (Python's sqlite3 given bytes), which the
// relay sends to the routing key of its bytes: Republish never found such
// a record again (a review). No index of SQLite's holds these columns.
func (sqlite) bytes(col string) string { return "CAST(" + col + " AS TEXT)" }

func (sqlite) keepCreatedAt() string { return "" }

// text: SQLite pads nothing.
func (sqlite) text(col string) string { return col }

// currentRead: a transaction that writes holds the database's write lock,
// and could take it only from the latest snapshot (SQLITE_BUSY_SNAPSHOT
// otherwise).
func (sqlite) currentRead() string { return "" }

// stored: unary plus, a no-op on any value, makes the column an expression
// with no declared type, which go-sqlite3 reads as stored: a TIMESTAMP
// column it would read as a time.Time, and pass back as text of another
// form ("…+00:00"), which compares with the stored text as something else.
func (sqlite) stored(col string) string { return "+" + col }

// timeOf: a time as the text this library stores one in, so that MIN
// orders every kind together: a number (a number is otherwise below every
// text), and text of another form that julianday() reads, converted to
// UTC: ISO 8601 with a "T" or an offset, mattn/go-sqlite3's own form of a
// time.Time ("2026-12-03 20:51:35.82+00:00"). As text, a row of two hours
// ago with a +02:00 offset sorted above one written now, and the oldest
// pending age read 0; and MIN of mattn's form alone could not be read
// back, so that a pending row read as none. Text of this library's form is
// taken as it is (the GLOB), and other text that is no time stays as it
// is. strftime keeps milliseconds.
func (sqlite) timeOf(col string) string {
	return "(CASE WHEN typeof(" + col + ") IN ('integer', 'real') THEN strftime('%Y-%m-%d %H:%M:%f', " + unixSeconds(col) + ", 'unixepoch')" +
		" WHEN " + col + " GLOB '[0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9] [0-9][0-9]:[0-9][0-9]:[0-9][0-9].[0-9][0-9][0-9][0-9][0-9][0-9]' THEN " + col +
		" ELSE COALESCE(strftime('%Y-%m-%d %H:%M:%f', " + col + "), " + col + ") END)"
}

// timeText: the column is read as it is stored (text or a number).
func (sqlite) timeText(expr string) string { return expr }

// unixSeconds is a numeric timestamp column in Unix seconds, as
// mattn/go-sqlite3 reads one: milliseconds when it has 13 digits or more.
func unixSeconds(col string) string {
	return "(CASE WHEN abs(" + col + ") > 1000000000000 THEN " + col + " / 1000.0 ELSE " + col + " END)"
}

func (sqlite) insertProcessed(table string) string { return insertProcessedOnConflict(table) }

func (sqlite) purgeProcessed(table, before string) string { return purgeProcessedByKey(table, before) }

func (sqlite) insertInboxSequence() string { return insertInboxSequenceOnConflict }

func (sqlite) insertInboxHeld() string { return insertInboxHeldOnConflict }

// applyInOrder: SQLite has no data-modifying CTE, and runs in process, so
// what counts is each statement's cost in Go and cgo. The advance and the
// dedupe key are two Execs, which read their counts from the result: a
// RETURNING row through database/sql's Query cost about as much again as
// the whole plain inbox (Rows, its close, and for a transaction with a
// cancellable context a goroutine per query). The advance is an update of
// the key's row for any seq but 1, and affects none when the row is
// missing (the caller then writes it); seq 1 may find no row, and writes
// it applied, or moves a row at 0 that holds nothing.
func (sqlite) applyInOrder(in *Inbox, m InOrder) []ApplyStep {
	advance := Query{
		SQL:  "UPDATE " + InboxSequencesTable + " SET last_seq = ? WHERE consumer_name = ? AND aggregate_id = ? AND last_seq = ? AND held = 0",
		Args: []any{m.Seq, m.Consumer, m.Key, m.Seq - 1},
	}
	if m.Seq == 1 {
		advance = Query{
			SQL: "INSERT INTO " + InboxSequencesTable + " (consumer_name, aggregate_id, last_seq, held) VALUES (?, ?, 1, 0)" +
				" ON CONFLICT (consumer_name, aggregate_id) DO UPDATE SET last_seq = 1" +
				" WHERE " + InboxSequencesTable + ".last_seq = 0 AND " + InboxSequencesTable + ".held = 0",
			Args: []any{m.Consumer, m.Key},
		}
	}
	return []ApplyStep{{Query: advance, Done: oneRow}, {Query: in.Insert(m.Consumer, m.MessageID, m.At), Done: oneRow}}
}

// lockInboxSequence: SQLite has no row locks. The insert-if-absent before it
// is a write, which takes the database's write lock for the rest of the
// transaction (at BEGIN already under _txlock=immediate), so the read is as
// good as a lock.
func (sqlite) lockInboxSequence() string { return selectInboxSequence }

// WithMigrationLock holds SQLite's write lock from the migration's first
// statement, whatever the DSN's _txlock: it begins the transaction itself,
// BEGIN IMMEDIATE, which waits on the busy timeout for the lock. A
// transaction that reads first and writes later cannot wait for it: once
// another process has committed meanwhile, its snapshot is stale, and its
// first write fails at once with "database is locked", busy timeout or
// not. A migration reads first (the migrations table's CREATE … IF NOT
// EXISTS, finding the table, and the versions applied), so with
// _txlock=deferred, the driver's default, processes booting together
// failed; and so did the CREATE itself, run on its own, when they booted
// together on a fresh file. The statements run on conn, inside the
// transaction database/sql does not know of.
func (d sqlite) WithMigrationLock(ctx context.Context, conn *sql.Conn, fn func(Execer) error) (err error) {
	if _, err := conn.ExecContext(ctx, "BEGIN IMMEDIATE"); err != nil {
		return fmt.Errorf("take the write lock: %w", err)
	}
	defer func() {
		if err != nil {
			_, _ = conn.ExecContext(context.WithoutCancel(ctx), "ROLLBACK")
		}
	}()
	if _, err := conn.ExecContext(ctx, d.createMigrationsTable()); err != nil {
		return err
	}
	if err := fn(conn); err != nil {
		return err
	}
	_, err = conn.ExecContext(ctx, "COMMIT")
	return err
}

func (sqlite) createMigrationsTable() string {
	return `CREATE TABLE IF NOT EXISTS acemq_schema_migrations (
    version    INTEGER  NOT NULL PRIMARY KEY,
    name       TEXT     NOT NULL,
    applied_at DATETIME NOT NULL DEFAULT (strftime('%Y-%m-%d %H:%M:%f000', 'now'))
)`
}

func (sqlite) insertMigration() string {
	return "INSERT INTO acemq_schema_migrations (version, name) VALUES (?, ?)"
}

// DatabaseList lists an SQLite connection's databases: seq, name, file
// ("" for an in-memory database). The relay watches the file of "main".
func DatabaseList() Query { return Query{SQL: "PRAGMA database_list"} }
