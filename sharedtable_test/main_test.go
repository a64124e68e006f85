// Package sharedtable_test drives acemq_outbox as the AceMQ libraries of
// other languages share it: a table Rails' migration made, migrated in
// place; rows Ruby wrote beside rows this library wrote; leases of other
// relays; rows nobody can read. The whole package runs in a process whose
// local time zone is far from UTC, which its TestMain sets before any test
// starts, so that every time the library writes, compares or reads must be
// UTC for the tests to pass.
package sharedtable_test

import (
	"bytes"
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"math"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/go-sql-driver/mysql"
	"github.com/jmoiron/sqlx"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/outboxctl"
	"github.com/acemq/watermill-outbox/internal/testdb"
	"github.com/acemq/watermill-outbox/internal/testrails"
	"github.com/acemq/watermill-outbox/internal/testrelay"
)

// farOffset is UTC+13:45 (the Chatham Islands in summer): a local wall
// clock taken for UTC is 13 h 45 min off, which no test's margin absorbs,
// and not a whole number of hours. The zone is named Local, as the process
// zone always is, so that DSNs that name it (MySQL's loc=Local) survive
// a round trip through the driver's own parser.
const farOffset = 13*3600 + 45*60

// TestMain sets the process's zone before any test, and before any
// goroutine that could read time.Local while it is written, without
// relying on the system's tzdata. TZ says the same to C code (SQLite's)
// and to any child process.
func TestMain(m *testing.M) {
	time.Local = time.FixedZone("Local", farOffset)
	if err := os.Setenv("TZ", "<+1345>-13:45"); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	if _, off := time.Now().Zone(); off != farOffset {
		fmt.Fprintf(os.Stderr, "the process zone is %d s from UTC, want %d\n", off, farOffset)
		os.Exit(2)
	}
	os.Exit(m.Run())
}

// conn is a database of one kind as a service in the far zone opens it for
// the library, and the test's own handle on the same database.
type conn struct {
	name string // the subtest's
	db   *testdb.DB
	// lib is what the library is given: on MySQL with loc=Local in the DSN
	// when local is set, so that the driver returns DATETIMEs in the far
	// zone; on SQLite with _loc=auto, likewise.
	lib *sqlx.DB
	dsn string // lib's
	d   outbox.Dialect
}

// eachConn runs fn on every kind of database, and on MySQL both with the
// default loc (UTC) and with loc=Local.
func eachConn(t *testing.T, fn func(t *testing.T, c *conn)) {
	for _, v := range []struct {
		name, kind string
		local      bool
	}{{"postgres", testdb.Postgres, false}, {"mysql", testdb.MySQL, false}, {"mysql-loc-local", testdb.MySQL, true}, {"sqlite-loc-auto", testdb.SQLite, true}} {
		t.Run(v.name, func(t *testing.T) {
			t.Parallel() // each on its own database and exchange; the lease waits overlap
			fn(t, open(t, v.name, v.kind, v.local))
		})
	}
}

func open(t *testing.T, name, kind string, local bool) *conn {
	t.Helper()
	db := testdb.New(t, kind)
	dsn := db.DSN
	switch {
	case local && kind == testdb.MySQL:
		cfg, err := mysql.ParseDSN(dsn)
		if err != nil {
			t.Fatal(err)
		}
		cfg.Loc = time.Local // written loc=Local: the zone's name
		dsn = cfg.FormatDSN()
	case local && kind == testdb.SQLite:
		dsn += "&_loc=auto"
	}
	lib, err := sqlx.Open(db.DriverName(), dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = lib.Close() })
	d := map[string]outbox.Dialect{testdb.Postgres: outbox.Postgres, testdb.MySQL: outbox.MySQL, testdb.SQLite: outbox.SQLite}[kind]
	return &conn{name: name, db: db, lib: lib, dsn: dsn, d: d}
}

// ctl runs outboxctl in this process, on c's database, and returns its
// standard output; it fails the test unless the command exits 0.
func (c *conn) ctl(t *testing.T, args ...string) string {
	t.Helper()
	var stdout, stderr bytes.Buffer
	args = append(args, "--db", c.dsn)
	if code := outboxctl.Run(context.Background(), args, func(string) string { return "" }, &stdout, &stderr); code != 0 {
		t.Fatalf("outboxctl %s: exit %d: %s", strings.Join(args, " "), code, stderr.String())
	}
	return stdout.String()
}

// ctlJSON runs an outboxctl command with --json and decodes what it prints.
func (c *conn) ctlJSON(t *testing.T, v any, args ...string) {
	t.Helper()
	out := c.ctl(t, append(args, "--json")...)
	if err := json.Unmarshal([]byte(out), v); err != nil {
		t.Fatalf("outboxctl %s --json: %v\n%s", args[0], err, out)
	}
}

// forwarder is a relay over c's library handle, publishing to RabbitMQ.
func (c *conn) forwarder(t *testing.T, cfg outbox.ForwarderConfig) *outbox.Forwarder {
	t.Helper()
	return testrelay.New(t, c.lib, cfg)
}

// alteredTable opens a database of kind with acemq_outbox made as the Rails
// store makes it, then changed by alter (another library's column types),
// and migrated.
func alteredTable(t *testing.T, name, kind, alter string) *conn {
	t.Helper()
	c := open(t, name, kind, false)
	testrails.CreateTable(t, c.db)
	if _, err := c.db.Exec(alter); err != nil {
		t.Fatal(err)
	}
	c.migrate(t)
	return c
}

// migrate applies the library's schema with outbox.Migrate.
func (c *conn) migrate(t *testing.T) {
	t.Helper()
	if err := outbox.Migrate(context.Background(), c.lib.DB, c.d); err != nil {
		t.Fatalf("migrate: %v", err)
	}
}

// publish runs fn with a TxPublisher in a transaction of the library's
// connection, which it commits, or rolls back and returns fn's error.
func (c *conn) publish(t *testing.T, fn func(pub *outbox.TxPublisher) error) error {
	t.Helper()
	tx, err := c.lib.Beginx()
	if err != nil {
		t.Fatal(err)
	}
	pub, err := outbox.NewTxPublisher(tx)
	if err != nil {
		t.Fatal(err)
	}
	if err := fn(pub); err != nil {
		_ = tx.Rollback()
		return err
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	return nil
}

// q rebinds a query written with ? placeholders for c's database.
func (c *conn) q(query string) string { return c.db.Rebind(query) }

// state is what the relay did to a row.
type state struct {
	Published bool
	Attempts  int
	LastError string
	LockedBy  string
}

func (c *conn) state(t *testing.T, id string) state {
	t.Helper()
	var (
		s                 state
		lastErr, lockedBy sql.NullString
	)
	err := c.db.QueryRow(c.q("SELECT published_at IS NOT NULL, attempts, last_error, locked_by FROM acemq_outbox WHERE id = ?"), id).
		Scan(&s.Published, &s.Attempts, &lastErr, &lockedBy)
	if err != nil {
		t.Fatalf("row %s: %v", id, err)
	}
	s.LastError, s.LockedBy = lastErr.String, lockedBy.String
	return s
}

// maxSkew bounds how far a time the library just wrote may be from the
// database's clock: the length of a test, not of a time zone.
const maxSkew = 2 * time.Minute

// assertUTCNow checks that column col of row id holds a time written just
// now in UTC, as the database itself reads the column.
func (c *conn) assertUTCNow(t *testing.T, table, col, idCol, id string) {
	t.Helper()
	var skew sql.NullFloat64
	q := c.q("SELECT " + testrails.UTCSkew(c.db.Kind, col) + " FROM " + table + " WHERE " + idCol + " = ?")
	if err := c.db.QueryRow(q, id).Scan(&skew); err != nil {
		t.Fatalf("%s.%s of %s: %v", table, col, id, err)
	}
	if !skew.Valid || math.Abs(skew.Float64) > maxSkew.Seconds() {
		t.Errorf("%s.%s of %s is %.0f s from the database's UTC clock (valid %v), want a UTC time written just now",
			table, col, id, skew.Float64, skew.Valid)
	}
}

// eventually polls cond until it holds, failing the test at the deadline.
func eventually(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", timeout, what)
		}
		time.Sleep(20 * time.Millisecond) // polling a condition, with a deadline
	}
}

// sweepAll sweeps until a sweep publishes nothing, and returns the total.
func sweepAll(t *testing.T, f *outbox.Forwarder) int {
	t.Helper()
	total := 0
	for {
		n, err := f.Sweep(context.Background())
		if err != nil {
			t.Fatalf("sweep: %v", err)
		}
		if total += n; n == 0 {
			return total
		}
	}
}
