package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testamqp"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// hookedDest is the AMQP destination, pipelining, with a test's hooks run
// before each Connect (the relay's first step of every claim) and before
// each send, given how many batches were sent and waited for before it.
type hookedDest struct {
	*outbox.AMQPDestination
	beforeConnect func(sent, waited int32) error
	beforeSend    func(sent int32)
	// afterWait may change the results a Wait returns.
	afterWait func(records []outbox.Record, results []error)

	sends, waits atomic.Int32
}

func newHookedDest(t *testing.T) *hookedDest {
	t.Helper()
	inner, err := outbox.NewAMQPDestination(outbox.AMQPConfig{URLs: []string{testdb.AMQPURL()}})
	if err != nil {
		t.Fatal(err)
	}
	return &hookedDest{AMQPDestination: inner}
}

func (d *hookedDest) Connect(ctx context.Context) error {
	if d.beforeConnect != nil {
		if err := d.beforeConnect(d.sends.Load(), d.waits.Load()); err != nil {
			return err
		}
	}
	return d.AMQPDestination.Connect(ctx)
}

func (d *hookedDest) Pipeline() outbox.Pipeline {
	return hookedPipe{Pipeline: d.AMQPDestination.Pipeline(), d: d}
}

type hookedPipe struct {
	outbox.Pipeline
	d *hookedDest
}

func (p hookedPipe) Destination() outbox.Destination { return p.d }

func (p hookedPipe) Send(ctx context.Context, records []outbox.Record) outbox.Sent {
	if p.d.beforeSend != nil {
		p.d.beforeSend(p.d.sends.Load())
	}
	defer p.d.sends.Add(1)
	return p.Pipeline.Send(ctx, records)
}

func (p hookedPipe) Wait(ctx context.Context, s outbox.Sent) []error {
	defer p.d.waits.Add(1)
	res := p.Pipeline.Wait(ctx, s)
	if p.d.afterWait != nil {
		p.d.afterWait(s.Records(), res)
	}
	return res
}

// A claim that fails while batches are in flight is behind none of them:
// the ones the broker confirms are marked, and no message reaches the
// broker twice. (They were held back, released and sent again.)
func TestForwarder_Run_ClaimFailsWithBatchesInFlight_ConfirmedOnesMarkedNoneTwice(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		b := testamqp.New(t)
		queue := b.Queue("claim.fails")
		const n = 500
		publishBatch(t, db, b.Exchange, "claim.fails", n)

		// The connect fails once, at the first claim after 3 batches were
		// sent: a claim that fails while batches are in flight, as a MySQL
		// claim that deadlocks does.
		var (
			failed   atomic.Bool
			inFlight atomic.Int32 // batches sent and not waited for when it failed
		)
		dest := newHookedDest(t)
		dest.beforeConnect = func(sent, waited int32) error {
			if sent >= 3 && failed.CompareAndSwap(false, true) {
				inFlight.Store(sent - waited)
				return errors.New("the test refuses this connect")
			}
			return nil
		}
		f, err := outbox.NewForwarder(db.DB, dest, outbox.ForwarderConfig{
			BatchSize: 10, MaxBatchSize: 10, RetryMin: 10 * time.Millisecond, RetryMax: 50 * time.Millisecond,
		})
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		runUntilDrained(t, f)
		if !failed.Load() {
			t.Fatal("the connect never failed: the test proved nothing")
		}
		if inFlight.Load() == 0 {
			t.Fatal("no batch was in flight when the claim failed: the test proved nothing")
		}
		if twice := arrivedTwice(t, b, queue, n); twice != 0 {
			t.Errorf("%d messages arrived twice, want none", twice)
		}
		t.Logf("%d batch(es) in flight when the claim failed", inFlight.Load())
	})
}

// A batch's claim connection killed while the batches after it are in
// flight: its mark fails, and its records are sent again (the broker had
// them), but the batches after it are marked as their confirms say. (They
// were held back as if behind a failed record, and went out again too.)
func TestForwarder_Run_MarkFailsWithBatchesInFlight_OnlyItsBatchGoesTwice(t *testing.T) {
	t.Parallel()
	for _, kind := range []string{testdb.Postgres, testdb.MySQL} {
		t.Run(kind, func(t *testing.T) {
			db := migrated(t, kind)
			b := testamqp.New(t)
			queue := b.Queue("mark.fails")
			const n, batch = 300, 10
			publishBatch(t, db, b.Exchange, "mark.fails", n)

			relayDB, appName := ownRelayPool(t, db)
			killer, err := db.Conn(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			defer killer.Close()
			oldest := "SELECT pid FROM pg_stat_activity WHERE application_name = $1 AND state = 'idle in transaction' ORDER BY xact_start LIMIT 1"
			kill := "SELECT pg_terminate_backend($1)"
			args := []any{appName}
			if kind == testdb.MySQL {
				oldest = "SELECT t.trx_mysql_thread_id FROM information_schema.INNODB_TRX t JOIN information_schema.PROCESSLIST p ON p.ID = t.trx_mysql_thread_id" +
					" WHERE p.DB = DATABASE() AND p.ID <> CONNECTION_ID() ORDER BY CAST(t.trx_id AS UNSIGNED) LIMIT 1"
				kill, args = "KILL ?", nil
			}
			// At the third send, first the connection of the relay's oldest
			// open transaction goes: the claim of the oldest batch in
			// flight, whose mark then fails, with the batches after it in
			// flight.
			var killed atomic.Bool
			dest := newHookedDest(t)
			dest.beforeSend = func(sent int32) {
				if sent != 2 {
					return
				}
				var id int64
				if err := killer.QueryRowContext(context.Background(), oldest, args...).Scan(&id); err != nil {
					t.Logf("no claim to kill: %v", err)
					return
				}
				_, err := killer.ExecContext(context.Background(), kill, id)
				killed.Store(err == nil)
			}
			f, err := outbox.NewForwarder(relayDB, dest, outbox.ForwarderConfig{
				BatchSize: batch, MaxBatchSize: batch, RetryMin: 10 * time.Millisecond, RetryMax: 50 * time.Millisecond,
				OnError: func(error, outbox.ErrorContext) {},
			})
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			runUntilDrained(t, f)
			if !killed.Load() {
				t.Fatal("no claim was killed: the test proved nothing")
			}
			twice := arrivedTwice(t, b, queue, n)
			t.Logf("%d messages arrived twice", twice)
			if twice > batch {
				t.Errorf("%d messages arrived twice: more than the batch whose mark failed (%d)", twice, batch)
			}
		})
	}
}

// runUntilDrained runs f until no row is pending, and stops it.
func runUntilDrained(t *testing.T, f *outbox.Forwarder) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- f.Run(ctx) }()
	waitFor(t, 60*time.Second, "every row to be published", func() bool { return pendingCount(t, f) == 0 })
	cancel()
	if err := <-done; err != nil && !errors.Is(err, context.Canceled) {
		t.Fatalf("Run: %v", err)
	}
}

// arrivedTwice drains queue of n distinct messages and their copies, fails
// t unless all n arrived, and returns how many copies came beyond one each.
func arrivedTwice(t *testing.T, b *testamqp.Broker, queue string, n int) int {
	t.Helper()
	seen := countIDs(b.Drain(queue, n, 10*time.Second))
	if len(seen) != n {
		t.Errorf("%d distinct messages arrived, want %d", len(seen), n)
	}
	twice := 0
	for _, c := range seen {
		twice += c - 1
	}
	return twice
}

// A batch with a record that failed (unroutable) and whose mark then failed
// too: the batches in flight after it are still behind a failed record, and
// none of their rows is marked before it is tried again. (From review: the
// mark's failure hid the record's, and they were marked.)
func TestForwarder_Run_RecordAndMarkFailInOneBatch_BatchesAfterItHeldBack(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.SQLite)
	b := testamqp.New(t)
	queue := b.Queue("ok")
	var keys [][2]string
	for i := 0; i < 60; i++ {
		rk := "ok"
		if i == 4 {
			rk = "nobody.listens"
		}
		keys = append(keys, [2]string{fmt.Sprintf("m-%03d", i), rk})
	}
	publishOrdered(t, db, b.Exchange, keys...)
	f := newForwarder(t, db, outbox.ForwarderConfig{
		BatchSize: 10, MaxBatchSize: 10, MaxAttempts: 3, RetryMin: 2 * time.Second, RetryMax: 2 * time.Second,
		OnError: func(error, outbox.ErrorContext) {},
	})
	var (
		mu        sync.Mutex
		calls     int
		refusedAt time.Time
		early     []string // marked within a second of the refusal
	)
	outbox.SetAfterPublishHook(f, func(published []string) error {
		mu.Lock()
		defer mu.Unlock()
		if calls++; calls == 1 { // the first batch's, with m-004 refused by the broker
			refusedAt = time.Now()
			return errors.New("injected: the database refused the marks")
		}
		if time.Since(refusedAt) < time.Second {
			early = append(early, published...)
		}
		return nil
	})
	go func() { _ = f.Run(context.Background()) }()
	waitFor(t, 60*time.Second, "the outbox to drain, m-004 stuck", func() bool {
		st, err := f.Store().Stats(context.Background())
		return err == nil && st.Pending == 0 && st.Stuck == 1
	})
	mu.Lock()
	defer mu.Unlock()
	if len(early) > 0 {
		t.Errorf("%d rows after the refused m-004 were marked before it was tried again (%v …)", len(early), early[0])
	}
	if seen := countIDs(b.Drain(queue, 59, 10*time.Second)); len(seen) != 59 {
		t.Errorf("%d distinct messages arrived, want 59", len(seen))
	}
}

// A record released unsent in the middle of what went out (ErrNotSent: the
// broker closed the channel over another message before it confirmed this
// one, while it had confirmed records after it, to other queues) holds back
// the records after it, in its batch and in the batches in flight behind
// it, as a failed record does: none is marked published before it. They
// were marked, and it went out after them.
func TestForwarder_Run_RecordReleasedUnsentMidBatch_NothingAfterItMarkedFirst(t *testing.T) {
	t.Parallel()
	for _, unsent := range []string{"m-015", "m-019"} { // within its batch, and last in it
		t.Run(unsent, func(t *testing.T) { releasedUnsentHoldsBack(t, unsent) })
	}
}

func releasedUnsentHoldsBack(t *testing.T, unsent string) {
	db := migrated(t, testdb.SQLite)
	b := testamqp.New(t)
	queue := b.Queue("ok")
	var keys [][2]string
	for i := 0; i < 60; i++ {
		keys = append(keys, [2]string{fmt.Sprintf("m-%03d", i), "ok"})
	}
	publishOrdered(t, db, b.Exchange, keys...)
	d := newHookedDest(t)
	var released atomic.Bool
	d.afterWait = func(records []outbox.Record, results []error) {
		for i, r := range records {
			if r.ID == unsent && results[i] == nil && released.CompareAndSwap(false, true) {
				results[i] = fmt.Errorf("%w: injected: the broker closed the channel over another message before it confirmed this one", outbox.ErrNotSent)
			}
		}
	}
	f, err := outbox.NewForwarder(db.DB, d, outbox.ForwarderConfig{
		BatchSize: 10, MaxBatchSize: 10, RetryMin: 10 * time.Millisecond, RetryMax: 50 * time.Millisecond,
		OnError: func(error, outbox.ErrorContext) {},
	})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var (
		mu     sync.Mutex
		marked []string
	)
	outbox.SetAfterPublishHook(f, func(published []string) error {
		mu.Lock()
		defer mu.Unlock()
		marked = append(marked, published...)
		return nil
	})
	runUntilDrained(t, f)
	if !released.Load() {
		t.Fatalf("%s was never released unsent", unsent)
	}
	mu.Lock()
	defer mu.Unlock()
	for i := 1; i < len(marked); i++ {
		if marked[i] < marked[i-1] {
			t.Fatalf("%s marked published after %s: a record behind it went first", marked[i], marked[i-1])
		}
	}
	if len(marked) != 60 {
		t.Errorf("%d marks, want 60, one per row", len(marked))
	}
	if seen := countIDs(b.Drain(queue, 60, 10*time.Second)); len(seen) != 60 {
		t.Errorf("%d distinct messages arrived, want 60", len(seen))
	}
}
