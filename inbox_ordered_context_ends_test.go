package outbox_test

import (
	"context"
	"database/sql"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// Two handlers share an ordered consumer (the README's case of a key whose
// events come on two topics), behind middleware.Timeout. Seq 2 is held by
// handler B; seq 1 arrives on A, commits, and A's delivery applies 2 in
// B's handler. The held message's transaction runs under A's delivery's
// context without its cancellation but with its deadline (finishing),
// while B's handler ran under B's remembered context, with none: at A's
// deadline the transaction was rolled back beneath a handler that could
// not tell, and which ran whole again at the next apply. Its context ends
// with its transaction now.
func TestOrderedInbox_HeldOfAnotherHandler_ItsContextEndsWithItsTransaction(t *testing.T) {
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		createEffects(t, db)
		in := orderedInbox(t, db, outbox.InboxConfig{ConsumerName: "tmo"})
		var completed, runs atomic.Int32
		var ctxHadDeadline, endedWithTx atomic.Bool
		l := &applyLog{}
		inner := l.handler(t, db)
		b := func(msg *message.Message) error {
			if _, err := inner(msg); err != nil {
				return err
			}
			if runs.Add(1) == 1 {
				_, has := msg.Context().Deadline()
				ctxHadDeadline.Store(has)
				tx, _ := outbox.TxFromContext(msg.Context())
				deadline := time.Now().Add(10 * time.Second)
				for time.Now().Before(deadline) { // until the transaction is gone beneath it
					if _, err := tx.ExecContext(context.Background(), "SELECT 1"); errors.Is(err, sql.ErrTxDone) {
						endedWithTx.Store(msg.Context().Err() != nil)
						break
					}
					time.Sleep(10 * time.Millisecond)
				}
			}
			completed.Add(1) // its work outside the transaction done
			return nil
		}
		a := func(msg *message.Message) error { _, err := inner(msg); return err }

		ps := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
		router := newRouter(t)
		router.AddMiddleware(middleware.Timeout(300*time.Millisecond), in.Middleware)
		router.AddNoPublisherHandler("a", "topic_a", ps, a)
		router.AddNoPublisherHandler("b", "topic_b", ps, b)
		startRouter(t, router)

		if err := ps.Publish("topic_b", keyedMsg("k", 2)); err != nil {
			t.Fatal(err)
		}
		waitFor(t, 10*time.Second, "2 held", func() bool { return countHeld(t, db) == 1 })
		if err := ps.Publish("topic_a", keyedMsg("k", 1)); err != nil {
			t.Fatal(err)
		}
		waitFor(t, 15*time.Second, "B's first run over", func() bool { return completed.Load() >= 1 })
		waitFor(t, 20*time.Second, "2 applied by ApplyHeld", func() bool {
			_, _ = in.ApplyHeld(context.Background())
			return countHeld(t, db) == 0
		})
		if got := countEffects(t, db, keyedMsg("k", 2).UUID); got != 1 {
			t.Errorf("seq 2: %d effects in the database, want 1", got)
		}
		// A handler that goes on past its context's end does its work
		// twice, as under any Timeout; one that reads its context can tell.
		if !ctxHadDeadline.Load() || !endedWithTx.Load() {
			t.Fatalf("B's handler of seq 2, applied in A's delivery: its context had a deadline %v, had ended when its transaction was gone %v; want both: its transaction ends at A's deadline", ctxHadDeadline.Load(), endedWithTx.Load())
		}
	})
}
