package outbox_test

import (
	"context"
	"errors"
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

// A key's last event, held behind its predecessor, whose handler fails
// when the predecessor's commit releases it: no later delivery of the key
// comes to try it again, and a service that ran no ApplyHeld ticker of its
// own left it held for good, its outbox record marked processed (a review's
// service did so). The inbox's router plugin ticks ApplyHeld: it runs.
func TestOrderedInbox_Plugin_HeldMessageFailedAtItsTurn_AppliedWithoutAnotherDelivery(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		createEffects(t, db)
		in := newInbox(t, db, outbox.InboxConfig{Ordered: true, ApplyHeldEvery: 20 * time.Millisecond})
		var failedOnce atomic.Bool
		log := &applyLog{fail: func(msg *message.Message) error {
			if msg.Metadata.Get(outbox.HeaderSeq) == "2" && failedOnce.CompareAndSwap(false, true) {
				return errors.New("the ledger is briefly away")
			}
			return nil
		}}
		pubsub := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
		router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
		if err != nil {
			t.Fatal(err)
		}
		router.AddPlugin(in.Plugin())
		h := in.Middleware(log.handler(t, db))
		router.AddConsumerHandler("ledger", "payments", pubsub, func(msg *message.Message) error { _, err := h(msg); return err })
		done := make(chan error, 1)
		go func() { done <- router.Run(context.Background()) }()
		defer func() {
			if err := router.Close(); err != nil {
				t.Error(err)
			}
			if err := <-done; err != nil {
				t.Error(err)
			}
		}()
		<-router.Running()
		for _, seq := range []int{2, 1} { // 2 is held, 1 releases it, and it fails
			if err := pubsub.Publish("payments", keyedMsg("pay-1", seq)); err != nil {
				t.Fatal(err)
			}
		}
		deadline := time.Now().Add(10 * time.Second)
		for len(log.of("pay-1")) < 2 && time.Now().Before(deadline) {
			time.Sleep(10 * time.Millisecond) // polling the handler's log
		}
		if got := log.of("pay-1"); !failedOnce.Load() || len(got) != 2 || got[0] != 1 || got[1] != 2 {
			t.Fatalf("applied %v (seq 2 failed once: %v); want [1 2]: the plugin's ApplyHeld runs seq 2 again", got, failedOnce.Load())
		}
	})
}

// An inbox that is not ordered holds nothing: its plugin adds no handler.
func TestInbox_Plugin_NotOrdered_AddsNoHandler(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	in := newInbox(t, db, outbox.InboxConfig{})
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	if err := in.Plugin()(router); err != nil {
		t.Fatal(err)
	}
	if n := len(router.Handlers()); n != 0 {
		t.Fatalf("the router has %d handlers; want none", n)
	}
}

// A held message whose handler fails at its turn is tried again by the
// plugin 100 ms later, doubling, as Retry tries a delivery: it waited for
// the next ApplyHeldEvery tick (10 s by default; a review's restarts
// waited 10.4 s for transient failures).
func TestOrderedInbox_Plugin_HeldMessageFailedAtItsTurn_TriedAgainSoonNotAtTheNextTick(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.SQLite)
	createEffects(t, db)
	in := newInbox(t, db, outbox.InboxConfig{Ordered: true, ApplyHeldEvery: time.Hour})
	var fails atomic.Int32
	log := &applyLog{fail: func(msg *message.Message) error {
		if msg.Metadata.Get(outbox.HeaderSeq) == "2" && fails.Add(1) <= 2 {
			return errors.New("the ledger is briefly away")
		}
		return nil
	}}
	pubsub := pluggedLedger(t, db, in, log)
	for _, seq := range []int{2, 1} { // 2 is held, 1 releases it, and it fails
		if err := pubsub.Publish("payments", keyedMsg("pay-1", seq)); err != nil {
			t.Fatal(err)
		}
	}
	waitFor(t, 5*time.Second, "seq 2 applied", func() bool { return len(log.of("pay-1")) == 2 })
	if n := fails.Load(); n != 3 {
		t.Errorf("seq 2 ran %d times; want 3 (failed at its turn, at the first try again, then applied)", n)
	}
}

// A held message that fails while a tick runs (released by a delivery
// meanwhile) is tried again soon as well: the tick took the failure
// signals it found at its end for its own, and a tick that itself
// succeeded then waited ApplyHeldEvery (a review: 10.7 s in 4 runs of 4).
func TestOrderedInbox_Plugin_HeldMessageFailsDuringATick_TriedAgainSoon(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.Postgres) // locks by key: SQLite's one write lock would hold b back until the tick ends
	createEffects(t, db)
	in := newInbox(t, db, outbox.InboxConfig{Ordered: true, ApplyHeldEvery: time.Hour})
	runs := map[string]int{}
	var mu sync.Mutex
	tickRuns := make(chan struct{})
	log := &applyLog{fail: func(msg *message.Message) error {
		id := msg.Metadata.Get(outbox.HeaderAggregateID) + "/" + msg.Metadata.Get(outbox.HeaderSeq)
		mu.Lock()
		runs[id]++
		n := runs[id]
		mu.Unlock()
		switch {
		case (id == "a/2" || id == "b/2") && n == 1:
			return errors.New("the ledger is briefly away")
		case id == "a/2" && n == 2: // the tick's run of it, 100 ms later
			close(tickRuns)
			time.Sleep(600 * time.Millisecond) // while b's seq 2 fails
		}
		return nil
	}}
	pubsub := pluggedLedger(t, db, in, log)
	publish := func(key string, seqs ...int) {
		for _, seq := range seqs {
			if err := pubsub.Publish("payments", keyedMsg(key, seq)); err != nil {
				t.Fatal(err)
			}
		}
	}
	publish("a", 2, 1) // a's seq 2 fails at its turn: a tick 100 ms later
	select {
	case <-tickRuns:
	case <-time.After(5 * time.Second):
		t.Fatal("no tick ran a's seq 2 again within 5 s")
	}
	publish("b", 2, 1) // b's seq 2 fails at its turn, as the tick runs
	waitFor(t, 5*time.Second, "b's seq 2 applied", func() bool { return len(log.of("b")) == 2 })
}

// pluggedLedger runs, until the test ends, a router with in's middleware
// and plugin and one handler, "ledger", applying log's effects for
// topic "payments" of the returned pubsub, whose Publish returns once the
// handler acked.
func pluggedLedger(t *testing.T, db *testdb.DB, in *outbox.Inbox, log *applyLog) *gochannel.GoChannel {
	t.Helper()
	pubsub := gochannel.NewGoChannel(gochannel.Config{BlockPublishUntilSubscriberAck: true}, watermill.NopLogger{})
	router := newRouter(t)
	router.AddMiddleware(in.Middleware)
	router.AddPlugin(in.Plugin())
	router.AddConsumerHandler("ledger", "payments", pubsub, func(msg *message.Message) error {
		_, err := log.handler(t, db)(msg)
		return err
	})
	startRouter(t, router)
	return pubsub
}
