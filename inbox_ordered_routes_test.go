package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"reflect"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// Two router handlers share one ordered consumer (ConsumerName), as they
// must when a key's events come on two topics: its numbers run across
// both. A message held on one topic is applied, when its predecessor on
// the other arrives, by the handler it was delivered to, with that
// handler's router context, not by the handler of the predecessor.
func TestOrderedInbox_SharedConsumer_HeldMessageRunsInItsOwnHandler(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		in := orderedInbox(t, db, outbox.InboxConfig{ConsumerName: "billing"})
		pubsub := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 16}, watermill.NopLogger{})
		router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, watermill.NopLogger{})
		if err != nil {
			t.Fatal(err)
		}
		router.AddMiddleware(in.Middleware)
		var (
			mu  sync.Mutex
			ran []string
		)
		handler := func(name string) message.NoPublishHandlerFunc {
			return func(msg *message.Message) error {
				mu.Lock()
				defer mu.Unlock()
				ran = append(ran, name+" "+msg.Metadata.Get(outbox.HeaderSeq)+" from "+message.SubscribeTopicFromCtx(msg.Context()))
				if _, held := msg.Metadata["x-acemq-inbox-handler"]; held {
					return errors.New("the inbox's own metadata reached the handler")
				}
				return nil
			}
		}
		router.AddConsumerHandler("on_created", "order.created", pubsub, handler("on_created"))
		router.AddConsumerHandler("on_paid", "order.paid", pubsub, handler("on_paid"))
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- router.Run(ctx) }()
		t.Cleanup(func() {
			cancel()
			if err := <-done; err != nil {
				t.Error(err)
			}
			_ = pubsub.Close()
		})
		<-router.Running()

		if err := pubsub.Publish("order.paid", keyedMsg("order-42", 2)); err != nil {
			t.Fatal(err)
		}
		waitFor(t, 10*time.Second, "seq 2 held", func() bool { return countHeld(t, db) == 1 })
		if err := pubsub.Publish("order.created", keyedMsg("order-42", 1)); err != nil {
			t.Fatal(err)
		}
		waitFor(t, 10*time.Second, "both applied", func() bool { mu.Lock(); defer mu.Unlock(); return len(ran) >= 2 })
		// The handler ran inside the transaction that deletes the held row:
		// its commit may come a moment later.
		waitFor(t, 10*time.Second, "nothing held", func() bool { return countHeld(t, db) == 0 })
		mu.Lock()
		defer mu.Unlock()
		if want := []string{"on_created 1 from order.created", "on_paid 2 from order.paid"}; !reflect.DeepEqual(ran, want) {
			t.Errorf("ran %q, want %q", ran, want)
		}
	})
}

// A held message whose handler failed when its turn came is retried by the
// key's next delivery, also one that is itself held (a later number): not
// only by ApplyHeld.
func TestOrderedInbox_HeldMessageFailed_NextDeliveryOfTheKeyRetriesIt(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		createEffects(t, db)
		failing := true
		l := applyLog{fail: failSeq2(&failing)}
		h := orderedInbox(t, db, outbox.InboxConfig{}).Middleware(l.handler(t, db))
		deliver(t, h, "a", 2, 1) // 1 applied; 2's turn comes, and it fails
		if got := l.of("a"); !reflect.DeepEqual(got, []int{1}) {
			t.Fatalf("applied %v, want [1]", got)
		}
		failing = false
		deliver(t, h, "a", 4) // held, and 2 is retried
		if got := l.of("a"); !reflect.DeepEqual(got, upTo(2)) {
			t.Fatalf("after 4 arrived: applied %v, want [1 2]", got)
		}
		deliver(t, h, "a", 3)
		if got := l.of("a"); !reflect.DeepEqual(got, upTo(4)) {
			t.Errorf("applied %v, want [1 2 3 4]", got)
		}
		assertEffectsOnce(t, db, "a", 4)
		if n := countHeld(t, db); n != 0 {
			t.Errorf("%d held, want 0", n)
		}
	})
}

// A row held by an earlier version names no handler: the consumer's first
// handler seen applies it, as every held row was applied before. One that
// names a handler this process has not seen stays held, rather than run
// in another handler.
func TestOrderedInbox_HeldRowWithoutOrWithUnknownHandler(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.SQLite)
	createEffects(t, db)
	var l applyLog
	logs := watermill.NewCaptureLogger()
	in := orderedInbox(t, db, outbox.InboxConfig{Logger: logs})
	h := in.Middleware(l.handler(t, db))
	deliver(t, h, "a", 1) // the consumer's handler is seen
	hold := func(key, metadata string) {
		t.Helper()
		m := keyedMsg(key, 2)
		if _, err := db.Exec("INSERT INTO acemq_inbox_held (consumer_name, aggregate_id, seq, message_id, payload, payload_encoding, metadata, held_at) VALUES (?, ?, ?, ?, ?, 'utf-8', ?, ?)",
			"fulfilment", key, 2, m.UUID, string(m.Payload), metadata, time.Now().UTC().Format("2006-01-02 15:04:05.000000")); err != nil {
			t.Fatal(err)
		}
		if _, err := db.Exec("UPDATE acemq_inbox_sequences SET held = held + 1 WHERE consumer_name = 'fulfilment' AND aggregate_id = ?", key); err != nil {
			t.Fatal(err)
		}
	}
	deliver(t, h, "b", 1)
	hold("a", `{"aggregateId":"a","seq":"2"}`)
	hold("b", `{"aggregateId":"b","seq":"2","x-acemq-inbox-handler":"on_paid"}`)
	n, err := in.ApplyHeld(context.Background())
	if err != nil || n != 1 {
		t.Fatalf("ApplyHeld: %d, %v; want 1 (the row naming no handler)", n, err)
	}
	if got := l.of("a"); !reflect.DeepEqual(got, upTo(2)) {
		t.Errorf("a applied %v, want [1 2]", got)
	}
	if got := l.of("b"); !reflect.DeepEqual(got, upTo(1)) {
		t.Errorf("b applied %v, want [1]: its held message is on_paid's, which this process has not seen", got)
	}
	if n := countHeld(t, db); n != 1 {
		t.Errorf("%d held, want 1 (b's)", n)
	}
	// Said at INFO, once a handler: at DEBUG only, a restarted service's
	// held messages waited for a quiet topic with nothing in its log.
	if _, err := in.ApplyHeld(context.Background()); err != nil {
		t.Fatal(err)
	}
	var told []watermill.LogFields
	for _, m := range logs.Captured()[watermill.InfoLogLevel] {
		if strings.HasPrefix(m.Msg, "Held messages wait for their handler") {
			told = append(told, m.Fields)
		}
	}
	if len(told) != 1 || told[0]["handler"] != "on_paid" {
		t.Errorf("logged at INFO %v; want once, for on_paid", told)
	}
}

// A held row of which one part cannot be decoded is skipped all the same,
// and SkipHeld hands back the other part decoded and this one as the row
// stored it, with the reason: the row was the message's only copy.
func TestOrderedInbox_SkipHeld_RowPartlyUndecodable_HandsBackEveryPart(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.SQLite)
	in := newInbox(t, db, outbox.InboxConfig{}) // as outboxctl's: not Ordered
	const badMetadata = `{"seq": 2}`            // a number: metadata values are strings
	for key, row := range map[string][3]string{
		"a": {"the only copy of the event", "utf-8", badMetadata},
		"b": {"not base64!", "base64", `{"tenant":"t-1","x-acemq-inbox-handler":"on_order"}`},
	} {
		db.MustExec("INSERT INTO acemq_inbox_sequences (consumer_name, aggregate_id, last_seq, held) VALUES ('fulfilment', ?, 1, 1)", key)
		db.MustExec("INSERT INTO acemq_inbox_held (consumer_name, aggregate_id, seq, message_id, payload, payload_encoding, metadata, held_at) VALUES ('fulfilment', ?, 2, ?, ?, ?, ?, ?)",
			key, key+"2", row[0], row[1], row[2], time.Now().UTC().Format("2006-01-02 15:04:05.000000"))
	}
	ctx := context.Background()
	a, err := in.SkipHeld(ctx, "fulfilment", "a", 2)
	if err != nil {
		t.Fatal(err)
	}
	if string(a.Payload) != "the only copy of the event" || a.Metadata != nil || a.MetadataErr == nil || a.StoredMetadata != badMetadata || a.PayloadErr != nil {
		t.Errorf("skipped %+v; want its payload, and its metadata as stored with the reason", a)
	}
	b, err := in.SkipHeld(ctx, "fulfilment", "b", 2)
	if err != nil {
		t.Fatal(err)
	}
	if b.Payload != nil || !reflect.DeepEqual(b.Metadata, message.Metadata{"tenant": "t-1"}) || b.PayloadErr == nil ||
		b.StoredPayload != "not base64!" || b.StoredEncoding != "base64" || b.MetadataErr != nil {
		t.Errorf("skipped %+v; want its metadata without the inbox's own, and its payload as stored with the reason", b)
	}
	if n := countHeld(t, db); n != 0 {
		t.Errorf("%d held, want 0", n)
	}
}

// A held message whose handler always fails (a poison message the broker no
// longer has: it was acked when held) blocks its key until an operator
// gives up on it: SkipHeld deletes it, hands it back, and the messages held
// behind it are applied. A later copy of it is a duplicate. It skips only
// the key's next, and only a held one.
func TestOrderedInbox_SkipHeld_PoisonSkippedHandedBackTheRestApplied(t *testing.T) {
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		createEffects(t, db)
		poison := true
		l := applyLog{fail: failSeq2(&poison)}
		in := orderedInbox(t, db, outbox.InboxConfig{})
		h := in.Middleware(l.handler(t, db))
		ctx := context.Background()
		deliver(t, h, "a", 2, 3, 1, 6) // 1 applied; 2 fails; 3 and 6 held
		if got := l.of("a"); !reflect.DeepEqual(got, []int{1}) {
			t.Fatalf("applied %v, want [1]", got)
		}
		for _, bad := range []struct {
			seq  int64
			want error
		}{{3, outbox.ErrGapChanged}, {6, outbox.ErrGapChanged}, {4, outbox.ErrNoHeld}, {1, outbox.ErrNoHeld}} {
			if _, err := in.SkipHeld(ctx, "fulfilment", "a", bad.seq); !errors.Is(err, bad.want) {
				t.Errorf("SkipHeld seq %d: %v, want %v", bad.seq, err, bad.want)
			}
		}
		skipped, err := in.SkipHeld(ctx, "fulfilment", "a", 2)
		if err != nil {
			t.Fatal(err)
		}
		want := keyedMsg("a", 2)
		if skipped.ID != want.UUID || string(skipped.Payload) != string(want.Payload) || !reflect.DeepEqual(skipped.Metadata, want.Metadata) {
			t.Errorf("skipped %+v, want %s with its payload and metadata %v", skipped, want.UUID, want.Metadata)
		}
		if got := l.of("a"); !reflect.DeepEqual(got, []int{1, 3}) {
			t.Errorf("after the skip: applied %v, want [1 3]", got)
		}
		deliver(t, h, "a", 2, 4, 5) // 2 again: a duplicate
		if got := l.of("a"); !reflect.DeepEqual(got, []int{1, 3, 4, 5, 6}) {
			t.Errorf("applied %v, want [1 3 4 5 6]", got)
		}
		if n := countEffects(t, db, want.UUID); n != 0 {
			t.Errorf("%d effects of the skipped message, want 0", n)
		}
		if n := countHeld(t, db); n != 0 {
			t.Errorf("%d held, want 0", n)
		}
	})
}

// The ordered inbox kept the first route it saw per (consumer, handler
// name) for its whole life: after that router closed and another with the
// same handler name took over in the process, a message held there was
// applied by the closed router's handler function. The latest delivery's
// route now takes it. (From an audit.)
func TestOrderedInbox_RouterRebuilt_HeldMessageRunsInTheNewRoutersHandler(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.SQLite)
	in := newInbox(t, db, outbox.InboxConfig{ConsumerName: "ledger", Ordered: true})
	var mu sync.Mutex
	ranBy := map[string]string{}
	keyed := func(seq int) *message.Message {
		m := message.NewMessage(fmt.Sprintf("acct-1-%d-%s", seq, testdb.RandomName()), nil)
		m.Metadata.Set(outbox.HeaderAggregateID, "acct-1")
		m.Metadata.Set(outbox.HeaderSeq, fmt.Sprint(seq))
		return m
	}
	run := func(name string) (*gochannel.GoChannel, *atomic.Int32, func()) {
		ch := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
		r := newRouter(t)
		var acked atomic.Int32
		r.AddMiddleware(countSucceeded(&acked), in.Middleware)
		r.AddConsumerHandler("apply", "ledger", ch, func(msg *message.Message) error {
			mu.Lock()
			defer mu.Unlock()
			ranBy[msg.Metadata.Get(outbox.HeaderSeq)] = name
			return nil
		})
		return ch, &acked, startRouter(t, r)
	}
	ch1, acked1, stop1 := run("router-1")
	if err := ch1.Publish("ledger", keyed(1)); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "seq 1", func() bool { return acked1.Load() >= 1 })
	stop1()
	ch2, acked2, _ := run("router-2")
	for i, seq := range []int{3, 2} { // 3 is held, 2 runs and applies it
		if err := ch2.Publish("ledger", keyed(seq)); err != nil {
			t.Fatal(err)
		}
		waitFor(t, 10*time.Second, fmt.Sprint("seq ", seq), func() bool { return acked2.Load() >= int32(i+1) })
	}
	mu.Lock()
	defer mu.Unlock()
	if want := map[string]string{"1": "router-1", "2": "router-2", "3": "router-2"}; !reflect.DeepEqual(ranBy, want) {
		t.Errorf("ran by %v, want %v", ranBy, want)
	}
}

// A skip is committed before the messages held behind it are applied; a
// handler of theirs that fails then leaves its message held. SkipGap and
// SkipHeld returned that handler's error, so the caller read a done skip
// as a failed one: retried, the skip found the gap changed, and SkipHeld's
// message, whose row was deleted, came back beside an error that callers
// drop. Both now return nil (and the message) once the skip is committed;
// the failing message stays held and is applied once its handler passes.
func TestOrderedInbox_Skip_MessageBehindItFails_SkipDoneMessageStaysHeld(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		createEffects(t, db)
		failing := map[string]bool{}
		l := applyLog{fail: func(msg *message.Message) error {
			if failing[msg.UUID] {
				return errors.New("downstream unavailable")
			}
			return nil
		}}
		in := orderedInbox(t, db, outbox.InboxConfig{})
		h := in.Middleware(l.handler(t, db))
		ctx := context.Background()

		// SkipGap: 1 applied, 2 never comes, 3 held and failing.
		deliver(t, h, "g", 1, 3)
		failing["g-3"] = true
		if err := in.SkipGap(ctx, "fulfilment", "g", 2, 2); err != nil {
			t.Fatalf("SkipGap(2..2) = %v, want nil: the skip is committed", err)
		}
		// SkipHeld: 1 applied, 2 held and poison, 3 held and failing.
		failing["s-2"], failing["s-3"] = true, true
		deliver(t, h, "s", 2, 3, 1)
		skipped, err := in.SkipHeld(ctx, "fulfilment", "s", 2)
		if err != nil || skipped.ID != "s-2" || string(skipped.Payload) != "event 2" {
			t.Fatalf("SkipHeld(2) = %q %q, %v; want s-2 and its payload, nil: the skip is committed", skipped.ID, skipped.Payload, err)
		}
		if n := countHeld(t, db); n != 2 {
			t.Fatalf("%d held, want g-3 and s-3, left held by their failing handlers", n)
		}
		failing["g-3"], failing["s-3"] = false, false
		if n, err := in.ApplyHeld(ctx); n != 2 || err != nil {
			t.Fatalf("ApplyHeld once the handler passes = %d, %v; want 2, nil", n, err)
		}
		if g, s := l.of("g"), l.of("s"); !reflect.DeepEqual(g, []int{1, 3}) || !reflect.DeepEqual(s, []int{1, 3}) {
			t.Errorf("applied g %v, s %v; want [1 3] each", g, s)
		}
	})
}

// A message that arrives with the metadata key the held row keeps its
// handler's name under is handed back by SkipHeld with its own value;
// before, the handler's name had taken its place.
func TestOrderedInbox_SkipHeld_MessageWithTheHeldRowsHandlerKey_HandedBackAsItCame(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		createEffects(t, db)
		poison := true
		l := applyLog{fail: failSeq2(&poison)}
		in := orderedInbox(t, db, outbox.InboxConfig{})
		h := in.Middleware(l.handler(t, db))
		msg := keyedMsg("a", 2)
		msg.Metadata.Set("x-acemq-inbox-handler", "the sender's")
		msg.Metadata.Set("x-acemq-inbox-handler~", "")
		want := maps.Clone(msg.Metadata)
		if _, err := h(msg); err != nil { // held
			t.Fatal(err)
		}
		deliver(t, h, "a", 1) // 1 applied, then 2 fails and stays held
		skipped, err := in.SkipHeld(context.Background(), "fulfilment", "a", 2)
		if err != nil {
			t.Fatal(err)
		}
		if !maps.Equal(skipped.Metadata, map[string]string(want)) {
			t.Errorf("skipped with metadata %q, want %q", skipped.Metadata, want)
		}
	})
}
