package outbox_test

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	amqp "github.com/rabbitmq/amqp091-go"
	"go.uber.org/goleak"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testamqp"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// newRouterWithConsumer returns a router with a consumer handler of its own on an
// in-process gochannel, as a service's router has handlers besides the relay.
func newRouterWithConsumer(t testing.TB) *message.Router {
	t.Helper()
	r, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	ch := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	t.Cleanup(func() { _ = ch.Close() })
	r.AddConsumerHandler("consume-orders", "orders", ch, func(*message.Message) error { return nil })
	return r
}

// runRouter runs r and returns once it runs, failing the test if it does
// not start. stop closes it and returns Close's error (or Run's) once Run
// returned; the test's end stops it too.
func runRouter(t testing.TB, r *message.Router) (stop func() error) {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- r.Run(context.Background()) }()
	select {
	case <-r.Running():
	case err := <-done:
		t.Fatalf("the router did not start: %v", err)
	case <-time.After(30 * time.Second):
		t.Fatal("the router did not start within 30 s")
	}
	var (
		once sync.Once
		err  error
	)
	stop = func() error {
		once.Do(func() {
			err = r.Close()
			if runErr := <-done; err == nil && runErr != nil {
				err = fmt.Errorf("router Run: %w", runErr)
			}
		})
		return err
	}
	t.Cleanup(func() { _ = stop() })
	return stop
}

// messageIDs is the ids of msgs.
func messageIDs(msgs []*message.Message) []string {
	ids := make([]string, len(msgs))
	for i, m := range msgs {
		ids[i] = m.UUID
	}
	return ids
}

// publishedIDs is the ids of the rows marked published.
func publishedIDs(t testing.TB, db *testdb.DB) map[string]bool {
	t.Helper()
	var ids []string
	if err := db.Select(&ids, "SELECT id FROM acemq_outbox WHERE published_at IS NOT NULL"); err != nil {
		t.Fatal(err)
	}
	set := make(map[string]bool, len(ids))
	for _, id := range ids {
		set[id] = true
	}
	return set
}

// assertArrivedOnce fails the test unless the deliveries hold each of ids
// exactly once, and nothing else.
func assertArrivedOnce(t testing.TB, ds []amqp.Delivery, ids []string) {
	t.Helper()
	seen := countIDs(ds)
	for _, id := range ids {
		if seen[id] != 1 {
			t.Errorf("%s arrived %d times, want once", id, seen[id])
		}
	}
	if len(seen) != len(ids) {
		t.Errorf("%d distinct ids arrived, want %d", len(seen), len(ids))
	}
}

// assertNothingClaimed fails the test if a row of acemq_outbox is still
// claimed: a lease in locked_by/locked_until (SQLite's claims), or a row
// lock that an open claim transaction holds (PostgreSQL, MySQL), which
// FOR UPDATE NOWAIT runs into at once.
func assertNothingClaimed(t testing.TB, db *testdb.DB) {
	t.Helper()
	var leased int
	if err := db.Get(&leased, "SELECT COUNT(*) FROM acemq_outbox WHERE locked_by IS NOT NULL OR locked_until IS NOT NULL"); err != nil {
		t.Fatal(err)
	}
	if leased != 0 {
		t.Errorf("%d rows still leased", leased)
	}
	if db.Kind == testdb.SQLite {
		return
	}
	tx, err := db.Beginx()
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback() }()
	var ids []string
	if err := tx.Select(&ids, "SELECT id FROM acemq_outbox FOR UPDATE NOWAIT"); err != nil {
		t.Errorf("a row is still locked by a claim: %v", err)
	}
}

// assertForwarderClosed fails the test unless f was closed, and stays so.
func assertForwarderClosed(t testing.TB, f *outbox.Forwarder) {
	t.Helper()
	if _, err := f.Sweep(context.Background()); !errors.Is(err, outbox.ErrForwarderClosed) {
		t.Errorf("Sweep after the router closed: %v, want ErrForwarderClosed", err)
	}
	if err := f.Close(); err != nil {
		t.Errorf("Close after the router closed: %v", err)
	}
	if err := f.Run(context.Background()); !errors.Is(err, outbox.ErrForwarderClosed) {
		t.Errorf("Run after the router closed: %v, want ErrForwarderClosed", err)
	}
}

// The relay starts with the router: what was committed before it started and
// what is committed while it runs arrives once, and the router's Close
// closes the forwarder.
func TestForwarderPlugin_RouterRunsRelay_RowsCommittedBeforeAndAfterStartArriveOnce(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		b := testamqp.New(t)
		queue := b.Queue("t")
		before := messageIDs(publishBatch(t, db, b.Exchange, "t", 5))

		f := newForwarder(t, db, outbox.ForwarderConfig{PollInterval: 50 * time.Millisecond})
		r := newRouterWithConsumer(t)
		r.AddPlugin(f.Plugin())
		stop := runRouter(t, r)

		got := b.Drain(queue, len(before), 10*time.Second)
		after := messageIDs(publishBatch(t, db, b.Exchange, "t", 5))
		got = append(got, b.Drain(queue, len(after), 10*time.Second)...)
		if err := stop(); err != nil {
			t.Fatal(err)
		}
		assertArrivedOnce(t, got, append(before, after...))
		assertForwarderClosed(t, f)
	})
}

// The router closed in the middle of a backlog: its Close waits for the batch
// the relay has in flight, and returns with that batch marked, every marked
// row on the broker and no other, nothing claimed, the forwarder closed and
// no goroutine left.
func TestForwarderPlugin_RouterClosedMidStream_BatchFinishedNothingClaimedNoGoroutineLeft(t *testing.T) {
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		defer goleak.VerifyNone(t, goleak.IgnoreCurrent(), ignorePools)
		b := testamqp.New(t)
		queue := b.Queue("t")
		const backlog, batchSize = 3000, 25
		publishBatch(t, db, b.Exchange, "t", backlog)

		f := newForwarder(t, db, outbox.ForwarderConfig{BatchSize: batchSize, MaxBatchSize: batchSize})
		// The fifth batch is held between the broker's confirms and its
		// marks until the router is closing.
		var (
			marks            atomic.Int32
			held             []string
			inBatch, release = make(chan struct{}), make(chan struct{})
			releaseOnce      sync.Once
		)
		releaseBatch := func() { releaseOnce.Do(func() { close(release) }) }
		defer releaseBatch() // a failing test lets the relay go too
		outbox.SetAfterPublishHook(f, func(published []string) error {
			if len(published) > 0 && marks.Add(1) == 5 {
				held = published
				close(inBatch)
				<-release
			}
			return nil
		})
		r := newRouterWithConsumer(t)
		r.AddPlugin(f.Plugin())
		stop := runRouter(t, r)
		<-inBatch

		closed := make(chan error, 1)
		go func() { closed <- stop() }()
		select {
		case err := <-closed:
			t.Fatalf("the router's Close returned (%v) while the relay had a batch in flight", err)
		case <-time.After(200 * time.Millisecond): // long enough for a Close that does not wait to return
		}
		releaseBatch()
		if err := <-closed; err != nil {
			t.Fatalf("router Close: %v", err)
		}

		published := publishedIDs(t, db)
		for _, id := range held {
			if !published[id] {
				t.Fatalf("%s of the batch in flight is not marked: the relay did not finish its batch", id)
			}
		}
		if len(published) >= backlog {
			t.Fatalf("all %d rows were published: the relay did not stop with the router", backlog)
		}
		t.Logf("%d of %d rows published before the relay stopped", len(published), backlog)
		seen := countIDs(b.Drain(queue, len(published), 10*time.Second))
		for id, n := range seen {
			if !published[id] || n != 1 {
				t.Errorf("%s arrived %d times, marked published: %t; want once, and marked", id, n, published[id])
			}
		}
		if len(seen) != len(published) {
			t.Errorf("%d rows marked published, %d on the broker", len(published), len(seen))
		}
		assertNothingClaimed(t, db)
		assertForwarderClosed(t, f)
	})
}

// A Forwarder runs once: of two routers starting at once with its plugin,
// exactly one runs it, and the other's Run fails naming the cause. The same
// plugin added twice to one router, a second relay of the same table on one
// router, a Forwarder under Run and a closed one refuse the router too.
func TestForwarderPlugin_OneForwarderOnTwoRouters_SecondRouterFailsToStart(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.SQLite) // the refusal is the plugin's, the same on every database
	b := testamqp.New(t)
	queue := b.Queue("t")
	f := newForwarder(t, db, outbox.ForwarderConfig{PollInterval: 50 * time.Millisecond})

	routers := []*message.Router{newRouterWithConsumer(t), newRouterWithConsumer(t)}
	results := make(chan error, len(routers))
	for _, r := range routers {
		r.AddPlugin(f.Plugin())
		go func() { results <- r.Run(context.Background()) }()
	}
	var refused error
	select {
	case refused = <-results:
	case <-time.After(30 * time.Second):
		t.Fatal("neither router refused the forwarder within 30 s")
	}
	if !errors.Is(refused, outbox.ErrForwarderInUse) {
		t.Fatalf("the second router's Run: %v, want ErrForwarderInUse", refused)
	}
	t.Logf("refused: %v", refused)
	var running *message.Router
	waitFor(t, 30*time.Second, "the other router to run", func() bool {
		for _, r := range routers {
			if r.IsRunning() {
				running = r
				return true
			}
		}
		return false
	})
	ids := messageIDs(publishBatch(t, db, b.Exchange, "t", 3))
	assertArrivedOnce(t, b.Drain(queue, len(ids), 10*time.Second), ids)
	if err := running.Close(); err != nil {
		t.Fatal(err)
	}
	if err := <-results; err != nil {
		t.Fatalf("the router that ran the relay: %v", err)
	}

	refusals := map[string]func(t *testing.T, r *message.Router) error{
		"the same plugin added twice": func(t *testing.T, r *message.Router) error {
			p := newForwarder(t, db, outbox.ForwarderConfig{}).Plugin()
			r.AddPlugin(p, p)
			return outbox.ErrForwarderInUse
		},
		"two relays of one table": func(t *testing.T, r *message.Router) error {
			r.AddPlugin(newForwarder(t, db, outbox.ForwarderConfig{}).Plugin(), newForwarder(t, db, outbox.ForwarderConfig{}).Plugin())
			return outbox.ErrForwarderInUse
		},
		"a forwarder under Run": func(t *testing.T, r *message.Router) error {
			g := newForwarder(t, db, outbox.ForwarderConfig{})
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan error, 1)
			go func() { done <- g.Run(ctx) }()
			<-g.Running()
			t.Cleanup(func() { cancel(); <-done })
			r.AddPlugin(g.Plugin())
			return outbox.ErrForwarderInUse
		},
		"a closed forwarder": func(t *testing.T, r *message.Router) error {
			g := newForwarder(t, db, outbox.ForwarderConfig{})
			if err := g.Close(); err != nil {
				t.Fatal(err)
			}
			r.AddPlugin(g.Plugin())
			return outbox.ErrForwarderClosed
		},
	}
	for name, add := range refusals {
		t.Run(name, func(t *testing.T) {
			r := newRouterWithConsumer(t)
			want := add(t, r)
			// Bounded: a router the plugins do not refuse runs until its
			// context ends, and the test must fail then, not hang.
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			err := r.Run(ctx)
			if !errors.Is(err, want) {
				t.Errorf("router Run: %v, want %v", err, want)
			}
			t.Logf("refused: %v", err)
		})
	}
}

// Two Forwarders of one table, each under a router of its own in one
// process: claims are exclusive, so every row is published exactly once.
func TestForwarderPlugin_TwoForwardersOneTableTwoRouters_EveryRowPublishedExactlyOnce(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		b := testamqp.New(t)
		queue := b.Queue("t")
		const n = 2000
		ids := messageIDs(publishBatch(t, db, b.Exchange, "t", n))

		var relays []*outbox.Forwarder
		var stops []func() error
		for range 2 {
			f := newForwarder(t, db, outbox.ForwarderConfig{BatchSize: 50})
			relays = append(relays, f)
			r := newRouterWithConsumer(t)
			r.AddPlugin(f.Plugin())
			stops = append(stops, runRouter(t, r))
		}
		waitFor(t, 60*time.Second, "every row published", func() bool { return pendingCount(t, relays[0]) == 0 })
		for _, stop := range stops {
			if err := stop(); err != nil {
				t.Fatal(err)
			}
		}
		assertArrivedOnce(t, b.Drain(queue, n, 10*time.Second), ids)
	})
}

// Republisher's plugin, added before the relay's or after it, runs before
// the relay starts (the relay starts with the handlers, after the last
// plugin): the records it makes pending go out at router start, with no
// poll (an hour) and no Notify to wake the relay.
func TestForwarderPlugin_WithRepublisherPlugin_RepublishedRowsSentAtRouterStart(t *testing.T) {
	t.Parallel()
	for _, order := range []string{"republisher first", "relay first"} {
		t.Run(order, func(t *testing.T) {
			eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
				b := testamqp.New(t)
				queue := b.Queue("t")
				ids := publishN(t, db, b.Exchange, "t", 2)
				// The first life: published, then lost by the broker.
				if n := sweepAll(t, newForwarder(t, db, outbox.ForwarderConfig{})); n != len(ids) {
					t.Fatalf("published %d, want %d", n, len(ids))
				}
				b.With(func(ch *amqp.Channel) error { _, err := ch.QueuePurge(queue, false); return err })
				ageRecords(t, db, time.Hour, ids...)

				// The next boot.
				f := newForwarder(t, db, outbox.ForwarderConfig{PollInterval: time.Hour, DisableListen: true})
				rp, err := outbox.NewRepublisher(db.DB, outbox.RepublisherConfig{TrackedTopics: outbox.NewTrackedTopics("t"), Grace: time.Minute})
				if err != nil {
					t.Fatal(err)
				}
				r := newRouterWithConsumer(t)
				if order == "republisher first" {
					r.AddPlugin(rp.Plugin(), f.Plugin())
				} else {
					r.AddPlugin(f.Plugin(), rp.Plugin())
				}
				var relayInPlugins atomic.Bool
				r.AddPlugin(func(*message.Router) error {
					select {
					case <-f.Running():
						relayInPlugins.Store(true)
					default:
					}
					return nil
				})
				runRouter(t, r)
				if relayInPlugins.Load() {
					t.Error("the relay ran before the router's last plugin")
				}
				assertArrivedOnce(t, b.Drain(queue, len(ids), 10*time.Second), ids)
			})
		})
	}
}

// Two databases, each with its acemq_outbox, and a relay of each under one
// router: the second was refused as a second relay of the table, and the
// router did not run. It is named "outbox-relay acemq_outbox #2" now, and
// both relay. (From an audit.)
func TestForwarderPlugin_TwoDatabasesOneTableName_BothRelayUnderOneRouter(t *testing.T) {
	t.Parallel()
	db1, db2 := migrated(t, testdb.SQLite), migrated(t, testdb.Postgres)
	id1, id2 := publishN(t, db1, "", "t", 1)[0], publishN(t, db2, "", "t", 1)[0]
	ch := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	var plugins []message.RouterPlugin
	for _, db := range []*testdb.DB{db1, db2} {
		f, err := outbox.NewForwarder(db.DB, outbox.NewPublisherDestination(ch, nil), outbox.ForwarderConfig{})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = f.Close() })
		plugins = append(plugins, f.Plugin())
	}
	r := newRouterWithConsumer(t)
	r.AddPlugin(plugins...)
	done := make(chan error, 1)
	go func() { done <- r.Run(context.Background()) }()
	select {
	case <-r.Running():
	case err := <-done:
		t.Fatalf("router Run: %v", err)
	case <-time.After(20 * time.Second):
		t.Fatal("router did not start")
	}
	defer func() { _ = r.Close(); <-done }()
	for _, name := range []string{"outbox-relay acemq_outbox", "outbox-relay acemq_outbox #2"} {
		if _, ok := r.Handlers()[name]; !ok {
			t.Errorf("no handler %q", name)
		}
	}
	waitFor(t, 20*time.Second, "both rows published", func() bool {
		return stateOf(t, db1, id1).Published && stateOf(t, db2, id2).Published
	})
}

// blackholeConnector is a database server behind a black hole: a dial waits
// for its context, or for the kernel to give up (here 20 s).
type blackholeConnector struct{}

func (blackholeConnector) Connect(ctx context.Context) (driver.Conn, error) {
	select {
	case <-ctx.Done():
		return nil, ctx.Err()
	case <-time.After(20 * time.Second):
		return nil, errors.New("dial tcp: connect: connection timed out")
	}
}

func (blackholeConnector) Driver() driver.Driver { return nil }

// A router whose relay plugin cannot reach MySQL as it starts: Close
// returns within its CloseTimeout. The relay prepared its statements (on
// MySQL after a dial) before it was running, and Watermill's Close waits,
// holding the router's handlers lock, for a plugin's subscriber to be
// running before it can end anything: Close waited for the dial, as long as
// the kernel tries a connection.
func TestForwarder_Plugin_DatabaseUnreachableAtStart_RouterClosesInTime(t *testing.T) {
	db := sql.OpenDB(blackholeConnector{})
	t.Cleanup(func() { _ = db.Close() })
	f, err := outbox.NewForwarder(db, okDest{}, outbox.ForwarderConfig{Dialect: outbox.MySQL, OnError: func(error, outbox.ErrorContext) {}})
	if err != nil {
		t.Fatal(err)
	}
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: time.Second}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	r.AddPlugin(f.Plugin())
	go func() { _ = r.Run(context.Background()) }()
	time.Sleep(300 * time.Millisecond) // the relay is dialling
	start := time.Now()
	closed := make(chan error, 1)
	go func() { closed <- r.Close() }()
	select {
	case err := <-closed:
		t.Logf("router.Close returned after %s: %v", time.Since(start).Round(time.Millisecond), err)
	case <-time.After(10 * time.Second):
		t.Fatal("router.Close still waiting after 10 s (CloseTimeout 1 s): the relay's start waited for a dial")
	}
	stopped := make(chan error, 1)
	go func() { stopped <- f.Close() }() // waits for Run to return
	select {
	case <-stopped:
	case <-time.After(5 * time.Second):
		t.Fatal("the relay still runs 5 s after the router closed: its dial was not cut")
	}
}

// startRouterBesidePlugin runs a router with f's plugin and then later, a
// plugin of the service's (Republisher's, say) during which something
// happens to f, and returns Run's error once the router runs or failed.
func startRouterBesidePlugin(t *testing.T, f *outbox.Forwarder, later message.RouterPlugin) (r *message.Router, runErr error) {
	t.Helper()
	return startRouterBesidePluginWithin(t, 10*time.Second, f, later)
}

// startRouterBesidePluginWithin is startRouterBesidePlugin with the
// router's CloseTimeout.
func startRouterBesidePluginWithin(t *testing.T, closeTimeout time.Duration, f *outbox.Forwarder, later message.RouterPlugin) (r *message.Router, runErr error) {
	t.Helper()
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: closeTimeout}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	r.AddPlugin(f.Plugin(), later)
	done := make(chan error, 1)
	go func() { done <- r.Run(context.Background()) }()
	select {
	case runErr = <-done:
	case <-r.Running():
	case <-time.After(30 * time.Second):
		t.Fatal("the router neither ran nor failed within 30 s")
	}
	return r, runErr
}

// closesWithin fails the test unless r's Close returns within bound.
func closesWithin(t *testing.T, r *message.Router, bound time.Duration, why string) {
	t.Helper()
	start := time.Now()
	_ = r.Close()
	if took := time.Since(start); took > bound {
		t.Errorf("router Close took %s (CloseTimeout 10 s): %s", took.Round(time.Millisecond), why)
	}
}

// A Forwarder closed by hand after its plugin ran and before the router
// started its handlers (a shutdown during a later plugin) ends its
// handler, as one closed later does. Its Subscribe returned
// ErrForwarderClosed: the router's Run failed after starting the other
// handlers, and its Close waited the whole CloseTimeout for the relay's.
func TestForwarderPlugin_ClosedByHandWhileRouterStarts_HandlerEndsRouterClosesAtOnce(t *testing.T) {
	db := migrated(t, testdb.SQLite) // the plugin's lifecycle, the same on every database
	f, err := outbox.NewForwarder(db.DB, okDest{}, outbox.ForwarderConfig{Dialect: outbox.SQLite})
	if err != nil {
		t.Fatal(err)
	}
	r, runErr := startRouterBesidePlugin(t, f, func(*message.Router) error { return f.Close() })
	if runErr != nil {
		t.Errorf("router Run: %v, want the relay's handler to end", runErr)
	}
	closesWithin(t, r, 5*time.Second, "it waited for a relay handler that never started")
}

// A Forwarder's own Run, started after its plugin ran and before the
// router started its handlers (in a later plugin), returns
// ErrForwarderInUse, and the router runs the relay. The Run was accepted:
// the router's Subscribe then failed with ErrForwarderClosed ("Run called
// twice") and its Close waited CloseTimeout.
func TestForwarderPlugin_OwnRunAfterThePluginRan_RunRefusedRouterRunsTheRelay(t *testing.T) {
	db := migrated(t, testdb.SQLite) // the plugin's lifecycle, the same on every database
	f, err := outbox.NewForwarder(db.DB, okDest{}, outbox.ForwarderConfig{Dialect: outbox.SQLite})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = f.Close() }) // ends a Run that was let through
	own := make(chan error, 1)
	r, runErr := startRouterBesidePlugin(t, f, func(*message.Router) error {
		go func() { own <- f.Run(context.Background()) }()
		select {
		case err := <-own:
			own <- err
		case <-f.Running():
		}
		return nil
	})
	select {
	case err := <-own:
		if !errors.Is(err, outbox.ErrForwarderInUse) {
			t.Errorf("the Forwarder's own Run: %v, want ErrForwarderInUse", err)
		}
	default:
		t.Errorf("the Forwarder's own Run was let through after its plugin was on a router")
	}
	if runErr != nil {
		t.Errorf("router Run: %v, want it to run the relay", runErr)
	} else if _, err := f.Sweep(context.Background()); err != nil {
		t.Errorf("Sweep beside the router's relay: %v", err)
	}
	closesWithin(t, r, 5*time.Second, "it waited for the relay's handler")
}

// A Forwarder whose router closed without starting the relay (its Run
// failed in a later plugin, or the router was closed as it started) is
// the user's again: its own Run, or its plugin on another router, runs
// it. It stayed on the router for ever, and both returned
// ErrForwarderInUse though nothing could run it. While that router is not
// closed its Run may still start its handlers (RunHandlers), so the
// Forwarder stays on it.
func TestForwarderPlugin_RouterClosedWithoutStartingTheRelay_ForwarderRunsAgain(t *testing.T) {
	db := migrated(t, testdb.SQLite) // the plugin's lifecycle, the same on every database
	failedRouter := func(t *testing.T) *outbox.Forwarder {
		t.Helper()
		f, err := outbox.NewForwarder(db.DB, okDest{}, outbox.ForwarderConfig{Dialect: outbox.SQLite})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = f.Close() })
		r, runErr := startRouterBesidePluginWithin(t, time.Second, f, func(*message.Router) error { return errors.New("a later plugin failed") })
		if runErr == nil {
			t.Fatal("the router ran, want its Run to fail in the later plugin")
		}
		if err := f.Run(context.Background()); !errors.Is(err, outbox.ErrForwarderInUse) {
			t.Errorf("Run while the router that failed is not closed: %v, want ErrForwarderInUse", err)
		}
		// Watermill's Close waits CloseTimeout (a second here) for the
		// handlers that never started, and says it timed out.
		_ = r.Close()
		return f
	}

	t.Run("its own Run", func(t *testing.T) {
		f := failedRouter(t)
		relaysByHand(t, db, f)
	})

	t.Run("its plugin on another router", func(t *testing.T) {
		f := failedRouter(t)
		r := newRouterWithConsumer(t)
		r.AddPlugin(f.Plugin())
		stop := runRouter(t, r)
		insertRaw(t, db, "other-router", "x", "t", "{}", "utf-8")
		waitFor(t, 10*time.Second, "the other router's relay to publish", func() bool { return publishedIDs(t, db)["other-router"] })
		if err := stop(); err != nil {
			t.Fatal(err)
		}
		assertForwarderClosed(t, f)
	})

	// Closed while its Run is between the plugins and the handlers: the
	// Forwarder is taken by hand, and the relay's handler, started after
	// all, ends at once rather than fail the router's Run (whose Close
	// would then wait CloseTimeout for it).
	t.Run("its own Run while the router closes as it starts", func(t *testing.T) {
		f, err := outbox.NewForwarder(db.DB, okDest{}, outbox.ForwarderConfig{Dialect: outbox.SQLite})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = f.Close() })
		own := make(chan error, 1)
		_, runErr := startRouterBesidePluginWithin(t, time.Second, f, func(r *message.Router) error {
			// Close waits CloseTimeout for the handlers, which start
			// after this plugin: IsClosed waits with it.
			go func() { _ = r.Close() }()
			waitFor(t, 30*time.Second, "the router to be closed", r.IsClosed)
			go func() { own <- f.Run(context.Background()) }()
			select {
			case err := <-own:
				own <- err
			case <-f.Running():
			}
			return nil
		})
		if runErr != nil {
			t.Errorf("router Run: %v, want the relay's handler to end", runErr)
		}
		select {
		case err := <-own:
			t.Fatalf("the Forwarder's own Run after its router closed: %v", err)
		default:
		}
		if err := f.Close(); err != nil {
			t.Fatal(err)
		}
		if err := <-own; err != nil {
			t.Errorf("the Forwarder's own Run: %v", err)
		}
	})
}

// A router closed before its Run (a service shutting down as it starts)
// runs its plugins all the same: the relay's started, published a batch,
// and then closed the Forwarder as its router closed, which was not the
// user's Close. The plugin starts no relay on a closed router, and the
// Forwarder stays the user's.
func TestForwarderPlugin_RouterClosedBeforeItsRun_NoRelayForwarderRunsAgain(t *testing.T) {
	db := migrated(t, testdb.SQLite) // the plugin's lifecycle, the same on every database
	f, err := outbox.NewForwarder(db.DB, okDest{}, outbox.ForwarderConfig{Dialect: outbox.SQLite})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = f.Close() })
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: time.Second}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	r.AddPlugin(f.Plugin())
	if err := r.Close(); err != nil {
		t.Fatal(err)
	}
	insertRaw(t, db, "closed-router", "x", "t", "{}", "utf-8")
	ran := make(chan error, 1)
	go func() { ran <- r.Run(context.Background()) }()
	select {
	case err := <-ran:
		if err != nil {
			t.Logf("Run of the closed router: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Run of a closed router did not return")
	}
	if publishedIDs(t, db)["closed-router"] {
		t.Error("a router closed before its Run relayed a row")
	}
	relaysByHand(t, db, f)
}

// relaysByHand runs f with its own Run, sees it publish a row, and stops
// it.
func relaysByHand(t *testing.T, db *testdb.DB, f *outbox.Forwarder) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- f.Run(ctx) }()
	select {
	case err := <-done:
		t.Fatalf("Run by hand: %v", err)
	case <-f.Running():
	}
	insertRaw(t, db, "by-hand", "x", "t", "{}", "utf-8")
	f.Notify()
	waitFor(t, 10*time.Second, "the row published by hand", func() bool { return publishedIDs(t, db)["by-hand"] })
	cancel()
	if err := <-done; err != nil {
		t.Errorf("Run by hand: %v", err)
	}
}
