package outbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// ctxKey carries a value (a trace, say) on the relay's context.
type ctxKey struct{}

// Through a GoChannel that preserves the message's context (for tracing),
// the subscriber received the relay's per-publish context, which the relay
// cancels as soon as Publish returns: dead on arrival, and an Inbox
// downstream failed at BEGIN on every delivery. The message now carries
// the relay's context's values without its cancellation.
func TestPublisherDestination_GoChannelPreserveContext_InboxHandlesIt(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	publishN(t, db, "", "orders", 1)
	ch := gochannel.NewGoChannel(gochannel.Config{PreserveContext: true, OutputChannelBuffer: 1}, nil)
	defer ch.Close()
	out, err := ch.Subscribe(context.Background(), "orders")
	if err != nil {
		t.Fatal(err)
	}
	inbox, err := outbox.NewInbox(db.DB, outbox.InboxConfig{ConsumerName: "c"})
	if err != nil {
		t.Fatal(err)
	}
	runs := 0
	h := inbox.Middleware(func(msg *message.Message) ([]*message.Message, error) { runs++; return nil, nil })
	f, err := outbox.NewForwarder(db.DB, outbox.NewPublisherDestination(ch, nil), outbox.ForwarderConfig{Dialect: outbox.SQLite})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	ctx := context.WithValue(context.Background(), ctxKey{}, "trace-1")
	if n, err := f.Sweep(ctx); n != 1 || err != nil {
		t.Fatalf("sweep: %d, %v", n, err)
	}
	for i := 0; i < 3; i++ { // GoChannel redelivers on nack
		select {
		case m := <-out:
			if got := m.Context().Value(ctxKey{}); got != "trace-1" {
				t.Errorf("the message's context lost the relay's values: %v", got)
			}
			_, herr := h(m)
			if herr != nil {
				t.Logf("delivery %d: inbox error: %v (message context: %v)", i, herr, m.Context().Err())
				m.Nack()
				continue
			}
			m.Ack()
			if runs != 1 {
				t.Errorf("handler ran %d times, want 1", runs)
			}
			return
		case <-time.After(5 * time.Second):
			t.Fatal("no message")
		}
	}
	t.Errorf("the inbox failed every delivery with the message's context cancelled; the handler ran %d times", runs)
}
