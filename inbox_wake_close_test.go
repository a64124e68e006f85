package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// A wake whose held message waits on its key's row lock (another
// transaction holds it: an operator's session, a stuck process) as the
// router closes: the wait is before the handler runs, so cancelling it is
// harmless, and Close cancelled it before finishing(); now it waits for
// the lock holder, beyond CloseTimeout.
func TestOrderedInbox_Wake_LockWaitBeforeTheHandler_RouterCloseReturns(t *testing.T) {
	db := migrated(t, testdb.Postgres)
	createEffects(t, db)
	cfg := outbox.InboxConfig{ConsumerName: "ledger", ApplyHeldEvery: time.Hour}
	var log applyLog
	readyHeldAfterAStop(t, db, cfg, &log, "zz-lock-1")

	lock, err := db.Beginx()
	if err != nil {
		t.Fatal(err)
	}
	defer lock.Rollback()
	if _, err := lock.Exec("SELECT last_seq FROM acemq_inbox_sequences WHERE consumer_name = 'ledger' AND aggregate_id = 'zz-lock-1' FOR UPDATE"); err != nil {
		t.Fatal(err)
	}

	in := orderedInbox(t, db, cfg)
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	r.AddMiddleware(in.Middleware)
	r.AddPlugin(in.Plugin())
	bus := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	r.AddNoPublisherHandler("ledger", "t", in.Subscriber(bus), func(msg *message.Message) error {
		_, err := log.handler(t, db)(msg)
		return err
	})
	ctx, cancel := context.WithCancel(context.Background())
	go func() { _ = r.Run(ctx) }()
	<-r.Running()
	waitFor(t, 10*time.Second, "the wake waiting on the key's lock", func() bool {
		var n int
		_ = db.Get(&n, "SELECT COUNT(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%acemq_inbox_sequences%' AND pid <> pg_backend_pid()")
		return n > 0
	})
	start := time.Now()
	cancel()
	closeErr := r.Close()
	took := time.Since(start)
	_ = lock.Rollback()
	if closeErr != nil {
		t.Errorf("router Close took %v (%v); want it to return, not wait out CloseTimeout: the held message's handler had not begun", took.Round(time.Millisecond), closeErr)
	}
}

// A held message that fails for good (key zz-perm), while deliveries of
// other keys keep releasing held messages that fail too (a downstream
// outage): each of those failures signals ordered.failed, which puts the
// plugin's next tick back at 100 ms however long the backoff had grown, so
// the ticks never back off: every ready key is run again every ~100 ms
// for as long as the deliveries come.
func TestOrderedInbox_Plugin_FailuresOfOtherKeysKeepComing_TicksStillBackOff(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	createEffects(t, db)
	in := newInbox(t, db, outbox.InboxConfig{Ordered: true, ApplyHeldEvery: 2 * time.Second})
	var permTries atomic.Int32
	log := &applyLog{fail: func(msg *message.Message) error {
		if msg.Metadata.Get(outbox.HeaderSeq) != "2" {
			return nil
		}
		if msg.Metadata.Get(outbox.HeaderAggregateID) == "zz-perm" {
			permTries.Add(1)
		}
		return errors.New("downstream away")
	}}
	pubsub := pluggedLedger(t, db, in, log)
	for _, seq := range []int{2, 1} {
		if err := pubsub.Publish("payments", keyedMsg("zz-perm", seq)); err != nil {
			t.Fatal(err)
		}
	}
	start := permTries.Load()
	deadline := time.Now().Add(4 * time.Second)
	for i := 0; time.Now().Before(deadline); i++ {
		key := fmt.Sprintf("zz-other-%d", i)
		for _, seq := range []int{2, 1} {
			if err := pubsub.Publish("payments", keyedMsg(key, seq)); err != nil {
				t.Fatal(err)
			}
		}
		time.Sleep(30 * time.Millisecond)
	}
	// Backing off from 100 ms to 2 s: 100+200+400+800+1600 ms, then 2 s:
	// about 6 tries in 4 s.
	if n := permTries.Load() - start; n > 10 {
		t.Errorf("the failing held message was tried %d times in 4 s; want the ticks to back off (about 6)", n)
	}
}
