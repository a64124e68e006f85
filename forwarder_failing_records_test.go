package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testamqp"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// An unroutable message (no queue bound for its key) and one to a missing
// exchange each fail alone: attempts and last_error counted, reported with
// their destination, left alone at MaxAttempts and listed as stuck, and the
// other rows flow.
func TestForwarder_UnroutableAndMissingExchange_CountedStuckOthersFlow(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		b := testamqp.New(t)
		queue := b.Queue("ok")
		publishOrdered(t, db, b.Exchange, [2]string{"ok-1", "ok"}, [2]string{"unroutable", "nobody.listens"}, [2]string{"ok-2", "ok"})
		publishOrdered(t, db, "no-such-exchange-"+testdb.RandomName(), [2]string{"lost-exchange", "ok"})
		publishOrdered(t, db, b.Exchange, [2]string{"ok-3", "ok"})

		var reported []outbox.ErrorContext
		const maxAttempts = 3
		f := newForwarder(t, db, outbox.ForwarderConfig{MaxAttempts: maxAttempts})
		for i := 0; i < 3*maxAttempts; i++ {
			_, err := f.Sweep(context.Background())
			var perr *outbox.PublishError
			if errors.As(err, &perr) {
				reported = append(reported, perr.Dest)
			}
		}
		for _, id := range []string{"ok-1", "ok-2", "ok-3"} {
			if s := stateOf(t, db, id); !s.Published {
				t.Errorf("%s not published: %+v", id, s)
			}
		}
		for id, want := range map[string]string{"unroutable": "unroutable", "lost-exchange": "does not exist"} {
			s := stateOf(t, db, id)
			if s.Published || s.Attempts != maxAttempts || !strings.Contains(s.LastError, want) {
				t.Errorf("%s: %+v, want unpublished at %d attempts with last_error about %q", id, s, maxAttempts, want)
			}
		}
		seen := countIDs(b.Drain(queue, 3, 5*time.Second))
		// ok-2 was in flight behind the unroutable one when it came back, so
		// it was sent again after it: at-least-once, never lost.
		if seen["ok-1"] != 1 || seen["ok-2"] < 1 || seen["ok-3"] != 1 || len(seen) != 3 {
			t.Errorf("queue received %v, want ok-1, ok-2, ok-3 and nothing else", seen)
		}
		var gotMissing bool
		for _, r := range reported {
			if r.MessageID == "lost-exchange" && strings.HasPrefix(r.Exchange, "no-such-exchange-") && r.RoutingKey == "ok" {
				gotMissing = true
			}
		}
		if !gotMissing {
			t.Errorf("no error reported the missing exchange with its destination: %+v", reported)
		}

		st, err := f.Store().Stats(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		if st.Stuck != 2 || st.Pending != 0 {
			t.Errorf("stats %+v, want 2 stuck and 0 pending", st)
		}
		stuck, err := f.Store().Stuck(context.Background(), 10)
		if err != nil {
			t.Fatal(err)
		}
		if len(stuck) != 2 || stuck[0].ID != "unroutable" || stuck[1].ID != "lost-exchange" || stuck[0].LastError == "" {
			t.Errorf("stuck = %+v, want unroutable then lost-exchange, with last_error", stuck)
		}

		// Left alone: more sweeps neither publish nor count it.
		if n, err := f.Sweep(context.Background()); n != 0 || err != nil {
			t.Errorf("sweep over stuck rows: %d, %v; want 0, nil", n, err)
		}
		if s := stateOf(t, db, "unroutable"); s.Attempts != maxAttempts {
			t.Errorf("a stuck row was tried again: attempts %d", s.Attempts)
		}

		// An operator binds the queue and retries: it goes.
		b.Bind(queue, "nobody.listens")
		if n, err := f.Store().Retry(context.Background(), "unroutable"); n != 1 || err != nil {
			t.Fatalf("retry: %d, %v", n, err)
		}
		if n, err := f.Sweep(context.Background()); n != 1 || err != nil {
			t.Fatalf("sweep after retry: %d, %v; want 1", n, err)
		}
		if n, err := f.Store().RetryAllStuck(context.Background()); n != 1 || err != nil {
			t.Fatalf("retry all stuck: %d, %v; want 1 (lost-exchange)", n, err)
		}
	})
}

// The rows behind a failing record are not published before it: with
// Window 1 not even sent, with the whole batch in flight not marked (and so
// sent again after it). On its retry the failed record goes alone.
func TestForwarder_FailingRecord_RowsBehindItNotPublishedBeforeIt(t *testing.T) {
	t.Parallel()
	for _, window := range []int{1, 0} {
		t.Run(fmt.Sprintf("window=%d", window), func(t *testing.T) {
			eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
				b := testamqp.New(t)
				queue := b.Queue("ok")
				publishOrdered(t, db, b.Exchange, [2]string{"first", "ok"}, [2]string{"refused", "nobody.listens"}, [2]string{"behind", "ok"})

				f := newForwarder(t, db, outbox.ForwarderConfig{}, outbox.AMQPConfig{Window: window})
				n, err := f.Sweep(context.Background())
				if n != 1 || err == nil {
					t.Fatalf("sweep: %d, %v; want 1 published and the refusal", n, err)
				}
				if s := stateOf(t, db, "behind"); s.Published || s.Attempts != 0 {
					t.Fatalf("the row behind the failure: %+v; want it pending, its attempts untouched", s)
				}
				// Retried while still refused: it goes alone, and the row
				// behind it is not sent past it again.
				before := b.Count(queue)
				if n, err := f.Sweep(context.Background()); n != 0 || err == nil {
					t.Fatalf("second sweep: %d, %v; want nothing published", n, err)
				}
				if got := b.Count(queue); got != before {
					t.Fatalf("the retry let %d messages past the refused record", got-before)
				}
				// Once the failing one goes, the rest follow, in order.
				b.Bind(queue, "nobody.listens")
				sweepAll(t, f)
				var order []string
				for _, d := range b.Drain(queue, 3, 5*time.Second) {
					order = append(order, d.MessageId)
				}
				last := map[string]int{}
				for i, id := range order {
					last[id] = i
				}
				if order[0] != "first" || last["refused"] > last["behind"] || len(last) != 3 {
					t.Errorf("arrival order %v: want first, then refused before the final copy of behind", order)
				}
				if window == 1 && strings.Join(order, ",") != "first,refused,behind" {
					t.Errorf("arrival order %v, want exactly first, refused, behind", order)
				}
			})
		})
	}
}

// After a failed sweep the relay waits RetryMin, doubling up to RetryMax:
// a record that keeps failing is not hammered.
func TestForwarder_Run_FailingRecord_BackoffDoubles(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.SQLite)
	testamqp.New(t)
	publishOrdered(t, db, "no-such-exchange-"+testdb.RandomName(), [2]string{"refused", "k"})
	var (
		mu       sync.Mutex
		attempts []time.Time
	)
	f := newForwarder(t, db, outbox.ForwarderConfig{
		MaxAttempts: 5, RetryMin: 50 * time.Millisecond, RetryMax: 400 * time.Millisecond, PollInterval: time.Hour,
		OnError: func(error, outbox.ErrorContext) {
			mu.Lock()
			defer mu.Unlock()
			attempts = append(attempts, time.Now())
		},
	})
	go func() { _ = f.Run(context.Background()) }()
	// OnError runs after the relay commits the attempt: wait for the fifth
	// report, then the row must show five.
	waitFor(t, 20*time.Second, "five failures reported", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(attempts) >= 5
	})
	if n := stateOf(t, db, "refused").Attempts; n != 5 {
		t.Fatalf("row shows %d attempts after five reports, want 5", n)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(attempts) != 5 {
		t.Fatalf("%d failures reported, want 5", len(attempts))
	}
	// The gaps are at least 50, 100, 200 and 400 ms: the backoff grows.
	for i, min := range []time.Duration{50, 100, 200, 400} {
		if gap := attempts[i+1].Sub(attempts[i]); gap < min*time.Millisecond {
			t.Errorf("gap %d was %s, want at least %dms", i+1, gap, min)
		}
	}
}

// A wake-up during a backoff (Notify here; NOTIFY or the file watch alike)
// neither cuts it short nor lengthens it: the retry comes one backoff
// after the failure. The relay slept a whole backoff again after the
// wake-up, on top of what it had waited already: woken 1.5 s into a 2 s
// backoff, it tried again 3.5 s after the failure.
func TestForwarder_Run_WokenDuringBackoff_RetriesOneBackoffAfterTheFailure(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	insertRaw(t, db, "lost", "x", "t", "{}", "utf-8")
	const backoff = 2 * time.Second
	dest := &sendLog{}
	f, err := outbox.NewForwarder(db.DB, dest, outbox.ForwarderConfig{
		Dialect: outbox.SQLite, RetryMin: backoff, RetryMax: backoff, PollInterval: time.Hour,
		DisableListen: true, // no wake-up but the test's: its own marks would wake it through the file watch
		OnError:       func(error, outbox.ErrorContext) {},
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- f.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done; _ = f.Close() })

	waitFor(t, 10*time.Second, "the first send", func() bool { return len(dest.times()) >= 1 })
	// Not a synchronisation: the wake-up must come while the relay backs
	// off, three quarters of the way through.
	time.Sleep(backoff * 3 / 4)
	f.Notify()
	waitFor(t, 4*backoff, "the retry", func() bool { return len(dest.times()) >= 2 })
	sends := dest.times()
	gap := sends[1].Sub(sends[0])
	t.Logf("retry %s after the failure (backoff %s, woken at %s)", gap.Round(time.Millisecond), backoff, backoff*3/4)
	if gap < backoff {
		t.Errorf("retry %s after the failure: the wake-up cut the %s backoff short", gap.Round(time.Millisecond), backoff)
	}
	// Halfway between one backoff and the 1.75 it became: room for a
	// stalled machine either way.
	if limit := backoff * 11 / 8; gap > limit {
		t.Errorf("retry %s after the failure, over %s: the wake-up lengthened the %s backoff", gap.Round(time.Millisecond), limit, backoff)
	}
}

// sendLog is a broker whose connection goes before it confirms anything
// (see lostDest), and notes when each batch was sent.
type sendLog struct {
	lostDest
	mu   sync.Mutex
	sent []time.Time
}

func (d *sendLog) Publish(ctx context.Context, records []outbox.Record) []error {
	d.mu.Lock()
	d.sent = append(d.sent, time.Now())
	d.mu.Unlock()
	return d.lostDest.Publish(ctx, records)
}

func (d *sendLog) times() []time.Time {
	d.mu.Lock()
	defer d.mu.Unlock()
	return slices.Clone(d.sent)
}

// Rows another library or a person wrote badly (headers that are not a JSON
// object or hold what AMQP cannot carry, an unknown body encoding) fail alone
// and at once, and the relay goes on with the rest in the same sweep.
func TestForwarder_PoisonRows_FailAloneStuckAtOnce_RelayGoesOn(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		b := testamqp.New(t)
		queue := b.Queue("ok")
		insertRaw(t, db, "bad-json", b.Exchange, "ok", "{not json", "utf-8")
		insertRaw(t, db, "bad-value", b.Exchange, "ok", `{"retries": 18446744073709551616}`, "utf-8") // no AMQP integer holds 2^64
		insertRaw(t, db, "bad-encoding", b.Exchange, "ok", `{}`, "rot13")
		insertRaw(t, db, "good", b.Exchange, "ok", `{"k":"v"}`, "utf-8")

		f := newForwarder(t, db, outbox.ForwarderConfig{})
		n, err := f.Sweep(context.Background())
		if n != 1 {
			t.Fatalf("sweep published %d (%v), want the good row in the same sweep", n, err)
		}
		if !outbox.IsPermanent(err) {
			t.Errorf("sweep error %v, want permanent failures", err)
		}
		for id, want := range map[string]string{"bad-json": "headers are not a JSON object", "bad-value": `header "retries"`, "bad-encoding": "body_encoding"} {
			s := stateOf(t, db, id)
			if s.Published || s.Attempts != outbox.DefaultMaxAttempts || !strings.Contains(s.LastError, want) {
				t.Errorf("%s: %+v, want stuck at once with last_error about %q", id, s, want)
			}
		}
		if d := b.Drain(queue, 1, 5*time.Second); len(d) != 1 || d[0].MessageId != "good" || d[0].Headers["k"] != "v" {
			t.Errorf("queue received %d messages, want only the good one", len(d))
		}
	})
}

// Under the pipelined Run, a row the client cannot encode (a header name
// over AMQP's 255 bytes, written by hand or another library) is stuck at
// once, as under Sweep: it is not taken for a lost connection and retried
// for ever. The rows around it arrive.
func TestForwarder_Run_RowTheClientCannotEncode_StuckAtOnce(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		b := testamqp.New(t)
		queue := b.Queue("ok")
		before := publishN(t, db, b.Exchange, "ok", 30)
		insertRaw(t, db, "long-header-name", b.Exchange, "ok", `{"`+strings.Repeat("k", 300)+`":"v"}`, "utf-8")
		after := publishN(t, db, b.Exchange, "ok", 30)

		f := newForwarder(t, db, outbox.ForwarderConfig{BatchSize: 10, RetryMin: 10 * time.Millisecond, RetryMax: 50 * time.Millisecond})
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- f.Run(ctx) }()
		waitFor(t, 30*time.Second, "the row to be stuck and the rest published", func() bool {
			return stateOf(t, db, "long-header-name").Attempts == outbox.DefaultMaxAttempts && pendingCount(t, f) == 0
		})
		cancel()
		if err := <-done; err != nil {
			t.Fatal(err)
		}
		got := countIDs(b.Drain(queue, 60, 10*time.Second))
		if s := stateOf(t, db, "long-header-name"); s.Published || !strings.Contains(s.LastError, "header name of 300 bytes") {
			t.Errorf("row: %+v, want stuck with last_error about the header name", s)
		}
		for _, id := range append(before, after...) {
			if got[id] == 0 {
				t.Fatalf("message %s never arrived (%d of 60)", id, len(got))
			}
		}
	})
}

// A row of another library with a CC (or BCC) header that is a string:
// RabbitMQ reads both as sender-selected routing, takes arrays only, and
// closes the channel over any other value, at every try. The row was
// retried as an ordinary failure and held back every row behind it until
// MaxAttempts (43 s with the defaults). It is stuck at once, saying why,
// and the rows around it arrive; an array is sent.
func TestForwarder_Run_ForeignRoutingHeaderNotAnArray_StuckAtOnce(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		b := testamqp.New(t)
		queue := b.Queue("ok")
		before := publishN(t, db, b.Exchange, "ok", 10)
		insertRaw(t, db, "cc-string", b.Exchange, "ok", `{"CC":"audit"}`, "utf-8")
		insertRaw(t, db, "cc-array", b.Exchange, "ok", `{"CC":["nowhere-bound"]}`, "utf-8")
		after := publishN(t, db, b.Exchange, "ok", 10)

		f := newForwarder(t, db, outbox.ForwarderConfig{BatchSize: 5})
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- f.Run(ctx) }()
		waitFor(t, 10*time.Second, "the row to be stuck and the rest published", func() bool {
			return stateOf(t, db, "cc-string").Attempts == outbox.DefaultMaxAttempts && pendingCount(t, f) == 0
		})
		cancel()
		if err := <-done; err != nil {
			t.Fatal(err)
		}
		if s := stateOf(t, db, "cc-string"); s.Published || !strings.Contains(s.LastError, `header "CC" of type string`) {
			t.Errorf("row: %+v, want stuck with last_error about the CC header", s)
		}
		got := countIDs(b.Drain(queue, 21, 10*time.Second))
		for _, id := range append(append(before, after...), "cc-array") {
			if got[id] == 0 {
				t.Fatalf("message %s never arrived (%d of 21)", id, len(got))
			}
		}
	})
}

// Under the pipelined Run, a message over which the broker closes the
// channel (its exchange deleted after the relay checked it) fails its
// record with an attempt counted, and the exchange is checked again: the
// record is stuck after MaxAttempts with "does not exist", never taken for a
// lost connection and retried for ever. (Whether the next batch's connect or
// the wait sees the closed channel first is up to timing; both must count.)
func TestForwarder_Run_ChannelClosedOverARecord_CountedNotLost(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		b := testamqp.New(t)
		queue := b.Queue("ok")
		var lost atomic.Int64
		f := newForwarder(t, db, outbox.ForwarderConfig{
			MaxAttempts: 3, RetryMin: 10 * time.Millisecond, RetryMax: 50 * time.Millisecond, PollInterval: 20 * time.Millisecond,
			OnError: func(err error, _ outbox.ErrorContext) {
				if errors.Is(err, outbox.ErrConnectionLost) {
					lost.Add(1)
				}
			},
		})
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- f.Run(ctx) }()
		first := publishN(t, db, b.Exchange, "ok", 1)
		if got := b.Drain(queue, 1, 10*time.Second); len(got) != 1 || got[0].MessageId != first[0] {
			t.Fatalf("the first message did not arrive: the relay never checked the exchange")
		}
		b.With(func(ch *amqp.Channel) error { return ch.ExchangeDelete(b.Exchange, false, false) })
		doomed := publishN(t, db, b.Exchange, "ok", 1)[0]
		waitFor(t, 30*time.Second, "the record to be stuck", func() bool { return stateOf(t, db, doomed).Attempts == 3 })
		cancel()
		if err := <-done; err != nil {
			t.Fatal(err)
		}
		if s := stateOf(t, db, doomed); s.Published || !strings.Contains(s.LastError, "does not exist") {
			t.Errorf("record: %+v, want stuck with last_error saying the exchange does not exist", s)
		}
		if n := lost.Load(); n > 0 {
			t.Errorf("%d failures were taken for a lost connection; the broker closed the channel over the record", n)
		}
	})
}

// A row that fails at once and for good (malformed, or one the client
// cannot encode) holds nobody back: under the pipelined Run the batches in
// flight behind it are marked as the broker confirms them, not held back
// and sent again, and the relay does not back off. Every other row arrives
// once.
func TestForwarder_Run_RowStuckAtOnce_BatchesBehindItNotSentAgain(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		b := testamqp.New(t)
		queue := b.Queue("ok")
		const half = 300
		t0 := time.Now().Add(-time.Hour)
		var rows []keyedRow
		for i := range 2 * half {
			at := t0.Add(time.Duration(i) * time.Millisecond)
			if i >= half {
				at = time.Now().Add(time.Hour + time.Duration(i)*time.Millisecond) // after the bad row
			}
			rows = append(rows, keyedRow{id: fmt.Sprintf("row-%03d", i), exchange: b.Exchange, routingKey: "ok", createdAt: at})
		}
		insertKeyed(t, db, rows[:half])
		insertRaw(t, db, "bad-json", b.Exchange, "ok", "{not json", "utf-8")
		insertRaw(t, db, "long-header-name", b.Exchange, "ok", `{"`+strings.Repeat("k", 300)+`":"v"}`, "utf-8")
		insertKeyed(t, db, rows[half:])

		f := newForwarder(t, db, outbox.ForwarderConfig{BatchSize: 20, RetryMin: time.Second, RetryMax: time.Second, OnError: func(error, outbox.ErrorContext) {}})
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		start := time.Now()
		go func() { done <- f.Run(ctx) }()
		waitFor(t, 30*time.Second, "every good row published", func() bool { return pendingCount(t, f) == 0 })
		took := time.Since(start)
		cancel()
		if err := <-done; err != nil {
			t.Fatal(err)
		}
		// Run has returned: the queue holds all that will ever arrive,
		// duplicates too.
		got := countIDs(b.Drain(queue, 2*half, 10*time.Second))
		for _, r := range rows {
			if got[r.id] != 1 {
				t.Errorf("%s arrived %d times, want once", r.id, got[r.id])
			}
		}
		if len(got) != len(rows) {
			t.Errorf("%d distinct messages arrived, want %d", len(got), len(rows))
		}
		// Two backoffs of RetryMin would take 2 s; the drain takes well under.
		if took > 1900*time.Millisecond {
			t.Logf("the drain took %s: did the relay back off over the bad rows?", took)
		}
	})
}

// A record the broker nacks (here its queue is full and rejects publishes,
// x-overflow reject-publish) is not marked published: it fails with
// "nacked" in last_error, and goes out once the queue has room. No other
// test had the broker nack a publish: a nack read as a confirm passed the
// whole suite, marking a message the broker dropped. It counts an attempt,
// and the next publish goes on a fresh connection: after a quorum queue's
// leader was lost, a channel on a surviving node nacked every publish
// while a fresh one was acked, and a row went stuck every few seconds (an
// audit, on a three-node cluster). A nack never takes a record to
// MaxAttempts (see the test below).
func TestForwarder_RecordTheBrokerNacks_NotMarkedRetriedLater(t *testing.T) {
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		b := testamqp.New(t)
		full := b.FullQueue("full")

		insertRaw(t, db, "nacked", b.Exchange, "full", "{}", "utf-8")
		proxy := testamqp.NewProxy(t)
		f := newForwarder(t, db, outbox.ForwarderConfig{OnError: func(error, outbox.ErrorContext) {}},
			outbox.AMQPConfig{AMQP: amqp.Config{Dial: proxy.Dial}})
		if n, _ := f.Sweep(context.Background()); n != 0 {
			t.Fatalf("sweep published %d, want 0: the broker nacked the record", n)
		}
		if s := stateOf(t, db, "nacked"); s.Published || s.Attempts != 1 || !strings.Contains(s.LastError, "nacked") {
			t.Fatalf("nacked record %+v, want unpublished, one attempt, last_error naming the nack", s)
		}
		_, _ = f.Sweep(context.Background())
		if n := proxy.Dialed(); n < 2 {
			t.Errorf("%d connections for two nacked sweeps, want a fresh one after the nack", n)
		}

		b.With(func(ch *amqp.Channel) error { _, err := ch.QueuePurge(full, false); return err })
		waitFor(t, 10*time.Second, "the record published once the queue has room", func() bool {
			_, _ = f.Sweep(context.Background())
			return stateOf(t, db, "nacked").Published
		})
		if got := countIDs(b.Drain(full, 1, 5*time.Second)); got["nacked"] != 1 {
			t.Errorf("the record arrived %d times, want once", got["nacked"])
		}
	})
}

// RabbitMQ nacks for a queue's reasons (full under x-overflow
// reject-publish, a quorum queue without its majority), never for what a
// message holds. Each nack counted an attempt: a queue full for a few
// seconds, or a quorum queue that lost its majority for a minute (an
// audit, on a three-node cluster), made every record that reached it stuck
// at MaxAttempts, and they stayed unpublished once the queue took
// publishes again, keyed and unkeyed alike. A nack still counts, so the
// record's backoff grows, but never to MaxAttempts.
func TestForwarder_QueueFullForAWhile_NackedRecordsNotStuck_PublishedOnceItHasRoom(t *testing.T) {
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		b := testamqp.New(t)
		full := b.FullQueue("full")

		ids := publishN(t, db, b.Exchange, "full", 2)
		keyed := message.NewMessage(watermill.NewUUID(), []byte("k"))
		keyed.Metadata.Set(outbox.MetadataAggregateID, "order-1")
		publishInTx(t, db, "full", []*message.Message{keyed}, outbox.TxPublisherConfig{Exchange: b.Exchange})
		ids = append(ids, keyed.UUID)

		f := newForwarder(t, db, outbox.ForwarderConfig{
			MaxAttempts: 3, RetryMin: 5 * time.Millisecond, RetryMax: 20 * time.Millisecond,
			OnError: func(error, outbox.ErrorContext) {},
		})
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- f.Run(ctx) }()
		defer func() { cancel(); <-done }()
		// Well past MaxAttempts nacks at the head record.
		waitFor(t, 30*time.Second, "the head record nacked", func() bool {
			return strings.Contains(stateOf(t, db, ids[0]).LastError, "nacked")
		})
		time.Sleep(2 * time.Second) // backoffs of 20 ms at most: far past MaxAttempts nacks
		for _, id := range ids {
			if s := stateOf(t, db, id); s.Published || s.Attempts >= 3 {
				t.Errorf("record %s while its queue is full: %+v, want unpublished and below MaxAttempts (3)", id, s)
			}
		}
		b.With(func(ch *amqp.Channel) error { _, err := ch.QueuePurge(full, false); return err })
		// One at a time: the queue holds one.
		arrived := map[string]int{}
		waitFor(t, 30*time.Second, "every record published once the queue has room", func() bool {
			for id, n := range countIDs(b.Drain(full, 0, 100*time.Millisecond)) {
				arrived[id] += n
			}
			for _, id := range ids {
				if !stateOf(t, db, id).Published {
					return false
				}
			}
			return true
		})
		for id, n := range countIDs(b.Drain(full, 0, 500*time.Millisecond)) {
			arrived[id] += n
		}
		for _, id := range ids {
			if arrived[id] == 0 {
				t.Errorf("record %s is marked published and never arrived", id)
			}
		}
	})
}
