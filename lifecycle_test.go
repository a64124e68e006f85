package outbox_test

import (
	"context"
	"errors"
	"math/rand/v2"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"
	"github.com/prometheus/client_golang/prometheus"
	amqp "github.com/rabbitmq/amqp091-go"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testamqp"
	"github.com/acemq/watermill-outbox/internal/testdb"
	"github.com/acemq/watermill-outbox/internal/testutil"
)

// Close while Run's loop is connecting to a broker that
// does not answer (a partition the kernel does not see). Nothing is claimed
// and no batch is in flight, yet Close waits the connect out: up to
// PublishTimeout, because claimNext's Connect runs under
// context.WithoutCancel of Run's context. The same holds for a cancelled
// ctx. Close should return promptly when no batch is in flight.
func TestLifecycle_CloseDuringBlackholedConnect_ReturnsPromptly(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	proxy := testamqp.NewProxy(t)
	proxy.Blackhole(true)
	const publishTimeout = 8 * time.Second
	f := newForwarder(t, db, outbox.ForwarderConfig{PublishTimeout: publishTimeout, OnError: func(error, outbox.ErrorContext) {}},
		outbox.AMQPConfig{AMQP: amqp.Config{Dial: proxy.Dial}})
	done := make(chan error, 1)
	go func() { done <- f.Run(context.Background()) }()
	<-f.Running()
	waitFor(t, 5*time.Second, "the relay dialing the broker", func() bool { return proxy.Dialed() > 0 })
	time.Sleep(200 * time.Millisecond) // well inside the connect's handshake

	start := time.Now()
	err := f.Close()
	took := time.Since(start)
	if err != nil {
		t.Errorf("Close: %v", err)
	}
	if runErr := <-done; runErr != nil {
		t.Errorf("Run: %v", runErr)
	}
	t.Logf("Close took %s with nothing claimed (PublishTimeout %s)", took.Round(10*time.Millisecond), publishTimeout)
	if took > 2*time.Second {
		t.Errorf("Close took %s while the relay was only connecting to an unanswering broker: it waits the connect out (PublishTimeout %s) instead of cutting it", took.Round(10*time.Millisecond), publishTimeout)
	}
}

// The same through the context: Run(ctx) with ctx cancelled while it
// connects returns only once the connect times out.
func TestLifecycle_CtxCancelledDuringBlackholedConnect_RunReturnsPromptly(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	proxy := testamqp.NewProxy(t)
	proxy.Blackhole(true)
	const publishTimeout = 8 * time.Second
	f := newForwarder(t, db, outbox.ForwarderConfig{PublishTimeout: publishTimeout, OnError: func(error, outbox.ErrorContext) {}},
		outbox.AMQPConfig{AMQP: amqp.Config{Dial: proxy.Dial}})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- f.Run(ctx) }()
	<-f.Running()
	waitFor(t, 5*time.Second, "the relay dialing the broker", func() bool { return proxy.Dialed() > 0 })
	time.Sleep(200 * time.Millisecond)

	start := time.Now()
	cancel()
	select {
	case err := <-done:
		if err != nil && !errors.Is(err, context.Canceled) {
			t.Errorf("Run: %v", err)
		}
		t.Logf("Run returned %s after its ctx was cancelled", time.Since(start).Round(10*time.Millisecond))
	case <-time.After(2 * time.Second):
		t.Errorf("Run still running 2 s after its ctx was cancelled, while only connecting (PublishTimeout %s)", publishTimeout)
		<-done
		t.Logf("Run returned %s after its ctx was cancelled", time.Since(start).Round(10*time.Millisecond))
	}
}

// Close while the relay's statement waits on the
// database (here a lock another session holds on the outbox table, standing
// for a slow or partitioned database). Nothing is claimed, nothing is in
// flight, yet Close waits until the database answers: the loop's probe and
// claim run under context.WithoutCancel, so neither Close nor ctx cuts
// them. Behind a partition that is the kernel's timeout, minutes.
func TestLifecycle_CloseWhileDatabaseBlocksIdleRelay_ReturnsPromptly(t *testing.T) {
	db := migrated(t, testdb.Postgres)
	f := newForwarder(t, db, outbox.ForwarderConfig{PollInterval: 50 * time.Millisecond, MinPollInterval: 10 * time.Millisecond, OnError: func(error, outbox.ErrorContext) {}})
	done := make(chan error, 1)
	go func() { done <- f.Run(context.Background()) }()
	<-f.Running()
	time.Sleep(300 * time.Millisecond) // a few idle sweeps

	tx, err := db.Beginx()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec("LOCK TABLE acemq_outbox IN ACCESS EXCLUSIVE MODE"); err != nil {
		t.Fatal(err)
	}
	const hold = 6 * time.Second
	released := make(chan struct{})
	go func() {
		defer close(released)
		time.Sleep(hold)
		_ = tx.Rollback()
	}()
	defer func() { <-released }()
	time.Sleep(500 * time.Millisecond) // the relay's next probe or claim now waits on the lock

	start := time.Now()
	if err := f.Close(); err != nil {
		t.Errorf("Close: %v", err)
	}
	took := time.Since(start)
	<-done
	t.Logf("Close took %s while the database held the relay's idle statement", took.Round(10*time.Millisecond))
	if took > 2*time.Second {
		t.Errorf("Close took %s: it waited for an idle probe/claim the database held (released after %s), with nothing in flight", took.Round(10*time.Millisecond), hold)
	}
}

// libGoroutines counts the goroutines with a frame of the library (not of
// its tests) or of amqp091-go in their stack.
func libGoroutines() (int, string) {
	buf := make([]byte, 1<<22)
	buf = buf[:runtime.Stack(buf, true)]
	n := 0
	var dump strings.Builder
	for _, g := range strings.Split(string(buf), "\n\n") {
		if strings.Contains(g, "github.com/acemq/watermill-outbox.") || strings.Contains(g, "github.com/rabbitmq/amqp091-go.") || strings.Contains(g, "github.com/fsnotify/fsnotify.") {
			n++
			dump.WriteString(g)
			dump.WriteString("\n\n")
		}
	}
	return n, dump.String()
}

// settledLibGoroutines waits up to 10 s for the count to fall to at most
// want, and returns the last count and dump.
func settledLibGoroutines(want int) (int, string) {
	deadline := time.Now().Add(10 * time.Second)
	for {
		n, dump := libGoroutines()
		if n <= want || time.Now().After(deadline) {
			return n, dump
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// brokerConnections counts the broker's client connections named name.
func brokerConnections(t testing.TB, name string) int {
	t.Helper()
	out, err := exec.Command("rabbitmqctl", "-q", "list_connections", "client_properties").CombinedOutput()
	if err != nil {
		t.Fatalf("rabbitmqctl list_connections: %v: %s", err, out)
	}
	return strings.Count(string(out), `{"connection_name","`+name+`"}`)
}

// After Run and Close, on each database: no goroutine of the library or of
// amqp091-go left, no connection of the pool in use, no connection left on
// the broker, and on PostgreSQL no LISTEN session left.
func TestLifecycle_RunClose_ReleasesEverything(t *testing.T) {
	testdb.Each(t, func(t *testing.T, tdb *testdb.DB) {
		d := migrate(t, tdb)
		app := "lifecycle" + testdb.RandomName()
		pool := tdb.DB
		if tdb.Kind == testdb.Postgres {
			var err error
			if pool, err = sqlx.Open("pgx", tdb.DSN+"&application_name="+app); err != nil {
				t.Fatal(err)
			}
			defer pool.Close()
		}
		before, _ := libGoroutines()
		b := testamqp.New(t)
		b.Queue("t")
		name := "outbox-lifecycle-" + testdb.RandomName()
		dest, err := outbox.NewAMQPDestination(outbox.AMQPConfig{URLs: []string{testdb.AMQPURL()}, ConnectionName: name})
		if err != nil {
			t.Fatal(err)
		}
		f, err := outbox.NewForwarder(pool, dest, outbox.ForwarderConfig{Dialect: d, PollInterval: 50 * time.Millisecond})
		if err != nil {
			t.Fatal(err)
		}
		done := make(chan error, 1)
		go func() { done <- f.Run(context.Background()) }()
		<-f.Running()
		ids := publishN(t, tdb, b.Exchange, "t", 20)
		waitFor(t, 20*time.Second, "the rows published", func() bool { return stateOf(t, tdb, ids[len(ids)-1]).Published })
		if tdb.Kind == testdb.Postgres {
			waitFor(t, 10*time.Second, "the LISTEN session", func() bool {
				var n int
				_ = tdb.Get(&n, "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND query LIKE 'LISTEN%'", app)
				return n == 1
			})
		}
		if brokerConnections(t, name) != 1 {
			t.Logf("broker connections named %s while running: %d", name, brokerConnections(t, name))
		}
		if err := f.Close(); err != nil {
			t.Fatal(err)
		}
		if err := <-done; err != nil {
			t.Fatal(err)
		}
		if n, dump := settledLibGoroutines(before); n > before {
			t.Errorf("%d goroutines of the library or amqp091-go after Close, %d before:\n%s", n, before, dump)
		}
		if inUse := pool.Stats().InUse; inUse != 0 {
			t.Errorf("%d pool connections in use after Close", inUse)
		}
		waitFor(t, 10*time.Second, "no broker connection left", func() bool { return brokerConnections(t, name) == 0 })
		if tdb.Kind == testdb.Postgres {
			waitFor(t, 10*time.Second, "no LISTEN session left", func() bool {
				var n int
				_ = tdb.Get(&n, "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND query LIKE 'LISTEN%'", app)
				return n == 0
			})
		}
	})
}

// Calls in every order and at once: Run, Close, Sweep, Notify, a second
// Run, on many forwarders of one database. Every call returns, Run with nil,
// ErrForwarderClosed or ErrForwarderInUse, Sweep after Close with
// ErrForwarderClosed, and no goroutine of the library is left.
func TestLifecycle_ConcurrentLifecycleCalls_NoDeadlockNoLeak(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	b := testamqp.New(t)
	b.Queue("t")
	publishN(t, db, b.Exchange, "t", 5)
	before, _ := libGoroutines()
	for i := 0; i < 40; i++ {
		dest, err := outbox.NewAMQPDestination(outbox.AMQPConfig{URLs: []string{testdb.AMQPURL()}})
		if err != nil {
			t.Fatal(err)
		}
		f, err := outbox.NewForwarder(db.DB, dest, outbox.ForwarderConfig{PollInterval: 10 * time.Millisecond, MinPollInterval: time.Millisecond, OnError: func(error, outbox.ErrorContext) {}})
		if err != nil {
			t.Fatal(err)
		}
		var wg sync.WaitGroup
		errs := make(chan error, 10)
		call := func(fn func() error) {
			wg.Add(1)
			go func() {
				defer wg.Done()
				time.Sleep(time.Duration(rand.IntN(3000)) * time.Microsecond)
				errs <- fn()
			}()
		}
		call(func() error { return f.Run(context.Background()) })
		call(func() error { return f.Run(context.Background()) })
		call(f.Close)
		call(func() error { _, err := f.Sweep(context.Background()); return err })
		call(func() error { f.Notify(); return nil })
		call(f.Close)
		finished := make(chan struct{})
		go func() { wg.Wait(); close(finished) }()
		select {
		case <-finished:
		case <-time.After(30 * time.Second):
			t.Fatalf("round %d: calls still running after 30 s", i)
		}
		close(errs)
		for err := range errs {
			// ErrDestinationClosed: a Sweep that ran after Close returned,
			// TestLifecycle_SweepConcurrentWithClose_NothingAfterCloseReturned;
			// ErrForwarderInUse: a Run called while the other ran.
			if err != nil && !errors.Is(err, outbox.ErrForwarderClosed) && !errors.Is(err, outbox.ErrDestinationClosed) && !errors.Is(err, outbox.ErrForwarderInUse) {
				t.Errorf("round %d: %v", i, err)
			}
		}
		if _, err := f.Sweep(context.Background()); !errors.Is(err, outbox.ErrForwarderClosed) {
			t.Errorf("round %d: Sweep after Close: %v", i, err)
		}
		f.Notify()
	}
	if n, dump := settledLibGoroutines(before); n > before {
		t.Errorf("%d goroutines of the library or amqp091-go after Close, %d before:\n%s", n, before, dump)
	}
}

// recordingDest is a Destination without Close: it notes a Publish that
// starts after the test marked the forwarder closed, and sends nothing.
type recordingDest struct {
	closed, late atomic.Bool
}

func (d *recordingDest) Publish(_ context.Context, recs []outbox.Record) []error {
	if d.closed.Load() {
		d.late.Store(true)
	}
	res := make([]error, len(recs))
	for i := range res {
		res[i] = outbox.ErrNotSent
	}
	return res
}

// A Sweep racing Close runs before Close returns or not at all. Sweep
// looked at closing before it took sweepMu, and Close took sweepMu only to
// wait for a Sweep already holding it: a Sweep that passed its look when
// Close began ran after Close returned, and claimed, published and marked
// on a closed forwarder (with AMQPDestination it failed with
// ErrDestinationClosed rather than ErrForwarderClosed). The window is
// narrow: it opened within a few hundred rounds under -race, and 2 runs in
// 3 of 20,000 rounds without.
func TestLifecycle_SweepConcurrentWithClose_NothingAfterCloseReturned(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.SQLite)
	publishN(t, db, "x", "t", 1)
	deadline := time.Now().Add(8 * time.Second)
	for round := 0; time.Now().Before(deadline); round++ {
		dest := &recordingDest{}
		f, err := outbox.NewForwarder(db.DB, dest, outbox.ForwarderConfig{OnError: func(error, outbox.ErrorContext) {}})
		if err != nil {
			t.Fatal(err)
		}
		start := make(chan struct{})
		var wg sync.WaitGroup
		wg.Add(2)
		go func() {
			defer wg.Done()
			<-start
			_, _ = f.Sweep(context.Background())
		}()
		go func() {
			defer wg.Done()
			<-start
			runtime.Gosched()
			_ = f.Close()
			dest.closed.Store(true)
		}()
		close(start)
		wg.Wait()
		if dest.late.Load() {
			t.Fatalf("round %d: Sweep published after Close had returned", round)
		}
	}
}

// A router with the relay's plugin closed at once, before or while it
// starts, and a router whose Run is given a cancelled context: Run and Close
// return, the forwarder is closed, and no goroutine is left.
func TestLifecycle_PluginRouterClosedAtOnce_NoLeak(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	before, _ := libGoroutines()
	for i := 0; i < 6; i++ {
		f := newForwarder(t, db, outbox.ForwarderConfig{PollInterval: 20 * time.Millisecond})
		r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 20 * time.Second}, watermill.NopLogger{})
		if err != nil {
			t.Fatal(err)
		}
		r.AddPlugin(f.Plugin())
		ctx, cancel := context.WithCancel(context.Background())
		if i%2 == 1 {
			cancel()
		}
		done := make(chan error, 1)
		go func() { done <- r.Run(ctx) }()
		time.Sleep(time.Duration(rand.IntN(20)) * time.Millisecond)
		closeErr := make(chan error, 1)
		go func() { closeErr <- r.Close() }()
		select {
		case <-done:
		case <-time.After(30 * time.Second):
			t.Fatalf("round %d: router Run did not return", i)
		}
		select {
		case <-closeErr:
		case <-time.After(30 * time.Second):
			t.Fatalf("round %d: router Close did not return", i)
		}
		cancel()
		if err := f.Close(); err != nil {
			t.Errorf("round %d: Close: %v", i, err)
		}
		if _, err := f.Sweep(context.Background()); !errors.Is(err, outbox.ErrForwarderClosed) {
			t.Errorf("round %d: Sweep after Close: %v", i, err)
		}
	}
	if n, dump := settledLibGoroutines(before); n > before {
		t.Errorf("%d goroutines of the library or amqp091-go left, %d before:\n%s", n, before, dump)
	}
}

// At-most-once renewers: whatever way the handler ends (returns, fails,
// panics, ends its goroutine, its message's context cancelled), no renewer
// goroutine is left and no pool connection in use.
func TestLifecycle_AtMostOnceRenewers_NoneLeft(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	createEffects(t, db)
	in := newInbox(t, db, outbox.InboxConfig{AtMostOnce: true, AtMostOnceLease: 100 * time.Millisecond})
	ends := []string{"ok", "error", "panic", "goexit", "cancel"}
	for _, end := range ends {
		h := in.Middleware(func(msg *message.Message) ([]*message.Message, error) {
			time.Sleep(120 * time.Millisecond) // renewals run meanwhile
			switch end {
			case "error":
				return nil, errors.New("failed")
			case "panic":
				panic("boom")
			case "goexit":
				runtime.Goexit()
			}
			return nil, nil
		})
		msg := message.NewMessage(watermill.NewUUID(), []byte(end))
		ctx, cancel := context.WithCancel(context.Background())
		msg.SetContext(ctx)
		if end == "cancel" {
			time.AfterFunc(50*time.Millisecond, cancel)
		}
		done := make(chan struct{})
		go func() {
			defer close(done)
			defer func() { _ = recover() }()
			_, _ = h(msg)
		}()
		<-done
		cancel()
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		buf := make([]byte, 1<<22)
		buf = buf[:runtime.Stack(buf, true)]
		n := strings.Count(string(buf), "renewWhileRunning")
		if n == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("renewer goroutines left:\n%s", buf)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if inUse := db.Stats().InUse; inUse != 0 {
		t.Errorf("%d pool connections in use", inUse)
	}
}

// AMQPDestination alone: Connect, Publish, Close, Close again: Publish
// after Close fails with ErrDestinationClosed, and no goroutine nor broker
// connection is left.
func TestLifecycle_AMQPDestinationAlone_CloseReleasesEverything(t *testing.T) {
	b := testamqp.New(t)
	queue := b.Queue("t")
	before, _ := libGoroutines()
	name := "outbox-lifecycle-" + testdb.RandomName()
	d, err := outbox.NewAMQPDestination(outbox.AMQPConfig{URLs: []string{testdb.AMQPURL()}, ConnectionName: name})
	if err != nil {
		t.Fatal(err)
	}
	if err := d.Connect(context.Background()); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 3; i++ {
		res := d.Publish(context.Background(), []outbox.Record{{ID: watermill.NewUUID(), Exchange: b.Exchange, RoutingKey: "t", Body: []byte("x")}})
		if res[0] != nil {
			t.Fatal(res[0])
		}
	}
	b.Drain(queue, 3, 10*time.Second)
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	res := d.Publish(context.Background(), []outbox.Record{{ID: watermill.NewUUID(), Exchange: b.Exchange, RoutingKey: "t", Body: []byte("x")}})
	if !errors.Is(res[0], outbox.ErrDestinationClosed) {
		t.Errorf("Publish after Close: %v, want ErrDestinationClosed", res[0])
	}
	if n, dump := settledLibGoroutines(before); n > before {
		t.Errorf("%d goroutines of the library or amqp091-go after Close, %d before:\n%s", n, before, dump)
	}
	waitFor(t, 10*time.Second, "no broker connection left", func() bool { return brokerConnections(t, name) == 0 })
}

// A long-running relay over many records with occasional failures (keyed
// records the broker returns as unroutable, stuck after their attempts, and
// the broker closing the relay's connection twice): its bookkeeping stays
// small, and so do the metrics' label sets.
func TestLifecycle_LongRun_BookkeepingBounded(t *testing.T) {
	t.Parallel()
	n := 30000
	if testing.Short() {
		n = 10000
	}
	db := migrated(t, testdb.SQLite)
	b := testamqp.New(t)
	queue := b.Queue("t")
	const every = 500
	start := time.Now()
	failing := 0
	for i := 0; i < n; i += 1000 {
		tx, err := db.Beginx()
		if err != nil {
			t.Fatal(err)
		}
		pub, err := outbox.NewTxPublisher(tx, outbox.TxPublisherConfig{Exchange: b.Exchange})
		if err != nil {
			t.Fatal(err)
		}
		var ok, bad []*message.Message
		for j := i; j < i+1000 && j < n; j++ {
			m := message.NewMessage(watermill.NewUUID(), []byte("x"))
			if j%every == every-1 {
				m.Metadata.Set(outbox.MetadataAggregateID, "k"+strconv.Itoa(j))
				bad = append(bad, m)
				continue
			}
			ok = append(ok, m)
		}
		failing += len(bad)
		if err := pub.Publish("t", ok...); err != nil {
			t.Fatal(err)
		}
		if len(bad) > 0 {
			if err := pub.Publish("nobody", bad...); err != nil {
				t.Fatal(err)
			}
		}
		if err := tx.Commit(); err != nil {
			t.Fatal(err)
		}
	}
	t.Logf("%d rows written in %s", n, time.Since(start).Round(time.Millisecond))

	reg := prometheus.NewRegistry()
	metrics, err := outbox.NewMetrics(reg)
	if err != nil {
		t.Fatal(err)
	}
	name := "outbox-lifecycle-" + testdb.RandomName()
	dest, err := outbox.NewAMQPDestination(outbox.AMQPConfig{URLs: []string{testdb.AMQPURL()}, ConnectionName: name})
	if err != nil {
		t.Fatal(err)
	}
	f, err := outbox.NewForwarder(db.DB, dest, outbox.ForwarderConfig{MaxAttempts: 2, RetryMin: 10 * time.Millisecond, RetryMax: 50 * time.Millisecond,
		Metrics: metrics, StatsInterval: 100 * time.Millisecond, OnError: func(error, outbox.ErrorContext) {}})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	go func() { _ = f.Run(context.Background()) }()
	<-f.Running()
	consumed := make(chan int, 1)
	go func() { consumed <- len(b.Drain(queue, n-failing, 10*time.Minute)) }()
	for i := 0; i < 2; i++ {
		time.Sleep(2 * time.Second)
		t.Logf("connections closed by the broker: %d", testamqp.CloseConnections(t, name))
	}
	waitFor(t, 10*time.Minute, "the relay to publish every routable row", func() bool {
		st, err := f.Store().Stats(context.Background())
		return err == nil && st.Pending == 0
	})
	time.Sleep(500 * time.Millisecond)
	returned, suspects, inflight, short, exchanges := outbox.DestBookkeeping(dest)
	t.Logf("after %d rows (%d failing) in %s: returned filed %d, suspects %d, windows in flight %d, short %d, exchanges %d",
		n, failing, time.Since(start).Round(time.Millisecond), returned, suspects, inflight, short, exchanges)
	if returned > 0 || suspects > 0 || inflight > 0 || short > 0 || exchanges > 1 {
		t.Errorf("bookkeeping left after the drain: returned %d, suspects %d, in flight %d, short %d, exchanges %d", returned, suspects, inflight, short, exchanges)
	}
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	series := 0
	for _, mf := range families {
		series += len(mf.GetMetric())
	}
	t.Logf("metric series: %d", series)
	if series > 40 {
		t.Errorf("%d metric series after the drain", series)
	}
	var stuck int64
	if st, err := f.Store().Stats(context.Background()); err == nil {
		stuck = st.Stuck
	}
	if stuck != int64(failing) {
		t.Errorf("stuck %d, want %d", stuck, failing)
	}
	if got := <-consumed; got < n-failing {
		t.Errorf("%d arrived, want %d", got, n-failing)
	}
}

// panickingDest panics in Publish, as a Destination of the user's may.
type panickingDest struct{}

func (panickingDest) Publish(context.Context, []outbox.Record) []error { panic("destination bug") }

// a panic in Run's loop (a Destination's Publish, an
// OnError or Logger of the user's) does not propagate: Run's deferred
// listener.Wait runs before its deferred cancel, and the LISTEN or file
// watch goroutine waits for a ctx nobody cancels, so Run hangs for ever
// with the panic in flight, and Close after it too. The process neither
// crashes nor relays.
func TestLifecycle_PanicInRunLoop_PropagatesInsteadOfHanging(t *testing.T) {
	db := migrated(t, testdb.SQLite) // the file watch is the listener here
	publishN(t, db, "x", "t", 1)
	f, err := outbox.NewForwarder(db.DB, panickingDest{}, outbox.ForwarderConfig{})
	if err != nil {
		t.Fatal(err)
	}
	// Without the fix the panic is stuck behind the deferred listener.Wait.
	runUntilPanic(t, f)
}

// with no listener the panic does propagate, but
// relayLoop.sweep holds sweepMu without a deferred unlock: a caller that
// recovers it (a supervisor restarting the relay) then calls Close, which
// waits for sweepMu for ever.
func TestLifecycle_PanicInRunLoop_CloseAfterRecoverReturns(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	publishN(t, db, "x", "t", 1)
	f, err := outbox.NewForwarder(db.DB, panickingDest{}, outbox.ForwarderConfig{DisableListen: true})
	if err != nil {
		t.Fatal(err)
	}
	panicked := make(chan any, 1)
	go func() {
		defer func() { panicked <- recover() }()
		_ = f.Run(context.Background())
	}()
	select {
	case p := <-panicked:
		t.Logf("Run panicked: %v", p)
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not panic")
	}
	closed := make(chan error, 1)
	go func() { closed <- f.Close() }()
	select {
	case <-closed:
	case <-time.After(5 * time.Second):
		t.Fatal("Close after Run's recovered panic did not return within 5 s: sweepMu is still held")
	}
}

// a Sweep whose Destination panics (recovered by its
// caller, as net/http recovers a handler's panic) leaves its claim open: on
// PostgreSQL the claim's transaction keeps its pool connection and the
// rows' locks for ever, so no relay publishes those rows until the process
// ends.
func TestLifecycle_PanicInSweep_ClaimReleased(t *testing.T) {
	db := migrated(t, testdb.Postgres)
	publishN(t, db, "x", "t", 1)
	pool := claimsPool(t, db)
	f, err := outbox.NewForwarder(pool, panickingDest{}, outbox.ForwarderConfig{})
	if err != nil {
		t.Fatal(err)
	}
	func() {
		defer func() { t.Logf("Sweep panicked: %v", recover()) }()
		_, _ = f.Sweep(context.Background())
	}()
	_ = f.Close()
	assertClaimsReleased(t, db, pool, "the panicking Sweep and Close")
}

// claimsPool opens a pool of its own on db (PostgreSQL), named so that its
// sessions can be ended: a claim's transaction left open would hold the
// pool's Close and the schema's drop for ever.
func claimsPool(t *testing.T, db *testdb.DB) *sqlx.DB {
	t.Helper()
	app := "claims" + testdb.RandomName()
	pool, err := sqlx.Open("pgx", db.DSN+"&application_name="+app)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = db.Exec("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1", app)
		_ = pool.Close()
	})
	return pool
}

// assertClaimsReleased checks that no claim of pool is left open after
// what: every connection back in the pool, and no row of db's outbox
// locked.
func assertClaimsReleased(t *testing.T, db *testdb.DB, pool *sqlx.DB, what string) {
	t.Helper()
	deadline := time.Now().Add(3 * time.Second)
	for pool.Stats().InUse != 0 && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
	}
	if inUse := pool.Stats().InUse; inUse != 0 {
		t.Errorf("%d pool connection(s) still in use after %s: a claim left open", inUse, what)
	}
	var locked int
	if err := db.Get(&locked, "SELECT count(*) FROM acemq_outbox WHERE id NOT IN (SELECT id FROM acemq_outbox FOR UPDATE SKIP LOCKED)"); err != nil {
		t.Fatal(err)
	}
	if locked != 0 {
		t.Errorf("%d rows still locked after %s: no relay can publish them", locked, what)
	}
}

// Run given a context that has ended, or closed while it
// starts, is stopped by design; it should not log an error for it. On the
// databases whose relay prepares its statements, prepareRelay runs under
// the ended context and Run logs "could not prepare its statements" at
// Error level, which alerts on every quick restart or shutdown. Run closes
// Running all the same, as its doc says.
func TestLifecycle_RunStoppedAtStart_LogsNoError(t *testing.T) {
	for _, kind := range []string{testdb.Postgres, testdb.MySQL, testdb.SQLite} {
		t.Run(kind, func(t *testing.T) {
			db := migrated(t, kind)
			log := &testutil.ErrorLog{}
			f := newForwarder(t, db, outbox.ForwarderConfig{Logger: log})
			ctx, cancel := context.WithCancel(context.Background())
			cancel()
			if err := f.Run(ctx); err != nil {
				t.Fatalf("Run: %v", err)
			}
			select {
			case <-f.Running():
			default:
				// Running's doc says it is closed; the router's Subscribe,
				// under a context the router ended, waits for it.
				t.Errorf("Run with an ended context returned nil without closing Running")
			}
			if msgs := log.Msgs(); len(msgs) > 0 {
				t.Errorf("Run with an ended context logged at Error level: %q", msgs)
			}
		})
	}
}
