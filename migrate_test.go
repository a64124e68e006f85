package outbox_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io/fs"
	"net/url"
	"reflect"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
	"github.com/acemq/watermill-outbox/internal/testrails"
	"github.com/acemq/watermill-outbox/sqlschema"
)

func TestMigrate_Twice_IsANoOp(t *testing.T) {
	t.Parallel()
	testdb.Each(t, func(t *testing.T, db *testdb.DB) {
		d := dialectOf(t, db)
		ctx := context.Background()
		for i := 0; i < 2; i++ {
			if err := outbox.Migrate(ctx, db.DB.DB, d); err != nil {
				t.Fatalf("migrate #%d: %v", i+1, err)
			}
		}
		assertMigratedOnce(t, db)
	})
}

// Several replicas of a service boot at once and each migrates: every one
// succeeds and the schema is applied once.
func TestMigrate_ConcurrentProcesses_AllSucceedSchemaAppliedOnce(t *testing.T) {
	for _, kind := range []string{testdb.Postgres, testdb.MySQL} {
		t.Run(kind, func(t *testing.T) {
			db := testdb.New(t, kind)
			migrateConcurrently(t, db, db.DSN)
		})
	}
}

// The same on PostgreSQL where the role, the database or the DSN makes
// transactions REPEATABLE READ or SERIALIZABLE by default. The migration's
// transaction took its snapshot at pg_advisory_xact_lock, before the wait
// for the lock: a replica that waited did not see the versions the first
// recorded, ran the migrations again, and failed recording them (23505, or
// 40001 under SERIALIZABLE).
func TestMigrate_ConcurrentProcesses_PostgresDefaultIsolationAboveReadCommitted_AllSucceed(t *testing.T) {
	t.Parallel()
	for _, iso := range []string{"repeatable read", "serializable"} {
		t.Run(iso, func(t *testing.T) {
			db := testdb.New(t, testdb.Postgres)
			u, err := url.Parse(db.DSN)
			if err != nil {
				t.Fatal(err)
			}
			q := u.Query()
			q.Set("default_transaction_isolation", iso)
			u.RawQuery = strings.ReplaceAll(q.Encode(), "+", "%20")
			migrateConcurrently(t, db, u.String())
		})
	}
}

// migrateConcurrently runs Migrate from four pools on dsn at once and wants
// every one to succeed and the schema applied once.
func migrateConcurrently(t *testing.T, db *testdb.DB, dsn string) {
	t.Helper()
	for i, err := range migrateAtOnce(t, db.DriverName(), dsn, dialectOf(t, db), 4) {
		if err != nil {
			t.Errorf("replica %d: %v", i, err)
		}
	}
	assertMigratedOnce(t, db)
}

// migrateAtOnce runs Migrate from n pools of its own at once, as n
// processes booting together would, and returns each one's error.
func migrateAtOnce(t *testing.T, driver, dsn string, d outbox.Dialect, n int) []error {
	t.Helper()
	var wg sync.WaitGroup
	errs := make([]error, n)
	start := make(chan struct{})
	for i := range errs {
		pool, err := sqlx.Open(driver, dsn)
		if err != nil {
			t.Fatal(err)
		}
		defer pool.Close()
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			errs[i] = outbox.Migrate(context.Background(), pool.DB, d)
		}()
	}
	close(start)
	wg.Wait()
	return errs
}

// Replicas of a service on one SQLite file, booting at once on a fresh
// database or on an upgrade (versions 8 and 9 to apply), each migrate
// through a DSN that leaves _txlock at the driver's default, deferred:
// every one succeeds. The transaction of an upgrade read first, and a
// replica whose snapshot another's commit had made stale failed at its
// first write with "database is locked" instead of waiting for the lock.
func TestMigrate_SQLiteConcurrentProcesses_DeferredTxLock_AllSucceed(t *testing.T) {
	t.Parallel()
	for _, upgrade := range []bool{false, true} {
		t.Run(map[bool]string{false: "fresh", true: "upgrade"}[upgrade], func(t *testing.T) {
			const replicas, rounds = 4, 10 // one round failed about half its replicas
			for round := 0; round < rounds; round++ {
				dsn := strings.Replace(testdb.SQLiteDSN(t.TempDir()+"/outbox.db"), "_txlock=immediate", "_txlock=deferred", 1)
				if !strings.Contains(dsn, "_txlock=deferred") {
					t.Fatalf("no _txlock=immediate to replace in %s", dsn)
				}
				// The file exists, in WAL mode, before the replicas come: a
				// connection's open switches a new file to WAL (the DSN's
				// _journal_mode), which fails with "database is locked" when
				// another process opens it at that moment. That is the
				// driver's open, before Migrate has a connection.
				if db, err := sqlx.Open("sqlite3", dsn); err != nil {
					t.Fatal(err)
				} else if err := db.Ping(); err != nil {
					t.Fatal(err)
				} else if err := db.Close(); err != nil {
					t.Fatal(err)
				}
				if upgrade {
					db, err := sqlx.Open("sqlite3", dsn)
					if err != nil {
						t.Fatal(err)
					}
					if err := outbox.Migrate(context.Background(), db.DB, outbox.SQLite); err != nil {
						t.Fatal(err)
					}
					if _, err := db.Exec("DELETE FROM acemq_schema_migrations WHERE version >= 8"); err != nil {
						t.Fatal(err)
					}
					if err := db.Close(); err != nil {
						t.Fatal(err)
					}
				}
				for i, err := range migrateAtOnce(t, "sqlite3", dsn, outbox.SQLite, replicas) {
					if err != nil {
						t.Errorf("round %d, replica %d: %v", round, i, err)
					}
				}
				db, err := sqlx.Open("sqlite3", dsn)
				if err != nil {
					t.Fatal(err)
				}
				assertMigratedOnce(t, &testdb.DB{DB: db, Kind: testdb.SQLite, DSN: dsn})
				if err := db.Close(); err != nil {
					t.Fatal(err)
				}
			}
		})
	}
}

// A database migrated by golang-migrate or goose (the same files, no record in
// acemq_schema_migrations) is left as it is by Migrate.
func TestMigrate_AfterExternalTool_Succeeds(t *testing.T) {
	t.Parallel()
	testdb.Each(t, func(t *testing.T, db *testdb.DB) {
		d := dialectOf(t, db)
		migs, err := sqlschema.Migrations(d.Name())
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range migs {
			for _, stmt := range sqlschema.Statements(m.Up) {
				if _, err := db.Exec(stmt); err != nil {
					t.Fatalf("%s: %v", m.Name, err)
				}
			}
		}
		if err := outbox.Migrate(context.Background(), db.DB.DB, d); err != nil {
			t.Fatal(err)
		}
		assertMigratedOnce(t, db)
	})
}

func TestMigrations_DownUndoesUp(t *testing.T) {
	t.Parallel()
	testdb.Each(t, func(t *testing.T, db *testdb.DB) {
		d := dialectOf(t, db)
		migs, err := sqlschema.Migrations(d.Name())
		if err != nil {
			t.Fatal(err)
		}
		if len(migs) < 2 {
			t.Fatalf("%d migrations, want at least 2", len(migs))
		}
		for _, m := range migs {
			for _, stmt := range sqlschema.Statements(m.Up) {
				if _, err := db.Exec(stmt); err != nil {
					t.Fatalf("%s up: %v", m.Name, err)
				}
			}
		}
		for i := len(migs) - 1; i >= 0; i-- {
			for _, stmt := range sqlschema.Statements(migs[i].Down) {
				if _, err := db.Exec(stmt); err != nil {
					t.Fatalf("%s down: %v", migs[i].Name, err)
				}
			}
		}
		for _, table := range []string{"acemq_outbox", "processed_messages"} {
			if _, err := db.Exec("SELECT 1 FROM " + table); err == nil {
				t.Errorf("%s still exists after the down migrations", table)
			}
		}
	})
}

// The down of 0001 drops acemq_outbox, which services in other languages
// share: a `migrate down` run to the bottom (golang-migrate's `down` with
// no count) dropped every service's events not yet sent. It now refuses
// while the table holds a row not published, with the reason in its
// error, and leaves the row; once none is pending it drops the table.
func TestMigrations_DownOf0001_RefusesWhileRowsAreUnpublished(t *testing.T) {
	t.Parallel()
	testdb.Each(t, func(t *testing.T, db *testdb.DB) {
		d := migrate(t, db)
		ids := publishN(t, db, "orders", "orders.created", 2)
		migs, err := sqlschema.Migrations(d.Name())
		if err != nil {
			t.Fatal(err)
		}
		ctx := context.Background()
		conn, err := db.Conn(ctx) // MySQL's check keeps its verdict in a session variable
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		down := func(m sqlschema.Migration) error {
			for _, stmt := range sqlschema.Statements(m.Down) {
				if _, err := conn.ExecContext(ctx, stmt); err != nil {
					return err
				}
			}
			return nil
		}
		for i := len(migs) - 1; i > 0; i-- {
			if err := down(migs[i]); err != nil {
				t.Fatalf("%s down: %v", migs[i].Name, err)
			}
		}
		if migs[0].Version != 1 {
			t.Fatalf("first migration is %s, want version 1", migs[0].Name)
		}
		err = down(migs[0])
		if err == nil || !strings.Contains(err.Error(), "refused: acemq_outbox holds rows not yet published") {
			t.Fatalf("0001 down with two rows pending: %v, want the refusal", err)
		}
		if n := countRows(t, db); n != 2 {
			t.Fatalf("%d rows after the refused down, want 2", n)
		}

		// One published, one pending: still refused.
		if _, err := db.Exec(db.Rebind("UPDATE acemq_outbox SET published_at = ? WHERE id = ?"), time.Now().UTC(), ids[0]); err != nil {
			t.Fatal(err)
		}
		if err := down(migs[0]); err == nil {
			t.Fatal("0001 down with a row pending succeeded")
		}
		if _, err := db.Exec(db.Rebind("UPDATE acemq_outbox SET published_at = ?"), time.Now().UTC()); err != nil {
			t.Fatal(err)
		}
		if err := down(migs[0]); err != nil {
			t.Fatalf("0001 down with every row published: %v", err)
		}
		if _, err := db.Exec("SELECT 1 FROM acemq_outbox"); err == nil {
			t.Error("acemq_outbox still exists after its down")
		}
		// And on a database whose table is gone already.
		if err := down(migs[0]); err != nil {
			t.Fatalf("0001 down without the table: %v", err)
		}
	})
}

func TestSQLSchema_GooseView_HoldsOnlyAnnotatedUpFiles(t *testing.T) {
	t.Parallel()
	for _, d := range sqlschema.Dialects {
		fsys, err := sqlschema.Goose(d)
		if err != nil {
			t.Fatal(err)
		}
		migs, _ := sqlschema.Migrations(d)
		entries, err := fsReadDir(fsys)
		if err != nil {
			t.Fatal(err)
		}
		if len(entries) != len(migs) {
			t.Errorf("%s: goose view has %d files, want %d (one per version)", d, len(entries), len(migs))
		}
		for _, m := range migs {
			if len(m.Up) < 12 || m.Up[:12] != "-- +goose Up" {
				t.Errorf("%s/%s.up.sql does not start with the goose annotation", d, m.Name)
			}
		}
	}
}

func assertMigratedOnce(t *testing.T, db *testdb.DB) {
	t.Helper()
	var versions []int
	if err := db.Select(&versions, "SELECT version FROM acemq_schema_migrations ORDER BY version"); err != nil {
		t.Fatal(err)
	}
	migs, _ := sqlschema.Migrations(dialectOf(t, db).Name())
	if len(versions) != len(migs) {
		t.Fatalf("recorded versions %v, want one row for each of %d migrations", versions, len(migs))
	}
	for _, table := range []string{"acemq_outbox", "processed_messages"} {
		var n int
		if err := db.Get(&n, "SELECT COUNT(*) FROM "+table); err != nil {
			t.Errorf("%s: %v", table, err)
		}
	}
}

func fsReadDir(fsys fs.FS) ([]fs.DirEntry, error) { return fs.ReadDir(fsys, ".") }

// An acemq_outbox that the Rails AceMQ library created (timestamp without
// time zone or datetime(6), its own acemq_outbox_pending index, no
// processed_at, no trigger) is brought up to date in place by Migrate: what
// is missing is added, every row stays as it was, the columns keep their
// types, and a second run changes nothing.
func TestMigrate_RailsTable_AddsWhatIsMissingInPlaceKeepsEveryRow(t *testing.T) {
	t.Parallel()
	testdb.Each(t, func(t *testing.T, db *testdb.DB) {
		testrails.CreateTable(t, db)
		now := time.Now().UTC()
		testrails.Insert(t, db, testrails.Row{ID: "pending", Exchange: "shop", RoutingKey: "order.placed", Body: `{"n":1}`, Headers: `{"tenant":"a","retries":3}`, CreatedAt: now.Add(-time.Minute)})
		testrails.Insert(t, db, testrails.Row{ID: "published", Exchange: "shop", RoutingKey: "order.placed", Body: `{"n":2}`, CreatedAt: now.Add(-time.Hour), PublishedAt: now.Add(-59 * time.Minute)})
		testrails.Insert(t, db, testrails.Row{ID: "leased", Exchange: "shop", RoutingKey: "order.placed", Body: `{"n":3}`, CreatedAt: now, LockedBy: "ruby-relay-1", LockedUntil: now.Add(time.Minute)})
		before := snapshot(t, db)
		typesBefore := columnTypes(t, db)

		d := dialectOf(t, db)
		for i := 0; i < 2; i++ {
			if err := outbox.Migrate(context.Background(), db.DB.DB, d); err != nil {
				t.Fatalf("migrate #%d: %v", i+1, err)
			}
		}
		assertMigratedOnce(t, db)
		if after := snapshot(t, db); !reflect.DeepEqual(after, before) {
			t.Errorf("rows changed by the migration:\nbefore %v\nafter  %v", before, after)
		}
		if after := columnTypes(t, db); !reflect.DeepEqual(after, typesBefore) {
			t.Errorf("column types changed:\nbefore %v\nafter  %v", typesBefore, after)
		}
		var processed int
		if err := db.Get(&processed, "SELECT COUNT(processed_at) FROM acemq_outbox"); err != nil || processed != 0 {
			t.Errorf("processed_at: %d set, %v; want the column, null in every row", processed, err)
		}
		want := map[string][]string{
			testdb.Postgres: {"acemq_outbox_aggregate_seq", "acemq_outbox_pending", "acemq_outbox_pending_claim", "acemq_outbox_pending_key", "acemq_outbox_pending_unkeyed", "acemq_outbox_pkey", "acemq_outbox_published"},
			testdb.MySQL:    {"PRIMARY", "acemq_outbox_aggregate_seq", "acemq_outbox_pending", "acemq_outbox_pending_key", "acemq_outbox_unprocessed"},
			testdb.SQLite:   {"acemq_outbox_aggregate_seq", "acemq_outbox_pending", "acemq_outbox_pending_key", "acemq_outbox_pending_unkeyed", "acemq_outbox_published", "sqlite_autoindex_acemq_outbox_1"},
		}[db.Kind]
		if got := indexes(t, db); !reflect.DeepEqual(got, want) {
			t.Errorf("indexes %v, want %v: Rails' kept, and the one the relay's claim walks", got, want)
		}
		if db.Kind == testdb.Postgres {
			var n int
			if err := db.Get(&n, "SELECT COUNT(*) FROM pg_trigger WHERE tgname = 'acemq_outbox_notify' AND tgrelid = 'acemq_outbox'::regclass"); err != nil || n != 1 {
				t.Errorf("%d notify triggers (%v), want 1", n, err)
			}
		}
	})
}

// A table made by hand with no index the relay's claim can walk gets one:
// 0001's on PostgreSQL and SQLite, where it is a statement of its own, and
// on MySQL, where 0001 makes its indexes with the table, 0004's, which the
// claim names.
func TestMigrate_TableWithoutPendingIndex_GetsOne(t *testing.T) {
	t.Parallel()
	testdb.Each(t, func(t *testing.T, db *testdb.DB) {
		testrails.CreateTable(t, db)
		drop := "DROP INDEX acemq_outbox_pending"
		if db.Kind == testdb.MySQL {
			drop += " ON acemq_outbox"
		}
		if _, err := db.Exec(drop); err != nil {
			t.Fatal(err)
		}
		d := migrate(t, db)
		want := "acemq_outbox_pending"
		if db.Kind == testdb.MySQL {
			want = "acemq_outbox_pending_claim"
		}
		if got := indexes(t, db); !slices.Contains(got, want) {
			t.Fatalf("indexes %v, want %s", got, want)
		}
		if db.Kind != testdb.MySQL {
			return
		}
		s, err := outbox.NewStore(db.DB, outbox.StoreConfig{Dialect: d})
		if err != nil {
			t.Fatal(err)
		}
		tx, err := db.DB.DB.Begin()
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = tx.Rollback() }()
		if index, err := outbox.PendingIndex(s, tx); err != nil || index != want {
			t.Errorf("the claim names %q (%v), want %s", index, err, want)
		}
	})
}

// An acemq_outbox another library made on MySQL with an index on
// published_at alone has no index the claim can walk: through it, the
// claim's ORDER BY created_at, id sorts every pending row, and its FOR
// UPDATE SKIP LOCKED locks them all before the sort, so a second relay
// claimed nothing while the first held its batch (10 pending, 2 a claim:
// 2 and 0). The relay names no such index, and 0004 adds its own
// acemq_outbox_pending_claim beside it, once, whether Migrate runs the file
// or a migration tool runs it twice; the relays' claims then go apart.
func TestMigrate_MySQL_IndexOnPublishedAtAlone_ClaimIndexAdded_SecondRelayClaims(t *testing.T) {
	t.Parallel()
	migs, err := sqlschema.Migrations("mysql")
	if err != nil {
		t.Fatal(err)
	}
	for _, by := range []string{"Migrate", "a migration tool, twice"} {
		t.Run(by, func(t *testing.T) {
			db := testdb.New(t, testdb.MySQL)
			testrails.CreateTable(t, db)
			for _, stmt := range []string{
				"DROP INDEX acemq_outbox_pending ON acemq_outbox",
				"CREATE INDEX acemq_outbox_by_published ON acemq_outbox (published_at)",
			} {
				if _, err := db.Exec(stmt); err != nil {
					t.Fatalf("%s: %v", stmt, err)
				}
			}
			pendingIndex := func() string {
				t.Helper()
				s, err := outbox.NewStore(db.DB, outbox.StoreConfig{Dialect: outbox.MySQL})
				if err != nil {
					t.Fatal(err)
				}
				tx, err := db.DB.DB.Begin()
				if err != nil {
					t.Fatal(err)
				}
				defer func() { _ = tx.Rollback() }()
				index, err := outbox.PendingIndex(s, tx)
				if err != nil {
					t.Fatal(err)
				}
				return index
			}
			if index := pendingIndex(); index != "" {
				t.Errorf("before the migration the claim names %q, an index on published_at alone; want none", index)
			}

			if by == "Migrate" {
				migrate(t, db)
			} else {
				for i := 0; i < 2; i++ {
					for _, m := range migs {
						for _, stmt := range sqlschema.Statements(m.Up) {
							if _, err := db.Exec(stmt); err != nil {
								t.Fatalf("run #%d, %s: %v", i+1, m.Name, err)
							}
						}
					}
				}
			}
			want := []string{"PRIMARY", "acemq_outbox_aggregate_seq", "acemq_outbox_by_published", "acemq_outbox_pending_claim", "acemq_outbox_pending_key", "acemq_outbox_unprocessed"}
			if got := indexes(t, db); !reflect.DeepEqual(got, want) {
				t.Errorf("indexes %v, want %v: the other library's kept, and the one the claim walks added once", got, want)
			}
			if index := pendingIndex(); index != "acemq_outbox_pending_claim" {
				t.Errorf("the claim names %q, want acemq_outbox_pending_claim", index)
			}

			publishBatch(t, db, "shop", "order.placed", 10)
			a, err := outbox.NewStore(db.DB, outbox.StoreConfig{Dialect: outbox.MySQL})
			if err != nil {
				t.Fatal(err)
			}
			b, err := outbox.NewStore(db.DB, outbox.StoreConfig{Dialect: outbox.MySQL})
			if err != nil {
				t.Fatal(err)
			}
			idsA, heldA, err := outbox.Claim(a, 2, "relay-a")
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = heldA.Abandon() }()
			idsB, heldB, err := outbox.Claim(b, 2, "relay-b")
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = heldB.Abandon() }()
			if len(idsA) != 2 || len(idsB) != 2 {
				t.Fatalf("relay A claimed %d, relay B %d while A held its claim, of 10 pending; want 2 each", len(idsA), len(idsB))
			}
			for _, id := range idsB {
				if slices.Contains(idsA, id) {
					t.Errorf("%s claimed by both relays", id)
				}
			}
		})
	}
}

// goose and golang-migrate run the files as plain SQL. On PostgreSQL and
// MySQL that alone brings a Rails table up to date, twice over without
// harm. On SQLite plain SQL cannot add a column only where it is missing,
// so the files' guarded steps are Migrate's: the tool stops at 0005, whose
// index needs aggregate_id, and names it, rather than leave a table no
// relay can claim from. Once the user has run the Run statements the table
// lacks, as the README says, the files run, twice over, and leave the
// table as Migrate leaves it. Migrate after the tool changes no row.
func TestMigrations_PlainSQL_RailsTable_UpToDateWhereSQLCanSayIt(t *testing.T) {
	t.Parallel()
	testdb.Each(t, func(t *testing.T, db *testdb.DB) {
		testrails.CreateTable(t, db)
		testrails.Insert(t, db, testrails.Row{ID: "a", Exchange: "shop", RoutingKey: "k", Body: "x", CreatedAt: time.Now()})
		d := dialectOf(t, db)
		migs, err := sqlschema.Migrations(d.Name())
		if err != nil {
			t.Fatal(err)
		}
		if db.Kind == testdb.SQLite {
			err := applyPlain(db, migs)
			if err == nil || !strings.Contains(err.Error(), "0005_aggregate_order") || !strings.Contains(err.Error(), "aggregate_id") {
				t.Fatalf("plain SQL on the Rails table: %v, want 0005 to fail naming aggregate_id", err)
			}
			runByHand(t, db, migs)
		}
		for i := 0; i < 2; i++ {
			if err := applyPlain(db, migs); err != nil {
				t.Fatalf("run #%d, %v", i+1, err)
			}
		}
		if _, err := db.Exec("SELECT processed_at, aggregate_id, seq FROM acemq_outbox"); err != nil {
			t.Errorf("the columns after plain SQL: %v", err)
		}
		if db.Kind == testdb.SQLite {
			adopted := testdb.New(t, testdb.SQLite)
			testrails.CreateTable(t, adopted)
			migrate(t, adopted)
			if got, want := sqliteSchema(t, db), sqliteSchema(t, adopted); got != want {
				t.Errorf("by the tool and the Run steps:\n%s\nwant, as Migrate leaves it:\n%s", got, want)
			}
		}
		if err := outbox.Migrate(context.Background(), db.DB.DB, d); err != nil {
			t.Fatal(err)
		}
		if n := countRows(t, db); n != 1 {
			t.Errorf("%d rows, want the one there was", n)
		}
	})
}

// snapshot reads every row of acemq_outbox, every column the Rails table
// has, as the driver returns it.
func snapshot(t *testing.T, db *testdb.DB) []map[string]any {
	t.Helper()
	rows, err := db.Queryx("SELECT id, exchange_name, routing_key, body, body_encoding, content_type, headers, created_at, published_at, attempts, last_error, locked_by, locked_until FROM acemq_outbox ORDER BY id")
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var out []map[string]any
	for rows.Next() {
		m := map[string]any{}
		if err := rows.MapScan(m); err != nil {
			t.Fatal(err)
		}
		out = append(out, m)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// columnTypes are the declared types of acemq_outbox's columns, by name.
func columnTypes(t *testing.T, db *testdb.DB) map[string]string {
	t.Helper()
	q := map[string]string{
		testdb.Postgres: "SELECT column_name, data_type FROM information_schema.columns WHERE table_schema = current_schema() AND table_name = 'acemq_outbox' AND column_name NOT IN ('processed_at', 'aggregate_id', 'seq')",
		testdb.MySQL:    "SELECT COLUMN_NAME, COLUMN_TYPE FROM information_schema.COLUMNS WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'acemq_outbox' AND COLUMN_NAME NOT IN ('processed_at', 'aggregate_id', 'seq')",
		testdb.SQLite:   "SELECT name, type FROM pragma_table_info('acemq_outbox') WHERE name NOT IN ('processed_at', 'aggregate_id', 'seq')",
	}[db.Kind]
	rows, err := db.Query(q)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	types := map[string]string{}
	for rows.Next() {
		var name, typ string
		if err := rows.Scan(&name, &typ); err != nil {
			t.Fatal(err)
		}
		types[name] = typ
	}
	return types
}

// indexes are the names of acemq_outbox's indexes, sorted.
func indexes(t *testing.T, db *testdb.DB) []string {
	t.Helper()
	q := map[string]string{
		testdb.Postgres: "SELECT indexname FROM pg_indexes WHERE schemaname = current_schema() AND tablename = 'acemq_outbox'",
		testdb.MySQL:    "SELECT DISTINCT INDEX_NAME FROM information_schema.STATISTICS WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'acemq_outbox'",
		testdb.SQLite:   "SELECT name FROM pragma_index_list('acemq_outbox')",
	}[db.Kind]
	var names []string
	if err := db.Select(&names, q); err != nil {
		t.Fatal(err)
	}
	slices.Sort(names) // byte order, whatever the database's collation
	return names
}

// On a MySQL table another library created in a collation that folds case
// and accents, 0005 added aggregate_id in that collation: "Order-1" and
// "order-1" were one key to the unique (aggregate_id, seq) index and two
// to the counters, and the second key's publishes failed. 0008 makes the
// column compare byte for byte, as the counters do.
func TestMigrate_MySQLRailsTable_KeysDifferingInCaseOrAccentAreTwoKeys(t *testing.T) {
	t.Parallel()
	for _, legacy := range []bool{false, true} {
		t.Run(map[bool]string{false: "utf8mb4", true: "utf8mb3 compact"}[legacy], func(t *testing.T) {
			mysqlRailsTableKeys(t, legacy)
		})
	}
}

// mysqlRailsTableKeys is the test above on a Rails table in utf8mb4, or in
// an older table's utf8mb3 and COMPACT row format, whose index columns
// take at most 767 bytes: aggregate_id keeps the table's character set.
func mysqlRailsTableKeys(t *testing.T, legacy bool) {
	db := testdb.New(t, testdb.MySQL)
	testrails.CreateTable(t, db)
	want := "utf8mb4_bin"
	if legacy {
		want = "utf8mb3_bin"
		if _, err := db.Exec("ALTER TABLE acemq_outbox ROW_FORMAT=COMPACT, CONVERT TO CHARACTER SET utf8mb3 COLLATE utf8mb3_general_ci"); err != nil {
			t.Fatal(err)
		}
	}
	d := migrate(t, db)
	collation := func() string {
		var c string
		if err := db.Get(&c, "SELECT COLLATION_NAME FROM information_schema.COLUMNS WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'acemq_outbox' AND COLUMN_NAME = 'aggregate_id'"); err != nil {
			t.Fatal(err)
		}
		return c
	}
	if c := collation(); c != want {
		t.Errorf("aggregate_id collation %s, want %s", c, want)
	}
	// A table migrated through 0007 before 0005 said its collation: 0008
	// mends it.
	for _, q := range []string{
		"ALTER TABLE acemq_outbox MODIFY COLUMN aggregate_id varchar(255) COLLATE " + strings.TrimSuffix(want, "_bin") + "_general_ci NULL",
		"DELETE FROM acemq_schema_migrations WHERE version = 8",
	} {
		if _, err := db.Exec(q); err != nil {
			t.Fatal(err)
		}
	}
	if err := outbox.Migrate(context.Background(), db.DB.DB, d); err != nil {
		t.Fatal(err)
	}
	if c := collation(); c != want {
		t.Errorf("aggregate_id collation %s after 0008, want %s", c, want)
	}
	for _, key := range []string{"Order-1", "order-1", "cafe", "café"} {
		inTx(t, db, true, []*message.Message{keyed(key)})
		if got := seqsOf(t, db, key); fmt.Sprint(got) != "[1]" {
			t.Errorf("key %q numbered %v, want [1]: a key of its own", key, got)
		}
	}
}

// A MySQL migration that failed part way leaves its session as it stopped
// (its user variables; a setting a file changes for its own ALTER and sets
// back at its end), so its connection is discarded rather than returned to
// the pool for the application's next statement. Here 0005's refusal
// leaves @acemq_guard set on the connection that ran it.
func TestMigrate_MySQLFailedPartWay_ItsConnectionDiscarded(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, testdb.MySQL)
	testrails.CreateTable(t, db)
	if _, err := db.Exec("ALTER TABLE acemq_outbox ROW_FORMAT=COMPACT"); err != nil {
		t.Fatal(err)
	}
	pool, err := sql.Open("mysql", db.DSN)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = pool.Close() })
	pool.SetMaxOpenConns(1)
	ctx := context.Background()
	var before int64
	if err := pool.QueryRowContext(ctx, "SELECT CONNECTION_ID()").Scan(&before); err != nil {
		t.Fatal(err)
	}
	if err := outbox.Migrate(ctx, pool, outbox.MySQL); err == nil {
		t.Fatal("Migrate on a utf8mb4 COMPACT table succeeded; the test needs 0005's refusal")
	}
	var (
		after int64
		guard sql.NullString
	)
	if err := pool.QueryRowContext(ctx, "SELECT CONNECTION_ID(), @acemq_guard").Scan(&after, &guard); err != nil {
		t.Fatal(err)
	}
	if after == before || guard.Valid {
		t.Errorf("after the failed Migrate the pool handed out connection %d (before: %d) with @acemq_guard = %q: the migration's session, as it stopped", after, before, guard.String)
	}
}

// A utf8mb4 acemq_outbox another library made in ROW_FORMAT=COMPACT
// (MySQL 5.6's default, kept by every upgrade since) cannot have 0005's
// index on aggregate_id: varchar(255) in utf8mb4 is 1,020 bytes, and
// COMPACT indexes 767 at the most (Error 1709). MySQL's DDL is not
// transactional, so 0005 had added the columns by then, and every boot
// failed half-way. 0005 now refuses before any change, naming the cause and
// the remedy; after that remedy, Migrate adopts the table. A utf8mb3 table
// in COMPACT fits (765 bytes), and is adopted at once.
func TestMigrate_MySQLCompactRowFormatTable_RefusedBeforeAnyChangeAdoptedOnceDynamic(t *testing.T) {
	t.Parallel()
	for _, c := range []struct{ name, alter string }{
		{"COMPACT", "ROW_FORMAT=COMPACT"},
		{"REDUNDANT", "ROW_FORMAT=REDUNDANT"},
		{"utf8mb3 COMPACT", "CONVERT TO CHARACTER SET utf8mb3 COLLATE utf8mb3_general_ci, ROW_FORMAT=COMPACT"}, // fits: adopted at once
	} {
		t.Run(c.name, func(t *testing.T) {
			db := testdb.New(t, testdb.MySQL)
			testrails.CreateTable(t, db)
			if _, err := db.Exec("ALTER TABLE acemq_outbox " + c.alter); err != nil {
				t.Fatal(err)
			}
			testrails.Insert(t, db, testrails.Row{ID: "pending", Exchange: "shop", RoutingKey: "order.placed", Body: `{}`, CreatedAt: time.Now()})
			ctx := context.Background()
			err := outbox.Migrate(ctx, db.DB.DB, outbox.MySQL)
			t.Logf("Migrate on the %s table: %v", c.name, err)
			if strings.HasPrefix(c.name, "utf8mb3") {
				if err != nil {
					t.Fatalf("Migrate on a utf8mb3 COMPACT table, whose index fits: %v", err)
				}
				assertMigratedOnce(t, db)
				return
			}
			if err == nil || !strings.Contains(err.Error(), "ROW_FORMAT=DYNAMIC") {
				t.Errorf("Migrate on a utf8mb4 %s table: %v, want 0005's refusal naming ROW_FORMAT=DYNAMIC", c.name, err)
			}
			var added int
			if err := db.Get(&added, "SELECT COUNT(*) FROM information_schema.COLUMNS WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'acemq_outbox' AND COLUMN_NAME IN ('aggregate_id', 'seq')"); err != nil {
				t.Fatal(err)
			}
			if added != 0 {
				t.Errorf("%d of aggregate_id and seq added by the refused 0005", added)
			}
			if _, err := db.Exec("ALTER TABLE acemq_outbox ROW_FORMAT=DYNAMIC"); err != nil {
				t.Fatal(err)
			}
			if err := outbox.Migrate(ctx, db.DB.DB, outbox.MySQL); err != nil {
				t.Fatalf("Migrate after ROW_FORMAT=DYNAMIC: %v", err)
			}
			assertMigratedOnce(t, db)
			if n := countRows(t, db); n != 1 {
				t.Errorf("%d rows after the adoption, want the pending one", n)
			}
		})
	}
}

// Rolling back past 0005 (golang-migrate down 0008 … 0005) and migrating
// up again goes on numbering each key where it was: 0005's down keeps the
// counters. It dropped them, and a key's next message was numbered 1
// again, which its consumers, having applied 1 and 2, dropped as a
// duplicate (and on SQLite, whose down keeps the columns, every keyed
// publish on an old key failed).
func TestMigrations_DownPast0005ThenUp_KeysGoOnNumbering(t *testing.T) {
	t.Parallel()
	testdb.Each(t, func(t *testing.T, db *testdb.DB) {
		d := migrate(t, db)
		inTx(t, db, true, []*message.Message{keyed("order-42")})
		inTx(t, db, true, []*message.Message{keyed("order-42")})
		markAllPublished(t, db) // 0005's down refuses while keyed rows are pending
		downAndUpAgain(t, db, d, 5)
		msg := keyed("order-42")
		inTx(t, db, true, []*message.Message{msg})
		if _, seq := seqOf(t, db, msg.UUID); seq != 3 {
			t.Errorf("order-42's next message numbered %d after down and up, want 3", seq)
		}
	})
}

// A down to the bottom (golang-migrate's down with no count) while the
// ordered inbox holds messages: 0002's down dropped acemq_inbox_held, and
// with it messages acked to the broker whose handlers had not run, their
// only copy. It now refuses, with the reason, before it drops anything;
// once none is held, the down goes through.
func TestMigrations_DownOf0002_RefusesWhileTheInboxHoldsMessages(t *testing.T) {
	t.Parallel()
	testdb.Each(t, func(t *testing.T, db *testdb.DB) {
		d := migrate(t, db)
		if _, err := db.Exec(db.Rebind("INSERT INTO acemq_inbox_held (consumer_name, aggregate_id, seq, message_id, payload, payload_encoding, metadata, held_at) VALUES (?, ?, ?, ?, ?, 'utf-8', '{}', ?)"),
			"billing", "order-1", 2, "m2", "event 2", "2026-12-03 06:00:00.000000"); err != nil {
			t.Fatal(err)
		}
		err := downTo(t, db, d, 1)
		t.Logf("down to the bottom: %v", err)
		if err == nil || !strings.Contains(err.Error(), "refused: acemq_inbox_held holds messages not yet handled") {
			t.Errorf("down to the bottom with a message held: %v, want 0002's refusal", err)
		}
		for _, table := range []string{"acemq_inbox_held", "processed_messages"} {
			var n int
			if err := db.Get(&n, "SELECT COUNT(*) FROM "+table); err != nil {
				t.Errorf("%s after the refused down: %v", table, err)
			} else if table == "acemq_inbox_held" && n != 1 {
				t.Errorf("%d messages held after the refused down, want 1", n)
			}
		}
		if _, err := db.Exec("DELETE FROM acemq_inbox_held"); err != nil {
			t.Fatal(err)
		}
		if err := downTo(t, db, d, 1); err != nil {
			t.Fatalf("down to the bottom with no message held: %v", err)
		}
		if _, err := db.Exec("SELECT 1 FROM acemq_inbox_held"); err == nil {
			t.Error("acemq_inbox_held still exists after 0002's down")
		}
		// And on a database whose inbox is gone already.
		migs, err := sqlschema.Migrations(d.Name())
		if err != nil {
			t.Fatal(err)
		}
		for _, stmt := range sqlschema.Statements(migs[1].Down) {
			if _, err := db.Exec(stmt); err != nil {
				t.Fatalf("%s down without its tables: %v", migs[1].Name, err)
			}
		}
	})
}

// Rolling back past 0005 while keyed rows are pending: its down dropped
// aggregate_id and seq, the rows went out unkeyed, and the key's ordered
// consumers, waiting for those numbers, waited for ever. The down now
// refuses, with the reason, before it changes anything; migrated up again,
// the rows still have their keys and numbers, and once they are published
// the down goes through. (SQLite's down keeps the columns.)
func TestMigrations_DownPast0005_RefusedWhileKeyedRowsArePending(t *testing.T) {
	t.Parallel()
	for _, kind := range []string{testdb.Postgres, testdb.MySQL} {
		t.Run(kind, func(t *testing.T) {
			db := testdb.New(t, kind)
			d := migrate(t, db)
			msgs := []*message.Message{keyed("order-42"), keyed("order-42")}
			inTx(t, db, true, msgs)
			err := downTo(t, db, d, 5)
			if err == nil || !strings.Contains(err.Error(), "refused: acemq_outbox holds keyed rows not yet published") {
				t.Fatalf("down to 5 with keyed rows pending: %v, want 0005's refusal", err)
			}
			t.Logf("down to 5: %v", err)
			if err := outbox.Migrate(context.Background(), db.DB.DB, d); err != nil {
				t.Fatalf("migrate up again after the refused down: %v", err)
			}
			for i, m := range msgs {
				if key, seq := seqOf(t, db, m.UUID); key != "order-42" || seq != int64(i+1) {
					t.Errorf("pending row %d after the refused down: aggregate_id=%q seq=%d, want order-42 #%d", i+1, key, seq, i+1)
				}
			}
			markAllPublished(t, db)
			downAndUpAgain(t, db, d, 5)
		})
	}
}

// markAllPublished marks every row of acemq_outbox published, as the relay
// would have.
func markAllPublished(t *testing.T, db *testdb.DB) {
	t.Helper()
	if _, err := db.Exec(db.Rebind("UPDATE acemq_outbox SET published_at = ? WHERE published_at IS NULL"), time.Now().UTC()); err != nil {
		t.Fatal(err)
	}
}

// downAndUpAgain runs the down migrations from the latest to version from,
// as golang-migrate down would, and then Migrate.
func downAndUpAgain(t *testing.T, db *testdb.DB, d outbox.Dialect, from int) {
	t.Helper()
	if err := downTo(t, db, d, from); err != nil {
		t.Fatal(err)
	}
	if err := outbox.Migrate(context.Background(), db.DB.DB, d); err != nil {
		t.Fatalf("migrate up again: %v", err)
	}
}

// downTo runs the down migrations of the versions recorded, from the
// latest to version from, on one connection (MySQL's checks keep their
// verdict in session variables), forgetting each one's record as it
// completes, and returns the first error, with the migration's name.
func downTo(t *testing.T, db *testdb.DB, d outbox.Dialect, from int) error {
	t.Helper()
	migs, err := sqlschema.Migrations(d.Name())
	if err != nil {
		t.Fatal(err)
	}
	var recorded []int
	if err := db.Select(&recorded, "SELECT version FROM acemq_schema_migrations"); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	conn, err := db.Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	for i := len(migs) - 1; i >= 0 && migs[i].Version >= from; i-- {
		if !slices.Contains(recorded, migs[i].Version) {
			continue
		}
		for _, stmt := range sqlschema.Statements(migs[i].Down) {
			if _, err := conn.ExecContext(ctx, stmt); err != nil {
				return fmt.Errorf("%s down: %w", migs[i].Name, err)
			}
		}
		if _, err := conn.ExecContext(ctx, db.Rebind("DELETE FROM acemq_schema_migrations WHERE version = ?"), migs[i].Version); err != nil {
			t.Fatal(err)
		}
	}
	return nil
}

// With search_path=svc,public and the estate's acemq_outbox in public (the
// Rails library created it there), an unqualified acemq_outbox names
// public's table, and Migrate brings that one up to date, with the rest of
// the schema beside it. CREATE TABLE IF NOT EXISTS alone would look in svc
// only, create a second, empty acemq_outbox there, and from then on the
// name would mean svc's: this service's messages in one table, the
// estate's relays reading the other.
func TestMigrate_PostgresSearchPath_AdoptsTheTableTheNameResolvesTo(t *testing.T) {
	t.Parallel()
	base := testdb.New(t, testdb.Postgres) // its schema plays public
	testrails.CreateTable(t, base)
	svc := base.Name + "_svc"
	if _, err := base.Exec("CREATE SCHEMA " + svc); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = base.Exec("DROP SCHEMA " + svc + " CASCADE") })
	dsn := strings.Replace(base.DSN, "search_path="+base.Name, "search_path="+svc+"%2C"+base.Name, 1)
	if dsn == base.DSN {
		t.Fatalf("no search_path in %s", base.DSN)
	}
	x, err := sqlx.Open("pgx", dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = x.Close() })
	db := &testdb.DB{DB: x, Kind: testdb.Postgres, DSN: dsn, Name: svc}
	for i := 0; i < 2; i++ {
		if err := outbox.Migrate(context.Background(), x.DB, outbox.Postgres); err != nil {
			t.Fatalf("migrate #%d: %v", i+1, err)
		}
	}
	var inSvc []string
	if err := x.Select(&inSvc, "SELECT table_name FROM information_schema.tables WHERE table_schema = $1 ORDER BY 1", svc); err != nil {
		t.Fatal(err)
	}
	if len(inSvc) != 0 {
		t.Errorf("Migrate created %v in %s, want nothing: acemq_outbox is %s's", inSvc, svc, base.Name)
	}
	var adopted bool
	if err := x.Get(&adopted, "SELECT EXISTS (SELECT 1 FROM information_schema.columns WHERE table_schema = $1 AND table_name = 'acemq_outbox' AND column_name = 'processed_at')", base.Name); err != nil {
		t.Fatal(err)
	}
	if !adopted {
		t.Errorf("%s.acemq_outbox has no processed_at: not migrated", base.Name)
	}
	msg := keyed("order-1")
	inTx(t, db, true, []*message.Message{msg})
	var n int
	if err := base.Get(&n, "SELECT COUNT(*) FROM acemq_outbox WHERE id = $1 AND seq = 1", msg.UUID); err != nil || n != 1 {
		t.Errorf("%s.acemq_outbox holds %d rows of the message (%v), want 1", base.Name, n, err)
	}
}

// A role that may use the estate's schema but not create in it (the table
// is another role's) migrates a database whose migrations have all run:
// Migrate creates nothing there, where PostgreSQL's CREATE TABLE IF NOT
// EXISTS checks the privilege before it looks for the table. A migration
// still to run fails, and says in which schema.
func TestMigrate_PostgresSearchPath_RoleWithoutCreateOnTheEstateSchema(t *testing.T) {
	t.Parallel()
	base := testdb.New(t, testdb.Postgres)
	testrails.CreateTable(t, base)
	migrate(t, base)
	svc := base.Name + "_svc"
	if _, err := base.Exec("CREATE SCHEMA " + svc); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = base.Exec("DROP SCHEMA " + svc + " CASCADE") })
	role, x := newRole(t, base, svc+","+base.Name,
		"USAGE ON SCHEMA "+base.Name,
		"ALL ON SCHEMA "+svc,
		"SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA "+base.Name)
	if err := outbox.Migrate(context.Background(), x.DB, outbox.Postgres); err != nil {
		t.Fatalf("migrate as %s, every migration applied: %v", role, err)
	}
	var inSvc int
	if err := x.Get(&inSvc, "SELECT COUNT(*) FROM information_schema.tables WHERE table_schema = $1", svc); err != nil || inSvc != 0 {
		t.Errorf("%d tables in %s (%v), want 0", inSvc, svc, err)
	}
	msg := keyed("order-1")
	inTx(t, x, true, []*message.Message{msg})

	if _, err := base.Exec("DELETE FROM acemq_schema_migrations WHERE version = 3"); err != nil {
		t.Fatal(err)
	}
	err := outbox.Migrate(context.Background(), x.DB, outbox.Postgres)
	if err == nil || !strings.Contains(err.Error(), "in schema "+base.Name) || !strings.Contains(err.Error(), "permission denied") {
		t.Fatalf("migrate as %s with 0003 to run: %v, want a permission error naming schema %s", role, err, base.Name)
	}
}

// Migrate takes the *sqlx.DB of the quick start, as the other constructors
// do, its dialect from its driver: the README's outbox.Migrate(ctx, db, …)
// did not compile with it. (From an audit of the README.)
func TestMigrate_TakesAnSqlxDB_DialectFromItsDriver(t *testing.T) {
	t.Parallel()
	testdb.Each(t, func(t *testing.T, db *testdb.DB) {
		if err := outbox.Migrate(context.Background(), db.DB, nil); err != nil {
			t.Fatal(err)
		}
		assertMigratedOnce(t, db)
	})
	var cfgErr *outbox.ConfigError
	if err := outbox.Migrate(context.Background(), "postgres://", outbox.Postgres); !errors.As(err, &cfgErr) {
		t.Errorf("a string for db: %v, want a ConfigError", err)
	}
}

// 0012's index holds the routing key only where an index can hold it
// whole: another library's TEXT routing_key, or a utf8mb4 varchar(255) in
// a COMPACT table (1,020 bytes over its 767), would refuse CREATE INDEX
// and stop the migration; there the index is (processed_at, published_at).
func TestMigrate_MySQL_0012_RoutingKeyAnIndexCannotHold_IndexWithoutIt(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name, alter string
		want        []string
	}{
		{"varchar, dynamic", "", []string{"processed_at", "routing_key", "published_at"}},
		{"text", "ALTER TABLE acemq_outbox MODIFY routing_key text NOT NULL", []string{"processed_at", "published_at"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			db := testdb.New(t, testdb.MySQL)
			testrails.CreateTable(t, db)
			if c.alter != "" {
				db.MustExec(c.alter)
			}
			migrate(t, db)
			var cols []string
			if err := db.Select(&cols, "SELECT COLUMN_NAME FROM information_schema.STATISTICS WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'acemq_outbox'"+
				" AND INDEX_NAME = 'acemq_outbox_unprocessed' ORDER BY SEQ_IN_INDEX"); err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(cols, c.want) {
				t.Errorf("acemq_outbox_unprocessed on %v, want %v", cols, c.want)
			}
		})
	}
}
