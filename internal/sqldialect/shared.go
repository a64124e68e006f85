package sqldialect

import (
	"context"
	"crypto/sha256"
	"database/sql"
	"encoding/base32"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"
)

// This file holds the SQL all three databases run as it is, written with "?"
// placeholders that each dialect rebinds. What differs lives in the
// dialect's own file.

// outboxColumns are the columns TxPublisher writes, in Row's order.
const outboxColumns = "id, exchange_name, routing_key, body, body_encoding, content_type, headers, created_at"

const outboxColumnCount = 8

// keyedColumns are the columns of a call with a keyed message: the same and
// the key and its sequence number. A call without one writes outboxColumns
// only (see Insert).
const keyedColumns = outboxColumns + ", aggregate_id, seq"

const keyedColumnCount = outboxColumnCount + 2

// claimColumns are what a claim reads, in ClaimedRow's order.
const claimColumns = "id, exchange_name, routing_key, body, body_encoding, content_type, headers, created_at, attempts, aggregate_id, seq"

// textColumns is cols (comma-separated names) with each of names read as
// text by d (see Dialect.text).
func textColumns(d Dialect, cols string, names ...string) string {
	parts := strings.Split(cols, ", ")
	for i, c := range parts {
		if slices.Contains(names, c) {
			parts[i] = d.text(c)
		}
	}
	return strings.Join(parts, ", ")
}

// claimed is claimColumns as d's claim reads them: the names and short
// strings without a fixed-width column's padding. Each locking dialect
// keeps its own, made once (postgresClaimed, mysqlClaimed).
func claimed(d Dialect) string {
	return timeColumns(d, textColumns(d, claimColumns, "id", "exchange_name", "routing_key", "body_encoding", "content_type", "aggregate_id"), "created_at")
}

// timeColumns is cols (comma-separated names) with each of names read by
// d's timeText.
func timeColumns(d Dialect, cols string, names ...string) string {
	parts := strings.Split(cols, ", ")
	for i, c := range parts {
		if slices.Contains(names, c) {
			parts[i] = d.timeText(c)
		}
	}
	return strings.Join(parts, ", ")
}

// SequencesTable is the table of each key's last sequence number, in the
// schema of the outbox table it numbers.
const SequencesTable = "acemq_outbox_sequences"

// claimAlias names the claimed table in a claim, so that the key-head
// probe's subquery can tell its own rows from the claim's.
const claimAlias = "c"

// claimable is the relay's condition: unpublished, under the attempt ceiling,
// and not under a live lease (ours, or one written by an AceMQ relay in
// another language; see leaseOver). A NULL attempts (a nullable column of
// another library's table, a writer that left it out) is no attempt yet.
// Claim adds the dialect's keyHead: a keyed row must be at the head of
// its key.
func (o *Outbox) claimable(maxAttempts int, now time.Time) (string, []any) {
	over, args := o.leaseOver(now)
	return "published_at IS NULL AND COALESCE(attempts, 0) < ? AND " + over, append([]any{maxAttempts}, args...)
}

// leaseOver is the condition of a row under no live lease at now: none
// written, or one that has expired. It compares the instants (instantCmp),
// so that on SQLite a lease another library wrote as a number (Java's
// sqlite-jdbc writes Unix milliseconds), which sorts below every text, or
// as ISO 8601 text, is neither taken for one long expired, and its row for
// ours to claim, nor held for hours after it expired. A lease whose end
// cannot be read as a time ('garbage', an empty text) is over: held, its row would
// never be published, and at-least-once allows the resend should its
// writer have it in flight. Retry and Stuck (notClaimed) agree.
func (o *Outbox) leaseOver(now time.Time) (string, []any) {
	before, args := o.d.instantCmp("locked_until", "<", now)
	return "(locked_until IS NULL OR " + before + ")", args
}

// keyHeadNotExists is the key-head condition of PostgreSQL and SQLite. It
// keeps a key's records in sequence order across batches, pipelined
// batches and relays: a keyed row is claimable only once no row of its key
// with a smaller seq is unpublished, but for the rows the claiming relay
// has in flight itself (ClaimParams.InFlight), so a key's records are in
// flight in one relay at most, which sends each only once the broker
// confirmed the one before (see the Forwarder's dependOn). Another relay
// can claim the key's next record once the one before is marked published
// (after the broker's confirm). A stuck row (at
// MaxAttempts) is unpublished: it holds its key until an operator retries
// it. Unkeyed rows (aggregate_id NULL) pass at the first test, and so does
// a row without a seq, which has no place in its key's order. The probe
// walks 0007's acemq_outbox_pending_key, which holds a key's pending rows
// only, as a range that ends below the row's seq (on PostgreSQL, through
// 0005's index alone the planner ANDed it with the pending index's bitmap,
// reading every pending entry per probe: 11 times slower drains of keyed
// rows). MySQL's is its own: see mysql's keyHead.
//
// notOurs, if not "", is the condition on p that leaves out the records the
// relay has in flight itself (ClaimParams.InFlight): a key's next record is
// then claimable while its predecessors are in this relay's batches.
func keyHeadNotExists(table, alias, notOurs string) string {
	return "(" + alias + ".aggregate_id IS NULL OR NOT EXISTS (SELECT 1 FROM " + table + " p WHERE p.aggregate_id = " + alias + ".aggregate_id" +
		" AND p.seq < " + alias + ".seq AND p.published_at IS NULL" + notOurs + "))"
}

// inFlightArg is ClaimParams.InFlight as the one argument of a dialect's
// notOurs condition: a JSON array of the ids. One argument of any length
// keeps the claim's text the same whatever the relay has in flight, for
// the prepared claims of MySQL and pgx's statement cache.
func inFlightArg(ids []string) any {
	b, _ := json.Marshal(ids) // strings only: cannot fail
	return string(b)
}

// afterCursor resumes a drain after the last row claimed, rather than at the
// head of the pending index, where the entries of rows just marked published
// linger until MySQL's purge or PostgreSQL's vacuum removes them: scanning
// them on every claim makes a long drain quadratic. Written as a range on
// created_at plus a filter so that MySQL's range optimizer uses the index.
// Arguments: created_at, created_at, id.
const afterCursor = "created_at >= ? AND (created_at > ? OR id > ?)"

// after is the condition of the rows after c (afterCursor), in a claim or
// a count. A cursor without an id stands just before its created_at
// (Store.firstNext's): every row from that time on, without comparing ids
// with "", which an id column of another type (PostgreSQL's uuid, that an
// EF Core or Hibernate outbox makes) refuses to read.
func (o *Outbox) after(c *Cursor) (string, []any) {
	at := o.d.TimeArg(c.CreatedAt)
	if c.ID == "" {
		return "created_at >= ?", []any{at}
	}
	if c.IDArg != nil {
		return afterCursor, []any{at, at, c.IDArg}
	}
	return afterCursor, []any{at, at, c.ID}
}

// andAfter is the condition where (with its arguments args) and, when c is
// not nil, after c (see after).
func (o *Outbox) andAfter(c *Cursor, where string, args []any) (string, []any) {
	if c == nil {
		return where, args
	}
	cond, cargs := o.after(c)
	return where + " AND " + cond, append(args, cargs...)
}

// savepoint is the savepoint of a Publish that takes several statements.
const savepoint = "acemq_outbox_publish"

// Outbox is the SQL of one outbox table.
type Outbox struct {
	d            Dialect
	table        string // quoted
	schema, name string // as configured: the pending-index lookup's arguments
	sequences    string // quoted: SequencesTable in the table's schema
}

// NewOutbox returns the statements of table ("name" or "schema.name"),
// which it validates and quotes.
func NewOutbox(d Dialect, table string) (*Outbox, error) {
	quoted, err := QuoteTable(d, table)
	if err != nil {
		return nil, err
	}
	o := &Outbox{d: d, table: quoted, name: table}
	seq := SequencesTable
	if i := strings.LastIndexByte(table, '.'); i >= 0 {
		o.schema, o.name = table[:i], table[i+1:]
		seq = o.schema + "." + SequencesTable
	}
	if o.sequences, err = QuoteTable(d, seq); err != nil {
		return nil, err
	}
	return o, nil
}

// Table is the table's name as quoted in the SQL, for error messages.
func (o *Outbox) Table() string { return o.table }

// Schema is the schema the table was named in ("schema.name"), "" for an
// unqualified name.
func (o *Outbox) Schema() string { return o.schema }

// Name is the table's name without its schema, as configured.
func (o *Outbox) Name() string { return o.name }

func (o *Outbox) query(sql string, args ...any) Query {
	return Query{SQL: o.d.rebind(sql), Args: args}
}

// Row is one row TxPublisher writes.
type Row struct {
	ID, Exchange, RoutingKey string
	Body, BodyEncoding       string
	ContentType, Headers     string
	CreatedAt                time.Time
	// AggregateID is the row's ordering key, "" for none; InsertNumbered
	// gives it its number.
	AggregateID string
}

// Insert writes rows without a key in one statement, skipping ids already
// present (RowsAffected counts only the rows it inserted). It writes
// outboxColumns only, as before per-aggregate order, so that it still works
// on a table that lacks aggregate_id and seq (as does Destinations without
// keys, the read back of an id already there); keyed rows go through
// InsertNumbered.
func (o *Outbox) Insert(rows []Row) Query {
	args := make([]any, 0, len(rows)*outboxColumnCount)
	for i := range rows {
		r := &rows[i]
		args = append(args, r.ID, r.Exchange, r.RoutingKey, r.Body, r.BodyEncoding, r.ContentType, r.Headers, o.d.TimeArg(r.CreatedAt))
	}
	return Query{SQL: o.d.insertOutbox(o.table, outboxColumns, outboxColumnCount, len(rows)), Args: args}
}

// Sequences is the sequences table as quoted in the SQL, for error messages.
func (o *Outbox) Sequences() string { return o.sequences }

// KeyCount is how many sequence numbers a call takes from one key.
type KeyCount struct {
	Key string
	N   int
}

// InsertNumbered numbers the keyed rows of rows and inserts rows, skipping
// ids already present as Insert does; the last statement's RowsAffected
// counts the rows inserted. The statements run in order in one
// transaction: one (PostgreSQL), or two, the raise of the keys and then
// the insert, each all or nothing; so the numbers are taken once every
// statement but the last has run.
//
// Each key of keys (sorted, and with N its rows' count in rows) has its
// last sequence number raised by N, created at N, and its row of the
// sequences table stays locked until the transaction ends: a second
// transaction on the key waits for this one, and a rollback takes the
// numbers back. The keys are raised in the order of keys, so that two
// calls sharing keys take them in one order and cannot deadlock. The k-th
// of a key's N rows, in the order of rows, gets the number last-N+k, read
// back from the raised counter inside the insert; so the numbers never
// travel to the client and back, and on PostgreSQL the whole is one
// statement (one round trip, as an unkeyed Publish).
func (o *Outbox) InsertNumbered(rows []Row, keys []KeyCount) []Query {
	if len(keys) == 0 {
		// A statement's share of a call whose keyed rows are all in its
		// other statements: nothing to number (a raise of no keys is no
		// SQL).
		return []Query{o.Insert(rows)}
	}
	return o.d.insertNumbered(o, rows, keys)
}

// LockKeys locks the sequence rows of keys (sorted), creating them at 0,
// without taking a number: a call whose rows take several InsertNumbered
// statements takes all its keys first, in sorted order, as one statement
// would.
func (o *Outbox) LockKeys(keys []KeyCount) Query {
	zero := make([]KeyCount, len(keys))
	for i, k := range keys {
		zero[i] = KeyCount{Key: k.Key}
	}
	return o.d.raiseSeqs(o.sequences, zero)
}

// raiseSeqsOnConflict raises each key's counter by N in one statement, in
// the order of keys (PostgreSQL and SQLite insert a VALUES list in its
// order), with "?" placeholders.
func raiseSeqsOnConflict(sequences string, keys []KeyCount) (string, []any) {
	var b strings.Builder
	args := make([]any, 0, 2*len(keys))
	b.WriteString("INSERT INTO " + sequences + " AS s (aggregate_id, last_seq) VALUES ")
	for i, k := range keys {
		if i > 0 {
			b.WriteString(", ")
		}
		b.WriteString("(?, ?)")
		args = append(args, k.Key, k.N)
	}
	b.WriteString(" ON CONFLICT (aggregate_id) DO UPDATE SET last_seq = s.last_seq + excluded.last_seq")
	return b.String(), args
}

// numberedInsert is the INSERT of InsertNumbered without its conflict
// clause, each keyed row's seq read from src (the sequences table, or a CTE
// of its raised rows) once its key was raised.
func (o *Outbox) numberedInsert(verb string, rows []Row, keys []KeyCount, src string) (string, []any) {
	left := make(map[string]int, len(keys)) // numbers of the key still to hand out after this row
	for _, k := range keys {
		left[k.Key] = k.N
	}
	var b strings.Builder
	b.Grow(96 + len(rows)*(keyedColumnCount*3+len(src)+64))
	args := make([]any, 0, len(rows)*(keyedColumnCount+1))
	b.WriteString(verb + " " + o.table + " (" + keyedColumns + ") VALUES ")
	for i := range rows {
		r := &rows[i]
		if i > 0 {
			b.WriteString(", ")
		}
		args = append(args, r.ID, r.Exchange, r.RoutingKey, r.Body, r.BodyEncoding, r.ContentType, r.Headers, o.d.TimeArg(r.CreatedAt))
		if r.AggregateID == "" {
			b.WriteString("(?, ?, ?, ?, ?, ?, ?, ?, NULL, NULL)")
			continue
		}
		left[r.AggregateID]--
		b.WriteString("(?, ?, ?, ?, ?, ?, ?, ?, ?, (SELECT last_seq FROM " + src + " WHERE aggregate_id = ?) - ?)")
		args = append(args, r.AggregateID, r.AggregateID, left[r.AggregateID])
	}
	return b.String(), args
}

// GiveBackSeq takes n numbers back from key, which this transaction
// allocated and then did not use: the key's row is still locked by it, so
// no other transaction took a number in between.
func (o *Outbox) GiveBackSeq(key string, n int) Query {
	return o.query("UPDATE "+o.sequences+" SET last_seq = last_seq - ? WHERE aggregate_id = ?", n, key)
}

// LastSeq reads key's last sequence number.
func (o *Outbox) LastSeq(key string) Query {
	return o.query("SELECT last_seq FROM "+o.sequences+" WHERE aggregate_id = ?", key)
}

// Numbered is a keyed row as a call wrote it: its id, the number it took,
// and its created_at.
type Numbered struct {
	ID        string
	Seq       int64
	CreatedAt time.Time
}

// DeleteNumbered deletes the rows of rows that hold their id, their number
// and their created_at to the microsecond: a call's own. A row of the same
// id already there has another created_at, even under the same number (a
// key's counter behind the table).
func (o *Outbox) DeleteNumbered(rows []Numbered) Query {
	var b strings.Builder
	args := make([]any, 0, 3*len(rows))
	b.WriteString("DELETE FROM " + o.table + " WHERE ")
	for i, r := range rows {
		if i > 0 {
			b.WriteString(" OR ")
		}
		b.WriteString("(id = ? AND seq = ? AND created_at = ?)")
		args = append(args, r.ID, r.Seq, o.d.TimeArg(r.CreatedAt))
	}
	return o.query(b.String(), args...)
}

// GiveBackAbove lowers key's counter to the highest number above low, and
// at most high, that a row of the key still holds, or to low where none
// does: the numbers this transaction took (low, high] and left unused go
// back, and none that a row holds.
func (o *Outbox) GiveBackAbove(key string, low, high int64) Query {
	return o.query("UPDATE "+o.sequences+" SET last_seq = COALESCE((SELECT MAX(seq) FROM "+o.table+
		" WHERE aggregate_id = ? AND seq > ? AND seq <= ?), ?) WHERE aggregate_id = ?", key, low, high, low, key)
}

// Destinations reads where the rows of ids go and, with keys, under which
// ordering key. Columns: id, exchange_name, routing_key, created_at, and
// with keys aggregate_id (NULL for an unkeyed row). Without keys it reads
// no column Insert does not write: a service that publishes only unkeyed
// messages into a table another library made, without 0005's columns,
// reads its retries back. It reads the rows the insert before it met,
// also those committed after the transaction's snapshot (currentRead).
func (o *Outbox) Destinations(ids []string, keys bool) Query {
	cols := "id, exchange_name, routing_key, created_at"
	if keys {
		cols += ", aggregate_id"
	}
	cols = timeColumns(o.d, textColumns(o.d, cols, "id", "exchange_name", "routing_key", "aggregate_id"), "created_at")
	return o.query("SELECT "+cols+" FROM "+o.table+" WHERE id IN ("+placeholders(len(ids))+")"+o.d.currentRead(), stringArgs(nil, ids)...)
}

// update begins an UPDATE of the outbox's rows, up to its SET and the
// first column's: on MySQL with created_at set to itself. A table another
// library made may update created_at itself (TIMESTAMP … ON UPDATE
// CURRENT_TIMESTAMP, MariaDB's first TIMESTAMP column before 10.10), and
// every failure counted, lease or mark then moved its row to the end of
// the claim order: a failing record went behind the rows written after
// it, and they out before it. A column the statement sets is not
// updated by itself.
func (o *Outbox) update() string {
	return "UPDATE " + o.table + " SET " + o.d.keepCreatedAt()
}

// Delete deletes the rows of ids.
func (o *Outbox) Delete(ids []string) Query {
	return o.query("DELETE FROM "+o.table+" WHERE id IN ("+placeholders(len(ids))+")", stringArgs(nil, ids)...)
}

// Savepoint, RollbackToSavepoint and ReleaseSavepoint make a Publish of
// several statements all or nothing inside the caller's transaction.
func (o *Outbox) Savepoint() Query { return Query{SQL: "SAVEPOINT " + savepoint} }

// RollbackToSavepoint undoes what was written since Savepoint.
func (o *Outbox) RollbackToSavepoint() Query { return Query{SQL: "ROLLBACK TO SAVEPOINT " + savepoint} }

// ReleaseSavepoint keeps what was written since Savepoint.
func (o *Outbox) ReleaseSavepoint() Query { return Query{SQL: "RELEASE SAVEPOINT " + savepoint} }

// Cursor is the (created_at, id) of the last row a drain claimed.
type Cursor struct {
	CreatedAt time.Time
	ID        string
	// IDArg, if not nil, is the id as the row holds it, where that is not
	// text (ClaimedRow.RawID): in an SQLite column without a type no
	// INTEGER is greater than a TEXT, and a drain's next claim, comparing
	// with the id's text, passed over the rest of its created_at.
	IDArg any
	// CreatedText, if set, is created_at as the database wrote it (the
	// text PendingBelow read), which a point (ClaimParams.Points) binds as
	// it is: equal to the column's value whatever its precision.
	CreatedText string
}

// KeySeq is a keyed record's place in its key.
type KeySeq struct {
	Key string
	Seq int64
}

// FirstNext reads the first, in claim order, of the unpublished records
// that follow recs in their keys (seq+1). Columns: created_at, id; no row
// when there is none.
func (o *Outbox) FirstNext(recs []KeySeq) Query {
	var b strings.Builder
	args := make([]any, 0, 2*len(recs))
	for i, r := range recs {
		if i > 0 {
			b.WriteString(" OR ")
		}
		b.WriteString("(aggregate_id = ? AND seq = ?)")
		args = append(args, r.Key, r.Seq+1)
	}
	return o.query("SELECT "+o.d.timeText("created_at")+", id FROM "+o.table+" WHERE published_at IS NULL AND ("+b.String()+
		") ORDER BY created_at, id LIMIT 1", args...)
}

// ClaimParams says which rows a claim takes.
type ClaimParams struct {
	Limit       int
	MaxAttempts int
	Now         time.Time
	// After, if set, resumes a drain after that row (see afterCursor).
	After *Cursor
	// Index, if set, is the pending index a locking claim walks (MySQL).
	Index string
	// KeyIndex, if set, is the index of a key's pending rows its key-head
	// probe walks (MySQL).
	KeyIndex string
	// InFlight, if set, holds the ids of the keyed records the relay has in
	// flight, sent and their confirms not yet collected: a keyed row whose
	// unpublished predecessors are all among them is claimable too (see
	// keyHead). The relay then sends it only once they are confirmed.
	InFlight []string
	// RelayID and LeaseUntil fill locked_by and locked_until of a leasing
	// claim (SQLite).
	RelayID    string
	LeaseUntil time.Time
	// Window, if set, makes the claim windowed: it walks that many entries
	// of the pending index (see window.go). Set it only where Windows says
	// so and WindowFull found that many.
	Window int
	// KeysRead, if set, bounds the keys a windowed claim looks at beyond its window to that many after
	// KeysFrom (nil for the first; a key as a slice's end was read, a
	// string or, on SQLite, a []byte for a blob), read inside the claim
	// and only if the window falls short. Where that read stopped,
	// PostgreSQL's claim says on the rows it took beyond the window
	// (ScanClaimedSlice); KeysSliceEnd asks after.
	KeysRead int
	KeysFrom any
	// Points, if set, makes the claim one of these rows only, each found
	// by its place in the pending index or its id (see atPoints): the
	// rows below a floor that its measure found (the Store's headFloor).
	// After and Window are not read.
	Points []Cursor
	// ByID, if set, makes a windowed claim lock the rows it chose beyond
	// its window by their id alone, not their ctid too (PostgreSQL): the
	// table's rows have none (a view; see TupleIDs).
	ByID bool
}

// Claim claims up to p.Limit claimable rows in created_at, id order.
// Columns: those of ClaimedRow, read by ScanClaimed.
func (o *Outbox) Claim(p ClaimParams) Query {
	where, args := o.claimWhere(p)
	if len(p.Points) > 0 {
		cond, pargs := o.atPoints(p.Points)
		return o.d.claim(o.table, p, where+" AND "+cond, append(args, pargs...))
	}
	where, args = o.andAfter(p.After, where, args)
	if p.Window > 0 {
		return o.d.windowClaim(o, p, where, args)
	}
	return o.d.claim(o.table, p, where, args)
}

// Windows reports whether the dialect's claims can be windowed.
func (o *Outbox) Windows() bool { return o.d.windows() }

// PendingBetween counts the unpublished rows under maxAttempts after after
// (from the head when it is nil) and up to last, in claim order, through
// index when it is set (MySQL's pending index): those a claim from after
// took, and those it passed over but for stuck ones. Column: the count.
func (o *Outbox) PendingBetween(index string, maxAttempts int, after *Cursor, last Cursor) Query {
	from, where, args := o.pendingUnder(index, maxAttempts, after)
	l := o.d.TimeArg(last.CreatedAt)
	return o.query("SELECT COUNT(*) FROM "+from+" WHERE "+where+" AND created_at <= ? AND (created_at < ? OR id <= ?)", append(args, l, l, last.ID)...)
}

// PendingParams says where PendingFirst reads.
type PendingParams struct {
	// Index, if set, is the pending index the read walks; KeyIndex, if
	// set, the index of a key's pending rows (MySQL's).
	Index, KeyIndex string
	MaxAttempts     int
	Now             time.Time
	// After, if set, reads after that row (see afterCursor); from the
	// head when it is nil.
	After *Cursor
	// Skip holds records of keys stuck at MaxAttempts: the records after
	// each in its key (a greater seq) are not read. No claim takes them
	// until the stuck one is retried.
	Skip []KeySeq
	// Lock makes the read a locking one, as a claim's is (FOR UPDATE SKIP
	// LOCKED, bounded as MySQL's claim is), for its time, not its row: it
	// passes rows other transactions hold, and locks the row it reads,
	// and on MySQL those it passes, until the transaction ends. A row
	// whose created_at is NULL is not read.
	Lock bool
}

// PendingFirst reads the first unpublished row under p.MaxAttempts, in
// claim order, but for those p.Skip holds: where the rows a claim could
// take start. Columns: created_at, id, aggregate_id, seq, and hold: the
// end of the row's retry backoff (locked_until where locked_by is
// RetryHold and the lease is live at p.Now), else NULL; no row when there
// is none.
//
// From the head, a row whose created_at is NULL (another library's table
// may allow it) that a claim could take at p.Now (under no live lease, its
// key's head) comes first, its created_at NULL: no floor is below it, so
// the claim that asks starts at the head (PostgreSQL orders it last, where
// a claim at a floor never reaches it). One no claim could take (its key
// held by a stuck record) is not read: it would send every claim to the
// head for as long as it waits. After a cursor no such row is read.
func (o *Outbox) PendingFirst(p PendingParams) Query {
	from, where, args := o.pendingUnder(p.Index, p.MaxAttempts, p.After)
	where, args = andNotHeld(p.Skip, where, args)
	over, holdArgs := o.leaseOver(p.Now)
	cols := func(hold string) string {
		return o.d.timeText("created_at") + " AS created_text, id, " + o.d.text("aggregate_id") + " AS aggregate_id, seq, " + hold + " AS hold_text FROM "
	}
	held := cols("CASE WHEN locked_by = '" + RetryHold + "' AND NOT " + over + " THEN " + o.d.timeText("locked_until") + " END")
	args = append(holdArgs, args...)
	first := held + from + " WHERE " + where + " AND created_at IS NOT NULL ORDER BY created_at, id LIMIT 1"
	if p.Lock {
		// The claim's bound (see mysql's claim): the walk stops at the
		// newest pending row of the subquery's snapshot, before rows
		// committed since, whose writers' locks it would otherwise meet.
		return o.query("SELECT "+held+from+" WHERE "+where+" AND created_at <= (SELECT MAX(created_at) FROM "+from+
			" WHERE published_at IS NULL) ORDER BY created_at, id LIMIT 1 FOR UPDATE SKIP LOCKED", args...)
	}
	if p.After != nil {
		return o.query("SELECT "+first, args...)
	}
	// A claimable row is under no live lease: no hold.
	claimable, cargs := o.claimWhere(ClaimParams{MaxAttempts: p.MaxAttempts, Now: p.Now, KeyIndex: p.KeyIndex})
	null := "SELECT 0 AS nulls_last, " + cols("NULL") + o.table + " " + claimAlias + " WHERE " + claimable + " AND created_at IS NULL LIMIT 1"
	return o.query("SELECT created_text, id, aggregate_id, seq, hold_text FROM (("+null+") UNION ALL (SELECT 1, "+first+")) pending_first ORDER BY nulls_last LIMIT 1", append(cargs, args...)...)
}

// andNotHeld is the condition where (with its arguments args) and not a
// record that one of skip holds in its key (see PendingParams.Skip).
func andNotHeld(skip []KeySeq, where string, args []any) (string, []any) {
	for _, k := range skip {
		// COALESCE: an unkeyed row, or one without a seq, compares NULL.
		where += " AND NOT COALESCE(aggregate_id = ? AND seq > ?, FALSE)"
		args = append(args, k.Key, k.Seq)
	}
	return where, args
}

// PendingBelow reads, from the head (after p.After, where it is set), up
// to limit of the unpublished rows under p.MaxAttempts whose created_at is
// before before, in claim order, but for those p.Skip holds: the rows a
// floor at before passes over, to be claimed as points
// (ClaimParams.Points). With p.Lock a locking read (FOR UPDATE SKIP
// LOCKED, bounded by before alone), as PendingBelowWalk's is. Columns:
// created_at, id.
func (o *Outbox) PendingBelow(p PendingParams, before time.Time, limit int) Query {
	// The id as the claim reads it (text): PostgreSQL's char(n) keeps its
	// padding otherwise, and a mark of the claim's id never matched it.
	return o.pendingBelow(o.d.timeText("created_at")+" AS created_text, "+o.d.text("id")+" AS id", p, before, limit)
}

// PendingBelowWalk is PendingBelow's walk, for its time: the same read,
// which passes every entry PendingBelow would, counted where it stands
// (one column, one row: how many rows it found). A measure times it, not
// PendingBelow, whose rows' transfer and reading, 128 of them under a
// busy machine's load, took pointsAbove where no entry was dead.
func (o *Outbox) PendingBelowWalk(p PendingParams, before time.Time, limit int) Query {
	q := o.pendingBelow("1 AS one", p, before, limit)
	q.SQL = "SELECT COUNT(*) FROM (" + q.SQL + ") AS walked"
	return q
}

// pendingBelow is PendingBelow reading cols.
func (o *Outbox) pendingBelow(cols string, p PendingParams, before time.Time, limit int) Query {
	from, where, args := o.pendingUnder(p.Index, p.MaxAttempts, p.After)
	where, args = andNotHeld(p.Skip, where, args)
	below, bargs := o.d.timeCmp("created_at", "<", before)
	q := "SELECT " + cols + " FROM " + from + " WHERE " + where + " AND " + below +
		" ORDER BY created_at, id LIMIT ?"
	if p.Lock {
		q += " FOR UPDATE SKIP LOCKED"
	}
	return o.query(q, append(append(args, bargs...), limit)...)
}

// atPoints is the condition of the rows at pts, and its arguments: each
// row by its id and its created_at. Where the dialect finds points in the
// pending index (MySQL, whose claim names it: through the primary key a
// claim locks a row's clustered record alone; see mysql's pendingIndex),
// pairs of them, created_at equal to the text PendingBelow read
// (CreatedText): each point an exact key of the index, a lookup that
// stops at the next entry. Elsewhere (PostgreSQL) a list of each. Within a range of created_at, however narrow, InnoDB's
// locking read stepped over every entry a held snapshot kept after the
// row (a point before 100,000 of them took 110 ms) to the first live
// one, to find the range over.
func (o *Outbox) atPoints(pts []Cursor) (string, []any) {
	var b strings.Builder
	args := make([]any, 0, 2*len(pts))
	inIndex := o.d.pointsInIndex()
	if !inIndex {
		// Their created_at too, a condition on the pending index: by
		// id alone, with statistics taken beside a held snapshot,
		// PostgreSQL walked that index for 64 points or more (13,000
		// blocks for 128 behind 20,000 dead entries, against some 600).
		b.WriteString("created_at IN (")
		for i, c := range pts {
			if i > 0 {
				b.WriteString(", ")
			}
			b.WriteString("?")
			args = append(args, o.d.TimeArg(c.CreatedAt))
		}
		b.WriteString(") AND id IN (")
	} else {
		b.WriteString("(")
	}
	for i, c := range pts {
		var id any = c.ID
		if c.IDArg != nil {
			id = c.IDArg
		}
		switch {
		case !inIndex && i > 0:
			b.WriteString(", ?")
		case !inIndex:
			b.WriteString("?")
		case i > 0:
			b.WriteString(" OR (created_at = ? AND id = ?)")
		default:
			b.WriteString("(created_at = ? AND id = ?)")
		}
		if inIndex {
			var at any = c.CreatedText
			if c.CreatedText == "" {
				at = o.d.TimeArg(c.CreatedAt)
			}
			args = append(args, at)
		}
		args = append(args, id)
	}
	b.WriteString(")")
	return b.String(), args
}

// KeyRecord reads the unpublished record of key at seq, through keyIndex
// when it is set (MySQL's index of a key's pending rows). Column: its
// attempts (0 for NULL); no row when there is none or it is published. A
// point read: one entry (two for a record published under a snapshot),
// where a read of the key's first pending record walks every entry a held
// snapshot keeps of the key's published ones.
func (o *Outbox) KeyRecord(keyIndex, key string, seq int64) Query {
	from := o.table
	if keyIndex != "" {
		from += " FORCE INDEX (" + o.d.quoteIdent(keyIndex) + ")"
	}
	return o.query("SELECT COALESCE(attempts, 0) FROM "+from+" WHERE aggregate_id = ? AND published_at IS NULL AND seq = ?", key, seq)
}

// pendingUnder is the FROM (through index, when it is set) and the WHERE
// of the unpublished rows under maxAttempts after after, and the WHERE's
// arguments.
func (o *Outbox) pendingUnder(index string, maxAttempts int, after *Cursor) (from, where string, args []any) {
	from = o.table
	if index != "" {
		from += " FORCE INDEX (" + o.d.quoteIdent(index) + ")"
	}
	where, args = o.andAfter(after, "published_at IS NULL AND COALESCE(attempts, 0) < ?", []any{maxAttempts})
	return from, where, args
}

// Claimable tells whether a Claim with p (its MaxAttempts, Now and After)
// would find a row, in one statement that locks and leases nothing: what an idle relay
// asks instead of claiming, a claim being a transaction of three or four
// statements (on SQLite a write). Column: 1; no row when there is none.
//
// With p.Window set (where Windows says so), it reads at most that many
// entries of the pending index and the keys with pending records, as a
// windowed claim does, whether or not the index holds a window's worth.
func (o *Outbox) Claimable(p ClaimParams) Query {
	where, args := o.claimWhere(p)
	if len(p.Points) > 0 {
		cond, pargs := o.atPoints(p.Points)
		return o.query("SELECT 1 FROM "+o.table+" "+claimAlias+" WHERE "+where+" AND "+cond+" LIMIT 1", append(args, pargs...)...)
	}
	where, args = o.andAfter(p.After, where, args)
	if p.Window > 0 && o.d.windows() {
		return o.claimableWindowed(p, where, args)
	}
	return o.query("SELECT 1 FROM "+o.table+" "+claimAlias+" WHERE "+where+" LIMIT 1", args...)
}

// claimWhere is the condition a row must meet to be claimed now, on the
// claim's alias, and its arguments.
func (o *Outbox) claimWhere(p ClaimParams) (string, []any) {
	where, args := o.claimable(p.MaxAttempts, p.Now)
	if len(p.InFlight) > 0 {
		args = append(args, inFlightArg(p.InFlight))
	}
	return where + " AND " + o.d.keyHead(o.table, claimAlias, p), args
}

// ClaimSetup, if its SQL is not empty, runs first in a locking claim's
// transaction.
func (o *Outbox) ClaimSetup() Query { return Query{SQL: o.d.claimSetup()} }

// BusyTimeout reads (ms < 0: one row, one integer column, milliseconds) or
// sets a connection's wait for another connection's write lock. ok is
// false where the server queues writers itself.
func (o *Outbox) BusyTimeout(ms int) (q Query, ok bool) {
	setting := o.d.busyTimeout()
	if setting == "" {
		return Query{}, false
	}
	if ms < 0 {
		return Query{SQL: setting}, true
	}
	return Query{SQL: setting + " = " + strconv.Itoa(ms)}, true
}

// WriteLock is a statement that takes the database's write lock for the
// rest of its transaction and changes nothing, where writers wait in the
// client (SQLite; see BusyTimeout): a read after it sees every commit
// whose writer held the lock before. ok is false elsewhere.
func (o *Outbox) WriteLock() (q Query, ok bool) {
	if o.d.busyTimeout() == "" {
		return Query{}, false
	}
	return Query{SQL: "UPDATE " + o.table + " SET attempts = attempts WHERE 0 = 1"}, true
}

// PendingIndex is the lookup of the name of the table's index of pending
// rows (on published_at, then created_at), if the dialect's claims name it.
// Column: the index name; no row when there is none.
func (o *Outbox) PendingIndex() (Query, bool) { return o.indexLookup(o.d.pendingIndex()) }

// KeyIndex is the lookup of the name of the table's index of a key's
// pending rows, if the dialect's claims name it (see PendingIndex). Column:
// the index name; no row when there is none.
func (o *Outbox) KeyIndex() (Query, bool) { return o.indexLookup(o.d.keyIndex()) }

// CreatedAtPrecision is the lookup of how many fractional digits of a
// second the table's created_at keeps, if the database rounds (not
// SQLite). Column: the digits; no row when created_at is no timestamp.
func (o *Outbox) CreatedAtPrecision() (Query, bool) { return o.catalogLookup(o.d.createdAtPrecision()) }

// ZonedTimes is the lookup of which of the table's time columns the
// database converts from and to each session's time zone (MySQL's
// TIMESTAMP), comma-separated (empty for none), and how many seconds the
// session's zone is ahead of UTC now; false when the dialect converts
// none.
func (o *Outbox) ZonedTimes() (Query, bool) { return o.catalogLookup(o.d.zonedTimes()) }

// IDType is the lookup of the type of the table's id column, as the
// database names it, in lower case (uuid, bigint, integer, character
// varying; MySQL's DATA_TYPE, followed by " unsigned" for an unsigned
// integer: bigint unsigned, int, varchar): another library's
// table may hold its ids in a type that a message id of another form
// cannot be, and where a statement binding such an id fails
// (PostgreSQL), or finds a row it does not name (MySQL, which reads
// "12abc" as 12). Column: the type, "" when the table has no id column;
// false when the dialect has no types to tell (SQLite).
func (o *Outbox) IDType() (Query, bool) { return o.catalogLookup(o.d.idType()) }

// catalogLookup is indexLookup for a lookup written with "?" placeholders,
// rebound for the dialect.
func (o *Outbox) catalogLookup(q string) (Query, bool) {
	lookup, ok := o.indexLookup(q)
	lookup.SQL = o.d.rebind(lookup.SQL)
	return lookup, ok
}

// indexLookup gives a dialect's index-name lookup q the table's schema and
// name; false when the dialect has none.
func (o *Outbox) indexLookup(q string) (Query, bool) {
	if q == "" {
		return Query{}, false
	}
	var schema any // NULL: the current one
	if o.schema != "" {
		schema = o.schema
	}
	return Query{SQL: q, Args: []any{schema, o.name}}, true
}

// ClaimedRow is one row as the relay reads it, before decoding.
type ClaimedRow struct {
	ID, Exchange, RoutingKey string
	Body, BodyEncoding       string
	ContentType, Headers     string
	CreatedAt                time.Time
	Attempts                 int
	// AggregateID and Seq are the row's ordering key and its number within
	// the key; "" and 0 for an unkeyed row (both columns NULL).
	AggregateID string
	Seq         int64
	// SeqNull: the row's seq is NULL (Seq reads 0), which an error about a
	// keyed row without a number says as the row holds it.
	SeqNull bool
	// Unreadable, if not nil, names the columns of the row that could not
	// be read and says why: a NULL in a table made by hand, a created_at
	// that is no time, an id stored as a BLOB. Their fields are zero. No
	// retry mends such a row.
	Unreadable error
	// RawID, if not nil, is the id as the driver gave it, where that is
	// not text (see idColumn): a BLOB's bytes, a number. ID holds its
	// text. A mark binding the text may match nothing: IDArg binds it as
	// it is stored.
	RawID any
}

// IDArg is the row's id as a mark's argument must bind it to find the row.
func (r ClaimedRow) IDArg() any {
	if r.RawID != nil {
		return r.RawID
	}
	return r.ID
}

// idColumn reads a claimed row's id. An id that is not text is kept as
// the driver gave it (ClaimedRow.RawID), for the row's marks to find it:
//
//   - An integer, the text of its digits, is published under it.
//     Another library's row holds one where SQLite stores a numeric id
//     ("1700000000123", a snowflake) as an INTEGER, in a column of
//     NUMERIC affinity (typed UUID or STRING, say) or of none, and in a
//     MySQL table whose id is a BIGINT (UNSIGNED too: Laravel's). Failing
//     the claim over it (it did) held back every row behind it, for ever.
//   - A BLOB, where the dialect has them (BlobIDs), and a REAL make their
//     row Unreadable, to be failed alone. Read as text, a BLOB's marks
//     bound it as TEXT, which SQLite never finds equal to a BLOB: it was
//     published, never marked, and claimed again at every lease's end,
//     for ever, charged no attempt. Its bytes are no message id another
//     library's consumers would know it by (a UUID's 16 raw bytes, say),
//     and a REAL's text need not be the id its writer wrote ("1e3"), so
//     neither is published.
type idColumn struct {
	c   *columnReader
	dst *ClaimedRow
}

func (col idColumn) Scan(v any) error {
	switch x := v.(type) {
	case string:
		col.dst.ID = x
	case []byte:
		col.dst.ID = string(x)
		if col.c.d.BlobIDs() {
			col.dst.RawID = []byte(col.dst.ID)
			col.c.failed = append(col.c.failed, fmt.Sprintf("column id: a BLOB of %d bytes (hex %X), not text, which this library cannot read as a message id; rewrite it as text and retry the row", len(x), x))
		}
	case int64:
		col.dst.ID = strconv.FormatInt(x, 10)
		col.dst.RawID = x
	case uint64: // MySQL's BIGINT UNSIGNED, read by the text protocol
		col.dst.ID = strconv.FormatUint(x, 10)
		col.dst.RawID = x
	case float64:
		col.dst.ID = strconv.FormatFloat(x, 'g', -1, 64)
		col.dst.RawID = x
		col.c.failed = append(col.c.failed, fmt.Sprintf("column id: a REAL (%s), not text, which this library cannot read as the message id its writer gave; rewrite it as text and retry the row", col.dst.ID))
	case nil:
		return errors.New("column id: NULL")
	default:
		return fmt.Errorf("column id: a %T, not text", v)
	}
	return nil
}

// ScanClaimed reads the rows of a Claim of d, and closes them. Every column
// but the id is read on its own: a value that cannot be read makes its row
// Unreadable, for the relay to fail alone, rather than failing the claim,
// which would put the whole batch into a retry that never ends. An id stored
// as a BLOB makes its row Unreadable too (see idColumn); an id that cannot
// be read at all (no primary key is NULL) fails the claim.
func (o *Outbox) ScanClaimed(rows *sql.Rows) ([]ClaimedRow, error) {
	return o.scanClaimed(rows, nil, nil)
}

// KeysSlice is where the read of a windowed claim with ClaimParams.KeysRead
// stopped: Read keys, the last of them Last. Known is false when the claim
// did not say: it took no row beyond its window, which it may not have
// read the keys for.
type KeysSlice struct {
	Known bool
	Read  int
	Last  any
}

// ScanClaimedSlice reads the rows of a windowed claim with
// ClaimParams.KeysRead, and where its read of the keys stopped.
func (o *Outbox) ScanClaimedSlice(rows *sql.Rows) ([]ClaimedRow, KeysSlice, error) {
	var (
		ks   KeysSlice
		read sql.NullInt64
		last any
	)
	claimed, err := o.scanClaimed(rows, []any{&read, &last}, func() {
		if read.Valid && !ks.Known {
			ks = KeysSlice{Known: true, Read: int(read.Int64), Last: last}
		}
	})
	return claimed, ks, err
}

// scanClaimed reads the claimed rows; extra, if any, are the scanners of
// the columns after the row's, and after, if set, is called after each row.
func (o *Outbox) scanClaimed(rows *sql.Rows, extra []any, after func()) ([]ClaimedRow, error) {
	defer rows.Close()
	var (
		out []ClaimedRow
		r   ClaimedRow
		c   = columnReader{d: o.d}
	)
	dest := []any{idColumn{c: &c, dst: &r},
		c.text("exchange_name", &r.Exchange), c.text("routing_key", &r.RoutingKey), c.text("body", &r.Body),
		c.text("body_encoding", &r.BodyEncoding), c.text("content_type", &r.ContentType), c.text("headers", &r.Headers),
		c.timestamp("created_at", &r.CreatedAt), nullable(c.integer("attempts", &r.Attempts)),
		nullable(c.text("aggregate_id", &r.AggregateID)), nullFlag{nullable(c.int64("seq", &r.Seq)), &r.SeqNull}}
	dest = append(dest, extra...)
	for rows.Next() {
		r, c.failed = ClaimedRow{}, c.failed[:0]
		if err := rows.Scan(dest...); err != nil {
			return nil, err
		}
		if after != nil {
			after()
		}
		if len(c.failed) > 0 {
			r.Unreadable = errors.New(strings.Join(c.failed, "; "))
		}
		out = append(out, r)
	}
	return out, rows.Err()
}

// columnReader reads the columns of one row each on its own, noting rather
// than returning what it cannot read.
type columnReader struct {
	d      Dialect
	failed []string // "column name: why", of the row being read
}

// column is one column of a columnReader: a sql.Scanner that never fails.
type column struct {
	c        *columnReader
	name     string
	read     func(v any) error
	nullable bool
}

func (col column) Scan(v any) error {
	if v == nil && col.nullable {
		return nil // the destination was reset with the row
	}
	err := errors.New("NULL")
	if v != nil || col.nullable {
		err = col.read(v)
	}
	if err != nil {
		col.c.failed = append(col.c.failed, "column "+col.name+": "+err.Error())
	}
	return nil
}

func (c *columnReader) text(name string, dst *string) column {
	return column{c: c, name: name, read: func(v any) error {
		switch x := v.(type) {
		case string:
			*dst = x
		case []byte:
			*dst = string(x)
		default:
			return fmt.Errorf("a %T, not text", v)
		}
		return nil
	}}
}

// timestamp reads a timestamp. The zero time is no time: MySQL's zero date
// reads as it, and so does text in an SQLite DATETIME column that
// mattn/go-sqlite3 could not parse (it returns no error).
func (c *columnReader) timestamp(name string, dst *time.Time) column {
	return column{c: c, name: name, read: func(v any) error {
		t, err := readTime(c.d, v)
		if err == nil && t.IsZero() {
			err = errors.New("no time: a zero date, or text the driver could not parse as one")
		}
		*dst = t
		return err
	}}
}

// SyntaxError reports whether err is a database's refusal of a
// statement's syntax, whichever database sent it (PostgreSQL's 42601,
// MySQL's 1064, SQLite's "syntax error"): what a statement written for
// another dialect than the connection's database gets.
func SyntaxError(err error) bool {
	if err == nil {
		return false
	}
	if sqlState(err) == "42601" {
		return true
	}
	s := err.Error()
	return strings.Contains(s, "Error 1064") || strings.Contains(s, "syntax error")
}

// nullFlag is a nullable column that notes whether the row held NULL.
type nullFlag struct {
	column
	isNull *bool
}

func (n nullFlag) Scan(v any) error {
	*n.isNull = v == nil
	return n.column.Scan(v)
}

// nullable makes col read NULL as its zero value rather than fail: the
// columns an unkeyed row leaves NULL.
func nullable(col column) column {
	col.nullable = true
	return col
}

func (c *columnReader) integer(name string, dst *int) column {
	return column{c: c, name: name, read: func(v any) error {
		n, err := ReadInt64(v)
		*dst = int(n)
		return err
	}}
}

func (c *columnReader) int64(name string, dst *int64) column {
	return column{c: c, name: name, read: func(v any) (err error) {
		*dst, err = ReadInt64(v)
		return err
	}}
}

// ReadInt64 reads an integer column's value as a driver gives it: an
// int64, or its decimal text.
func ReadInt64(v any) (int64, error) {
	switch x := v.(type) {
	case int64:
		return x, nil
	case []byte:
		return strconv.ParseInt(string(x), 10, 64)
	case string:
		return strconv.ParseInt(x, 10, 64)
	}
	return 0, fmt.Errorf("a %T, not an integer", v)
}

// MarkPublished marks the rows of ids published at now. An id binds as
// ClaimedRow.IDArg gives it.
func (o *Outbox) MarkPublished(now time.Time, ids []any) Query {
	args := make([]any, 0, len(ids)+1)
	args = append(args, o.d.TimeArg(now))
	return o.query(o.update()+"published_at = ?, locked_by = NULL, locked_until = NULL WHERE id IN ("+
		placeholders(len(ids))+")", append(args, ids...)...)
}

// RelayStatements are the statements a relay runs for every batch, as the
// claims on index and keyIndex name them, and the marks of full batches of
// batchSizes: what it prepares.
func (o *Outbox) RelayStatements(index, keyIndex string, batchSizes []int) []string {
	head := ClaimParams{Index: index, KeyIndex: keyIndex}
	// A drain's cursor has an id; a floor's has none (the Store's
	// headFloor, and firstNext's), a statement of its own.
	after := ClaimParams{Index: index, KeyIndex: keyIndex, After: &Cursor{ID: "-"}}
	floor := ClaimParams{Index: index, KeyIndex: keyIndex, After: &Cursor{}}
	var stmts []string
	for _, inFlight := range [][]string{nil, {""}} { // with keyed records in flight and without
		head.InFlight, after.InFlight, floor.InFlight = inFlight, inFlight, inFlight
		stmts = append(stmts, o.Claim(head).SQL, o.Claim(after).SQL, o.Claim(floor).SQL)
	}
	for _, n := range batchSizes {
		stmts = append(stmts, o.MarkPublished(time.Time{}, make([]any, n)).SQL)
	}
	return stmts
}

// MarkFailed records a failed publish of the row id: its attempts and why.
// With holdBy set, the row stays leased to holdBy until holdUntil, a
// retry-after every relay respects (a keyed record's backoff: see the
// Forwarder); without, it is free at once.
//
// leasedBy, if not "", is the relay whose lease the row must still be
// under (a leasing claim's): when its lease ran out and another relay
// claimed the row, that relay's outcome decides, and this failure must not
// clear its live lease and free the row for a third.
func (o *Outbox) MarkFailed(id any, attempts int, reason string, holdBy string, holdUntil time.Time, leasedBy string) Query {
	var by, until any // NULL
	if holdBy != "" {
		by, until = holdBy, o.d.TimeArg(holdUntil)
	}
	if leasedBy != "" {
		return o.query(o.update()+"attempts = ?, last_error = ?, locked_by = ?, locked_until = ? WHERE id = ? AND locked_by = ?",
			attempts, reason, by, until, id, leasedBy)
	}
	return o.query(o.update()+"attempts = ?, last_error = ?, locked_by = ?, locked_until = ? WHERE id = ?",
		attempts, reason, by, until, id)
}

// ReleaseLease frees leased rows that were neither published nor failed. By
// id, not by relay: a release by locked_by alone scans every pending row.
// An id is bound as given: a ClaimedRow's IDArg.
func (o *Outbox) ReleaseLease(relayID string, ids []any) Query {
	args := make([]any, 0, len(ids)+1)
	args = append(args, relayID)
	return o.query(o.update()+"locked_by = NULL, locked_until = NULL WHERE locked_by = ? AND id IN ("+
		placeholders(len(ids))+")", append(args, ids...)...)
}

// Stats counts pending and stuck rows. Columns: pending, stuck, the oldest
// pending created_at (NULL if none).
func (o *Outbox) Stats(maxAttempts int) Query {
	return o.query("SELECT COALESCE(SUM(CASE WHEN COALESCE(attempts, 0) < ? THEN 1 ELSE 0 END), 0), "+
		"COALESCE(SUM(CASE WHEN attempts >= ? THEN 1 ELSE 0 END), 0), "+
		o.d.timeText("MIN(CASE WHEN COALESCE(attempts, 0) < ? THEN "+o.d.timeOf("created_at")+" END)")+" FROM "+o.table+" WHERE published_at IS NULL",
		maxAttempts, maxAttempts, maxAttempts)
}

// Stuck lists up to limit rows at maxAttempts, oldest first. Columns: id,
// exchange_name, routing_key, aggregate_id, seq, attempts, last_error,
// created_at, locked_by, locked_until, and leased: 1 when a relay holds the row under a live lease
// now, which Retry leaves alone (the negation of notClaimed), else 0.
func (o *Outbox) Stuck(maxAttempts, limit int, now time.Time) Query {
	return o.failedRows("attempts >= ?", []any{maxAttempts}, limit, now)
}

// failing is the condition of an unpublished row that failed and is not
// stuck: 0 < attempts < maxAttempts.
const failing = "attempts > 0 AND attempts < ?"

// Failing is Stuck for the rows that failed and are not stuck yet: the
// relay tries them again itself, and an unkeyed one holds back the
// records behind it meanwhile.
func (o *Outbox) Failing(maxAttempts, limit int, now time.Time) Query {
	return o.failedRows(failing, []any{maxAttempts}, limit, now)
}

// FailingCount counts the rows Failing lists.
func (o *Outbox) FailingCount(maxAttempts int) Query {
	return o.query("SELECT COUNT(*) FROM "+o.table+" WHERE published_at IS NULL AND "+failing, maxAttempts)
}

// failedRows lists, as Stuck does, up to limit unpublished rows on which
// attempts holds (cond, with its args), oldest first.
func (o *Outbox) failedRows(cond string, condArgs []any, limit int, now time.Time) Query {
	free, args := o.notClaimed(now)
	return o.query(o.stuckColumns("CASE WHEN "+free+" THEN 0 ELSE 1 END")+
		" WHERE published_at IS NULL AND "+cond+" ORDER BY created_at, id LIMIT ?", append(append(args, condArgs...), limit)...)
}

// stuckColumns selects from the table the columns Stuck lists, leased
// (1 or 0) the last.
func (o *Outbox) stuckColumns(leased string) string {
	return "SELECT id, exchange_name, routing_key, aggregate_id, seq, attempts, last_error, " + o.d.timeText("created_at") + ", locked_by, " + o.d.timeText("locked_until") + ", " +
		leased + " FROM " + o.table
}

// SetAside lists, in Stuck's columns, up to limit published records a
// consumer set aside (MarkSetAside's note in last_error), oldest first. It
// reads the whole table: an operator's look, not a relay's.
func (o *Outbox) SetAside(limit int) Query {
	return o.query(o.stuckColumns("0")+" WHERE published_at IS NOT NULL AND last_error LIKE ? ORDER BY created_at, id LIMIT ?", SetAsideNote+"%", limit)
}

// SetAsideCount counts the records SetAside lists.
func (o *Outbox) SetAsideCount() Query {
	return o.query("SELECT COUNT(*) FROM "+o.table+" WHERE published_at IS NOT NULL AND last_error LIKE ?", SetAsideNote+"%")
}

// Records reads the rows of ids, as an operator looks them up: id,
// exchange_name, routing_key, aggregate_id, seq, attempts, last_error,
// created_at, published_at, processed_at, locked_by, locked_until, and 1
// where a relay holds the row under a live lease at now (see notClaimed).
func (o *Outbox) Records(ids []string, now time.Time) Query {
	free, args := o.notClaimed(now)
	in, inArgs := o.idIn(ids)
	return o.query("SELECT "+o.d.text("id")+", exchange_name, routing_key, aggregate_id, seq, attempts, last_error, "+
		o.d.timeText("created_at")+", "+o.d.timeText("published_at")+", "+o.d.timeText("processed_at")+", locked_by, "+o.d.timeText("locked_until")+", "+
		"CASE WHEN "+free+" THEN 0 ELSE 1 END, headers FROM "+o.table+" WHERE "+in+" ORDER BY created_at, id", append(args, inArgs...)...)
}

// HeadersLike reads the rows whose headers, as text, are like pattern (the
// whole table is read). Columns: id, headers.
func (o *Outbox) HeadersLike(pattern string) Query {
	return o.query("SELECT "+o.d.text("id")+", headers FROM "+o.table+" WHERE "+o.d.text("headers")+" LIKE ?", pattern)
}

// LeaseHolders reads the relays that hold unpublished rows under a lease
// that has not run out at now (SQLite's claims), a failed keyed record's
// backoff aside. Columns: locked_by.
func (o *Outbox) LeaseHolders(now time.Time) Query {
	over, args := o.leaseOver(now)
	return o.query("SELECT DISTINCT locked_by FROM "+o.table+" WHERE published_at IS NULL AND locked_by IS NOT NULL AND locked_by <> '"+RetryHold+"' AND NOT "+over, args...)
}

// EndLeases ends the leases relay holds on unpublished rows: a relay whose
// process is gone, its rows claimable again at once.
func (o *Outbox) EndLeases(relay string) Query {
	return o.query(o.update()+"locked_by = NULL, locked_until = NULL WHERE published_at IS NULL AND locked_by = ?", relay)
}

// Discard deletes the stuck rows of ids (unpublished, at maxAttempts or
// more) but those a relay holds under a live lease: an operator's giving
// up on records that will never go out.
func (o *Outbox) Discard(ids []string, maxAttempts int, now time.Time) Query {
	free, args := o.notClaimed(now)
	in, inArgs := o.idIn(ids)
	return o.query("DELETE FROM "+o.table+" WHERE published_at IS NULL AND attempts >= ? AND "+free+" AND "+in,
		append(append([]any{maxAttempts}, args...), inArgs...)...)
}

// Contents reads what the rows of ids would send. Columns: id,
// exchange_name, routing_key, body, body_encoding, content_type, headers.
func (o *Outbox) Contents(ids []string) Query {
	in, args := o.idIn(ids)
	return o.query("SELECT "+o.d.text("id")+", exchange_name, routing_key, body, body_encoding, content_type, headers FROM "+o.table+" WHERE "+in, args...)
}

// RetryHold is the locked_by of a lease that is a failed keyed record's
// backoff (its retry-after), not a relay's claim: an operator's retry ends
// it, where it leaves a claim alone.
const RetryHold = "retry-after"

// notClaimed is the condition of a row no relay has claimed under a lease
// at now: a lease written by a relay (ours on SQLite, another library's
// anywhere) is a row in flight, and clearing it would let a second relay
// publish it too. A failed keyed record's backoff is no claim.
func (o *Outbox) notClaimed(now time.Time) (string, []any) {
	over, args := o.leaseOver(now)
	return "(" + over + " OR locked_by = '" + RetryHold + "')", args
}

// Retry makes the unpublished rows of ids pending again, but for those a
// relay holds under a live lease (see notClaimed), and those with nothing
// to reset (pending already, no attempt and no lease), which it does not
// count: on PostgreSQL and SQLite an update counts the rows it matched,
// on MySQL those it changed.
func (o *Outbox) Retry(ids []string, now time.Time) Query {
	free, args := o.notClaimed(now)
	in, inArgs := o.idIn(ids)
	return o.query(o.update()+"attempts = 0, locked_by = NULL, locked_until = NULL"+
		" WHERE published_at IS NULL AND "+free+" AND (COALESCE(attempts, 0) <> 0 OR locked_by IS NOT NULL OR locked_until IS NOT NULL)"+
		" AND "+in, append(args, inArgs...)...)
}

// idIn is the condition of the rows of ids, given as text (an operator's,
// a message's). On SQLite, whose columns take any type, an id that is an
// integer's digits is looked for as the INTEGER too: a column without a
// declared type keeps another library's integer id as one, which no text
// equals, and a Retry of a stuck row that Stuck lists, or the mark of its
// message's record processed, found nothing. So is every id as a BLOB:
// another library's BLOB id (a UUID's 16 bytes), which the relay sets
// aside stuck and Stuck lists (quoted, in outboxctl), equals no text
// either, and outboxctl show said of it "not in acemq_outbox".
func (o *Outbox) idIn(ids []string) (string, []any) {
	args := stringArgs(nil, ids)
	if o.d.BlobIDs() { // SQLite's dynamic types
		for _, id := range ids {
			if n, err := strconv.ParseInt(id, 10, 64); err == nil && strconv.FormatInt(n, 10) == id {
				args = append(args, n)
			}
			args = append(args, []byte(id))
		}
	}
	return "id IN (" + placeholders(len(args)) + ")", args
}

// RetryStuck makes every row at maxAttempts pending again, but for those a
// relay holds under a live lease (see notClaimed).
func (o *Outbox) RetryStuck(maxAttempts int, now time.Time) Query {
	free, args := o.notClaimed(now)
	return o.query(o.update()+"attempts = 0, locked_by = NULL, locked_until = NULL"+
		" WHERE published_at IS NULL AND "+free+" AND attempts >= ?", append(args, maxAttempts)...)
}

// PurgePublishedBound reads the published_at (as stored: see stored) of
// the n-th row, from 0, that PurgePublishedRange would delete from from on
// (nil: from the first); no row when there are fewer. A purge's batches go
// on from where the last ended: each started at the head of the index,
// and walked the entries of the rows the batches before it deleted, which
// stay while any transaction older than them is open (pg_dump, a report,
// a replica's feedback): 950,000 rows took 97 s on PostgreSQL with a
// snapshot held (4.7 s so), and MariaDB slowed from 55 to 564 ms a batch.
func (o *Outbox) PurgePublishedBound(cutoff time.Time, from any, n int) Query {
	before, args := timeRange(o.d, "published_at", cutoff, from, nil)
	return o.query("SELECT "+o.d.stored("published_at")+" FROM "+o.table+" WHERE published_at IS NOT NULL AND "+before+
		" ORDER BY published_at LIMIT 1 OFFSET ?", append(args, n)...)
}

// PurgePublishedRange deletes at most limit rows published before cutoff,
// from from to upTo (either nil: unbounded), both as PurgePublishedBound
// read them.
func (o *Outbox) PurgePublishedRange(cutoff time.Time, limit int, from, upTo any) Query {
	before, args := timeRange(o.d, "published_at", cutoff, from, upTo)
	return o.query(o.d.purgePublished(o.table, before), append(args, limit)...)
}

// timeRange is the condition of col's rows before cutoff, from from to
// upTo (nil: unbounded), and its arguments.
func timeRange(d Dialect, col string, cutoff time.Time, from, upTo any) (string, []any) {
	before, args := d.timeCmp(col, "<", cutoff)
	if from != nil {
		before += " AND " + col + " >= ?"
		args = append(args, from)
	}
	if upTo != nil {
		before += " AND " + col + " <= ?"
		args = append(args, upTo)
	}
	return before, args
}

// Probe reads no row of the table: it fails if the table is not there.
func (o *Outbox) Probe() Query { return Query{SQL: "SELECT 1 FROM " + o.table + " WHERE 1 = 0"} }

// PublishedSince counts the rows published at or after t.
func (o *Outbox) PublishedSince(t time.Time) Query {
	since, args := o.d.timeCmp("published_at", ">=", t)
	return o.query("SELECT COUNT(*) FROM "+o.table+" WHERE published_at IS NOT NULL AND "+since, args...)
}

// PublishedBefore counts the rows published before t.
func (o *Outbox) PublishedBefore(t time.Time) Query {
	before, args := o.d.timeCmp("published_at", "<", t)
	return o.query("SELECT COUNT(*) FROM "+o.table+" WHERE published_at IS NOT NULL AND "+before, args...)
}

// RepublishCursor is where a walk of the published rows goes on from: the
// published_at and id of the last row RepublishPick read, published_at as
// the driver read it, so that it compares as the column orders (on SQLite
// a number another library wrote sorts below every text).
type RepublishCursor struct {
	PublishedAt any
	ID          string
}

// RepublishPick reads the ids of at most limit published, unprocessed
// records of routingKeys (to one of exchanges, unless it is empty; both
// compared byte for byte, see bytes)
// published before cutoff (and after since, unless it is zero), in
// (published_at, id) order from after (nil: from the first). Each walk goes on where the last ended, rather than
// from the oldest published row past every processed one again. Columns:
// id, published_at, aggregate_id, seq (both NULL without keys: a table
// without the columns).
func (o *Outbox) RepublishPick(cutoff, since time.Time, routingKeys, exchanges []string, after *RepublishCursor, limit int, keys bool) Query {
	where, args := o.republishable(cutoff, since, routingKeys, exchanges)
	if after != nil {
		// The range first, which an index bounds: PostgreSQL took the OR
		// alone for a filter and walked every published row before the
		// cursor at each batch (569 ms a batch at row 900,000 of 950,000;
		// a Republish of 190,000 records overran the plugin's 30 s), and
		// SQLite read every row after it.
		where += " AND published_at >= ? AND (published_at > ? OR published_at = ? AND id > ?)"
		args = append(args, after.PublishedAt, after.PublishedAt, after.PublishedAt, after.ID)
	}
	cols := ", aggregate_id, seq"
	if !keys {
		cols = ", NULL, NULL"
	}
	return o.query("SELECT id, "+o.d.stored("published_at")+cols+" FROM "+o.table+" WHERE "+where+" ORDER BY published_at, id LIMIT ?", append(args, limit)...)
}

// KeyColumnsProbe reads the table's aggregate_id and seq, and no row: it
// fails where the table lacks them.
func (o *Outbox) KeyColumnsProbe() Query {
	return Query{SQL: "SELECT aggregate_id, seq FROM " + o.table + " WHERE 1 = 0"}
}

// republishable is RepublishPick's condition, without its cursor.
func (o *Outbox) republishable(cutoff, since time.Time, routingKeys, exchanges []string) (string, []any) {
	before, args := o.d.timeCmp("published_at", "<", cutoff)
	where := "published_at IS NOT NULL AND " + before + " AND processed_at IS NULL AND "
	if !since.IsZero() {
		later, laterArgs := o.d.timeCmp("published_at", ">", since)
		where += later + " AND "
		args = append(args, laterArgs...)
	}
	if _, indexed := o.d.(mysql); indexed {
		// The column as it is, for 0012's index to narrow the walk to the
		// tracked keys, which the conversion of bytes cannot serve: its
		// collation may take more rows for equal than their bytes do,
		// never fewer, and the exact test follows.
		where += "routing_key IN (" + placeholders(len(routingKeys)) + ") AND "
		args = stringArgs(args, routingKeys)
	}
	where += o.d.bytes("routing_key") + " IN (" + placeholders(len(routingKeys)) + ")"
	args = stringArgs(args, routingKeys)
	if len(exchanges) > 0 {
		where += " AND " + o.d.bytes("exchange_name") + " IN (" + placeholders(len(exchanges)) + ")"
		args = stringArgs(args, exchanges)
	}
	return where, args
}

// RepublishIDs makes the records of ids pending again: those still
// published before cutoff and unprocessed, conditions the update checks
// again on each row it locks, so that of two instances racing for a record
// one makes it pending.
func (o *Outbox) RepublishIDs(ids []string, cutoff time.Time) Query {
	before, args := o.d.timeCmp("published_at", "<", cutoff)
	in, inArgs := o.idIn(ids)
	return o.query(o.update()+"published_at = NULL, attempts = 0, locked_by = NULL, locked_until = NULL"+
		" WHERE "+in+" AND published_at IS NOT NULL AND "+before+" AND processed_at IS NULL",
		append(inArgs, args...)...)
}

// Resend makes the published records of ids pending again, with attempts
// reset and processed_at and last_error cleared: an operator's resend of
// records a consumer set aside or lost (Republish does it for unprocessed
// records of tracked topics only). Rows not published are left as they
// are. last_error goes too: a consumer's "set aside by …" (MarkSetAside)
// kept through the resend and the apply after it made a record applied
// read as set aside, and the relay's failures before the first publish
// are not this send's.
func (o *Outbox) Resend(ids []string) Query {
	in, args := o.idIn(ids)
	return o.query(o.update()+"published_at = NULL, processed_at = NULL, attempts = 0, last_error = NULL, locked_by = NULL, locked_until = NULL"+
		" WHERE published_at IS NOT NULL AND "+in, args...)
}

// KeySeq reads the id of key's record seq. Columns: id.
func (o *Outbox) KeySeq(key string, seq int64) Query {
	return o.query("SELECT id FROM "+o.table+" WHERE aggregate_id = ? AND seq = ? AND "+o.d.bytes("aggregate_id")+" = ?", key, seq, key)
}

// MarkProcessed sets the record id's processed_at, if still null.
func (o *Outbox) MarkProcessed(id string, now time.Time) Query {
	in, args := o.idIn([]string{id})
	return o.query(o.update()+"processed_at = ? WHERE "+in+" AND processed_at IS NULL", append([]any{o.d.TimeArg(now)}, args...)...)
}

// SetAsideNote starts the last_error of a record whose message a
// consumer set aside (MarkSetAside).
const SetAsideNote = "set aside by "

// MarkSetAside is MarkProcessed of a record whose message a consumer set
// aside, with note (starting SetAsideNote) in its last_error: processed
// says only that Republish has nothing to send again, and an operator's
// show said "processed" of a payment never applied.
func (o *Outbox) MarkSetAside(id string, now time.Time, note string) Query {
	in, args := o.idIn([]string{id})
	return o.query(o.update()+"processed_at = ?, last_error = ? WHERE "+in+" AND processed_at IS NULL", append([]any{o.d.TimeArg(now), note}, args...)...)
}

// HeldErrorKey is the held row's metadata key under which the ordered
// inbox keeps the last failure of a held message's handler (its time, RFC
// 3339, and the error), for outboxctl to show.
const HeldErrorKey = "x-acemq-inbox-last-error"

// SkippedNote starts the last_error of a record whose message an ordered
// inbox gave up on at an operator's word (SkipHeld, SkipGap): marked
// processed, never applied, and dropped as a duplicate if sent again.
const SkippedNote = "skipped by "

// MarkSkipped writes note (starting SkippedNote) into the last_error of
// the published records of ids and marks them processed, if not yet: the
// hold had marked a held message's record, and show said "processed" of a
// message an operator gave up on.
func (o *Outbox) MarkSkipped(ids []string, now time.Time, note string) Query {
	in, args := o.idIn(ids)
	return o.query(o.update()+"processed_at = COALESCE(processed_at, ?), last_error = ? WHERE published_at IS NOT NULL AND "+in,
		append([]any{o.d.TimeArg(now), note}, args...)...)
}

// MarkSkippedSeqs is MarkSkipped of key's published records from..through:
// the numbers of a gap an operator gave up on.
func (o *Outbox) MarkSkippedSeqs(key string, from, through int64, now time.Time, note string) Query {
	return o.query(o.update()+"processed_at = COALESCE(processed_at, ?), last_error = ? WHERE published_at IS NOT NULL AND aggregate_id = ? AND "+o.d.bytes("aggregate_id")+" = ? AND seq BETWEEN ? AND ?",
		o.d.TimeArg(now), note, key, key, from, through)
}

// Unprocessed reads 1 if the record id is there with processed_at still
// null (or, applied, with a set-aside note: MarkApplied), and no row
// otherwise: a plain read, which locks nothing where MarkProcessed would
// lock the gap of a missing id (see GapLocks).
func (o *Outbox) Unprocessed(id string, applied bool) Query {
	in, args := o.idIn([]string{id})
	if applied {
		return o.query("SELECT 1 FROM "+o.table+" WHERE "+in+" AND (processed_at IS NULL OR last_error LIKE ?)", append(args, SetAsideNote+"%")...)
	}
	return o.query("SELECT 1 FROM "+o.table+" WHERE "+in+" AND processed_at IS NULL", args...)
}

// MarkApplied is MarkProcessed of a record whose message a consumer
// applied: it also takes out a set-aside note (MarkSetAside), which a
// message set aside and then applied after all (held, or delivered again)
// kept, and show read "set aside, not applied" of it (an on-call review).
func (o *Outbox) MarkApplied(id string, now time.Time) Query {
	in, args := o.idIn([]string{id})
	return o.query(o.update()+"processed_at = COALESCE(processed_at, ?), last_error = CASE WHEN last_error LIKE ? THEN NULL ELSE last_error END"+
		" WHERE "+in+" AND (processed_at IS NULL OR last_error LIKE ?)",
		append(append([]any{o.d.TimeArg(now), SetAsideNote + "%"}, args...), SetAsideNote+"%")...)
}

// The statements below are those PostgreSQL and SQLite write alike and
// MySQL does not (it has INSERT IGNORE, and refuses LIMIT in a subquery).

// insertOutboxOnConflict inserts rows rows, skipping ids already present:
// a retried transaction adds the same id again, and leaves one row.
func insertOutboxOnConflict(table, cols string, n, rows int, placeholder func(n int) string) string {
	var b strings.Builder
	b.Grow(64 + rows*n*6)
	b.WriteString("INSERT INTO " + table + " (" + cols + ") VALUES ")
	valuesList(&b, rows, n, placeholder)
	b.WriteString(" ON CONFLICT (id) DO NOTHING")
	return b.String()
}

// timeColumnCmp is timeCmp where a timestamp column holds times, which
// compare as such.
func timeColumnCmp(d Dialect, col, op string, t time.Time) (string, []any) {
	return col + " " + op + " ?", []any{d.TimeArg(t)}
}

// insertProcessedOnConflict records (consumer_name, message_id,
// processed_at), and affects no row when the key is there already.
func insertProcessedOnConflict(table string) string {
	return "INSERT INTO " + table + " (consumer_name, message_id, processed_at) VALUES (?, ?, ?) ON CONFLICT DO NOTHING"
}

// purgeProcessedByKey deletes at most ? inbox rows processed before (a
// timeCmp), oldest first.
func purgeProcessedByKey(table, before string) string {
	return "DELETE FROM " + table + " WHERE (consumer_name, message_id) IN (SELECT consumer_name, message_id FROM " + table +
		" WHERE " + before + " ORDER BY processed_at LIMIT ?)"
}

// lockingClaim is the claim of PostgreSQL and MySQL: row locks held by the
// claim's open transaction, skipping rows another relay holds. from is the
// table, with an index hint where the dialect gives one; cols the dialect's
// claimed columns.
func lockingClaim(cols, from, where string) string {
	return "SELECT " + cols + " FROM " + from + " WHERE " + where +
		" ORDER BY created_at, id LIMIT ? FOR UPDATE SKIP LOCKED"
}

// Inbox is the SQL of one inbox table (processed_messages).
type Inbox struct {
	d     Dialect
	table string // quoted
}

// NewInbox returns the statements of table, which it validates and quotes.
func NewInbox(d Dialect, table string) (*Inbox, error) {
	quoted, err := QuoteTable(d, table)
	if err != nil {
		return nil, err
	}
	return &Inbox{d: d, table: quoted}, nil
}

// Table is the table's name as quoted in the SQL, for error messages.
func (in *Inbox) Table() string { return in.table }

// InboxKey is the key the inbox stores for the message id id, in
// processed_messages.message_id and acemq_inbox_held.message_id, both
// varchar(64): id itself where it is 1 to 64 bytes of printable ASCII
// without a space, as the ids this library writes are; otherwise "sha256 "
// and the SHA-256 of id's bytes in lower-case base32 without padding (59
// bytes). Another library's table may have ids of up to 255 bytes, or
// with spaces or UTF-8, which the relay publishes as they are; the inbox
// refused them at every delivery. The space sets the digests apart from
// every id kept as it is, and lower case keeps two of them apart under a
// case-insensitive collation. A key in that form is kept as it is: a held
// message's stored key is its key again when it is applied.
func InboxKey(id string) string {
	if keptAsIs(id) || isDigestKey(id) {
		return id
	}
	sum := sha256.Sum256([]byte(id))
	return digestPrefix + digestEncoding.EncodeToString(sum[:])
}

const digestPrefix = "sha256 "

var digestEncoding = base32.NewEncoding("abcdefghijklmnopqrstuvwxyz234567").WithPadding(base32.NoPadding)

// keptAsIs reports whether InboxKey keeps id as it is.
func keptAsIs(id string) bool {
	if id == "" || len(id) > 64 {
		return false
	}
	for i := 0; i < len(id); i++ {
		if c := id[i]; c <= ' ' || c > '~' {
			return false
		}
	}
	return true
}

// isDigestKey reports whether key is in the form InboxKey gives an id it
// does not keep.
func isDigestKey(key string) bool {
	rest, ok := strings.CutPrefix(key, digestPrefix)
	if !ok || len(rest) != digestEncoding.EncodedLen(sha256.Size) {
		return false
	}
	_, err := digestEncoding.DecodeString(rest)
	return err == nil
}

// Insert records that consumer processed id at now; it affects no row when
// the key is there already. This and the statements below take a message
// id, and store or look for its InboxKey.
func (in *Inbox) Insert(consumer, id string, now time.Time) Query {
	return Query{SQL: in.d.rebind(in.d.insertProcessed(in.table)), Args: []any{consumer, InboxKey(id), in.d.TimeArg(now)}}
}

// Key reads the key stored under consumer's id, as the table's collation
// matched it: another id's under a case-insensitive collation, which a
// table another library created may have. Columns: consumer_name,
// message_id; no row when there is none.
func (in *Inbox) Key(consumer, id string) Query {
	return in.readKey(consumer, InboxKey(id), in.d.currentRead())
}

// KeyAsIs is Key of the id as it is, not its InboxKey, in a plain read
// (one that locks nothing, where Key's reads what is committed now): a
// table another library's inbox wrote, whose message_id is wider than 64,
// may hold an id InboxKey digests as it is.
func (in *Inbox) KeyAsIs(consumer, id string) Query {
	return in.readKey(consumer, id, "")
}

// readKey reads the row of consumer's key, as stored, the read's end
// (a locking clause, or none) after it.
func (in *Inbox) readKey(consumer, key, end string) Query {
	return Query{SQL: in.d.rebind("SELECT " + in.d.text("consumer_name") + ", " + in.d.text("message_id") + " FROM " + in.table +
		" WHERE consumer_name = ? AND message_id = ?" + end), Args: []any{consumer, key}}
}

// Delete takes back the key Insert recorded: an at-most-once handler that
// failed before its effect, whose message is to be retried.
func (in *Inbox) Delete(consumer, id string) Query {
	return Query{SQL: in.d.rebind("DELETE FROM " + in.table + " WHERE consumer_name = ? AND message_id = ?"), Args: []any{consumer, InboxKey(id)}}
}

// Stamp reads the processed_at of consumer's key id. Under AtMostOnce a
// stamp ahead of now is the end of the lease of a handler still running.
func (in *Inbox) Stamp(consumer, id string) Query {
	return Query{SQL: in.d.rebind("SELECT " + in.d.timeText("processed_at") + " FROM " + in.table + " WHERE consumer_name = ? AND message_id = ?"), Args: []any{consumer, InboxKey(id)}}
}

// Done stamps consumer's key id processed at now: its at-most-once
// handler returned (or, with a time ahead, renews its running lease).
func (in *Inbox) Done(consumer, id string, now time.Time) Query {
	return Query{SQL: in.d.rebind("UPDATE " + in.table + " SET processed_at = ? WHERE consumer_name = ? AND message_id = ?"), Args: []any{in.d.TimeArg(now), consumer, InboxKey(id)}}
}

// PurgeBound is Outbox.PurgePublishedBound's for processed_messages.
func (in *Inbox) PurgeBound(cutoff time.Time, from any, n int) Query {
	before, args := timeRange(in.d, "processed_at", cutoff, from, nil)
	return Query{SQL: in.d.rebind("SELECT " + in.d.stored("processed_at") + " FROM " + in.table + " WHERE " + before +
		" ORDER BY processed_at LIMIT 1 OFFSET ?"), Args: append(args, n)}
}

// PurgeRange deletes at most limit rows processed before cutoff, from from
// to upTo (either nil: unbounded), as PurgeBound read them.
func (in *Inbox) PurgeRange(cutoff time.Time, limit int, from, upTo any) Query {
	// By timeCmp: on SQLite a key another library stamped as a number
	// (sqlite-jdbc's Unix milliseconds) sorts below every text, and a key
	// processed a minute ago was deleted as older than any cutoff: its
	// message, delivered again, ran again.
	before, args := timeRange(in.d, "processed_at", cutoff, from, upTo)
	return Query{SQL: in.d.rebind(in.d.purgeProcessed(in.table, before)), Args: append(args, limit)}
}

// Probe reads no row of the inbox table, naming the columns the inbox
// uses: a table without them (the outbox's, given as the inbox's) fails.
func (in *Inbox) Probe() Query {
	return Query{SQL: "SELECT consumer_name, message_id, processed_at FROM " + in.table + " WHERE 1 = 0"}
}

// Count counts every row, all consumers.
func (in *Inbox) Count() Query { return Query{SQL: "SELECT COUNT(*) FROM " + in.table} }

// ProcessedBefore counts the rows processed before t.
func (in *Inbox) ProcessedBefore(t time.Time) Query {
	before, args := in.d.timeCmp("processed_at", "<", t)
	return Query{SQL: in.d.rebind("SELECT COUNT(*) FROM " + in.table + " WHERE " + before), Args: args}
}

// CreateMigrationsTable creates acemq_schema_migrations, where Migrate
// records the versions it applied.
func CreateMigrationsTable(d Dialect) Query { return Query{SQL: d.createMigrationsTable()} }

// SelectMigrations reads the versions applied. Column: version.
func SelectMigrations() Query { return Query{SQL: "SELECT version FROM acemq_schema_migrations"} }

// InsertMigration records that version (name) was applied.
func InsertMigration(d Dialect, version int, name string) Query {
	return Query{SQL: d.insertMigration(), Args: []any{version, name}}
}

// The ordered inbox's tables, named as sqlschema's 0006 creates them. Not
// configurable: every consumer of a database shares them, keyed by
// consumer_name as processed_messages is.
const (
	InboxSequencesTable = "acemq_inbox_sequences"
	InboxHeldTable      = "acemq_inbox_held"
)

const (
	inboxHeldColumns     = "consumer_name, aggregate_id, seq, message_id, payload, payload_encoding, metadata, held_at"
	inboxHeldColumnCount = 8

	selectInboxSequence = "SELECT last_seq, held FROM " + InboxSequencesTable + " WHERE consumer_name = ? AND aggregate_id = ?"

	insertInboxSequenceOnConflict = "INSERT INTO " + InboxSequencesTable +
		" (consumer_name, aggregate_id, last_seq) VALUES (?, ?, 0) ON CONFLICT DO NOTHING"
	insertInboxHeldOnConflict = "INSERT INTO " + InboxHeldTable + " (" + inboxHeldColumns + ") VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING"

	// advanceInboxSequenceOnConflict is PostgreSQL's advance of a key: it
	// writes the key's row if it is missing (at 1 for seq 1, the message
	// applied by the very insert, else at 0) and locks it, new or not; the
	// DO UPDATE's WHERE fails for any but the key's next message with
	// nothing held, and then returns no row, but PostgreSQL locks the row
	// all the same. A row returned at seq says the key moved to seq.
	advanceInboxSequenceOnConflict = "INSERT INTO " + InboxSequencesTable + " (consumer_name, aggregate_id, last_seq, held) VALUES (?, ?, ?, 0)" +
		" ON CONFLICT (consumer_name, aggregate_id) DO UPDATE SET last_seq = ?" +
		" WHERE " + InboxSequencesTable + ".last_seq = ? AND " + InboxSequencesTable + ".held = 0 RETURNING last_seq"
)

// firstSeq is the last applied of a key's new row written by an advance:
// seq 1 is applied by the very insert, any later one finds nothing applied.
func firstSeq(seq int64) int64 {
	if seq == 1 {
		return 1
	}
	return 0
}

// InOrder is a keyed message on the ordered inbox's in-order path.
type InOrder struct {
	Consumer  string
	Key       string
	Seq       int64
	MessageID string
	At        time.Time // processed_at of its dedupe key
}

// ApplyStep is one statement of the in-order path, and how its result says
// that it did its part.
type ApplyStep struct {
	Query
	Done func(sql.Result) (bool, error)
}

// oneRow is the Done of a statement that did its part when it affected one
// row: an insert that found no key in its way, an update whose WHERE held.
func oneRow(res sql.Result) (bool, error) {
	n, err := res.RowsAffected()
	return n == 1, err
}

// InsertedAll reports whether an insert of n rows that skips those whose
// unique key is taken (Outbox.Insert, InsertNumbered's last statement,
// Inbox.Insert) inserted every one, from the statement's result.
func InsertedAll(d Dialect, res Result, n int) (bool, error) {
	return d.insertedAll(res, n)
}

// affectedAll is insertedAll where a skipped row counts 0 affected (ON
// CONFLICT DO NOTHING).
func affectedAll(res Result, n int) (bool, error) {
	affected, err := res.RowsAffected()
	return affected == int64(n), err
}

// OrderedInbox is the SQL of the ordered inbox: the last sequence number
// applied per (consumer, key), and the messages held until their
// predecessor is applied.
type OrderedInbox struct{ d Dialect }

// NewOrderedInbox returns the ordered inbox's statements for d.
func NewOrderedInbox(d Dialect) *OrderedInbox { return &OrderedInbox{d: d} }

func (o *OrderedInbox) query(sql string, args ...any) Query {
	return Query{SQL: o.d.rebind(sql), Args: args}
}

// Apply is the in-order path of m, the common case of an ordered consumer:
// statements that, in the caller's transaction, move the key's last
// applied to m.Seq if m.Seq is its next and the key holds no message, and
// record m's dedupe key in in's table. Run them in order and stop at the
// first whose Done is false. All done: m is the key's next and recorded,
// its handler runs in the transaction. Otherwise its dedupe key is not
// recorded, and the key moved on only if m's id was processed already (a
// duplicate: its effect happened, and the key moves on past it): the caller
// takes the key's row (EnsureSequence, LockSequence) and decides from it
// as for any other message. A dialect's steps are as few as it allows:
// one on PostgreSQL, as many as the plain inbox's key plus one elsewhere.
func (o *OrderedInbox) Apply(in *Inbox, m InOrder) []ApplyStep {
	return o.d.applyInOrder(in, m)
}

// EnsureSequence writes the key's row at 0 if it is missing, so that the
// lock that follows has a row to take: without it two first messages of a
// key would both find none.
func (o *OrderedInbox) EnsureSequence(consumer, key string) Query {
	return o.query(o.d.insertInboxSequence(), consumer, key)
}

// LockSequence reads the key's last applied sequence number and its count of
// held messages, and locks its row until the transaction ends. Columns:
// last_seq, held.
func (o *OrderedInbox) LockSequence(consumer, key string) Query {
	return o.query(o.d.lockInboxSequence(), consumer, key)
}

// SetSequence records seq as the key's last applied and recounts its held
// messages: run after the held messages up to seq are deleted, it leaves the
// count exact, even one an operator's hand made wrong.
func (o *OrderedInbox) SetSequence(consumer, key string, seq int64) Query {
	return o.query("UPDATE "+InboxSequencesTable+" SET last_seq = ?, held = (SELECT COUNT(*) FROM "+InboxHeldTable+
		" WHERE consumer_name = ? AND aggregate_id = ?) WHERE consumer_name = ? AND aggregate_id = ?", seq, consumer, key, consumer, key)
}

// Advance records seq as the key's last applied after removed of its held
// messages were deleted by a drain, counting them off the key's held count
// rather than counting what is left: a drain of a key's n held messages
// recounted the rest at each one, n²/2 index entries (21 ms a message with
// 100,000 held on PostgreSQL). A message applied as it came (removed 0:
// once before each drain), or a count that would reach 0 or below (one an
// operator's hand made wrong), counts what is left, as SetSequence does:
// the count tells Apply, on the key's row alone, that nothing is held.
func (o *OrderedInbox) Advance(consumer, key string, seq, removed int64) Query {
	return o.query("UPDATE "+InboxSequencesTable+" SET last_seq = ?, held = CASE WHEN ? > 0 AND held > ? THEN held - ? ELSE (SELECT COUNT(*) FROM "+InboxHeldTable+
		" WHERE consumer_name = ? AND aggregate_id = ?) END WHERE consumer_name = ? AND aggregate_id = ?", seq, removed, removed, removed, consumer, key, consumer, key)
}

// CountHold adds a message just held to the key's count, which lets Apply
// tell, on the key's row alone, that nothing is held.
func (o *OrderedInbox) CountHold(consumer, key string) Query {
	return o.query("UPDATE "+InboxSequencesTable+" SET held = held + 1 WHERE consumer_name = ? AND aggregate_id = ?", consumer, key)
}

// HeldRow is one held message.
type HeldRow struct {
	Consumer, Key   string
	Seq             int64
	MessageID       string
	Payload         string
	PayloadEncoding string
	Metadata        string
	HeldAt          time.Time
}

// Hold writes r; it affects no row when the key's seq is held already.
func (o *OrderedInbox) Hold(r HeldRow) Query {
	return o.query(o.d.insertInboxHeld(), r.Consumer, r.Key, r.Seq, InboxKey(r.MessageID), r.Payload, r.PayloadEncoding, r.Metadata, o.d.TimeArg(r.HeldAt))
}

// NoteHeld writes metadata into the key's held message seq, if it is still
// the message of messageID (the row's message_id as read).
func (o *OrderedInbox) NoteHeld(consumer, key string, seq int64, messageID, metadata string) Query {
	return o.query("UPDATE "+InboxHeldTable+" SET metadata = ? WHERE consumer_name = ? AND aggregate_id = ? AND seq = ? AND message_id = ?",
		metadata, consumer, key, seq, messageID)
}

// HeldUpTo counts the key's held messages up to seq: after applying seq-1,
// one at seq is to be applied next, and one below is a copy of a message
// applied since it was held.
func (o *OrderedInbox) HeldUpTo(consumer, key string, seq int64) Query {
	return o.query("SELECT COUNT(*) FROM "+InboxHeldTable+" WHERE consumer_name = ? AND aggregate_id = ? AND seq <= ?", consumer, key, seq)
}

// DeleteHeldUpTo deletes the key's held messages up to seq.
func (o *OrderedInbox) DeleteHeldUpTo(consumer, key string, seq int64) Query {
	return o.query("DELETE FROM "+InboxHeldTable+" WHERE consumer_name = ? AND aggregate_id = ? AND seq <= ?", consumer, key, seq)
}

// Held reads the key's held message seq. Columns: message_id, payload,
// payload_encoding, metadata.
func (o *OrderedInbox) Held(consumer, key string, seq int64) Query {
	return o.query("SELECT message_id, payload, payload_encoding, metadata FROM "+InboxHeldTable+
		" WHERE consumer_name = ? AND aggregate_id = ? AND seq = ?", consumer, key, seq)
}

// HeldID reads the id of the key's held message seq. Columns: message_id.
func (o *OrderedInbox) HeldID(consumer, key string, seq int64) Query {
	return o.query("SELECT message_id FROM "+InboxHeldTable+" WHERE consumer_name = ? AND aggregate_id = ? AND seq = ?", consumer, key, seq)
}

// LowestHeld reads the key's lowest held sequence number, NULL if none.
func (o *OrderedInbox) LowestHeld(consumer, key string) Query {
	return o.query("SELECT MIN(seq) FROM "+InboxHeldTable+" WHERE consumer_name = ? AND aggregate_id = ?", consumer, key)
}

// Ready lists up to limit keys of consumer after afterKey, in key order,
// whose next message is held, to apply now: "" starts at the first. The
// caller pages on the last key it read. The primary key of held messages,
// (consumer_name, aggregate_id, seq), serves the consumer's range in that
// order, and a page's cursor is the key text the database returned, so it
// compares exactly as it did (a held_at cursor would compare against a time
// in whatever format its writer chose). The first page (after nil) has no
// lower bound: a key starting with a control byte sorts below any bound,
// and on a MySQL database not yet migrated to 0009 (keys in a PAD SPACE
// collation) a key of spaces equals the empty string. Columns:
// aggregate_id.
func (o *OrderedInbox) Ready(consumer string, after *string, limit int) Query {
	q := "SELECT h.aggregate_id FROM " + InboxHeldTable + " h JOIN " + InboxSequencesTable +
		" s ON s.consumer_name = h.consumer_name AND s.aggregate_id = h.aggregate_id AND s.last_seq + 1 = h.seq" +
		" WHERE h.consumer_name = ?"
	args := []any{consumer}
	if after != nil {
		q += " AND h.aggregate_id > ?"
		args = append(args, *after)
	}
	return o.query(q+" ORDER BY h.aggregate_id LIMIT ?", append(args, limit)...)
}

// Gaps lists the keys with a message held since before cutoff, oldest
// first, at most limit (0: every one). Columns: consumer_name,
// aggregate_id, last applied (0 when the key has no row), held count,
// lowest held seq, oldest held_at, and how many keys the list has without
// the limit, counted in the same statement, so that it agrees with the
// rows.
func (o *OrderedInbox) Gaps(cutoff time.Time, limit int) Query {
	q := "SELECT h.consumer_name, h.aggregate_id, COALESCE(MAX(s.last_seq), 0), COUNT(*), MIN(h.seq), " + o.d.timeText("MIN(h.held_at)") + ", COUNT(*) OVER ()" +
		" FROM " + InboxHeldTable + " h LEFT JOIN " + InboxSequencesTable +
		" s ON s.consumer_name = h.consumer_name AND s.aggregate_id = h.aggregate_id" +
		" GROUP BY h.consumer_name, h.aggregate_id HAVING MIN(h.held_at) < ? ORDER BY MIN(h.held_at), h.consumer_name, h.aggregate_id"
	args := []any{o.d.TimeArg(cutoff)}
	if limit > 0 {
		q += " LIMIT ?"
		args = append(args, limit)
	}
	return o.query(q, args...)
}

// HeldStats reads what the gauges show of every held message, of every
// consumer: how many are held, on how many keys a message is held since
// before cutoff, and when the longest-held one was held (NULL when none).
// Columns: those three.
func (o *OrderedInbox) HeldStats(cutoff time.Time) Query {
	return o.query("SELECT (SELECT COUNT(*) FROM "+InboxHeldTable+"),"+
		" (SELECT COUNT(*) FROM (SELECT 1 AS k FROM "+InboxHeldTable+" GROUP BY consumer_name, aggregate_id HAVING MIN(held_at) < ?) g),"+
		" (SELECT "+o.d.timeText("MIN(held_at)")+" FROM "+InboxHeldTable+")",
		o.d.TimeArg(cutoff))
}

// migrationTableLockWait is how long one try of a migration waits for a
// table's lock. DDL on a table another transaction uses (a long read, a
// slow batch of another service's) waits for it, and every statement on the
// table that comes after waits behind the DDL: left unbounded, one long
// transaction stops every service writing the estate's acemq_outbox for as
// long as it runs. A try gives up after this wait, lets the queue behind it
// through, and tries again (retryTableLocks).
const migrationTableLockWait = time.Second

// retryTableLocks runs try again while it fails with a lock wait cut short
// (lockTimedOut), backing off up to a second, until deadline (a Migrate's
// start plus migrationLockTimeout); then it gives up with an error that
// says so.
func retryTableLocks(ctx context.Context, deadline time.Time, try func() error, lockTimedOut func(error) bool) error {
	for wait := 50 * time.Millisecond; ; wait = min(2*wait, time.Second) {
		err := try()
		if err == nil || !lockTimedOut(err) {
			return err
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("a table stayed locked by another transaction for %ds; each try waited %v so that other statements on it were not queued behind the migration, and nothing of the try was kept: %w",
				migrationLockTimeout, migrationTableLockWait, err)
		}
		select {
		case <-ctx.Done():
			return errors.Join(err, ctx.Err())
		case <-time.After(wait):
		}
	}
}
