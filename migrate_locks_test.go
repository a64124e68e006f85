package outbox_test

import (
	"context"
	"testing"
	"time"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
	"github.com/acemq/watermill-outbox/internal/testrails"
)

// Adopting a table another library created while one of its transactions
// holds the table (a long read): the migration's DDL waits for it, and every
// statement on the table after the DDL queues behind it. Migrate waits a
// second at a time and lets go in between, so that another service's
// writes go on meanwhile, and it completes once the long transaction ends.
func TestMigrate_AdoptingABusyTable_OtherServicesWritesGoOn(t *testing.T) {
	for _, kind := range []string{testdb.Postgres, testdb.MySQL} {
		t.Run(kind, func(t *testing.T) {
			db := testdb.New(t, kind)
			testrails.CreateTable(t, db)
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
			go func() { done <- outbox.Migrate(ctx, db.DB.DB, dialectOf(t, db)) }()
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
