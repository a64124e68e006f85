package outbox_test

import (
	"context"
	"errors"
	"reflect"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// readyHeldAfterAStop leaves, in db, key's seq 2 held and ready (its
// predecessor applied, its handler failed at its turn), as a service that
// stopped then leaves it: handler name "ledger", topic "t".
func readyHeldAfterAStop(t *testing.T, db *testdb.DB, cfg outbox.InboxConfig, log *applyLog, key string) {
	t.Helper()
	in := orderedInbox(t, db, cfg)
	// Each publish waits for its ack: seq 2 arrives first, and is held.
	bus := gochannel.NewGoChannel(gochannel.Config{BlockPublishUntilSubscriberAck: true}, watermill.NopLogger{})
	var failed atomic.Bool
	log.fail = func(msg *message.Message) error {
		if msg.Metadata.Get(outbox.HeaderSeq) == "2" && failed.CompareAndSwap(false, true) {
			return errors.New("away for a moment")
		}
		return nil
	}
	r := newRouter(t)
	r.AddMiddleware(in.Middleware)
	r.AddPlugin(in.Plugin())
	r.AddNoPublisherHandler("ledger", "t", bus, func(msg *message.Message) error {
		_, err := log.handler(t, db)(msg)
		return err
	})
	stop := startRouter(t, r)
	for _, seq := range []int{2, 1} {
		if err := bus.Publish("t", keyedMsg(key, seq)); err != nil {
			t.Fatal(err)
		}
	}
	waitFor(t, 10*time.Second, "seq 1 applied, seq 2 failed at its turn", func() bool { return failed.Load() && len(log.of(key)) == 1 })
	stop()
	if n := countHeld(t, db); n != 1 {
		t.Fatalf("%d held after the stop; want seq 2's", n)
	}
	log.fail = nil
}

// A handler added after Run (RunHandlers), behind the inbox's Middleware
// added before Run: its wake comes at its own start, and its held message
// runs then.
func TestOrderedInbox_Wake_HandlerAddedAfterRun_HeldMessageAppliedAtItsStart(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	createEffects(t, db)
	cfg := outbox.InboxConfig{ConsumerName: "ledger", ApplyHeldEvery: time.Hour}
	var log applyLog
	readyHeldAfterAStop(t, db, cfg, &log, "late-1")

	in := orderedInbox(t, db, cfg)
	r := newRouter(t)
	r.AddMiddleware(in.Middleware)
	r.AddPlugin(in.Plugin())
	startRouter(t, r)
	bus := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	h := r.AddNoPublisherHandler("ledger", "t", in.Subscriber(bus), func(msg *message.Message) error {
		_, err := log.handler(t, db)(msg)
		return err
	})
	if err := r.RunHandlers(context.Background()); err != nil {
		t.Fatal(err)
	}
	<-h.Started()
	waitFor(t, 10*time.Second, "seq 2 applied at the handler's start", func() bool { return len(log.of("late-1")) == 2 })
	if got := log.of("late-1"); !reflect.DeepEqual(got, []int{1, 2}) {
		t.Errorf("applied %v; want [1 2]", got)
	}
}

// The router closes while the wake applies a held message: Close is
// graceful for deliveries (their context is not the router's), but the
// wake's context is the handler's Subscribe context, which Run cancels as
// Close begins, and the held message's transaction was begun under it.
// The handler, which runs under a context without that cancellation and
// so cannot tell, is cut off mid-way (its transaction rolled back beneath
// it) and runs again at the next start.
func TestOrderedInbox_Wake_RouterClosedWhileAWakeAppliesAHeldMessage_ItsHandlerRunsOnce(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	createEffects(t, db)
	cfg := outbox.InboxConfig{ConsumerName: "ledger", ApplyHeldEvery: time.Hour}
	var log applyLog
	readyHeldAfterAStop(t, db, cfg, &log, "close-1")

	var runs atomic.Int32
	started, release := make(chan struct{}), make(chan struct{})
	in := orderedInbox(t, db, cfg)
	r := newRouter(t)
	r.AddMiddleware(in.Middleware)
	r.AddPlugin(in.Plugin())
	bus := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	var handlerErr error
	var mu sync.Mutex
	r.AddNoPublisherHandler("ledger", "t", in.Subscriber(bus), func(msg *message.Message) error {
		if runs.Add(1) == 1 {
			close(started)
			<-release
		}
		_, err := log.handler(t, db)(msg)
		mu.Lock()
		handlerErr = err
		mu.Unlock()
		return err
	})
	stop := startRouter(t, r)
	select {
	case <-started:
	case <-time.After(10 * time.Second):
		t.Fatal("the held message did not run at the start")
	}
	stopped := make(chan struct{})
	go func() { defer close(stopped); stop() }()
	time.Sleep(300 * time.Millisecond) // Close has begun: Run cancelled its context
	close(release)
	<-stopped
	mu.Lock()
	defer mu.Unlock()
	if handlerErr != nil || countHeld(t, db) != 0 {
		t.Errorf("the held message's run, in flight as the router closed: handler error %v, %d still held; want it committed, as an in-flight delivery is",
			handlerErr, countHeld(t, db))
	}
}

// One wrapped subscriber shared by the handlers of two routers, deliveries
// in flight: both Close calls return, and no forwarding goroutine of the
// wrapper is left.
func TestOrderedInbox_Wake_SharedWrappedSubscriberTwoRouters_CloseLeavesNoGoroutine(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	in := orderedInbox(t, db, outbox.InboxConfig{ConsumerName: "ledger", ApplyHeldEvery: time.Hour})
	bus := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 16}, watermill.NopLogger{})
	shared := in.Subscriber(bus)
	var handled atomic.Int32
	slow := func(*message.Message) error {
		handled.Add(1)
		time.Sleep(5 * time.Millisecond)
		return nil
	}
	var stops []func()
	for i, names := range [][]string{{"a", "b"}, {"c"}} {
		r := newRouter(t)
		r.AddMiddleware(in.Middleware)
		r.AddPlugin(in.Plugin())
		for _, name := range names {
			r.AddNoPublisherHandler(name, "topic-"+name, shared, slow)
		}
		_ = i
		stops = append(stops, startRouter(t, r))
	}
	for i := 0; i < 30; i++ {
		for _, topic := range []string{"topic-a", "topic-b", "topic-c"} {
			if err := bus.Publish(topic, message.NewMessage(watermill.NewUUID(), []byte("x"))); err != nil {
				t.Fatal(err)
			}
		}
	}
	waitFor(t, 10*time.Second, "some handled", func() bool { return handled.Load() > 5 })
	done := make(chan struct{})
	go func() {
		defer close(done)
		for _, stop := range stops {
			stop()
		}
	}()
	select {
	case <-done:
	case <-time.After(40 * time.Second):
		t.Fatal("the routers' Close did not return")
	}
	waitFor(t, 5*time.Second, "no wakeSubscriber goroutine left", func() bool {
		buf := make([]byte, 1<<20)
		n := runtime.Stack(buf, true)
		return !strings.Contains(string(buf[:n]), "wakeSubscriber")
	})
}

// A middleware before the inbox that hands on a rebuilt message (a
// decrypting or decompressing middleware may): the wake's context is gone,
// and the inbox takes it for a delivery: the handler sees it.
func TestOrderedInbox_Wake_MiddlewareBeforeTheInboxRebuildsTheMessage_HandlerSeesNoWake(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	in := orderedInbox(t, db, outbox.InboxConfig{ConsumerName: "ledger", ApplyHeldEvery: time.Hour})
	bus := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	r := newRouter(t)
	r.AddMiddleware(func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			rebuilt := message.NewMessage(msg.UUID, append([]byte(nil), msg.Payload...))
			rebuilt.Metadata = msg.Metadata
			rebuilt.SetContext(context.WithoutCancel(context.Background()))
			return h(rebuilt)
		}
	}, in.Middleware)
	r.AddPlugin(in.Plugin())
	var wakes atomic.Int32
	r.AddNoPublisherHandler("ledger", "t", in.Subscriber(bus), func(msg *message.Message) error {
		if msg.Metadata.Get(outbox.WakeMetadataKey) != "" {
			wakes.Add(1)
		}
		return nil
	})
	startRouter(t, r)
	time.Sleep(500 * time.Millisecond)
	if n := wakes.Load(); n != 0 {
		t.Errorf("the handler saw %d of the inbox's own messages; want none", n)
	}
}

// Watermill's Retry, Timeout, CorrelationID and PoisonQueue (with
// PoisonPublisher) before the inbox, ConsumerName empty (the handler's
// name), a second ordered inbox on the router and its own wrapper: the
// held message is applied at the start, through the inbox's own chain,
// and no handler and no poison topic sees a wake.
func TestOrderedInbox_Wake_WatermillMiddlewaresTwoInboxesNoConsumerName_HeldAppliedNoWakeSeen(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	createEffects(t, db)
	cfg := outbox.InboxConfig{ApplyHeldEvery: time.Hour}
	var log applyLog
	readyHeldAfterAStop(t, db, cfg, &log, "mw-1")

	in := orderedInbox(t, db, cfg)
	in2 := orderedInbox(t, db, outbox.InboxConfig{ConsumerName: "zz_review_other", ApplyHeldEvery: time.Hour})
	bus := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	poisoned, err := bus.Subscribe(context.Background(), "poison")
	if err != nil {
		t.Fatal(err)
	}
	pq, err := middleware.PoisonQueue(in.PoisonPublisher(bus), "poison")
	if err != nil {
		t.Fatal(err)
	}
	r := newRouter(t)
	var wakesBefore atomic.Int32
	r.AddMiddleware(
		middleware.CorrelationID,
		pq,
		middleware.Retry{MaxRetries: 2, InitialInterval: time.Millisecond}.Middleware,
		middleware.Timeout(5*time.Second),
		func(h message.HandlerFunc) message.HandlerFunc {
			return func(msg *message.Message) ([]*message.Message, error) {
				if msg.Metadata.Get(outbox.WakeMetadataKey) != "" {
					wakesBefore.Add(1)
					if len(msg.Payload) == 0 && message.HandlerNameFromCtx(msg.Context()) == "other" {
						return nil, errors.New("refused before the inbox")
					}
				}
				return h(msg)
			}
		},
		in2.Middleware,
		in.Middleware,
	)
	r.AddPlugin(in.Plugin(), in2.Plugin())
	var wakes atomic.Int32
	r.AddNoPublisherHandler("ledger", "t", in2.Subscriber(in.Subscriber(bus)), func(msg *message.Message) error {
		if msg.Metadata.Get(outbox.WakeMetadataKey) != "" {
			wakes.Add(1)
			return nil
		}
		_, err := log.handler(t, db)(msg)
		return err
	})
	r.AddNoPublisherHandler("other", "o", in.Subscriber(bus), func(msg *message.Message) error {
		if msg.Metadata.Get(outbox.WakeMetadataKey) != "" {
			wakes.Add(1)
		}
		return nil
	})
	startRouter(t, r)
	waitFor(t, 10*time.Second, "seq 2 applied at the start", func() bool { return len(log.of("mw-1")) == 2 })
	waitFor(t, 10*time.Second, "wakes seen before the inboxes", func() bool { return wakesBefore.Load() >= 3 })
	time.Sleep(300 * time.Millisecond)
	if n := wakes.Load(); n != 0 {
		t.Errorf("handlers saw %d wakes; want none", n)
	}
	select {
	case msg := <-poisoned:
		t.Errorf("set aside %s %v; want nothing", msg.UUID, msg.Metadata)
	default:
	}
	if c := countEffects(t, db, keyedMsg("mw-1", 2).UUID); c != 1 {
		t.Errorf("seq 2: %d effects, want 1", c)
	}
}

// An ordered Inbox whose Plugin runs on a router, and which the service
// also uses outside any router (a consume loop of its own, a test), holds
// the direct deliveries' out-of-order messages for their bare handler, as
// it did before the router ran. (A refusal to hold a message without a
// router handler name on a plugged inbox, tried for msg.Copy() middlewares,
// refused these.)
func TestOrderedInbox_PluggedInboxUsedOutsideTheRouter_HoldsDirectDeliveries(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.Postgres)
	createEffects(t, db)
	in := orderedInbox(t, db, outbox.InboxConfig{ConsumerName: "direct", ApplyHeldEvery: time.Hour})
	pubsub := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	r := newRouter(t)
	r.AddMiddleware(in.Middleware)
	r.AddPlugin(in.Plugin())
	r.AddConsumerHandler("on_created", "order.created", pubsub, func(*message.Message) error { return nil })
	startRouter(t, r)

	var l applyLog
	deliver(t, in.Middleware(l.handler(t, db)), "direct-1", 2, 1)
	if got, want := l.of("direct-1"), []int{1, 2}; !reflect.DeepEqual(got, want) {
		t.Errorf("applied %v, want %v", got, want)
	}
}
