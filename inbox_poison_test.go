package outbox_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testamqp"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// The README's middleware chain, through a router, with the broker's own
// publisher (watermill-amqp's) for the poison topic. middleware.Timeout
// cancels the message's context as the last attempt returns, and
// watermill-amqp publishes with that context: PoisonQueue's publish failed
// at once, the router nacked the message, and it came back, for ever (a
// review counted 129 runs of one message in 10 s), never set aside. Now it
// is on the poison topic after its retries, acked, and its record counts
// as processed.
func TestInbox_PoisonPublisher_ReadmeChainWithTheBrokersPublisher_SetAsideAfterItsRetries(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		b := testamqp.New(t)
		orders, poisoned := b.Queue(), b.Queue()
		id := publishN(t, db, "", "order.placed", 1)[0]
		in := newInbox(t, db, outbox.InboxConfig{MarkOutboxProcessed: true})
		pub, err := wamqp.NewPublisher(wamqp.NewDurableQueueConfig(testdb.AMQPURL()), watermill.NopLogger{})
		if err != nil {
			t.Fatal(err)
		}
		defer pub.Close()
		poisonQueue, err := middleware.PoisonQueue(in.PoisonPublisher(pub), poisoned)
		if err != nil {
			t.Fatal(err)
		}
		router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
		if err != nil {
			t.Fatal(err)
		}
		// The router's message, as the router acks or nacks it.
		delivered := make(chan *message.Message, 8)
		router.AddMiddleware(
			func(h message.HandlerFunc) message.HandlerFunc {
				return func(msg *message.Message) ([]*message.Message, error) {
					delivered <- msg
					return h(msg)
				}
			},
			poisonQueue,
			middleware.Retry{MaxRetries: 3, InitialInterval: time.Millisecond, ResetContextOnRetry: true}.Middleware,
			middleware.Timeout(30*time.Second),
			in.Middleware,
		)
		var runs atomic.Int32
		router.AddConsumerHandler("fulfil-orders", orders, amqpSubscriber(t), func(*message.Message) error {
			runs.Add(1)
			return errors.New("no such warehouse")
		})
		router.AddPlugin(in.Plugin()) // as the README's chain: a running router's poison is set aside
		done := make(chan error, 1)
		go func() { done <- router.Run(context.Background()) }()
		<-router.Running()
		publishRaw(t, b, orders, id)

		var msg *message.Message
		select {
		case msg = <-delivered:
		case <-time.After(20 * time.Second):
			t.Fatal("the message was never delivered")
		}
		// Acked by the router once set aside, not nacked: what reaches the
		// broker after is watermill-amqp's (a router closed as it acks may
		// still see its subscriber nack: a race of watermill-amqp's, which
		// this test does not judge).
		select {
		case <-msg.Acked():
		case <-msg.Nacked():
			t.Fatal("the message was nacked: it comes back, its retries run again")
		case <-time.After(20 * time.Second):
			t.Fatal("the message was neither acked nor nacked within 20 s")
		}
		deadline := time.Now().Add(20 * time.Second)
		for b.Count(poisoned) == 0 && time.Now().Before(deadline) {
			time.Sleep(20 * time.Millisecond) // polling the broker
		}
		if err := router.Close(); err != nil {
			t.Fatal(err)
		}
		if err := <-done; err != nil {
			t.Fatal(err)
		}
		got := b.Drain(poisoned, 1, time.Second)
		if len(got) != 1 || runs.Load() != 4 {
			t.Fatalf("poison topic holds %d messages after the handler ran %d times; want 1 after 4 (a run and 3 retries)", len(got), runs.Load())
		}
		if got[0].MessageId != id && got[0].Headers[outbox.HeaderMessageID] != id {
			t.Errorf("poison topic holds %q (headers %v), want message %s", got[0].MessageId, got[0].Headers, id)
		}
		if len(delivered) > 0 {
			t.Errorf("the message was delivered %d times more after it was acked", len(delivered))
		}
		if !outboxStateOf(t, db, id).Processed {
			t.Error("the record of the message set aside is not marked processed")
		}
	})
}

// An ordered consumer behind the README's chain: a key's message whose
// handler keeps failing is set aside after its retries, and the key's next
// is held behind it (not applied out of order), a gap that Gaps surfaces for
// the operator to skip. Before, the poison topic's publish failed on the
// context Timeout had ended, the message came back for ever, and the key
// went no further, with no gap to see.
func TestOrderedInbox_PoisonPublisher_KeysFailingMessageSetAsideNextHeldBehindIt(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		createEffects(t, db)
		in := newInbox(t, db, outbox.InboxConfig{Ordered: true})
		poison := &poisonRecorder{}
		pq, err := middleware.PoisonQueue(in.PoisonPublisher(poison), "payments.poison")
		if err != nil {
			t.Fatal(err)
		}
		log := &applyLog{fail: func(msg *message.Message) error {
			if msg.Metadata.Get(outbox.HeaderSeq) == "2" {
				return errors.New("the ledger refuses it")
			}
			return nil
		}}
		h := pq(middleware.Retry{MaxRetries: 2, InitialInterval: time.Millisecond, ResetContextOnRetry: true}.Middleware(
			middleware.Timeout(30 * time.Second)(in.Middleware(log.handler(t, db)))))
		for seq := 1; seq <= 3; seq++ {
			msg := keyedMsg("pay-1", seq)
			msg.SetContext(context.Background())
			if _, err := h(msg); err != nil {
				t.Fatalf("seq %d: %v; want it acked (applied, set aside or held)", seq, err)
			}
		}
		if got := log.of("pay-1"); len(got) != 1 || got[0] != 1 {
			t.Errorf("applied %v, want [1]: seq 3 must wait for seq 2", got)
		}
		if poison.count() != 1 || poison.msgs[0].Metadata.Get(outbox.HeaderSeq) != "2" {
			t.Fatalf("poison topic holds %d messages; want seq 2 alone", poison.count())
		}
		gaps, err := in.Gaps(context.Background(), 0)
		if err != nil {
			t.Fatal(err)
		}
		if len(gaps) != 1 || gaps[0].AggregateID != "pay-1" || gaps[0].LastApplied != 1 || gaps[0].LowestHeld != 3 {
			t.Fatalf("gaps %+v, want pay-1 applied to 1 with seq 3 held", gaps)
		}
	})
}
