package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testamqp"
	"github.com/acemq/watermill-outbox/internal/testdb"
	"github.com/acemq/watermill-outbox/sqlschema"
)

// goose and golang-migrate run only the plain statements of the files, and
// skip the "+acemq" steps. On a fresh SQLite database that alone makes a
// schema the whole library works on: keyed and unkeyed messages are
// published, a relay claims and sends them (each key in order), and an
// ordered inbox applies them in order. 0001 made the table without
// aggregate_id and seq, which only 0005's steps added: the keyed publish
// failed, and every claim with "no such column: c.aggregate_id", so
// nothing was ever sent.
func TestMigrations_SQLiteToolsOnly_FreshDatabase_RelaySendsKeyedAndUnkeyedInboxAppliesInOrder(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, testdb.SQLite)
	if err := applyPlain(db, sqliteMigrations(t)); err != nil {
		t.Fatal(err)
	}
	b := testamqp.New(t)
	queue := b.Queue("orders")
	pub := outbox.TxPublisherConfig{Exchange: b.Exchange}
	first, unkeyed, second := keyed("order-1"), keyed(""), keyed("order-1")
	publishInTx(t, db, "orders", []*message.Message{first, unkeyed}, pub)
	publishInTx(t, db, "orders", []*message.Message{second}, pub)

	f := newForwarder(t, db, outbox.ForwarderConfig{})
	if n := sweepAll(t, f); n != 3 {
		t.Fatalf("the relay sent %d, want 3", n)
	}
	got := b.Drain(queue, 3, 5*time.Second)
	var ids []string
	for _, d := range got {
		ids = append(ids, d.MessageId)
	}
	if !slices.Contains(ids, unkeyed.UUID) || len(ids) != 3 {
		t.Fatalf("queue received %v, want the 3 published", ids)
	}
	keyedIDs := slices.DeleteFunc(slices.Clone(ids), func(id string) bool { return id == unkeyed.UUID })
	if !reflect.DeepEqual(keyedIDs, []string{first.UUID, second.UUID}) {
		t.Errorf("order-1 arrived as %v, want %v: in its order", keyedIDs, []string{first.UUID, second.UUID})
	}

	// The consumer's side, on the same database: seq 2 first is held, and
	// applied after 1.
	createEffects(t, db)
	var l applyLog
	h := orderedInbox(t, db, outbox.InboxConfig{}).Middleware(l.handler(t, db))
	for _, i := range []int{2, 1} {
		d := got[slices.Index(ids, []string{first.UUID, second.UUID}[i-1])]
		msg, err := outbox.AMQPMarshaler{}.Unmarshal(d)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := h(msg); err != nil {
			t.Fatalf("delivery of order-1 seq %d: %v", i, err)
		}
	}
	if applied := l.of("order-1"); !reflect.DeepEqual(applied, []int{1, 2}) {
		t.Errorf("the ordered inbox applied %v, want [1 2]", applied)
	}
}

// A SQLite database that Migrate of an earlier release brought to any
// version, or that a migration tool did and Migrate takes over, ends with
// the schema a fresh database gets, from Migrate or from a tool: the
// columns of 0005 in the same place, the same indexes. The earlier files
// are those testdata/sqlite-earlier holds, the rest as they are now.
func TestMigrate_SQLiteMigratedByAnEarlierRelease_EndsWithTheSchemaOfAFreshDatabase(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	want := func() string {
		db := testdb.New(t, testdb.SQLite)
		migrate(t, db)
		return sqliteSchema(t, db)
	}()
	tool := testdb.New(t, testdb.SQLite)
	if err := applyPlain(tool, sqliteMigrations(t)); err != nil {
		t.Fatal(err)
	}
	if got := sqliteSchema(t, tool); got != want {
		t.Errorf("fresh, by a tool:\n%s\nwant, as Migrate makes it:\n%s", got, want)
	}
	earlier := earlierSQLiteMigrations(t)
	// The earlier release's files went up to 0012. A table a tool brought
	// there without 0005's steps has no seq, and 0013, as 0007 before it
	// on such a table, fails naming the column (see the file).
	for k := 1; k <= min(len(earlier), 12); k++ {
		through := earlier[:k]
		t.Run(fmt.Sprintf("Migrate through %04d", k), func(t *testing.T) {
			db := testdb.New(t, testdb.SQLite)
			migrateAsEarlier(t, db, through)
			if err := outbox.Migrate(ctx, db.DB.DB, outbox.SQLite); err != nil {
				t.Fatal(err)
			}
			assertMigratedOnce(t, db)
			if got := sqliteSchema(t, db); got != want {
				t.Errorf("upgraded:\n%s\nwant:\n%s", got, want)
			}
		})
		t.Run(fmt.Sprintf("tool through %04d, then Migrate", k), func(t *testing.T) {
			db := testdb.New(t, testdb.SQLite)
			if err := applyPlain(db, through); err != nil {
				t.Fatal(err)
			}
			if err := outbox.Migrate(ctx, db.DB.DB, outbox.SQLite); err != nil {
				t.Fatal(err)
			}
			if got := sqliteSchema(t, db); got != want {
				t.Errorf("upgraded:\n%s\nwant:\n%s", got, want)
			}
		})
	}
}

// A tool that brought a SQLite database to a version before 0007 with the
// earlier files, which left out 0005's columns, stops at the first file
// whose index needs them, naming aggregate_id, rather than leave a table
// no relay can claim from. Before 0005, the Run statements the table
// lacks, run by hand as the README says, are all the tool's next run
// needs; past it, 0005's index is missing too, and Migrate, run once,
// adds what is missing.
func TestMigrations_SQLiteToolOnAnEarlierToolsTable_StopsNamingTheColumnThenUpToDate(t *testing.T) {
	t.Parallel()
	want := func() string {
		db := testdb.New(t, testdb.SQLite)
		migrate(t, db)
		return sqliteSchema(t, db)
	}()
	earlier, now := earlierSQLiteMigrations(t), sqliteMigrations(t)
	for k := 1; k < 7; k++ {
		t.Run(fmt.Sprintf("through %04d", k), func(t *testing.T) {
			db := testdb.New(t, testdb.SQLite)
			if err := applyPlain(db, earlier[:k]); err != nil {
				t.Fatal(err)
			}
			err := applyPlain(db, now[k:])
			if err == nil || !strings.Contains(err.Error(), "aggregate_id") {
				t.Fatalf("the tool's next run: %v, want a failure naming aggregate_id", err)
			}
			if k < 5 {
				runByHand(t, db, now)
				if err := applyPlain(db, now[k:]); err != nil {
					t.Fatalf("after the Run steps by hand: %v", err)
				}
			} else if err := outbox.Migrate(context.Background(), db.DB.DB, outbox.SQLite); err != nil {
				t.Fatal(err)
			}
			if got := sqliteSchema(t, db); got != want {
				t.Errorf("got:\n%s\nwant:\n%s", got, want)
			}
		})
	}
}

// sqliteMigrations are the SQLite files of sqlschema.
func sqliteMigrations(t testing.TB) []sqlschema.Migration {
	t.Helper()
	migs, err := sqlschema.Migrations("sqlite")
	if err != nil {
		t.Fatal(err)
	}
	return migs
}

// earlierSQLiteMigrations are the SQLite files as the release before 0001
// made aggregate_id and seq had them: those testdata/sqlite-earlier holds
// in place of the current ones.
func earlierSQLiteMigrations(t testing.TB) []sqlschema.Migration {
	t.Helper()
	migs := sqliteMigrations(t)
	files, err := filepath.Glob("testdata/sqlite-earlier/*.up.sql")
	if err != nil || len(files) == 0 {
		t.Fatalf("testdata/sqlite-earlier: %d files, %v", len(files), err)
	}
	for _, file := range files {
		up, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		name := strings.TrimSuffix(filepath.Base(file), ".up.sql")
		i := slices.IndexFunc(migs, func(m sqlschema.Migration) bool { return m.Name == name })
		if i < 0 {
			t.Fatalf("%s: no migration %s now", file, name)
		}
		steps, err := sqlschema.Steps(string(up))
		if err != nil {
			t.Fatalf("%s: %v", file, err)
		}
		migs[i].Up, migs[i].UpSteps = string(up), steps
	}
	return migs
}

// applyPlain runs the plain statements of each up file in order, as goose
// and golang-migrate do, and stops at the first that fails.
func applyPlain(db *testdb.DB, migs []sqlschema.Migration) error {
	for _, m := range migs {
		for _, stmt := range sqlschema.Statements(m.Up) {
			if _, err := db.Exec(stmt); err != nil {
				return fmt.Errorf("%s: %w", m.Name, err)
			}
		}
	}
	return nil
}

// migrateAsEarlier applies migs as Migrate does, each file's steps under
// their guards and then its record: Migrate of the release that had them.
func migrateAsEarlier(t testing.TB, db *testdb.DB, migs []sqlschema.Migration) {
	t.Helper()
	if _, err := db.Exec(`CREATE TABLE acemq_schema_migrations (
    version    INTEGER  NOT NULL PRIMARY KEY,
    name       TEXT     NOT NULL,
    applied_at DATETIME NOT NULL DEFAULT (strftime('%Y-%m-%d %H:%M:%f000', 'now'))
)`); err != nil {
		t.Fatal(err)
	}
	for _, m := range migs {
		for _, step := range m.UpSteps {
			if step.Unless != "" && guardHolds(t, db, step.Unless) {
				continue
			}
			if _, err := db.Exec(step.Run); err != nil {
				t.Fatalf("%s: %v", m.Name, err)
			}
		}
		if _, err := db.Exec("INSERT INTO acemq_schema_migrations (version, name) VALUES (?, ?)", m.Version, m.Name); err != nil {
			t.Fatal(err)
		}
	}
}

// runByHand runs what the README tells a user of a migration tool to run
// once on an acemq_outbox the files did not create: every "+acemq" Run
// statement the table needs, those whose Unless finds nothing.
func runByHand(t testing.TB, db *testdb.DB, migs []sqlschema.Migration) {
	t.Helper()
	for _, m := range migs {
		for _, step := range m.UpSteps {
			if step.Unless == "" || guardHolds(t, db, step.Unless) {
				continue
			}
			if _, err := db.Exec(step.Run); err != nil {
				t.Fatalf("%s, by hand: %s: %v", m.Name, step.Run, err)
			}
		}
	}
}

// guardHolds reports whether an Unless query returns a row.
func guardHolds(t testing.TB, db *testdb.DB, query string) bool {
	t.Helper()
	rows, err := db.Query(query)
	if err != nil {
		t.Fatalf("%s: %v", query, err)
	}
	found := rows.Next()
	if err := errors.Join(rows.Err(), rows.Close()); err != nil {
		t.Fatal(err)
	}
	return found
}

// sqliteSchema describes what the migrations made in an SQLite database,
// in an order of its own: each table's columns as pragma table_xinfo
// gives them (the text of a table that ALTER TABLE added to differs from
// one made whole), and each index's statement, its spacing collapsed. The
// migrations' own record, which a tool keeps elsewhere, is left out.
func sqliteSchema(t testing.TB, db *testdb.DB) string {
	t.Helper()
	var objects []struct {
		Type string  `db:"type"`
		Name string  `db:"name"`
		SQL  *string `db:"sql"`
	}
	if err := db.Select(&objects, "SELECT type, name, sql FROM sqlite_master WHERE name NOT GLOB 'sqlite_*' AND name <> 'acemq_schema_migrations' ORDER BY type, name"); err != nil {
		t.Fatal(err)
	}
	var b strings.Builder
	for _, o := range objects {
		fmt.Fprintf(&b, "%s %s", o.Type, o.Name)
		if o.Type != "table" {
			if o.SQL != nil {
				fmt.Fprintf(&b, ": %s", strings.Join(strings.Fields(*o.SQL), " "))
			}
			b.WriteByte('\n')
			continue
		}
		b.WriteString(":\n")
		rows, err := db.Queryx("SELECT cid, name, type, \"notnull\", dflt_value, pk, hidden FROM pragma_table_xinfo(?) ORDER BY cid", o.Name)
		if err != nil {
			t.Fatal(err)
		}
		for rows.Next() {
			cols, err := rows.SliceScan()
			if err != nil {
				t.Fatal(err)
			}
			for i, c := range cols {
				if s, ok := c.([]byte); ok {
					cols[i] = string(s)
				}
			}
			fmt.Fprintf(&b, "  %v\n", cols)
		}
		if err := errors.Join(rows.Err(), rows.Close()); err != nil {
			t.Fatal(err)
		}
	}
	return b.String()
}

// An acemq_outbox another library created as a STRICT table (its times
// TEXT, the only way STRICT allows) is adopted: Migrate adds processed_at
// as TEXT, where the DATETIME of a table 0001 made is refused ("unknown
// datatype") and failed the whole migration, and the table then takes
// keyed and unkeyed messages, which a relay sends, and the marks of the
// inbox. The row the other library wrote stays as it was.
func TestMigrate_SQLiteStrictTableOfAnotherLibrary_AdoptedAndUsable(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, testdb.SQLite)
	if _, err := db.Exec(`CREATE TABLE acemq_outbox (id TEXT PRIMARY KEY, exchange_name TEXT NOT NULL, routing_key TEXT NOT NULL, body TEXT NOT NULL,
		body_encoding TEXT NOT NULL, content_type TEXT NOT NULL, headers TEXT NOT NULL, created_at TEXT NOT NULL, published_at TEXT,
		attempts INTEGER NOT NULL DEFAULT 0, last_error TEXT, locked_by TEXT, locked_until TEXT) STRICT`); err != nil {
		t.Fatal(err)
	}
	b := testamqp.New(t)
	queue := b.Queue("orders")
	insertRaw(t, db, "ruby-1", b.Exchange, "orders", "{}", "utf-8")
	before := snapshot(t, db)
	for i := 0; i < 2; i++ {
		if err := outbox.Migrate(context.Background(), db.DB.DB, outbox.SQLite); err != nil {
			t.Fatalf("migrate #%d: %v", i+1, err)
		}
	}
	assertMigratedOnce(t, db)
	if after := snapshot(t, db); !reflect.DeepEqual(after, before) {
		t.Errorf("rows changed by the migration:\nbefore %v\nafter  %v", before, after)
	}
	var types []string
	if err := db.Select(&types, "SELECT name || ' ' || type FROM pragma_table_info('acemq_outbox') WHERE name IN ('processed_at', 'aggregate_id', 'seq') ORDER BY cid"); err != nil {
		t.Fatal(err)
	}
	if want := []string{"processed_at TEXT", "aggregate_id TEXT", "seq INTEGER"}; !reflect.DeepEqual(types, want) {
		t.Errorf("columns added %v, want %v", types, want)
	}

	msgs := []*message.Message{keyed("order-1"), keyed(""), keyed("order-1")}
	publishInTx(t, db, "orders", msgs, outbox.TxPublisherConfig{Exchange: b.Exchange})
	if n := sweepAll(t, newForwarder(t, db, outbox.ForwarderConfig{})); n != 4 {
		t.Fatalf("the relay sent %d, want 4: the other library's row and the 3 published", n)
	}
	if got := b.Drain(queue, 4, 5*time.Second); len(got) != 4 {
		t.Errorf("queue received %d, want 4", len(got))
	}

	createEffects(t, db)
	var ran atomic.Int32
	h := newInbox(t, db, outbox.InboxConfig{MarkOutboxProcessed: true}).Middleware(writeEffect(t, db, &ran))
	if _, err := h(message.NewMessage(msgs[1].UUID, []byte("x"))); err != nil {
		t.Fatalf("the inbox: %v", err)
	}
	var processed bool
	if err := db.Get(&processed, "SELECT processed_at IS NOT NULL FROM acemq_outbox WHERE id = ?", msgs[1].UUID); err != nil || !processed {
		t.Errorf("processed_at set: %v (%v), want the record marked processed", processed, err)
	}
}
