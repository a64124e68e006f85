package outbox_test

import (
	"context"
	"testing"
	"time"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testamqp"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// On PostgreSQL a relay woken by NOTIFY probes and claims at once, and
// otherwise waits PollInterval. With the floor on, a row below the floor
// (its transaction committed more than floorLag after its Publish) wakes
// the relay, whose probe starts at the floor and misses it: the relay goes
// back to sleep for PollInterval, not for what is left of the floor's
// period. The row waits PollInterval, however long that is configured,
// not "at most one period (<= 10 s)".
func TestForwarder_FloorOn_WokenForARowBelowIt_PublishesWithinThePeriod(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.Postgres)
	b := testamqp.New(t)
	queue := b.Queue("t")
	const (
		period = 2 * time.Second
		poll   = 12 * time.Second
	)
	f := newForwarder(t, db, outbox.ForwarderConfig{PollInterval: poll})
	outbox.SetFloorOn(f, period)
	runInBackground(t, f)
	// A record as usual: the relay is listening, and goes out at its NOTIFY.
	publishN(t, db, b.Exchange, "t", 1)
	if got := b.Drain(queue, 1, 5*time.Second); len(got) != 1 {
		t.Fatalf("the first record was not published (%d)", len(got))
	}
	// Committed now, created a minute ago (a transaction that took that
	// long after its Publish): below the floor; its NOTIFY wakes the relay.
	if _, err := db.Exec(db.Rebind("INSERT INTO acemq_outbox (id, exchange_name, routing_key, body, headers, created_at) VALUES (?, ?, 't', 'x', '{}', ?)"),
		"late", b.Exchange, time.Now().Add(-time.Minute).UTC()); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	got := b.Drain(queue, 1, poll+5*time.Second)
	took := time.Since(start)
	if len(got) != 1 {
		t.Fatalf("the late record was not published in %v", took)
	}
	if limit := period + 2*time.Second; took > limit {
		t.Fatalf("the record below the floor went out %v after its commit (and NOTIFY); the floor's period is %v, PollInterval %v: want it within %v",
			took.Round(time.Millisecond), period, poll, limit)
	}
}

// Republish (in this process) is said to make the relay's next claim start
// at the head, as Store.Retry does: the records it makes pending again are
// old, below the floor. But a Republisher has a Store of its own
// (NewRepublisher), whose floor it lowers, not the Forwarder's: the
// records it makes pending wait for the relay's next walk from the head,
// Notify or not (here a Sweep, "for a request that wants its message on
// the broker", finds nothing).
func TestForwarder_FloorOn_RepublishInProcess_LowersTheRelaysFloor(t *testing.T) {
	t.Parallel()
	for _, kind := range []string{testdb.Postgres, testdb.MySQL} {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			db := migrated(t, kind)
			topic := "orders-" + testdb.RandomName()
			b := testamqp.New(t)
			b.Queue(topic)
			f := newForwarder(t, db, outbox.ForwarderConfig{})
			outbox.SetFloorOn(f, time.Hour)
			id := publishN(t, db, b.Exchange, topic, 1)[0]
			if n := sweepAll(t, f); n != 1 {
				t.Fatalf("published %d, want 1", n)
			}
			// Published and created an hour ago, never processed.
			at := time.Now().Add(-time.Hour).UTC()
			var arg any = at
			if db.Kind != testdb.Postgres {
				arg = at.Format("2006-01-02 15:04:05.000000")
			}
			db.MustExec(db.Rebind("UPDATE acemq_outbox SET published_at = ?, created_at = ? WHERE id = ?"), arg, arg, id)
			if n := sweepAll(t, f); n != 0 { // the floor is read again, now above the record
				t.Fatalf("published %d, want 0", n)
			}
			rp, err := outbox.NewRepublisher(db.DB, outbox.RepublisherConfig{TrackedTopics: outbox.NewTrackedTopics(topic), Grace: 10 * time.Minute, Notify: f.Notify})
			if err != nil {
				t.Fatal(err)
			}
			if n, err := rp.Republish(context.Background()); err != nil || n != 1 {
				t.Fatalf("Republish: %d, %v; want 1", n, err)
			}
			if n, err := f.Sweep(context.Background()); err != nil || n != 1 {
				t.Fatalf("the Sweep after an in-process Republish published %d (%v), want 1: the relay's floor was not lowered", n, err)
			}
		})
	}
}
