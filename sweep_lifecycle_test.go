package outbox_test

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testamqp"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// windowInFlight connects a destination, sends a window of 1000 records on
// its pipeline (Run's batch in flight) and returns what the test needs:
// the destination, a maker of records, and the window's collection, which
// fails the test if a record of it was not confirmed (blamed on why).
func windowInFlight(t *testing.T) (d *outbox.AMQPDestination, recs func(n int) []outbox.Record, collect func(why string), queued func() int) {
	t.Helper()
	b := testamqp.New(t)
	q := b.Queue("t")
	d, err := outbox.NewAMQPDestination(outbox.AMQPConfig{URLs: []string{testdb.AMQPURL()}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Close() })
	recs = func(n int) []outbox.Record {
		r := make([]outbox.Record, n)
		for i := range r {
			r[i] = outbox.Record{ID: watermill.NewUUID(), Exchange: b.Exchange, RoutingKey: "t", Body: make([]byte, 4096)}
		}
		return r
	}
	if res := d.Publish(context.Background(), recs(1)); res[0] != nil { // connected, the exchange checked
		t.Fatal(res[0])
	}
	p := d.Pipeline()
	sent := p.Send(context.Background(), recs(1000))
	collect = func(why string) {
		t.Helper()
		wctx, wcancel := context.WithTimeout(context.Background(), 10*time.Second)
		res := p.Wait(wctx, sent)
		wcancel()
		lost, first := 0, error(nil)
		for _, err := range res {
			if err != nil {
				lost++
				first = cmp.Or(first, err)
			}
		}
		if lost > 0 {
			t.Errorf("%d of 1000 records of the window in flight failed (%v), because %s", lost, first, why)
		}
	}
	return d, recs, collect, func() int { return b.Count(q) }
}

// A Publish whose caller gives up before the confirms come (a Sweep bounded
// by a request) stops waiting; it does not drop the connection, which took
// with it the confirms of another window out on it (Run's batch in
// flight): 914–1000 of its 1000 records failed before, the broker holding
// most of them, and went out again.
func TestAMQPDestination_CallerGivesUpOnAPublish_WindowInFlightKeepsItsConfirms(t *testing.T) {
	t.Parallel()
	d, recs, collect, queued := windowInFlight(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Millisecond)
	cut := d.Publish(ctx, recs(1))
	cancel()
	collect(fmt.Sprintf("another caller gave up on its publish (%v)", cut[0]))
	if n := queued(); n < 1001 {
		t.Errorf("%d in the queue, want the 1001 confirmed at least", n)
	}
}

// The same with a caller whose context ended before its Publish began (a
// 5 ms deadline spent waiting for the destination's lock, as on a loaded
// machine): its write failed at once ("i/o timeout") and the connection
// went with it, and 255 of the 1000 records in flight failed in one CI run.
// Its writes are not cut short by its context now, and the window in
// flight keeps every confirm.
func TestAMQPDestination_CallerWhoseContextEndedBeforeItsPublish_WindowInFlightKeepsItsConfirms(t *testing.T) {
	t.Parallel()
	d, recs, collect, queued := windowInFlight(t)
	for _, ended := range []func() (context.Context, context.CancelFunc){
		func() (context.Context, context.CancelFunc) {
			return lateTimer{context.Background(), time.Now().Add(-time.Millisecond)}, func() {}
		},
		func() (context.Context, context.CancelFunc) {
			return context.WithDeadline(context.Background(), time.Now())
		},
		func() (context.Context, context.CancelFunc) {
			ctx, cancel := context.WithCancel(context.Background())
			cancel()
			return ctx, cancel
		},
	} {
		ctx, cancel := ended()
		cut := d.Publish(ctx, recs(3))
		cancel()
		for _, err := range cut {
			if err != nil && !errors.Is(err, outbox.ErrConnectionLost) && !errors.Is(err, outbox.ErrNotSent) {
				t.Errorf("a publish given up on failed with %v, want ErrConnectionLost or ErrNotSent (nothing of the record's doing)", err)
			}
		}
	}
	collect("callers had given up on their publishes before they began")
	if res := d.Publish(context.Background(), recs(1)); res[0] != nil {
		t.Errorf("a publish after them: %v", res[0])
	}
	if n := queued(); n < 1002 {
		t.Errorf("%d in the queue, want the 1002 confirmed at least", n)
	}
}

// lateTimer is a context whose deadline passed while its timer has not
// fired yet, as a loaded machine runs it late: not Done, no Err.
type lateTimer struct {
	context.Context
	deadline time.Time
}

func (c lateTimer) Deadline() (time.Time, bool) { return c.deadline, true }

// The same through the Forwarder: Run drains a backlog while a caller
// calls Sweep with deadlines of a few milliseconds. Run's records never
// fail for it (3–7 of them did, with ErrConnectionLost, before); the
// Sweeps' own records, given up on, go out again.
func TestForwarder_SweepsCutByTheirCallersBesideRun_RunLosesNoConnection(t *testing.T) {
	db := migrated(t, testdb.Postgres)
	b := testamqp.New(t)
	q := b.Queue("t")
	const n = 10000
	for i := 0; i < n/1000; i++ {
		publishBatch(t, db, b.Exchange, "t", 1000)
	}
	var lost atomic.Int32
	f := newForwarder(t, db, outbox.ForwarderConfig{BatchSize: 100, MaxBatchSize: 100, RetryMin: time.Millisecond, RetryMax: 5 * time.Millisecond,
		OnError: func(err error, dest outbox.ErrorContext) {
			if dest.MessageID != "" && errors.Is(err, outbox.ErrConnectionLost) && lost.Add(1) < 4 {
				t.Logf("Run's record: %v", err) // a Sweep reports nothing through OnError
			}
		}})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- f.Run(ctx) }()
	stop, stopped := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(stopped)
		for {
			select {
			case <-stop:
				return
			default:
			}
			sctx, c := context.WithTimeout(context.Background(), time.Duration(2+rand.IntN(25))*time.Millisecond)
			_, _ = f.Sweep(sctx)
			c()
			time.Sleep(2 * time.Millisecond)
		}
	}()
	waitFor(t, 120*time.Second, "the backlog drained", func() bool { return pendingCount(t, f) == 0 })
	close(stop)
	<-stopped
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if got := len(countIDs(b.Drain(q, n, 20*time.Second))); got != n {
		t.Errorf("%d ids delivered, want %d", got, n)
	}
	if lost.Load() > 0 {
		t.Errorf("%d of Run's records failed with ErrConnectionLost on a healthy broker", lost.Load())
	}
}

// Close while a caller's Sweep waits on the database for its claim (a
// lock): Close returns within moments, and the Sweep publishes nothing
// after it. Before, Close waited as long as the lock was held (5.5 s of
// 6), and the Sweep then published.
func TestForwarder_CloseWhileASweepWaitsOnTheDatabase_ReturnsPromptlyPublishesNothing(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.Postgres)
	b := testamqp.New(t)
	q := b.Queue("t")
	publishN(t, db, b.Exchange, "t", 1)
	f := newForwarder(t, db, outbox.ForwarderConfig{})
	tx, err := db.Beginx()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec("LOCK TABLE acemq_outbox IN ACCESS EXCLUSIVE MODE"); err != nil {
		t.Fatal(err)
	}
	released := make(chan struct{})
	go func() { defer close(released); time.Sleep(4 * time.Second); _ = tx.Rollback() }()
	defer func() { <-released }()
	type result struct {
		n   int
		err error
	}
	swept := make(chan result, 1)
	go func() { n, err := f.Sweep(context.Background()); swept <- result{n, err} }()
	time.Sleep(500 * time.Millisecond) // the Sweep's claim waits on the lock
	start := time.Now()
	_ = f.Close()
	if took := time.Since(start); took > 2*time.Second {
		t.Errorf("Close took %s behind a Sweep that had claimed nothing", took.Round(time.Millisecond))
	}
	if r := <-swept; r.n != 0 || !errors.Is(r.err, outbox.ErrForwarderClosed) {
		t.Errorf("the Sweep returned %d, %v; want 0, ErrForwarderClosed", r.n, r.err)
	}
	<-released
	if n := b.Count(q); n != 0 {
		t.Errorf("%d published after Close", n)
	}
	if n := pendingCount(t, newForwarder(t, db, outbox.ForwarderConfig{})); n != 1 {
		t.Errorf("%d pending, want the row still pending", n)
	}
}
