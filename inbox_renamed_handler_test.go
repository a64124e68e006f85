package outbox_test

import (
	"context"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// An ordered inbox whose ConsumerName defaults to the router handler's
// name, its handler renamed: the new name is a new consumer, and every
// key waits at its next number behind the ones the old name applied (an
// API review). Not applied out of order, and GapAfter's ERROR names the
// likely cause, a consumer that applied none of the key's numbers: a
// renamed handler, or one turned on over the key's history.
func TestOrderedInbox_HandlerRenamedUnderTheDefaultName_GapLogNamesTheCause(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.SQLite)
	logs := watermill.NewCaptureLogger()
	in, err := outbox.NewInbox(db.DB, outbox.InboxConfig{Ordered: true, GapAfter: 1, Logger: logs})
	if err != nil {
		t.Fatal(err)
	}
	ran := 0
	deliver := func(handler, seq string) {
		t.Helper()
		bus := gochannel.NewGoChannel(gochannel.Config{BlockPublishUntilSubscriberAck: true}, watermill.NopLogger{})
		r, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
		if err != nil {
			t.Fatal(err)
		}
		r.AddMiddleware(in.Middleware)
		r.AddConsumerHandler(handler, "order.paid", bus, func(*message.Message) error { ran++; return nil })
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- r.Run(ctx) }()
		<-r.Running()
		m := message.NewMessage(watermill.NewUUID(), []byte(`{}`))
		m.Metadata.Set(outbox.HeaderAggregateID, "order-1")
		m.Metadata.Set(outbox.HeaderSeq, seq)
		if err := bus.Publish("order.paid", m); err != nil {
			t.Fatal(err)
		}
		cancel()
		if err := <-done; err != nil {
			t.Fatal(err)
		}
	}
	deliver("ledger", "1")
	deliver("ledger-v2", "2")
	if ran != 1 {
		t.Fatalf("the handler ran %d times, want once: seq 2 held under the new name", ran)
	}
	if err := in.RefreshStats(context.Background()); err != nil {
		t.Fatal(err)
	}
	for _, l := range logs.Captured()[watermill.ErrorLogLevel] {
		if l.Fields["consumer"] == "ledger-v2" {
			if !strings.Contains(l.Msg, "renamed") || !strings.Contains(l.Msg, "ConsumerName") {
				t.Errorf("the gap's ERROR: %q, want it to name a renamed handler and ConsumerName", l.Msg)
			}
			return
		}
	}
	t.Errorf("no ERROR for ledger-v2's gap; errors: %v", logs.Captured()[watermill.ErrorLogLevel])
}
