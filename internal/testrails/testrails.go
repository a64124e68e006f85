// Package testrails gives tests the acemq_outbox of the Rails AceMQ library
// (the design's reference seed 000): the table as its migration makes it on
// each database, and rows as its ActiveRecordOutboxStore writes them, times
// in UTC into columns without a time zone. The tests of sharing the table
// with other libraries start from it.
package testrails

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/acemq/watermill-outbox/internal/testdb"
)

// columns are those of the Rails migration, in its order:
//
//	create_table :acemq_outbox, id: :string, limit: 64 do |t|
//	  t.string :exchange_name, null: false, limit: 255   … (see seed 000)
//	add_index :acemq_outbox, %i[published_at created_at], name: "acemq_outbox_pending"
var columns = []struct {
	name, kind string // kind: string(n), text, datetime, integer
	notNull    bool
}{
	{"id", "string(64)", true},
	{"exchange_name", "string(255)", true},
	{"routing_key", "string(255)", true},
	{"body", "text", true},
	{"body_encoding", "string(16)", true},
	{"content_type", "string(255)", true},
	{"headers", "text", true},
	{"created_at", "datetime", true},
	{"published_at", "datetime", false},
	{"attempts", "integer", true},
	{"last_error", "string(1000)", false},
	{"locked_by", "string(64)", false},
	{"locked_until", "datetime", false},
}

// sqlType is the type Rails 7.1 gives a column kind on a database:
// t.datetime is timestamp(6), without time zone, on PostgreSQL.
func sqlType(dbKind, kind string) string {
	if n, ok := strings.CutPrefix(kind, "string"); ok {
		if dbKind == testdb.Postgres {
			return "character varying" + n
		}
		return "varchar" + n
	}
	switch {
	case kind == "datetime" && dbKind == testdb.Postgres:
		return "timestamp(6)"
	case kind == "datetime":
		return "datetime(6)"
	case kind == "integer" && dbKind == testdb.MySQL:
		return "int"
	}
	return kind
}

// CreateTable makes acemq_outbox in db as the Rails migration does: no
// processed_at, no defaults but attempts', no trigger, and the index
// acemq_outbox_pending on (published_at, created_at). The columns named in
// nullable lose their NOT NULL, as in a table somebody made by hand.
func CreateTable(t testing.TB, db *testdb.DB, nullable ...string) {
	t.Helper()
	q := `"`
	if db.Kind == testdb.MySQL {
		q = "`"
	}
	defs := make([]string, len(columns))
	for i, c := range columns {
		def := q + c.name + q + " " + sqlType(db.Kind, c.kind)
		if c.name == "attempts" {
			def += " DEFAULT 0"
		}
		if c.notNull && !contains(nullable, c.name) {
			def += " NOT NULL"
		}
		if c.name == "id" {
			def += " PRIMARY KEY"
		}
		defs[i] = def
	}
	table := "CREATE TABLE " + q + "acemq_outbox" + q + " (" + strings.Join(defs, ", ") + ")"
	if db.Kind == testdb.MySQL {
		table += " DEFAULT CHARSET=utf8mb4" // as `rails db:create` makes the database
	}
	index := "CREATE INDEX " + q + "acemq_outbox_pending" + q + " ON " + q + "acemq_outbox" + q +
		" (" + q + "published_at" + q + ", " + q + "created_at" + q + ")"
	for _, stmt := range []string{table, index} {
		if _, err := db.Exec(stmt); err != nil {
			t.Fatalf("testrails: %s: %v", stmt, err)
		}
	}
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

// Row is what ActiveRecordOutboxStore#add writes, and what its relay
// writes later: published_at, the lease, a failure.
type Row struct {
	ID, Exchange, RoutingKey string
	Body                     string
	Headers                  string // JSON; default {}
	CreatedAt                time.Time
	PublishedAt              time.Time // zero: NULL
	Attempts                 int
	LastError                string    // "": NULL
	LockedBy                 string    // "": NULL
	LockedUntil              time.Time // zero: NULL
}

// Insert writes r as the Rails store does: every time in UTC, as text
// without a zone (ActiveRecord sends it so to every database), content
// type application/json, body utf-8.
func Insert(t testing.TB, db *testdb.DB, r Row) {
	t.Helper()
	if r.Headers == "" {
		r.Headers = "{}"
	}
	_, err := db.Exec(db.Rebind("INSERT INTO acemq_outbox (id, exchange_name, routing_key, body, body_encoding, content_type, headers,"+
		" created_at, published_at, attempts, last_error, locked_by, locked_until) VALUES (?, ?, ?, ?, 'utf-8', 'application/json', ?, ?, ?, ?, ?, ?, ?)"),
		r.ID, r.Exchange, r.RoutingKey, r.Body, r.Headers, Time(r.CreatedAt), Time(r.PublishedAt), r.Attempts, null(r.LastError), null(r.LockedBy), Time(r.LockedUntil))
	if err != nil {
		t.Fatalf("testrails: insert %s: %v", r.ID, err)
	}
}

// Time is t as ActiveRecord sends it: UTC text with microseconds, no zone;
// the zero time is NULL.
func Time(t time.Time) any {
	if t.IsZero() {
		return nil
	}
	return t.UTC().Format("2006-01-02 15:04:05.000000")
}

func null(s string) any {
	if s == "" {
		return nil
	}
	return s
}

// UTCSkew is the SQL expression of how many seconds the time in column col
// is behind the database's own clock, a column without a time zone read as
// UTC, by the database itself (no driver, no Go): near 0 for a time just
// written in UTC, hours off for one written as local time.
func UTCSkew(kind, col string) string {
	switch kind {
	case testdb.Postgres:
		// The epoch of a timestamp (without time zone) is that of its wall
		// clock read as UTC; of a timestamptz, its instant's.
		return fmt.Sprintf("EXTRACT(EPOCH FROM now()) - EXTRACT(EPOCH FROM %s)", col)
	case testdb.MySQL:
		return fmt.Sprintf("TIMESTAMPDIFF(MICROSECOND, %s, UTC_TIMESTAMP(6)) / 1e6", col)
	}
	return fmt.Sprintf("(julianday('now') - julianday(%s)) * 86400", col)
}
