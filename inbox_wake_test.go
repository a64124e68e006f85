package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// ledger is a service's two handlers of one ordered consumer, on
// order.created and order.paid, behind the inbox and a middleware after it;
// it notes each run and any message of the inbox's own that reached them.
type ledger struct {
	mu    sync.Mutex
	ran   []string
	wakes int
	// before, if set, is a middleware of the service's before the inbox.
	before message.HandlerMiddleware
}

type afterInboxKey struct{}

func (l *ledger) router(t *testing.T, in *outbox.Inbox, sub message.Subscriber, topics [2]string) (stop func()) {
	t.Helper()
	r := newRouter(t)
	if l.before != nil {
		r.AddMiddleware(l.before)
	}
	r.AddMiddleware(in.Middleware, func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			msg.SetContext(context.WithValue(msg.Context(), afterInboxKey{}, true))
			return h(msg)
		}
	})
	r.AddPlugin(in.Plugin())
	for _, name := range []string{"on_created", "on_paid"} {
		topic := topics[0]
		if name == "on_paid" {
			topic = topics[1]
		}
		r.AddConsumerHandler(name, topic, sub, func(msg *message.Message) error {
			l.mu.Lock()
			defer l.mu.Unlock()
			if msg.Metadata.Get(outbox.WakeMetadataKey) != "" {
				l.wakes++
				return nil
			}
			via := ""
			if msg.Context().Value(afterInboxKey{}) != nil {
				via = " after the inbox"
			}
			l.ran = append(l.ran, fmt.Sprintf("%s %s from %s%s", name, msg.Metadata.Get(outbox.HeaderSeq), message.SubscribeTopicFromCtx(msg.Context()), via))
			return nil
		})
	}
	return startRouter(t, r)
}

func (l *ledger) runs() ([]string, int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]string(nil), l.ran...), l.wakes
}

// A key's events come on two topics, one ordered consumer: order.paid's
// seq 2 arrived first and was held; the service restarted; order.created's
// seq 1 came, and order.paid had nothing more to deliver. The held message
// runs in the handler it was delivered to, which the inbox learned from a
// delivery: the restarted process had seen none of on_paid's, and the
// message waited until order.paid delivered again, for good on a quiet
// topic (a review's ledger held 98 of 100 keys so after a restart). With
// the handler's subscriber wrapped by inbox.Subscriber, the router's start
// tells the inbox on_paid's chain: seq 2 runs right after seq 1, through
// the middleware after the inbox, with on_paid's router context, and
// neither handler sees the inbox's own message.
func TestOrderedInbox_Subscriber_AfterARestart_HeldMessageOfAQuietHandlerRunsAfterItsPredecessor(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		cfg := outbox.InboxConfig{ConsumerName: "ledger", ApplyHeldEvery: time.Hour} // no tick helps
		topics := [2]string{"order.created", "order.paid"}
		var before ledger
		first := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
		stop := before.router(t, orderedInbox(t, db, cfg), first, topics)
		if err := first.Publish("order.paid", keyedMsg("order-7", 2)); err != nil {
			t.Fatal(err)
		}
		waitFor(t, 10*time.Second, "seq 2 held", func() bool { return countHeld(t, db) == 1 })
		stop()

		var after ledger
		in := orderedInbox(t, db, cfg) // the restarted process's
		second := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
		after.router(t, in, in.Subscriber(second), topics)
		after.predecessorRunsHeld(t, db, second, "order-7")
	})
}

// predecessorRunsHeld publishes key's order.created seq 1, its order.paid
// seq 2 held, and checks that each ran in its own handler, after the
// inbox, and that neither saw a message of the inbox's own.
func (l *ledger) predecessorRunsHeld(t *testing.T, db *testdb.DB, pub message.Publisher, key string) {
	t.Helper()
	if err := pub.Publish("order.created", keyedMsg(key, 1)); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "seq 2 applied", func() bool { return countHeld(t, db) == 0 })
	ran, wakes := l.runs()
	if want := []string{"on_created 1 from order.created after the inbox", "on_paid 2 from order.paid after the inbox"}; !reflect.DeepEqual(ran, want) || wakes != 0 {
		t.Errorf("ran %q, and the handlers saw %d of the inbox's own messages; want %q and none", ran, wakes, want)
	}
}

// A held message whose handler failed when its turn came, and then the
// service stopped: nothing more comes for its key or its handler. Before,
// the restarted service left it held until its handler's next delivery
// (ApplyHeld applies only the held messages of handlers it has seen). With
// inbox.Subscriber over watermill-amqp, the router's start applies it,
// with no delivery at all.
func TestOrderedInbox_Subscriber_AfterARestart_ReadyHeldMessageAppliedWithNoDelivery(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		createEffects(t, db)
		cfg := outbox.InboxConfig{ConsumerName: "ledger", ApplyHeldEvery: time.Hour}
		topic := "zz-wake-" + testdb.RandomName()
		t.Cleanup(func() { testamqpDeleteQueue(t, topic) }) // after the routers' stops
		var failed atomic.Bool
		log := &applyLog{fail: func(msg *message.Message) error {
			if msg.Metadata.Get(outbox.HeaderSeq) == "2" && failed.CompareAndSwap(false, true) {
				return errors.New("the ledger is briefly away")
			}
			return nil
		}}
		run := func(in *outbox.Inbox, sub message.Subscriber) (stop func()) {
			r := newRouter(t)
			r.AddMiddleware(in.Middleware)
			r.AddPlugin(in.Plugin())
			r.AddNoPublisherHandler("ledger", topic, sub, func(msg *message.Message) error {
				_, err := log.handler(t, db)(msg)
				return err
			})
			return startRouter(t, r)
		}
		stop := run(orderedInbox(t, db, cfg), amqpSubscriber(t))
		pub, err := wamqp.NewPublisher(wamqp.NewDurableQueueConfig(testdb.AMQPURL()), watermill.NopLogger{})
		if err != nil {
			t.Fatal(err)
		}
		defer pub.Close()
		for _, seq := range []int{2, 1} { // 2 is held, 1 releases it, and it fails
			if err := pub.Publish(topic, keyedMsg("pay-1", seq)); err != nil {
				t.Fatal(err)
			}
		}
		waitFor(t, 10*time.Second, "seq 1 applied, seq 2 failed at its turn", func() bool { return failed.Load() && len(log.of("pay-1")) == 1 })
		stop()
		if n := countHeld(t, db); n != 1 {
			t.Fatalf("%d held after the stop; want seq 2's", n)
		}

		in := orderedInbox(t, db, cfg)
		run(in, in.Subscriber(amqpSubscriber(t)))
		// The log is written as the handler runs, in the transaction: its
		// effect is waited for too, committed (a run read the effects between
		// the two, and found none).
		waitFor(t, 10*time.Second, "seq 2 applied and committed", func() bool {
			return len(log.of("pay-1")) == 2 && countEffects(t, db, keyedMsg("pay-1", 2).UUID) > 0
		})
		if got := log.of("pay-1"); !reflect.DeepEqual(got, []int{1, 2}) {
			t.Errorf("applied %v; want [1 2]", got)
		}
		assertEffectsOnce(t, db, "pay-1", 2)
	})
}

// The inbox's own message goes where the handler's messages go, up to the
// inbox: a handler of the wrapped subscriber that is not behind the inbox
// never sees it (the plugin's middleware ends it), nor does one on a
// router without the plugin (none is sent), and one that a middleware
// before the inbox fails is not set aside by PoisonPublisher.
func TestOrderedInbox_Subscriber_TheInboxsOwnMessageReachesNoHandlerAndNoPoisonTopic(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.SQLite)
	in := orderedInbox(t, db, outbox.InboxConfig{ConsumerName: "ledger", ApplyHeldEvery: time.Hour})
	pubsub := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	poisoned, err := pubsub.Subscribe(context.Background(), "poison")
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	seen := map[string][]string{}
	note := func(handler string) message.NoPublishHandlerFunc {
		return func(msg *message.Message) error {
			mu.Lock()
			defer mu.Unlock()
			seen[handler] = append(seen[handler], msg.UUID)
			return nil
		}
	}
	var acked atomic.Int32
	withPlugin := newRouter(t)
	poisonQueue, err := middleware.PoisonQueue(in.PoisonPublisher(pubsub), "poison")
	if err != nil {
		t.Fatal(err)
	}
	withPlugin.AddMiddleware(countSucceeded(&acked), poisonQueue)
	withPlugin.AddPlugin(in.Plugin())
	withPlugin.AddConsumerHandler("behind", "a", in.Subscriber(pubsub), note("behind")).AddMiddleware(func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			if len(msg.Payload) == 0 {
				return nil, errors.New("a middleware before the inbox refuses an empty message")
			}
			return h(msg)
		}
	}, in.Middleware)
	withPlugin.AddConsumerHandler("not-behind", "b", in.Subscriber(pubsub), note("not-behind"))
	startRouter(t, withPlugin)
	without := newRouter(t)
	without.AddConsumerHandler("no-plugin", "c", in.Subscriber(pubsub), note("no-plugin"))
	startRouter(t, without)

	want := map[string][]string{}
	for _, topic := range []string{"a", "b", "c"} {
		msg := keyedMsg("k-"+topic, 1)
		if err := pubsub.Publish(topic, msg); err != nil {
			t.Fatal(err)
		}
		want[map[string]string{"a": "behind", "b": "not-behind", "c": "no-plugin"}[topic]] = []string{msg.UUID}
	}
	// The inbox's own two (one refused before the inbox, one ended before
	// a handler not behind it), and a and b.
	waitFor(t, 10*time.Second, "every delivery acked", func() bool { return acked.Load() >= 4 })
	waitFor(t, 10*time.Second, "c handled", func() bool { mu.Lock(); defer mu.Unlock(); return len(seen["no-plugin"]) == 1 })
	mu.Lock()
	defer mu.Unlock()
	if !reflect.DeepEqual(seen, want) {
		t.Errorf("the handlers saw %v; want %v", seen, want)
	}
	select {
	case msg := <-poisoned:
		t.Errorf("message %s (metadata %v) set aside; want none", msg.UUID, msg.Metadata)
	case <-time.After(200 * time.Millisecond): // a poison publish comes before the ack counted above
	}
}

// Held messages are tied to the handler they were delivered to. A service
// that names its workers apart (ledger-paid-1, ledger-paid-2) and runs
// fewer after a deploy, or renames a handler, left the held messages of
// the handler gone held for good (a review: 148 of them, from three paid
// workers down to one). A handler of the same consumer and topic now runs
// them: a consumer dedupes a message once, so such handlers are workers
// of one. A handler of another topic never does.
func TestOrderedInbox_HandlerGone_ItsHeldMessagesRunInAWorkerOfTheSameTopic(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		cfg := outbox.InboxConfig{ConsumerName: "ledger", ApplyHeldEvery: time.Hour}
		var mu sync.Mutex
		var ran []string
		run := func(handlers ...string) (*gochannel.GoChannel, func()) {
			in := orderedInbox(t, db, cfg)
			bus := gochannel.NewGoChannel(gochannel.Config{BlockPublishUntilSubscriberAck: true}, watermill.NopLogger{})
			r := newRouter(t)
			r.AddMiddleware(in.Middleware)
			r.AddPlugin(in.Plugin())
			for _, name := range handlers {
				topic := "order.paid"
				if name == "ledger-placed" {
					topic = "order.placed"
				}
				r.AddConsumerHandler(name, topic, in.Subscriber(bus), func(msg *message.Message) error {
					mu.Lock()
					defer mu.Unlock()
					ran = append(ran, name+" "+msg.Metadata.Get(outbox.HeaderSeq))
					return nil
				})
			}
			return bus, startRouter(t, r)
		}
		bus, stop := run("ledger-paid-2")
		if err := bus.Publish("order.paid", keyedMsg("order-3", 2)); err != nil {
			t.Fatal(err)
		}
		waitFor(t, 10*time.Second, "seq 2 held", func() bool { return countHeld(t, db) == 1 })
		stop()

		bus, stop = run("ledger-placed") // no order.paid handler: seq 2 waits
		if err := bus.Publish("order.placed", keyedMsg("order-3", 1)); err != nil {
			t.Fatal(err)
		}
		if n := countHeld(t, db); n != 1 {
			t.Fatalf("%d held once seq 1 was acked; want seq 2, which no handler of its topic ran", n)
		}
		stop()

		run("ledger-placed", "ledger-paid-1") // one worker of order.paid, named otherwise
		waitFor(t, 10*time.Second, "seq 2 applied", func() bool { return countHeld(t, db) == 0 })
		mu.Lock()
		defer mu.Unlock()
		if want := []string{"ledger-placed 1", "ledger-paid-1 2"}; !reflect.DeepEqual(ran, want) {
			t.Errorf("ran %q, want %q", ran, want)
		}
	})
}

// A restart with many ready keys: the wake applies them several keys at
// once (one at a time, 2,000 keys took 6–10 s in a review; four at once
// about doubles the rate here), each key's held messages in order, each
// once.
func TestOrderedInbox_Subscriber_ManyReadyKeysAtAStart_EachAppliedInOrderOnce(t *testing.T) {
	t.Parallel()
	eachServer(t, func(t *testing.T, db *testdb.DB) {
		createEffects(t, db)
		cfg := outbox.InboxConfig{ConsumerName: "ledger", ApplyHeldEvery: time.Hour}
		const keys = 200
		var mu sync.Mutex
		failed := map[string]bool{}
		log := &applyLog{fail: func(msg *message.Message) error {
			mu.Lock()
			defer mu.Unlock()
			if key := msg.Metadata.Get(outbox.HeaderAggregateID); msg.Metadata.Get(outbox.HeaderSeq) == "2" && !failed[key] {
				failed[key] = true // at its turn: ready, and left for the next start
				return errors.New("the ledger is briefly away")
			}
			return nil
		}}
		run := func(in *outbox.Inbox, sub message.Subscriber, plugged bool) (stop func()) {
			r := newRouter(t)
			r.AddMiddleware(in.Middleware)
			if plugged { // its ticks would try the failed ones again
				r.AddPlugin(in.Plugin())
			}
			r.AddNoPublisherHandler("ledger", "t", sub, func(msg *message.Message) error {
				_, err := log.handler(t, db)(msg)
				return err
			})
			return startRouter(t, r)
		}
		bus := gochannel.NewGoChannel(gochannel.Config{BlockPublishUntilSubscriberAck: true}, watermill.NopLogger{})
		stop := run(orderedInbox(t, db, cfg), bus, false)
		for i := range keys {
			for _, seq := range []int{3, 2, 1} { // 3 and 2 held, 1 releases them, and 2 fails
				if err := bus.Publish("t", keyedMsg(fmt.Sprintf("acct-%03d", i), seq)); err != nil {
					t.Fatal(err)
				}
			}
		}
		stop()
		if n := countHeld(t, db); n != 2*keys {
			t.Fatalf("%d held after the stop; want %d", n, 2*keys)
		}
		in := orderedInbox(t, db, cfg)
		run(in, in.Subscriber(gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})), true)
		waitFor(t, 60*time.Second, "every key applied", func() bool { return countHeld(t, db) == 0 })
		for i := range keys {
			key := fmt.Sprintf("acct-%03d", i)
			if got := log.of(key); !reflect.DeepEqual(got, []int{1, 2, 3}) {
				t.Errorf("%s applied %v; want [1 2 3]", key, got)
			}
			assertEffectsOnce(t, db, key, 3)
		}
	})
}
