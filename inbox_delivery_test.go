package outbox_test

import (
	"context"
	"reflect"
	"sort"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	amqp "github.com/rabbitmq/amqp091-go"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testamqp"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// inboxNamedByHandler is an inbox with no ConsumerName (the router
// handler's name is the consumer) on a PostgreSQL database of its own,
// with the effects table.
func inboxNamedByHandler(t *testing.T) (*testdb.DB, *outbox.Inbox) {
	t.Helper()
	db := migrated(t, testdb.Postgres)
	createEffects(t, db)
	in, err := outbox.NewInbox(db.DB, outbox.InboxConfig{})
	if err != nil {
		t.Fatal(err)
	}
	return db, in
}

// handsOnCopies is a service's middleware that hands on msg.Copy(): the
// delivery's context, and with it the router's handler name, dropped.
func handsOnCopies(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		return h(msg.Copy())
	}
}

// A middleware before an ordered inbox hands on msg.Copy(). order.paid's
// seq 2 came first and was held; order.created's seq 1 then ran, and seq 2
// with it: in on_paid, the handler it was delivered to. Held without a
// handler name, it ran in whichever handler last came through nameless, on
// the key's other topic (a review's ledger: 251 of 300 order.paid events
// applied by its order.placed handler). With the plugin the inbox gives the
// copy the delivery's router values back.
func TestOrderedInbox_CopyingMiddlewareBeforeTheInbox_HeldMessageRunsInItsOwnHandler(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		in := orderedInbox(t, db, outbox.InboxConfig{ConsumerName: "ledger", ApplyHeldEvery: time.Hour})
		l := ledger{before: handsOnCopies}
		pubsub := gochannel.NewGoChannel(gochannel.Config{BlockPublishUntilSubscriberAck: true}, watermill.NopLogger{})
		l.router(t, in, in.Subscriber(pubsub), [2]string{"order.created", "order.paid"})
		if err := pubsub.Publish("order.paid", keyedMsg("order-9", 2)); err != nil {
			t.Fatal(err)
		}
		if n := countHeld(t, db); n != 1 {
			t.Fatalf("%d held after seq 2, want 1", n)
		}
		l.predecessorRunsHeld(t, db, pubsub, "order-9")
	})
}

// Over RabbitMQ, one message fanned out to two handlers (a queue each),
// behind a middleware that hands on msg.Copy(), on an inbox with no
// ConsumerName: each copy is deduped under its own handler's name, the
// two deliveries of one UUID told apart. Without its context, a copy
// carried no handler name, and every one was refused ("ConsumerName:
// empty").
func TestInbox_CopyingMiddlewareBeforeTheInbox_FannedOutMessageDedupedUnderEachHandlersName(t *testing.T) {
	t.Parallel()
	testdb.Require(t, "amqp")
	db := migrated(t, testdb.Postgres)
	createEffects(t, db)
	in, err := outbox.NewInbox(db.DB, outbox.InboxConfig{}) // consumer name: the handler's
	if err != nil {
		t.Fatal(err)
	}
	topic := "zz-copies-" + testdb.RandomName()
	r := newRouter(t)
	r.AddMiddleware(handsOnCopies, in.Middleware)
	r.AddPlugin(in.Plugin())
	var ran atomic.Int32
	for _, name := range []string{"billing", "shipping"} {
		sub, err := wamqp.NewSubscriber(wamqp.NewDurablePubSubConfig(testdb.AMQPURL(), wamqp.GenerateQueueNameTopicNameWithSuffix(name)), watermill.NopLogger{})
		if err != nil {
			t.Fatal(err)
		}
		if err := sub.SubscribeInitialize(topic); err != nil {
			t.Fatal(err)
		}
		h := writeEffect(t, db, &ran)
		r.AddConsumerHandler(name, topic, sub, func(msg *message.Message) error {
			_, err := h(msg)
			return err
		})
		t.Cleanup(func() { testamqpDeleteQueue(t, topic+"_"+name) })
	}
	t.Cleanup(func() {
		testamqp.New(t).With(func(ch *amqp.Channel) error { return ch.ExchangeDelete(topic, false, false) })
	})
	startRouter(t, r)
	pub, err := wamqp.NewPublisher(wamqp.NewDurablePubSubConfig(testdb.AMQPURL(), nil), watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	msg := message.NewMessage(watermill.NewUUID(), []byte("order 11"))
	if err := pub.Publish(topic, msg); err != nil {
		t.Fatal(err)
	}
	var consumers []string
	waitFor(t, 20*time.Second, "both handlers' dedupe rows", func() bool {
		consumers = nil
		if err := db.Select(&consumers, db.Rebind("SELECT consumer_name FROM processed_messages WHERE message_id = ?"), msg.UUID); err != nil {
			t.Fatal(err)
		}
		return len(consumers) == 2
	})
	sort.Strings(consumers)
	if want := []string{"billing", "shipping"}; !reflect.DeepEqual(consumers, want) || ran.Load() != 2 || countEffects(t, db, msg.UUID) != 2 {
		t.Errorf("dedupe rows for %q, handler ran %d times, %d effects; want %q, 2, 2", consumers, ran.Load(), countEffects(t, db, msg.UUID), want)
	}
}

// A service closes its router and builds another over the same Inbox (a
// restart within the process). A message held in the first router's
// on_paid, released in the second before its on_paid had a delivery, ran
// in the first router's chain, which was gone. With the plugin it waits
// for a handler of a router that runs, here the second's on_paid.
func TestOrderedInbox_RouterClosedAndRebuilt_HeldMessageRunsInTheRunningRouter(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.Postgres)
	in := orderedInbox(t, db, outbox.InboxConfig{ConsumerName: "ledger", ApplyHeldEvery: time.Hour})
	topics := [2]string{"order.created", "order.paid"}
	var first, second ledger
	bus := gochannel.NewGoChannel(gochannel.Config{BlockPublishUntilSubscriberAck: true}, watermill.NopLogger{})
	stop := first.router(t, in, bus, topics)
	if err := bus.Publish("order.paid", keyedMsg("order-7", 2)); err != nil {
		t.Fatal(err)
	}
	if n := countHeld(t, db); n != 1 {
		t.Fatalf("%d held, want 1", n)
	}
	stop()

	again := gochannel.NewGoChannel(gochannel.Config{BlockPublishUntilSubscriberAck: true}, watermill.NopLogger{})
	second.router(t, in, again, topics)
	if err := again.Publish("order.created", keyedMsg("order-7", 1)); err != nil {
		t.Fatal(err)
	}
	if ran, _ := first.runs(); len(ran) != 0 {
		t.Fatalf("the closed router's handlers ran %q", ran)
	}
	if n := countHeld(t, db); n != 1 {
		t.Fatalf("%d held once seq 1 applied with no running on_paid seen, want 1", n)
	}
	if err := again.Publish("order.paid", keyedMsg("order-8", 1)); err != nil { // the second's on_paid seen
		t.Fatal(err)
	}
	if n, err := in.ApplyHeld(context.Background()); n != 1 || err != nil {
		t.Fatalf("ApplyHeld: %d, %v; want 1 applied", n, err)
	}
	ran, _ := second.runs()
	if want := []string{"on_created 1 from order.created after the inbox", "on_paid 1 from order.paid after the inbox", "on_paid 2 from order.paid after the inbox"}; !reflect.DeepEqual(ran, want) {
		t.Errorf("the running router ran %q, want %q", ran, want)
	}
	if ran, _ := first.runs(); len(ran) != 0 {
		t.Errorf("the closed router's handlers ran %q", ran)
	}
}

// barrierOf returns a wait that returns once n callers have come.
func barrierOf(n int32) func() {
	var came atomic.Int32
	all := make(chan struct{})
	return func() {
		if came.Add(1) == n {
			close(all)
		}
		<-all
	}
}

func dedupeConsumers(t *testing.T, db *testdb.DB, id string) []string {
	t.Helper()
	var cs []string
	if err := db.Select(&cs, db.Rebind("SELECT consumer_name FROM processed_messages WHERE message_id = ?"), id); err != nil {
		t.Fatal(err)
	}
	sort.Strings(cs)
	return cs
}

// gochannel fans one message out to two handlers as two copies sharing
// one payload: behind a msg.Copy() middleware, both in flight at once,
// neither copy was told apart, and an inbox with no ConsumerName refused
// both ("ConsumerName: empty"). The second delivery gets bytes of its own.
func TestInbox_CopyingMiddlewareBeforeTheInbox_GoChannelFanOut_EachCopyGetsItsHandlersName(t *testing.T) {
	t.Parallel()
	db, in := inboxNamedByHandler(t)
	pubsub := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	r := newRouter(t)
	var mu sync.Mutex
	firstErr := map[string]error{}
	// Both deliveries in flight before either goes on; the first attempt's
	// outcome recorded and the delivery acked, so gochannel does not loop.
	barrier := barrierOf(2)
	both := func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			name := message.HandlerNameFromCtx(msg.Context())
			barrier()
			_, err := h(msg)
			mu.Lock()
			if _, seen := firstErr[name]; !seen {
				firstErr[name] = err
			}
			mu.Unlock()
			return nil, nil
		}
	}
	r.AddMiddleware(both, handsOnCopies, in.Middleware)
	r.AddPlugin(in.Plugin())
	var ran atomic.Int32
	for _, name := range []string{"billing", "shipping"} {
		h := writeEffect(t, db, &ran)
		r.AddConsumerHandler(name, "orders", pubsub, func(msg *message.Message) error { _, err := h(msg); return err })
	}
	startRouter(t, r)
	msg := message.NewMessage(watermill.NewUUID(), []byte("order 11"))
	if err := pubsub.Publish("orders", msg); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "both handlers' first attempts", func() bool { mu.Lock(); defer mu.Unlock(); return len(firstErr) == 2 })
	mu.Lock()
	defer mu.Unlock()
	for name, err := range firstErr {
		if err != nil {
			t.Errorf("%s: %v", name, err)
		}
	}
	if got, want := dedupeConsumers(t, db, msg.UUID), []string{"billing", "shipping"}; !reflect.DeepEqual(got, want) {
		t.Errorf("dedupe rows for %q; want %q", got, want)
	}
}

// A delivery acked before the inbox (middleware.InstantAck) leaves the
// deliveries in flight; a copy of it found "the only one of its UUID" in
// flight, the same message's delivery to another handler: billing's
// handler ran under shipping's name, its dedupe row shipping's, and
// shipping's own delivery was then a duplicate, never run. A copy is now
// found by the payload it shares only.
func TestInbox_CopyingMiddlewareBeforeTheInbox_DeliveryAckedEarly_CopyNeverTakesAnotherHandlersName(t *testing.T) {
	t.Parallel()
	db, in := inboxNamedByHandler(t)
	pubsub := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	r := newRouter(t)
	billingDone := make(chan struct{})
	barrier := barrierOf(2)
	order := func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			barrier() // both deliveries in flight
			if message.HandlerNameFromCtx(msg.Context()) == "shipping" {
				<-billingDone
				return h(msg)
			}
			defer close(billingDone)
			msg.Ack() // middleware.InstantAck
			waitFor(t, 5*time.Second, "billing's delivery forgotten", func() bool { return outbox.InFlightDeliveries(in, msg.UUID) == 1 })
			return h(msg)
		}
	}
	r.AddMiddleware(order, handsOnCopies, in.Middleware)
	r.AddPlugin(in.Plugin())
	var mu sync.Mutex
	saw := map[string][]string{}
	for _, name := range []string{"billing", "shipping"} {
		name := name
		r.AddConsumerHandler(name, "orders", pubsub, func(msg *message.Message) error {
			mu.Lock()
			saw[name] = append(saw[name], message.HandlerNameFromCtx(msg.Context()))
			mu.Unlock()
			return nil
		})
	}
	startRouter(t, r)
	msg := message.NewMessage(watermill.NewUUID(), []byte("order 11"))
	if err := pubsub.Publish("orders", msg); err != nil {
		t.Fatal(err)
	}
	// Both deliveries were in flight (the barrier) by the time billing's
	// handler returned, and shipping's goes on after it.
	select {
	case <-billingDone:
	case <-time.After(10 * time.Second):
		t.Fatal("billing's delivery never reached the inbox")
	}
	waitFor(t, 10*time.Second, "shipping's delivery done", func() bool { return outbox.InFlightDeliveries(in, msg.UUID) == 0 })
	mu.Lock()
	defer mu.Unlock()
	// Billing's copy refused (no name) is InstantAck's price; run as
	// another handler it is not.
	wrong := false
	for handler, names := range saw {
		for _, n := range names {
			wrong = wrong || n != handler
		}
	}
	if wrong || len(saw["shipping"]) != 1 {
		t.Errorf("handlers ran under names %q (dedupe rows %q); want each under its own, shipping once", saw, dedupeConsumers(t, db, msg.UUID))
	}
}

// A message handed to the inbox outside any router (a consume loop of the
// service's, a replay) took, while a router's delivery of its UUID was in
// flight, that router's handler name and run: its dedupe row that
// handler's, and the router's own delivery then a duplicate. It is left as
// it is.
func TestInbox_MessageOutsideTheRouter_TakesNoInFlightDeliverysHandlerName(t *testing.T) {
	t.Parallel()
	db, in := inboxNamedByHandler(t)
	pubsub := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	r := newRouter(t)
	release := make(chan struct{})
	arrived := make(chan struct{})
	r.AddMiddleware(func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			close(arrived)
			<-release
			return h(msg)
		}
	}, in.Middleware)
	r.AddPlugin(in.Plugin())
	var routed atomic.Int32
	r.AddConsumerHandler("billing", "orders", pubsub, func(*message.Message) error { routed.Add(1); return nil })
	startRouter(t, r)
	id := watermill.NewUUID()
	if err := pubsub.Publish("orders", message.NewMessage(id, []byte("order 11"))); err != nil {
		t.Fatal(err)
	}
	<-arrived
	var outsideName string
	_, err := in.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		outsideName = message.HandlerNameFromCtx(msg.Context())
		return nil, nil
	})(message.NewMessage(id, []byte("order 11")))
	close(release)
	waitFor(t, 5*time.Second, "the routed delivery done", func() bool { return outbox.InFlightDeliveries(in, id) == 0 })
	if err == nil || outsideName != "" || routed.Load() != 1 {
		t.Errorf("outside the router: err %v, ran under handler name %q; the router's delivery ran %d times (dedupe rows %q); "+
			"want refused (no ConsumerName, no handler name), and the routed delivery run once", err, outsideName, routed.Load(), dedupeConsumers(t, db, id))
	}
}

// A delivery was forgotten when its subscriber closed, though the router
// had not acked or nacked it yet: Router.Close closes every handler's
// subscriber first, then waits (CloseTimeout) for the handlers under way.
// A retry of one, behind a copying middleware and a Retry with
// ResetContextOnRetry (what the inbox's own error message asks for), then
// reached the inbox without a handler name. It is kept until its ack.
func TestInbox_CopyingMiddlewareBeforeTheInbox_RetryAcrossRouterClose_CopyKeepsItsHandlerName(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.Postgres)
	createEffects(t, db)
	in := newInbox(t, db, outbox.InboxConfig{ConsumerName: "ledger"})
	pubsub := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	r := newRouter(t)
	r.AddMiddleware(handsOnCopies, middleware.Retry{MaxRetries: 1, InitialInterval: 500 * time.Millisecond, ResetContextOnRetry: true}.Middleware, in.Middleware)
	r.AddPlugin(in.Plugin())
	failed := make(chan struct{})
	var mu sync.Mutex
	var names []string
	r.AddConsumerHandler("billing", "orders", pubsub, func(msg *message.Message) error {
		mu.Lock()
		defer mu.Unlock()
		names = append(names, message.HandlerNameFromCtx(msg.Context()))
		if len(names) == 1 {
			close(failed)
			return errRetryThis
		}
		return nil
	})
	startRouter(t, r)
	msg := message.NewMessage(watermill.NewUUID(), []byte("order 11"))
	if err := pubsub.Publish("orders", msg); err != nil {
		t.Fatal(err)
	}
	<-failed
	_ = r.Close() // during Retry's backoff (a service's shutdown); waits for the handler
	mu.Lock()
	defer mu.Unlock()
	if want := []string{"billing", "billing"}; !reflect.DeepEqual(names, want) {
		t.Errorf("attempts ran under handler names %q; want %q", names, want)
	}
}

var errRetryThis = retryError("try again")

type retryError string

func (e retryError) Error() string { return string(e) }

// A restart, behind a middleware that hands on msg.Copy(): the wake of
// on_paid lost its context in the copy, and the inbox learnt the route of
// a handler without a name. Its held seq 2, released by seq 1 on
// order.created, waited for on_paid's first delivery. The wake's payload
// finds its delivery as a delivery's does.
func TestOrderedInbox_CopyingMiddlewareBeforeTheInbox_AfterARestart_WakeLearnsItsHandler(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		cfg := outbox.InboxConfig{ConsumerName: "ledger", ApplyHeldEvery: time.Hour}
		topics := [2]string{"order.created", "order.paid"}
		before := ledger{before: handsOnCopies}
		first := gochannel.NewGoChannel(gochannel.Config{BlockPublishUntilSubscriberAck: true}, watermill.NopLogger{})
		stop := before.router(t, orderedInbox(t, db, cfg), first, topics)
		if err := first.Publish("order.paid", keyedMsg("order-7", 2)); err != nil {
			t.Fatal(err)
		}
		if n := countHeld(t, db); n != 1 {
			t.Fatalf("%d held, want 1", n)
		}
		stop()

		after := ledger{before: handsOnCopies}
		in := orderedInbox(t, db, cfg)
		second := gochannel.NewGoChannel(gochannel.Config{BlockPublishUntilSubscriberAck: true}, watermill.NopLogger{})
		after.router(t, in, in.Subscriber(second), topics)
		after.predecessorRunsHeld(t, db, second, "order-7")
	})
}
