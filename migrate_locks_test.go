package outbox_test

import (
	"context"
	"database/sql"
	"strings"
	"testing"
	"time"

	"github.com/jmoiron/sqlx"
	_ "github.com/lib/pq" // driver "postgres", which the library takes for PostgreSQL

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
	"github.com/acemq/watermill-outbox/internal/testrails"
)

// Adopting a table another library created while one of its transactions
// holds the table (a long read): the migration's DDL waits for it, and every
// statement on the table after the DDL queues behind it. Migrate waits a
// second at a time and lets go in between, so that another service's
// writes go on meanwhile, and it completes once the long transaction ends.
// Through lib/pq as through pgx: Migrate knew the lock's timeout only by
// pgx's text ("SQLSTATE 55P03"), and through lib/pq it failed after its
// first second's wait.
func TestMigrate_AdoptingABusyTable_OtherServicesWritesGoOn(t *testing.T) {
	for _, c := range []struct{ name, kind, driver string }{
		{"postgres/pgx", testdb.Postgres, "pgx"},
		{"postgres/lib-pq", testdb.Postgres, "postgres"},
		{"mysql", testdb.MySQL, "mysql"},
	} {
		t.Run(c.name, func(t *testing.T) {
			db := testdb.New(t, c.kind)
			testrails.CreateTable(t, db)
			pool, err := sqlx.Open(c.driver, db.DSN)
			if err != nil {
				t.Fatal(err)
			}
			defer pool.Close()
			ctx := context.Background()
			long, err := db.DB.DB.BeginTx(ctx, nil)
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = long.Rollback() }()
			var n int
			if err := long.QueryRow("SELECT COUNT(*) FROM acemq_outbox").Scan(&n); err != nil {
				t.Fatal(err)
			}
			done := make(chan error, 1)
			go func() { done <- outbox.Migrate(ctx, pool, nil) }()
			// Migrate is at the table's DDL by now, or soon: write while it
			// waits, as another service would, for longer than one wait.
			for i := range 5 {
				time.Sleep(300 * time.Millisecond)
				wctx, cancel := context.WithTimeout(ctx, 3*time.Second)
				start := time.Now()
				_, err := db.DB.DB.ExecContext(wctx, db.Rebind("INSERT INTO acemq_outbox (id, exchange_name, routing_key, body, body_encoding, content_type, headers, created_at)"+
					" VALUES (?, '', 'k', 'b', 'utf-8', '', '{}', ?)"), "other-"+string(rune('a'+i)), testrails.Time(time.Now()))
				cancel()
				if err != nil {
					t.Fatalf("another service's insert %d while Migrate waited: %v after %v", i, err, time.Since(start).Round(time.Millisecond))
				}
			}
			select {
			case err := <-done:
				t.Fatalf("Migrate returned while the long transaction held the table: %v", err)
			default:
			}
			if err := long.Rollback(); err != nil {
				t.Fatal(err)
			}
			select {
			case err := <-done:
				if err != nil {
					t.Fatalf("Migrate: %v", err)
				}
			case <-time.After(30 * time.Second):
				t.Fatal("Migrate did not complete within 30 s of the long transaction's end")
			}
		})
	}
}

// A MySQL DSN that names no database (root@tcp(host:3306)/): Migrate said
// "another process held the migration lock for 60s", sending the operator
// after a process that does not exist. It names the missing database now,
// at once.
func TestMigrate_MySQLDSNWithoutADatabase_SaysSo(t *testing.T) {
	t.Parallel()
	dsn := testdb.MySQLDSN()
	noDB := dsn[:strings.LastIndex(dsn, "/")+1]
	if i := strings.Index(dsn[len(noDB):], "?"); i >= 0 {
		noDB += dsn[len(noDB)+i:]
	}
	db, err := sql.Open("mysql", noDB)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	start := time.Now()
	err = outbox.Migrate(context.Background(), db, outbox.MySQL)
	if err == nil || !strings.Contains(err.Error(), "no database selected") {
		t.Errorf("Migrate over %q: %v, want an error saying the connection has no database", noDB, err)
	}
	if took := time.Since(start); took > 10*time.Second {
		t.Errorf("Migrate took %v to say so", took)
	}
}
