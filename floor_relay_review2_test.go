package outbox_test

import (
	"testing"
	"time"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testamqp"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// headFloor's doc: "a row whose created_at is NULL" waits for the floor's
// period, "None waits longer". On an idle relay the period's walk from
// the head is the probe (nothingToClaim), which finds the NULL row; the
// claim right after it is inside the new period, starts at the floor
// (created_at >= ?), and takes nothing. Every period repeats that: the row
// never goes out while the floor is on.
func TestForwarder_FloorOn_IdleRelay_NullCreatedAtClaimedWithinAPeriod(t *testing.T) {
	for _, kind := range []string{testdb.Postgres, testdb.MySQL} {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			db := migrated(t, kind)
			alter := "ALTER TABLE acemq_outbox ALTER created_at DROP NOT NULL"
			if kind == testdb.MySQL {
				alter = "ALTER TABLE acemq_outbox MODIFY created_at DATETIME(6) NULL"
			}
			db.MustExec(alter)
			b := testamqp.New(t)
			queue := b.Queue("t")
			const period = 300 * time.Millisecond
			f := newForwarder(t, db, outbox.ForwarderConfig{PollInterval: 50 * time.Millisecond})
			outbox.SetFloorOn(f, period)
			runInBackground(t, f)
			publishN(t, db, b.Exchange, "t", 1)
			if got := b.Drain(queue, 1, 5*time.Second); len(got) != 1 {
				t.Fatalf("the first record was not published (%d)", len(got))
			}
			time.Sleep(2 * period) // idle: the relay probes first
			db.MustExec(db.Rebind("INSERT INTO acemq_outbox (id, exchange_name, routing_key, body, headers, created_at) VALUES ('nullcreated', ?, 't', 'x', '{}', NULL)"), b.Exchange)
			// PostgreSQL publishes it; MySQL fails it at once as malformed
			// (TestStore_MySQL_RowWithoutCreatedAt_StillClaimed): either
			// way a claim took it.
			const limit = 20 * period
			deadline := time.Now().Add(limit)
			for {
				var n int
				if err := db.Get(&n, "SELECT COUNT(*) FROM acemq_outbox WHERE id = 'nullcreated' AND published_at IS NULL AND COALESCE(attempts, 0) = 0"); err != nil {
					t.Fatal(err)
				}
				if n == 0 {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("the row with a NULL created_at was not claimed in %v (floor period %v, floor on: %v)", limit, period, outbox.FloorOn(f))
				}
				time.Sleep(20 * time.Millisecond)
			}
		})
	}
}
