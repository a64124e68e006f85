package outbox_test

import (
	"context"
	"reflect"
	"sort"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	amqp "github.com/rabbitmq/amqp091-go"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testamqp"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

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
