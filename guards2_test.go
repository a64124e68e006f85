package outbox_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"
	"github.com/prometheus/client_golang/prometheus"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// Guards for code a second mutation run (over 57a5c26..3c90cc0) found
// unguarded: each fails when the code it names is broken.

// A Destination's panic in Run's loop, recovered by Run's caller (a
// supervisor that restarts the relay), leaves no claim open: the batch the
// loop claimed is rolled back, its pool connection back and its row
// unlocked. (The lifecycle tests check this of Sweep only, and of Run on
// SQLite, whose leases no test looked at.)
func TestPanicInRunLoop_Postgres_ClaimReleased(t *testing.T) {
	db := migrated(t, testdb.Postgres)
	publishN(t, db, "x", "t", 1)
	pool := claimsPool(t, db)
	f, err := outbox.NewForwarder(pool, panickingDest{}, outbox.ForwarderConfig{DisableListen: true})
	if err != nil {
		t.Fatal(err)
	}
	runUntilPanic(t, f)
	assertClaimsReleased(t, db, pool, "Run's recovered panic")
}

// runUntilPanic runs f until its Destination panics, and recovers it.
func runUntilPanic(t *testing.T, f *outbox.Forwarder) {
	t.Helper()
	panicked := make(chan any, 1)
	go func() {
		defer func() { panicked <- recover() }()
		_ = f.Run(context.Background())
	}()
	select {
	case p := <-panicked:
		if p == nil {
			t.Fatal("Run returned without the Destination's panic")
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not panic within 10 s")
	}
}

// gateDest blocks its first Publish until release is closed and counts
// the calls.
type gateDest struct {
	entered chan struct{}
	release chan struct{}
	calls   atomic.Int32
}

func (d *gateDest) Publish(_ context.Context, recs []outbox.Record) []error {
	if d.calls.Add(1) == 1 {
		close(d.entered)
		<-d.release
	}
	return make([]error, len(recs))
}

// Run's context cancelled while a claimed batch is being published: the
// claim was made, so its transaction lives on to the marks (the
// context.AfterFunc that ends a claim with ctx is stopped once the claim is
// made): the record is marked published, not rolled back to be sent again.
func TestRunCancelledMidPublish_Postgres_BatchStillMarked(t *testing.T) {
	db := migrated(t, testdb.Postgres)
	ids := publishN(t, db, "x", "t", 1)
	dest := &gateDest{entered: make(chan struct{}), release: make(chan struct{})}
	f, err := outbox.NewForwarder(db.DB, dest, outbox.ForwarderConfig{DisableListen: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = f.Close() })
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ran := make(chan error, 1)
	go func() { ran <- f.Run(ctx) }()
	select {
	case <-dest.entered:
	case <-time.After(10 * time.Second):
		t.Fatal("the relay did not publish")
	}
	cancel()
	time.Sleep(200 * time.Millisecond)
	close(dest.release)
	select {
	case err := <-ran:
		if err != nil {
			t.Errorf("Run: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not return after its context was cancelled")
	}
	var pending int
	if err := db.Get(&pending, "SELECT count(*) FROM acemq_outbox WHERE id = $1 AND published_at IS NULL", ids[0]); err != nil {
		t.Fatal(err)
	}
	if pending != 0 {
		t.Errorf("row %s published by the Destination but left pending: the claim's transaction was rolled back when Run's context ended, and the record goes out again", ids[0])
	}
}

// SkipHeld, like SkipGap, reads the held messages into the gauges again: an
// alert on a held message whose handler keeps failing ends with the
// operator's skip, not at the next RefreshStats.
func TestSkipHeld_RefreshesTheGauges(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	reg := prometheus.NewRegistry()
	m, err := outbox.NewMetrics(reg)
	if err != nil {
		t.Fatal(err)
	}
	in := orderedInbox(t, db, outbox.InboxConfig{ConsumerName: "ledger", Metrics: m, GapAfter: time.Nanosecond})
	h := in.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		if msg.Metadata.Get(outbox.HeaderSeq) == "2" {
			return nil, errors.New("handler bug")
		}
		return nil, nil
	})
	deliver(t, h, "a", 2)      // held: 1 is missing
	_, _ = h(keyedMsg("a", 1)) // applied; 2, now the key's next, fails and stays held
	if n := countHeld(t, db); n != 1 {
		t.Fatalf("%d held, want 1 (seq 2, its handler failing)", n)
	}
	if err := in.RefreshStats(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got := metricValue(t, reg, "outbox_inbox_held", ""); got != 1 {
		t.Fatalf("outbox_inbox_held = %v before the skip, want 1", got)
	}
	if _, err := in.SkipHeld(context.Background(), "ledger", "a", 2); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"outbox_inbox_held", "outbox_inbox_gaps", "outbox_inbox_oldest_gap_age_seconds"} {
		if got := metricValue(t, reg, name, ""); got != 0 {
			t.Errorf("%s = %v after SkipHeld removed the only held message, want 0", name, got)
		}
	}
}

// A Sweep's claim ends with its context up to the moment it is made: a
// claim that waits for a connection (the pool's only one busy) returns when
// the context ends, rather than waiting for the connection for ever.
func TestSweep_ClaimWaitingForAConnection_EndsWithItsContext(t *testing.T) {
	db := migrated(t, testdb.Postgres)
	publishN(t, db, "x", "t", 1)
	pool, err := sqlx.Open("pgx", db.DSN)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = pool.Close() })
	pool.SetMaxOpenConns(1)
	f, err := outbox.NewForwarder(pool, &gateDest{entered: make(chan struct{}), release: make(chan struct{})}, outbox.ForwarderConfig{DisableListen: true})
	if err != nil {
		t.Fatal(err)
	}
	conn, err := pool.Conn(context.Background()) // the pool's only connection
	if err != nil {
		t.Fatal(err)
	}
	released := false
	defer func() {
		if !released {
			_ = conn.Close()
		}
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	done := make(chan error, 1)
	go func() { _, err := f.Sweep(ctx); done <- err }()
	select {
	case err := <-done:
		if err == nil {
			t.Errorf("Sweep with no connection to be had: nil error, want its context's")
		}
	case <-time.After(5 * time.Second):
		t.Errorf("Sweep still waiting for a connection 5 s after its context ended")
		released = true
		_ = conn.Close()
		<-done
	}
}

// pipePanicDest pipelines: Send keeps the records, and the Wait of the
// second batch panics, with the batches sent after it still in flight.
type pipePanicDest struct {
	waits atomic.Int32
}

type pipePanicSent []outbox.Record

func (s pipePanicSent) Records() []outbox.Record { return s }

func (d *pipePanicDest) Publish(_ context.Context, recs []outbox.Record) []error {
	return make([]error, len(recs))
}
func (d *pipePanicDest) Pipeline() outbox.Pipeline       { return d }
func (d *pipePanicDest) Destination() outbox.Destination { return d }
func (d *pipePanicDest) Capacity() int                   { return 1000 }
func (d *pipePanicDest) Send(_ context.Context, recs []outbox.Record) outbox.Sent {
	return pipePanicSent(recs)
}
func (d *pipePanicDest) Wait(_ context.Context, s outbox.Sent) []error {
	if d.waits.Add(1) == 2 {
		panic("destination bug in Wait")
	}
	return make([]error, len(s.Records()))
}

// A panic while several batches are in flight on the pipeline ends every
// claim the relay holds, not only the one being settled: recovered, it
// leaves no transaction open, no pool connection taken and no row locked.
func TestPanicWithBatchesInFlight_Postgres_EveryClaimReleased(t *testing.T) {
	db := migrated(t, testdb.Postgres)
	publishN(t, db, "x", "t", 40)
	pool := claimsPool(t, db)
	// Batches of 5 and no growth: 40 rows are eight claims, three in flight
	// at once.
	f, err := outbox.NewForwarder(pool, &pipePanicDest{}, outbox.ForwarderConfig{DisableListen: true, BatchSize: 5, MaxBatchSize: 5})
	if err != nil {
		t.Fatal(err)
	}
	runUntilPanic(t, f)
	assertClaimsReleased(t, db, pool, "Run's recovered panic with batches in flight")
}
