// Package sqldialect holds every SQL statement of watermill-outbox, one file
// per database (postgres.go, mysql.go, sqlite.go) and one for the statements
// all three share (shared.go). DDL lives in the sqlschema package.
//
// Every operation returns its text and its arguments together, as a Query,
// so that an argument list cannot drift from the placeholders it fills. The
// rest of the module asks a Dialect what the database can do (Listens,
// Leases, PreparesRelay, …) rather than comparing dialects.
package sqldialect

import (
	"context"
	"database/sql"
	"fmt"
	"strconv"
	"strings"
	"time"
)

// Query is one statement and the arguments of its placeholders.
type Query struct {
	SQL  string
	Args []any
}

// Result is the part of a statement's result every transaction type gives
// (database/sql's, and watermill-sql's, which has no LastInsertId).
type Result interface {
	RowsAffected() (int64, error)
}

// Execer is the part of *sql.Conn and *sql.Tx the migrator uses.
type Execer interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
	QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error)
}

// Dialect is the SQL of one database: [Postgres], [MySQL] (which also serves
// MariaDB) or [SQLite]. It is sealed: the unexported methods are the
// statements that differ between databases, each written in its dialect's
// file.
type Dialect interface {
	// Name is "postgres", "mysql" or "sqlite", the folder of the dialect's
	// migrations in sqlschema.
	Name() string
	// DriverName is a database/sql driver name of the dialect that sqlx
	// knows the bind style of.
	DriverName() string
	// TimeArg turns a time into the argument the driver stores in UTC with
	// microsecond precision, in time order, whatever the time's zone, the
	// process's TZ or the column's type (with or without a time zone).
	TimeArg(t time.Time) any
	// Listens: the database can wake the relay at commit (LISTEN/NOTIFY).
	Listens() bool
	// WatchesFile: a commit by any process writes a file whose writes the
	// relay can be told of (SQLite's write-ahead log).
	WatchesFile() bool
	// Leases: claims are leases in locked_by/locked_until, committed before
	// publishing, rather than row locks held by an open transaction.
	Leases() bool
	// LocksPassedOver: a claim keeps the rows it scanned and did not take
	// locked until its transaction ends (InnoDB, through the pending
	// index), so other claims skip them meanwhile.
	LocksPassedOver() bool
	// GapLocks: a write over a range of an index under the server's
	// default isolation (REPEATABLE READ) locks the gaps in it, where other
	// transactions insert (InnoDB): the library's own range writes run
	// under READ COMMITTED there, so that the services' inserts neither
	// wait for them nor deadlock with them. So does a write of one key
	// that finds no row: it locks the gap where the row would be, until
	// the transaction ends.
	GapLocks() bool
	// PadsKeys: the outbox's key columns ignore trailing spaces in
	// comparisons (MySQL's _bin collations are PAD SPACE), so "k" and "k "
	// would share one key's sequence numbers.
	PadsKeys() bool
	// TextKeys: the ordered inbox's key columns are text, which holds
	// valid UTF-8 without NUL only (PostgreSQL); elsewhere they hold any
	// bytes (MySQL's varbinary since 0009, SQLite's TEXT).
	TextKeys() bool
	// BlobIDs: an outbox id may be stored as a BLOB rather than text (a
	// column of SQLite takes any storage class, and another library may
	// write a UUID's raw bytes), and no text equals it there.
	BlobIDs() bool
	// EndsTransaction reports whether err, a statement's, may have ended
	// the transaction it ran in: what the statement changed before it is
	// gone, and a statement sent after it would run outside it, committed
	// on its own (MySQL's deadlock, SQLite's automatic rollbacks). A
	// PostgreSQL error aborts the transaction, and every later statement
	// fails.
	EndsTransaction(err error) bool
	// TimeoutEnds is, for an error EndsTransaction cannot tell alone, the
	// query whose one integer answer, 1, says the error ended the
	// transaction: MySQL's lock wait timeout (1205) rolls back only its
	// statement unless innodb_rollback_on_timeout is on.
	TimeoutEnds(err error) (Query, bool)
	// AsksByBegin: whether an error ended the transaction is asked with a
	// BEGIN, where no error alone tells (SQLite: a write interrupted by its
	// context ending rolls the transaction back, a context that ended
	// before the statement does not, and the errors EndsTransaction lists
	// may or may not). BEGIN fails inside a transaction (BeginRefused);
	// outside one it starts one, to be rolled back at once.
	AsksByBegin() bool
	// SilentRollbacks: an error that rolls the transaction back (a
	// deadlock) leaves the connection outside it, each later statement
	// committed on its own, and a COMMIT then succeeds, committing nothing
	// (MySQL). Elsewhere the COMMIT fails (PostgreSQL's aborted transaction,
	// SQLite's "no transaction is active").
	SilentRollbacks() bool
	// CommitRolledBack reports whether err, a commit's, says the database
	// rolled the transaction back because a statement in it had failed
	// (PostgreSQL; pgx and lib/pq each say it their way).
	CommitRolledBack(err error) bool
	// Conflict reports whether err is the database's refusal of a
	// transaction that ran at the same time as another one on the same
	// rows (a serialization failure, a deadlock), rolled back whole: run
	// again, it may well succeed.
	Conflict(err error) bool
	// ConnLost reports whether err says the database dropped the
	// connection or did not answer on it (a backend terminated, a
	// connection killed, a server shutting down): the database's trouble,
	// not the statement's. Only the driver's and the server's own errors
	// count, never a bare network error, which a handler's call elsewhere
	// may return.
	ConnLost(err error) bool
	// CannotHold: err, a read's that compared a text column with a
	// value, says the column cannot hold that value (a character its
	// character set or the database's encoding lacks): no row holds it.
	CannotHold(err error) bool
	// MissingTable: err says a table is not there: the library's tables
	// were not migrated, or not made where a configuration names others.
	MissingTable(err error) bool
	// MissingColumn: err says a column is not there (a table another
	// library made without one).
	MissingColumn(err error) bool
	// PreparesRelay: the relay prepares its claims and the mark of a full
	// batch once rather than have the driver prepare them for every batch.
	PreparesRelay() bool
	// WithMigrationLock runs fn while no other process migrates the same
	// database, on one connection.
	WithMigrationLock(ctx context.Context, conn *sql.Conn, fn func(Execer) error) error

	// fromDriver is the instant of a time.Time the driver scanned from a
	// timestamp column (see Time).
	fromDriver(t time.Time) time.Time
	quoteIdent(part string) string
	rebind(query string) string
	// inline writes a statement's arguments into its text (see Inline).
	inline(q Query) (Query, bool)
	// insertOutbox inserts rows rows of the n columns cols, skipping ids
	// already present.
	insertOutbox(table, cols string, n, rows int) string
	// insertedAll reports whether an insert that skips rows whose unique
	// key is taken (insertOutbox, InsertNumbered's insert, insertProcessed)
	// inserted all n of its rows, from its result.
	insertedAll(res Result, n int) (bool, error)
	// raiseSeqs raises each key's counter by N (creating it at N), in the
	// order of keys, holding the rows' locks: one statement, all or nothing.
	raiseSeqs(sequences string, keys []KeyCount) Query
	// insertNumbered is InsertNumbered's statements: the folded one, or
	// raiseSeqs and then the insert.
	insertNumbered(o *Outbox, rows []Row, keys []KeyCount) []Query
	// claim claims p.Limit rows of table that meet where (filled by
	// whereArgs), in created_at, id order.
	claim(table string, p ClaimParams, where string, whereArgs []any) Query
	// keyHead is the claim's condition that a keyed row of table (alias
	// in the claim) is at the head of its key: see keyHeadNotExists.
	keyHead(table, alias string, p ClaimParams) string
	// notOurs is the condition that the row of alias is not one of
	// ClaimParams.InFlight, given as one argument (inFlightArg).
	notOurs(alias string) string
	// windowClaim is claim, windowed (see window.go).
	windowClaim(o *Outbox, p ClaimParams, where string, whereArgs []any) Query
	// windows reports whether the dialect's claims are windowed.
	windows() bool
	// pointsInIndex reports whether a claim of points (ClaimParams.Points)
	// finds them in the pending index (see Outbox.atPoints), rather than
	// by their ids.
	pointsInIndex() bool
	// latest is a value that sorts after every created_at.
	latest() string
	claimSetup() string
	// busyTimeout is the setting that says how long a connection waits
	// for another connection's write lock, "" where the server queues
	// writers itself.
	busyTimeout() string
	pendingIndex() string
	// createdAtPrecision looks up the fractional digits created_at keeps,
	// "" where a column keeps what it is sent (SQLite). Arguments: the
	// table's schema (or NULL for the current one), its name.
	createdAtPrecision() string
	// keyIndex looks up the index of a key's pending rows that keyHead
	// names, "" if the dialect's claims name none (see pendingIndex).
	keyIndex() string
	// zonedTimes looks up which time columns the database converts to the
	// session's time zone, and the session's offset (see
	// Outbox.ZonedTimes); idType the id column's type (see
	// Outbox.IDType). "" where the dialect has neither. Arguments: the
	// table's schema (or NULL for the current one), its name.
	zonedTimes() string
	idType() string
	// purgePublished deletes at most ? rows of table that meet before (a
	// timeCmp of published_at) and are published, oldest first. Arguments:
	// before's, then the limit.
	purgePublished(table, before string) string
	// timeCmp compares the timestamp column col with t: op is "<" or ">=".
	// It returns the condition and its arguments.
	timeCmp(col, op string, t time.Time) (string, []any)
	// instantCmp is timeCmp for a column no index serves (locked_until):
	// exact for any way a library writes a time, whatever it costs a row;
	// a value that is no time compares as earlier than any t.
	instantCmp(col, op string, t time.Time) (string, []any)
	// bytes is the text column col as a value that equals an argument
	// only if their bytes do: AMQP routing keys and exchange names are
	// case-sensitive, whatever collation the table was made with.
	bytes(col string) string
	// keepCreatedAt is what an UPDATE of the outbox's rows sets first to
	// leave created_at as it is (see Outbox.update): "" where no column
	// updates itself.
	keepCreatedAt() string
	// text is the text column col as a select list reads it: its value
	// without the padding a fixed-width column (PostgreSQL's character(n),
	// which another library may make) adds, as it was written.
	text(col string) string
	// currentRead ends a SELECT that must see the rows committed since the
	// transaction's snapshot, as its writes do: "" where a statement of
	// the default isolation reads them anyway.
	currentRead() string
	// timeOf is col as a value that orders as time does (for MIN).
	timeOf(col string) string
	// timeText is expr, a time a select list reads, as the driver should
	// read it: as text on MySQL (see mysql's).
	timeText(expr string) string
	// stored is col as a select list reads it back as stored, to be
	// passed back as an argument that compares as the column orders.
	stored(col string) string
	insertProcessed(table string) string
	// purgeProcessed deletes at most ? inbox rows processed before, by the
	// condition before (timeCmp of processed_at), oldest first.
	purgeProcessed(table, before string) string
	// The ordered inbox's statements that differ: insert-if-absent (the
	// dialect's ON CONFLICT DO NOTHING or INSERT IGNORE) and the lock of a
	// key's row.
	insertInboxSequence() string
	insertInboxHeld() string
	lockInboxSequence() string
	// applyInOrder is OrderedInbox.Apply: how few statements can move the
	// key and record the dedupe key, and how each tells that it did,
	// differs.
	applyInOrder(in *Inbox, m InOrder) []ApplyStep
	createMigrationsTable() string
	insertMigration() string
}

// The dialects.
var (
	Postgres Dialect = postgres{}
	MySQL    Dialect = mysql{}
	SQLite   Dialect = sqlite{}
)

// ForDriver returns the dialect of a database/sql driver name, as *sqlx.Tx
// and *sqlx.DB report it: "pgx", "pgx/v5", "postgres" (lib/pq), "mysql",
// "sqlite3".
func ForDriver(driverName string) (Dialect, bool) {
	switch driverName {
	case "pgx", "pgx/v5", "postgres":
		return Postgres, true
	case "mysql":
		return MySQL, true
	case "sqlite3":
		return SQLite, true
	}
	return nil, false
}

// QuoteTable validates a table name, "name" or "schema.name", each part an
// SQL identifier of letters, digits and underscores, and returns it quoted
// for d. It is the only way a configurable name reaches SQL text.
func QuoteTable(d Dialect, name string) (string, error) {
	parts := strings.Split(name, ".")
	if len(parts) > 2 {
		return "", fmt.Errorf("%q has more than one dot; want table or schema.table", name)
	}
	quoted := make([]string, len(parts))
	for i, p := range parts {
		if err := validIdent(p); err != nil {
			return "", fmt.Errorf("%q: %w", name, err)
		}
		quoted[i] = d.quoteIdent(p)
	}
	return strings.Join(quoted, "."), nil
}

// ValidTable reports whether name can be a table of this library, "name" or
// "schema.name" of letters, digits and underscores; the error says why not.
func ValidTable(name string) error {
	_, err := QuoteTable(Postgres, name)
	return err
}

func validIdent(s string) error {
	if s == "" {
		return fmt.Errorf("empty identifier")
	}
	if len(s) > 63 {
		return fmt.Errorf("identifier longer than 63 characters")
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case c == '_', 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z':
		case '0' <= c && c <= '9' && i > 0:
		default:
			return fmt.Errorf("identifier may hold only letters, digits and underscores, not starting with a digit")
		}
	}
	return nil
}

// timeLayout is the UTC text form of a timestamp for MySQL and SQLite:
// microseconds, fixed width, so that text order is time order.
const timeLayout = "2006-01-02 15:04:05.000000"

// Time reads a timestamp column of a dialect's table as UTC, however the
// driver delivers it. Every time this library writes is UTC (TimeArg), and
// so is every time the other AceMQ libraries write, into columns with a time
// zone or without one (Rails: timestamp without time zone, datetime(6)). A
// time.Time the driver returns is taken by the dialect's rule (fromDriver);
// text (MySQL without parseTime, SQLite) is UTC unless it names its zone.
// NULL reads as the zero time.
//
// A value that is no time (PostgreSQL's infinity, text nobody can parse)
// reads as the zero time too, and Err says why: the operator's questions
// (stats, stuck) must still answer about a table that holds a row another
// library wrote badly. Make one with NewTime: the rule is the dialect's, so
// a Time without one refuses to read.
type Time struct {
	T   time.Time
	Err error
	d   Dialect
}

// NewTime returns a Time that reads a timestamp column of d.
func NewTime(d Dialect) *Time { return &Time{d: d} }

// Scan implements sql.Scanner.
func (ts *Time) Scan(v any) error {
	if ts.d == nil {
		return fmt.Errorf("outbox: sqldialect.Time has no dialect; make it with NewTime")
	}
	ts.T, ts.Err = readTime(ts.d, v)
	return nil
}

// readTime turns what the driver scanned from one of d's timestamp columns
// into a UTC time; NULL is the zero time.
func readTime(d Dialect, v any) (time.Time, error) {
	switch x := v.(type) {
	case nil:
		return time.Time{}, nil
	case time.Time:
		return d.fromDriver(x), nil
	case []byte:
		return parseTime(string(x))
	case string:
		return parseTime(x)
	case int64:
		// SQLite hands back a number another library stored (Java's
		// sqlite-jdbc writes Unix milliseconds) raw where the column's
		// type is lost (an aggregate): read as the driver reads it through
		// the column: milliseconds when it has 13 digits or more, else seconds.
		if x > 1e12 || x < -1e12 {
			return time.UnixMilli(x).UTC(), nil
		}
		return time.Unix(x, 0).UTC(), nil
	}
	return time.Time{}, fmt.Errorf("cannot read a %T as a timestamp", v)
}

// parseTime reads a timestamp written as text, UTC unless it names its zone.
func parseTime(s string) (time.Time, error) {
	for _, layout := range []string{timeLayout, "2006-01-02 15:04:05.999999999", "2006-01-02 15:04:05", time.RFC3339Nano} {
		if t, err := time.Parse(layout, s); err == nil {
			return t.UTC(), nil
		}
	}
	return time.Time{}, fmt.Errorf("cannot read %.40q as a timestamp", s)
}

// instant is the fromDriver rule of drivers that return the instant the
// column holds: a zone the driver attached changes nothing.
func instant(t time.Time) time.Time { return t.UTC() }

// wallClock is the fromDriver rule of a column without a time zone that a
// driver returns in a zone of its choosing: the stored wall clock is UTC,
// and the zone is dropped.
func wallClock(t time.Time) time.Time {
	y, mo, d := t.Date()
	h, mi, s := t.Clock()
	return time.Date(y, mo, d, h, mi, s, t.Nanosecond(), time.UTC)
}

// placeholders returns "?, ?, …" for n arguments.
func placeholders(n int) string {
	if n <= 0 {
		return ""
	}
	return strings.Repeat("?, ", n-1) + "?"
}

// valuesList writes "(p1, p2, …), (…)" for rows rows of cols columns, with
// placeholder(n) giving the n-th (1-based) placeholder.
func valuesList(b *strings.Builder, rows, cols int, placeholder func(n int) string) {
	n := 1
	for r := 0; r < rows; r++ {
		if r > 0 {
			b.WriteString(", ")
		}
		b.WriteByte('(')
		for c := 0; c < cols; c++ {
			if c > 0 {
				b.WriteString(", ")
			}
			b.WriteString(placeholder(n))
			n++
		}
		b.WriteByte(')')
	}
}

func questionMark(int) string { return "?" }

func dollar(n int) string { return "$" + strconv.Itoa(n) }

// rebindDollar turns "?" placeholders into PostgreSQL's $1, $2, ….
func rebindDollar(q string) string {
	var b strings.Builder
	b.Grow(len(q) + 16)
	n := 0
	for i := 0; i < len(q); i++ {
		if q[i] == '?' {
			n++
			b.WriteByte('$')
			b.WriteString(strconv.Itoa(n))
			continue
		}
		b.WriteByte(q[i])
	}
	return b.String()
}

// stringArgs appends ids to args.
func stringArgs(args []any, ids []string) []any {
	for _, id := range ids {
		args = append(args, id)
	}
	return args
}
