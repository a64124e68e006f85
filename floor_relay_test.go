package outbox_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testamqp"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// With the floor on (claims start where the pending rows start, not at the
// head), a relay still publishes every record, once: among a flow of
// commits, rows committed with a created_at a minute old (a transaction
// that took that long after its Publish, a service whose clock is behind)
// lie below the floor, and go out with the next claim from the head.
func TestForwarder_FloorOn_RecordsBelowItPublishedToo(t *testing.T) {
	for _, kind := range []string{testdb.Postgres, testdb.MySQL} {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			db := migrated(t, kind)
			b := testamqp.New(t)
			queue := b.Queue("t")
			f := newForwarder(t, db, outbox.ForwarderConfig{PollInterval: 50 * time.Millisecond})
			outbox.SetFloorOn(f, 300*time.Millisecond)
			runInBackground(t, f)
			want := map[string]bool{}
			q := db.Rebind("INSERT INTO acemq_outbox (id, exchange_name, routing_key, body, headers, created_at) VALUES (?, ?, 't', 'x', '{}', ?)")
			for i := range 30 {
				for _, id := range publishN(t, db, b.Exchange, "t", 2) {
					want[id] = true
				}
				id := fmt.Sprintf("late-%02d", i)
				if _, err := db.Exec(q, id, b.Exchange, time.Now().Add(-time.Minute).UTC()); err != nil {
					t.Fatal(err)
				}
				want[id] = true
				time.Sleep(10 * time.Millisecond) // a flow, not a batch
			}
			got := countIDs(b.Drain(queue, len(want), 30*time.Second))
			if !outbox.FloorOn(f) {
				t.Error("the relay kept no floor")
			}
			for id := range want {
				if got[id] != 1 {
					t.Errorf("record %s published %d times", id, got[id])
				}
			}
		})
	}
}

// A Sweep, which a request calls to have what it committed on the broker
// before it answers, starts at the head whatever the floor says: its
// record committed more than the floor's lag after its Publish goes out
// with it, not with the relay's next walk from the head.
func TestForwarder_FloorOn_SweepStartsAtTheHead(t *testing.T) {
	for _, kind := range []string{testdb.Postgres, testdb.MySQL} {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			db := migrated(t, kind)
			b := testamqp.New(t)
			b.Queue("t")
			f := newForwarder(t, db, outbox.ForwarderConfig{})
			outbox.SetFloorOn(f, time.Hour)
			publishN(t, db, b.Exchange, "t", 1)
			if n := sweepAll(t, f); n != 1 { // the floor is read, at most its lag before now
				t.Fatalf("published %d, want 1", n)
			}
			if !outbox.FloorOn(f) {
				t.Fatal("the relay keeps no floor")
			}
			if _, err := db.Exec(db.Rebind("INSERT INTO acemq_outbox (id, exchange_name, routing_key, body, headers, created_at) VALUES (?, ?, 't', 'x', '{}', ?)"),
				"late", b.Exchange, time.Now().Add(-time.Minute).UTC()); err != nil {
				t.Fatal(err)
			}
			if n, err := f.Sweep(context.Background()); err != nil || n != 1 {
				t.Fatalf("the Sweep published %d (%v), want the record below the floor", n, err)
			}
		})
	}
}
