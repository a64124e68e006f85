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
		deliverThrough(t, in, handler, seq, false, func() { ran++ })
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

// deliverThrough delivers one keyed message of order-1, seq, to handler
// under a router with in's middleware (and its Plugin if plugged), and
// stops the router once it was handled.
func deliverThrough(t *testing.T, in *outbox.Inbox, handler, seq string, plugged bool, ran func()) {
	t.Helper()
	bus := gochannel.NewGoChannel(gochannel.Config{BlockPublishUntilSubscriberAck: true}, watermill.NopLogger{})
	r := newRouter(t)
	r.AddMiddleware(in.Middleware)
	if plugged {
		r.AddPlugin(in.Plugin())
	}
	r.AddConsumerHandler(handler, "order.paid", bus, func(*message.Message) error { ran(); return nil })
	stop := runRouter(t, r)
	m := message.NewMessage(watermill.NewUUID(), []byte(`{}`))
	m.Metadata.Set(outbox.HeaderAggregateID, "order-1")
	m.Metadata.Set(outbox.HeaderSeq, seq)
	if err := bus.Publish("order.paid", m); err != nil {
		t.Fatal(err)
	}
	if err := stop(); err != nil {
		t.Fatal(err)
	}
}

// An ordered inbox's keyed deliveries from a router that does not run its
// Plugin are said once, at INFO: without it a key whose last message
// failed when its turn came waits for good unless the service calls
// ApplyHeld itself, and nothing said so (an API review). Not said under
// a router that runs it.
func TestOrderedInbox_RouterWithoutItsPlugin_SaidOnce(t *testing.T) {
	t.Parallel()
	for _, plugged := range []bool{false, true} {
		db := migrated(t, testdb.SQLite)
		logs := watermill.NewCaptureLogger()
		in, err := outbox.NewInbox(db.DB, outbox.InboxConfig{ConsumerName: "ledger", Ordered: true, Logger: logs})
		if err != nil {
			t.Fatal(err)
		}
		deliverThrough(t, in, "ledger", "1", plugged, func() {})
		deliverThrough(t, in, "ledger", "2", plugged, func() {})
		said := 0
		for _, l := range logs.Captured()[watermill.InfoLogLevel] {
			if strings.Contains(l.Msg, "does not run its Plugin") {
				said++
			}
		}
		if want := map[bool]int{false: 1, true: 0}[plugged]; said != want {
			t.Errorf("plugged %v: said %d times, want %d", plugged, said, want)
		}
	}
}
