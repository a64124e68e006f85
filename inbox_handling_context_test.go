package outbox_test

import (
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jmoiron/sqlx"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// The pass-through of an inbox nested in itself (inbox_twice_test.go) is
// for the delivery it runs, not for every context made from its handler's.
// One Inbox around two router handlers on an in-process GoChannel whose
// PreserveContext carries a message's context to its subscribers (as a
// CQRS EventBus.Publish(ctx, ...) from inside a handler does): handler
// "orders" publishes an event with its own message's context; handler
// "billing" takes it. The event is a delivery of its own, for consumer
// billing, and must be deduped: its redelivery must not run billing again,
// and billing must get a transaction of its own, not orders'.
func TestInbox_HandlersContextOnAnotherMessage_ThatMessageDedupedInItsOwnTransaction(t *testing.T) {
	db := migrated(t, testdb.Postgres)
	in, err := outbox.NewInbox(db.DB, outbox.InboxConfig{}) // consumer: the router handler's name
	if err != nil {
		t.Fatal(err)
	}
	ch := gochannel.NewGoChannel(gochannel.Config{PreserveContext: true, OutputChannelBuffer: 10}, watermill.NopLogger{})
	t.Cleanup(func() { _ = ch.Close() })
	r, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	const eventID = "event-1"
	var ordersTx atomic.Pointer[sqlx.Tx]
	orders := in.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		tx, _ := outbox.TxFromContext(msg.Context())
		ordersTx.Store(tx)
		ev := message.NewMessage(eventID, []byte("order placed"))
		ev.SetContext(msg.Context()) // the incoming message's trace and values go on
		return nil, ch.Publish("events", ev)
	})
	var ran, sawOrdersTx atomic.Int32
	billing := in.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		ran.Add(1)
		if tx, ok := outbox.TxFromContext(msg.Context()); ok && tx == ordersTx.Load() {
			sawOrdersTx.Add(1)
		}
		return nil, nil
	})
	billed := make(chan error, 10)
	r.AddConsumerHandler("orders", "orders", ch, func(msg *message.Message) error { _, err := orders(msg); return err })
	r.AddConsumerHandler("billing", "events", ch, func(msg *message.Message) error {
		_, err := billing(msg)
		billed <- err
		return err
	})
	stop := runRouter(t, r)
	defer func() { _ = stop() }()

	if err := ch.Publish("orders", message.NewMessage("order-1", []byte("order 1"))); err != nil {
		t.Fatal(err)
	}
	wait := func(what string) {
		select {
		case err := <-billed:
			if err != nil {
				t.Fatalf("%s: billing's delivery failed: %v", what, err)
			}
		case <-time.After(30 * time.Second):
			t.Fatalf("%s: no billing delivery within 30 s", what)
		}
	}
	wait("the event")
	// The broker delivers the event again (a redelivery after a lost ack).
	if err := ch.Publish("events", message.NewMessage(eventID, []byte("order placed"))); err != nil {
		t.Fatal(err)
	}
	wait("the event's redelivery")
	if ran.Load() != 1 || countProcessed(t, db, eventID) != 1 || sawOrdersTx.Load() != 0 {
		t.Fatalf("billing ran %d times for one event (want 1), %d inbox keys for it (want 1), and %d time(s) got orders' transaction as its own (want 0)",
			ran.Load(), countProcessed(t, db, eventID), sawOrdersTx.Load())
	}
}
