package outbox_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testamqp"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// connectFailsOnce is the AMQP destination, pipelining, whose Connect (the
// relay's first step of every claim) fails once, at the first claim after
// failAfter batches were sent: a claim that fails while batches are in
// flight, as a MySQL claim that deadlocks does.
type connectFailsOnce struct {
	*outbox.AMQPDestination
	failAfter int32

	sends, waits atomic.Int32
	failed       atomic.Bool
	inFlight     atomic.Int32 // batches sent and not waited for when it failed
}

func (d *connectFailsOnce) Connect(ctx context.Context) error {
	if d.sends.Load() >= d.failAfter && d.failed.CompareAndSwap(false, true) {
		d.inFlight.Store(d.sends.Load() - d.waits.Load())
		return errors.New("the test refuses this connect")
	}
	return d.AMQPDestination.Connect(ctx)
}

func (d *connectFailsOnce) Pipeline() outbox.Pipeline {
	return connectFailsPipe{Pipeline: d.AMQPDestination.Pipeline(), d: d}
}

type connectFailsPipe struct {
	outbox.Pipeline
	d *connectFailsOnce
}

func (p connectFailsPipe) Destination() outbox.Destination { return p.d }

func (p connectFailsPipe) Send(ctx context.Context, records []outbox.Record) outbox.Sent {
	defer p.d.sends.Add(1)
	return p.Pipeline.Send(ctx, records)
}

func (p connectFailsPipe) Wait(ctx context.Context, s outbox.Sent) []error {
	defer p.d.waits.Add(1)
	return p.Pipeline.Wait(ctx, s)
}

// A claim that fails while batches are in flight is behind none of them:
// the ones the broker confirms are marked, and no message reaches the
// broker twice. (They were held back, released and sent again.)
func TestForwarder_Run_ClaimFailsWithBatchesInFlight_ConfirmedOnesMarkedNoneTwice(t *testing.T) {
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		b := testamqp.New(t)
		queue := b.Queue("claim.fails")
		const n = 500
		publishBatch(t, db, b.Exchange, "claim.fails", n)

		inner, err := outbox.NewAMQPDestination(outbox.AMQPConfig{URLs: []string{testdb.AMQPURL()}})
		if err != nil {
			t.Fatal(err)
		}
		dest := &connectFailsOnce{AMQPDestination: inner, failAfter: 3}
		f, err := outbox.NewForwarder(db.DB, dest, outbox.ForwarderConfig{
			BatchSize: 10, MaxBatchSize: 10, RetryMin: 10 * time.Millisecond, RetryMax: 50 * time.Millisecond,
		})
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- f.Run(ctx) }()
		waitFor(t, 60*time.Second, "every row to be published", func() bool { return pendingCount(t, f) == 0 })
		cancel()
		if err := <-done; err != nil && !errors.Is(err, context.Canceled) {
			t.Fatalf("Run: %v", err)
		}
		if !dest.failed.Load() {
			t.Fatal("the connect never failed: the test proved nothing")
		}
		if dest.inFlight.Load() == 0 {
			t.Fatal("no batch was in flight when the claim failed: the test proved nothing")
		}
		seen := countIDs(b.Drain(queue, n, 10*time.Second))
		if len(seen) != n {
			t.Errorf("%d distinct messages arrived, want %d", len(seen), n)
		}
		for id, c := range seen {
			if c != 1 {
				t.Errorf("message %s arrived %d times, want once", id, c)
			}
		}
		t.Logf("%d batch(es) in flight when the claim failed", dest.inFlight.Load())
	})
}
