package outbox_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// A service's own ticker calls ApplyHeld(ctx) (the README's alternative to
// the Plugin; its doc asks for a context with a deadline). The held
// message's transaction is begun under that ctx, but its handler runs under
// the route's context (the handler's latest delivery, without its
// cancellation). ctx ending while the handler runs (shutdown, the
// deadline) rolls the transaction back beneath a handler that cannot tell:
// it finishes whole (its effects outside the transaction done), the
// message stays held, and the next ApplyHeld runs the handler whole again.
// The router's paths (drain after a delivery, wake, Plugin ticks) ran the
// held message's transaction under finishing(ctx) exactly to avoid this;
// ApplyHeld and the drain after a skip do too now.
func TestOrderedInbox_ApplyHeldContextEndsUnderAHandler_HeldMessageFinishesOnce(t *testing.T) {
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		createEffects(t, db)
		var phase atomic.Int32 // 0: seq 2 fails; 1: seq 2 waits for the cancel; 2: plain
		var completed atomic.Int32
		var ctxEndedSeen atomic.Bool
		inHandler := make(chan struct{})
		release := make(chan struct{})
		l := &applyLog{}
		inner := l.handler(t, db)
		h := func(msg *message.Message) ([]*message.Message, error) {
			if msg.Metadata.Get(outbox.HeaderSeq) != "2" {
				return inner(msg)
			}
			switch phase.Load() {
			case 0:
				return nil, errors.New("not yet")
			case 1:
				out, err := inner(msg) // the effect in the transaction
				if err != nil {
					return out, err
				}
				close(inHandler)
				<-release
				ctxEndedSeen.Store(msg.Context().Err() != nil)
				completed.Add(1) // e.g. an e-mail sent, an HTTP call made
				return out, nil
			}
			out, err := inner(msg)
			if err == nil {
				completed.Add(1)
			}
			return out, err
		}
		in := orderedInbox(t, db, outbox.InboxConfig{ConsumerName: "cancel"})
		mw := in.Middleware(h)
		deliver(t, mw, "k", 2, 1) // 2 held; 1 applied, 2 fails at its turn: stays held
		if n := countHeld(t, db); n != 1 {
			t.Fatalf("%d held, want 1", n)
		}

		phase.Store(1)
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { _, err := in.ApplyHeld(ctx); done <- err }()
		<-inHandler
		cancel() // the service stops (or ApplyHeld's deadline passes) while the handler runs
		close(release)
		err := <-done
		t.Logf("ApplyHeld under the cancelled ctx: %v", err)

		phase.Store(2)
		waitFor(t, 20*time.Second, "seq 2 applied by a later ApplyHeld", func() bool {
			_, _ = in.ApplyHeld(context.Background())
			return countHeld(t, db) == 0
		})
		if got := countEffects(t, db, keyedMsg("k", 2).UUID); got != 1 {
			t.Errorf("seq 2: %d effects in the database, want 1", got)
		}
		if n := completed.Load(); n != 1 {
			t.Fatalf("seq 2's handler ran to completion %d times (its context ended: %v); want 1: ApplyHeld's ctx rolled its transaction back beneath it, and it ran whole again", n, ctxEndedSeen.Load())
		}
	})
}
