package outbox_test

import (
	"errors"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// Outside a router a delivery names no handler, so the two handlers one
// ordered Inbox wrapped under one ConsumerName shared the route of held
// messages: seq 2, held when delivered to A, ran in B when B applied seq
// 1, and A's own delivery of 1 was then a duplicate. B's delivery is now
// refused before any statement (nacked: nothing run, held or recorded),
// and A, which had the consumer's first keyed delivery, applies both.
func TestOrderedInbox_TwoHandlersOfOneInboxOutsideARouter_SecondRefusedNeverRunsTheFirstsHeldMessage(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		createEffects(t, db)
		var a, b applyLog
		in := orderedInbox(t, db, outbox.InboxConfig{ConsumerName: "billing"})
		// Two functions: two closures of applyLog.handler's one literal
		// would be one handler to the inbox.
		bh := b.handler(t, db)
		ha, hb := in.Middleware(a.handler(t, db)), in.Middleware(func(msg *message.Message) ([]*message.Message, error) { return bh(msg) })
		deliver(t, ha, "k", 2) // held, A's
		if _, err := hb(keyedMsg("k", 1)); !errors.Is(err, outbox.ErrConsumerShared) {
			t.Errorf("B's delivery of seq 1: %v, want ErrConsumerShared (nacked)", err)
		}
		if got := b.of("k"); len(got) != 0 {
			t.Errorf("B ran %v, want nothing: seq 2 was held for A, and seq 1 refused", got)
		}
		if n := countEffects(t, db, keyedMsg("k", 1).UUID); n != 0 {
			t.Errorf("seq 1: %d effects after B's refused delivery, want 0", n)
		}
		if n := countHeld(t, db); n != 1 {
			t.Errorf("%d held after B's refused delivery, want 1 (A's seq 2)", n)
		}
		deliver(t, ha, "k", 1)
		if got := a.of("k"); !reflect.DeepEqual(got, upTo(2)) {
			t.Errorf("A applied %v, want [1 2]", got)
		}
		assertEffectsOnce(t, db, "k", 2)
		deliver(t, ha, "k", 3) // A goes on as before
		if got := a.of("k"); !reflect.DeepEqual(got, upTo(3)) {
			t.Errorf("A applied %v, want [1 2 3]", got)
		}
	})
}

// Two ordered Inboxes over one pool with one ConsumerName and different
// Tables share the ordered state, keyed by consumer name alone: under a
// router, with handler names, the second one's seq 1 of a key the first
// had applied was acked as a duplicate without running. Refused now; a
// third Inbox on the first one's Table shares the consumer as before.
func TestOrderedInbox_TwoInboxesOneConsumerDifferentTables_SecondRefusedNotAckedAsDuplicate(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		createEffects(t, db)
		createInboxTable(t, db, "other_inbox")
		var a, b, c applyLog
		first := orderedInbox(t, db, outbox.InboxConfig{ConsumerName: "billing"})
		other := orderedInbox(t, db, outbox.InboxConfig{ConsumerName: "billing", InboxTable: "other_inbox"})
		same := orderedInbox(t, db, outbox.InboxConfig{ConsumerName: "billing"})
		msg := func(source string, seq int) *message.Message {
			m := keyedMsg("k", seq)
			m.UUID = source + "-" + m.UUID
			return m
		}
		if err := routedOnce(t, first, "on_a", a.handler(t, db), msg("a", 1)); err != nil {
			t.Fatalf("first inbox, seq 1: %v", err)
		}
		if err := routedOnce(t, other, "on_b", b.handler(t, db), msg("b", 1)); !errors.Is(err, outbox.ErrConsumerShared) {
			t.Errorf("other Table's seq 1: %v, want ErrConsumerShared (nacked, not acked as a duplicate)", err)
		}
		if got := b.of("k"); len(got) != 0 {
			t.Errorf("the other Table's handler ran %v, want nothing", got)
		}
		if err := routedOnce(t, same, "on_c", c.handler(t, db), msg("a", 2)); err != nil {
			t.Errorf("an inbox on the first one's Table, seq 2: %v", err)
		}
		if got := append(a.of("k"), c.of("k")...); !reflect.DeepEqual(got, upTo(2)) {
			t.Errorf("applied %v, want [1 2]", got)
		}
	})
}

// routedOnce delivers msg to a router handler name behind in, h its
// handler, and returns what the first delivery came to: nil (acked) or its
// error (nacked; the router, stopped when the test ends, delivers it
// again meanwhile).
func routedOnce(t *testing.T, in *outbox.Inbox, name string, h message.HandlerFunc, msg *message.Message) error {
	t.Helper()
	ps := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	router := newRouter(t)
	first := make(chan error, 1)
	router.AddMiddleware(func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			out, err := h(msg)
			select {
			case first <- err:
			default:
			}
			return out, err
		}
	}, in.Middleware)
	router.AddNoPublisherHandler(name, "events", ps, func(msg *message.Message) error {
		_, err := h(msg)
		return err
	})
	startRouter(t, router)
	if err := ps.Publish("events", msg); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-first:
		return err
	case <-time.After(10 * time.Second):
		t.Fatal("no delivery within 10 s")
		return nil
	}
}

// createInboxTable makes an inbox table like processed_messages, named name.
func createInboxTable(t testing.TB, db *testdb.DB, name string) {
	t.Helper()
	var q string
	switch db.Kind {
	case testdb.Postgres:
		q = "CREATE TABLE " + name + " (LIKE processed_messages INCLUDING ALL)"
	case testdb.MySQL:
		q = "CREATE TABLE " + name + " LIKE processed_messages"
	default:
		if err := db.Get(&q, "SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'processed_messages'"); err != nil {
			t.Fatal(err)
		}
		q = strings.Replace(q, "processed_messages", name, 1)
	}
	if _, err := db.Exec(q); err != nil {
		t.Fatal(err)
	}
}

// One handler function wrapped again (a worker's own wrapping, or a consume
// loop wrapping it at each reconnect) is one handler: its deliveries run,
// and a message held through one wrapping runs through the other.
func TestOrderedInbox_OneHandlerWrappedTwiceOutsideARouter_BothRun(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		createEffects(t, db)
		var l applyLog
		in := orderedInbox(t, db, outbox.InboxConfig{ConsumerName: "billing"})
		h := l.handler(t, db)
		first, again := in.Middleware(h), in.Middleware(h)
		deliver(t, first, "k", 2) // held
		deliver(t, again, "k", 1, 3)
		if got := l.of("k"); !reflect.DeepEqual(got, upTo(3)) {
			t.Errorf("applied %v, want [1 2 3]", got)
		}
		assertEffectsOnce(t, db, "k", 3)
	})
}
