package outbox_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testamqp"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// Three different messages from a producer in another language, each with
// its own message_id, and an x-acemq-id header that is not a string: void
// (a Python service forwarding headers.get("x-acemq-id") of a message that
// had none: pika sends None as void). AMQPMarshaler took the
// UUID from message_id (it skips a non-string x-acemq-id), but kept the
// header's JSON text ("null") in the metadata, and the inbox dedupes on
// that text first: every such message shared the key "null", and only the
// first ran; the others were acked as duplicates, never handled.
func TestInbox_ForeignXAcemqIDHeaderNotAString_EachMessageHandled(t *testing.T) {
	db := migrated(t, testdb.Postgres)
	testdb.Require(t, "amqp")
	cfg := wamqp.NewDurableQueueConfig(testdb.AMQPURL())
	cfg.Marshaler = outbox.AMQPMarshaler{}
	sub, err := wamqp.NewSubscriber(cfg, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	topic := "foreign-void-id-" + testdb.RandomName()
	t.Cleanup(func() { testamqpDeleteQueue(t, topic) })
	in := newInbox(t, db, outbox.InboxConfig{})

	var mu sync.Mutex
	ran := map[string]int{}
	seen := make(chan string, 16)
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	h := router.AddConsumerHandler("h", topic, sub, func(msg *message.Message) error {
		mu.Lock()
		ran[msg.UUID]++
		mu.Unlock()
		return nil
	})
	h.AddMiddleware(func(next message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			out, err := next(msg)
			if err == nil {
				seen <- msg.UUID
			}
			return out, err
		}
	}, in.Middleware)
	ctx, cancel := context.WithCancel(context.Background())
	go func() { _ = router.Run(ctx) }()
	t.Cleanup(func() { cancel(); _ = router.Close() })
	<-router.Running()

	msgs := []amqp.Publishing{
		{MessageId: "py-1-" + testdb.RandomName(), Headers: amqp.Table{outbox.HeaderMessageID: nil}, Body: []byte("1")},
		{MessageId: "py-2-" + testdb.RandomName(), Headers: amqp.Table{outbox.HeaderMessageID: nil}, Body: []byte("2")},
		{MessageId: "py-3-" + testdb.RandomName(), Headers: amqp.Table{outbox.HeaderMessageID: nil}, Body: []byte("3")},
	}
	testamqp.New(t).With(func(ch *amqp.Channel) error {
		for _, p := range msgs {
			if err := ch.PublishWithContext(context.Background(), "", topic, true, false, p); err != nil {
				return err
			}
		}
		return nil
	})
	for range msgs {
		select {
		case <-seen:
		case <-time.After(15 * time.Second):
			t.Fatal("not every message went through the inbox")
		}
	}
	mu.Lock()
	defer mu.Unlock()
	for _, p := range msgs {
		if ran[p.MessageId] != 1 {
			t.Errorf("message %s: handler ran %d times, want 1 (ran: %v)", p.MessageId, ran[p.MessageId], ran)
		}
	}
	var keys []string
	if err := db.Select(&keys, "SELECT message_id FROM processed_messages"); err != nil {
		t.Fatal(err)
	}
	t.Logf("processed_messages keys: %q", keys)
}
