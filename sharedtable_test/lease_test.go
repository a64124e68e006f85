package sharedtable_test

import (
	"context"
	"database/sql"
	"math"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testamqp"
	"github.com/acemq/watermill-outbox/internal/testdb"
	"github.com/acemq/watermill-outbox/internal/testrails"
)

// A relay of another AceMQ library leases rows in locked_by/locked_until,
// in UTC. Our relay leaves a row under a live lease alone, on every
// database (where it claims with row locks too), takes a row whose lease
// ran out (its relay died) at once, and the leased row once the lease has
// run out, never before.
func TestForwarder_ForeignLease_RespectedUntilItRunsOut(t *testing.T) {
	eachConn(t, func(t *testing.T, c *conn) {
		ctx := context.Background()
		b := testamqp.New(t)
		queue := b.Queue("ok")
		c.migrate(t)
		now := time.Now().UTC()
		leaseUntil := now.Add(foreignLease)
		for _, r := range []testrails.Row{
			{ID: "leased", CreatedAt: now.Add(-3 * time.Second), LockedBy: "ruby-relay-1", LockedUntil: leaseUntil},
			{ID: "lease-ran-out", CreatedAt: now.Add(-2 * time.Second), LockedBy: "ruby-relay-2", LockedUntil: now.Add(-time.Second)},
			{ID: "free", CreatedAt: now.Add(-time.Second)},
		} {
			r.Exchange, r.RoutingKey, r.Body = b.Exchange, "ok", r.ID
			testrails.Insert(t, c.db, r)
		}

		f := c.forwarder(t, outbox.ForwarderConfig{})
		if n := sweepAll(t, f); n != 2 {
			t.Errorf("relayed %d, want the free row and the one whose lease ran out", n)
		}
		if !time.Now().Before(leaseUntil) {
			t.Fatalf("the lease ran out before the test could see it respected; raise foreignLease")
		}
		if s := c.state(t, "leased"); s.Published || s.LockedBy != "ruby-relay-1" {
			t.Errorf("the row under a live lease: %+v, want untouched", s)
		}
		eventually(t, foreignLease+30*time.Second, "the leased row to be relayed once its lease ran out", func() bool {
			n, err := f.Sweep(ctx)
			if err != nil {
				t.Fatalf("sweep: %v", err)
			}
			if n > 0 && time.Now().Before(leaseUntil) {
				t.Fatalf("the leased row was relayed before its lease ran out at %s", leaseUntil)
			}
			return n > 0
		})
		got := map[string]int{}
		drain(t, b, queue, 3, got)
		for _, id := range []string{"leased", "lease-ran-out", "free"} {
			if got[id] != 1 {
				t.Errorf("%s arrived %d times, want once", id, got[id])
			}
		}
	})
}

// On SQLite our relay's claim is a lease too: written in UTC whatever the
// process's zone, as every AceMQ relay reads it, and respected by a second
// relay while the first publishes.
func TestForwarder_SQLiteLease_WrittenInUTC_SecondRelayWaits(t *testing.T) {
	c := open(t, "sqlite-loc-auto", testdb.SQLite, true)
	c.migrate(t)
	msgs := []*message.Message{message.NewMessage(watermill.NewUUID(), nil), message.NewMessage(watermill.NewUUID(), nil)}
	if err := c.publish(t, func(pub *outbox.TxPublisher) error { return pub.Publish("ok", msgs...) }); err != nil {
		t.Fatal(err)
	}

	const lease = time.Minute
	first := &gate{entered: make(chan struct{}), release: make(chan struct{})}
	fa, err := outbox.NewForwarder(c.lib, first, outbox.ForwarderConfig{RelayID: "relay-a", Lease: lease})
	if err != nil {
		t.Fatal(err)
	}
	defer fa.Close()
	swept := make(chan int, 1)
	go func() {
		n, err := fa.Sweep(context.Background())
		if err != nil {
			t.Errorf("relay A: %v", err)
		}
		swept <- n
	}()
	select {
	case <-first.entered:
	case <-time.After(30 * time.Second):
		t.Fatal("relay A never published")
	}

	for _, msg := range msgs {
		var (
			lockedBy string
			skew     sql.NullFloat64
		)
		q := c.q("SELECT locked_by, " + testrails.UTCSkew(testdb.SQLite, "locked_until") + " FROM acemq_outbox WHERE id = ?")
		if err := c.db.QueryRow(q, msg.UUID).Scan(&lockedBy, &skew); err != nil {
			t.Fatal(err)
		}
		// The lease ends a minute from now, by the database's UTC clock.
		if lockedBy != "relay-a" || !skew.Valid || math.Abs(skew.Float64+lease.Seconds()) > maxSkew.Seconds() {
			t.Errorf("row %s: locked by %q until %.0f s from now, want relay-a for %.0f s", msg.UUID, lockedBy, -skew.Float64, lease.Seconds())
		}
	}
	second := &gate{entered: make(chan struct{}), release: make(chan struct{})}
	close(second.release)
	fb, err := outbox.NewForwarder(c.lib, second, outbox.ForwarderConfig{RelayID: "relay-b"})
	if err != nil {
		t.Fatal(err)
	}
	defer fb.Close()
	if n, err := fb.Sweep(context.Background()); n != 0 || err != nil {
		t.Errorf("relay B swept %d (%v), want nothing: relay A's lease holds the rows", n, err)
	}

	close(first.release)
	if n := <-swept; n != len(msgs) {
		t.Errorf("relay A published %d, want %d", n, len(msgs))
	}
}

// gate is a Destination whose Publish waits until release is closed, and
// then reports every record published.
type gate struct {
	once    sync.Once
	entered chan struct{} // closed at the first Publish
	release chan struct{}
}

func (g *gate) Publish(ctx context.Context, records []outbox.Record) []error {
	g.once.Do(func() { close(g.entered) })
	select {
	case <-g.release:
	case <-ctx.Done():
		errs := make([]error, len(records))
		for i := range errs {
			errs[i] = ctx.Err()
		}
		return errs
	}
	return make([]error, len(records))
}
