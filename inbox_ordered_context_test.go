package outbox_test

import (
	"context"
	"errors"
	"reflect"
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

// tenantKey is the context key of the test's tenant middleware.
type tenantKey struct{ where string }

// tenantFromMetadata puts the message's "tenant" metadata into its context
// under where, as a service's middleware puts a tenant or a user there.
func tenantFromMetadata(where string) message.HandlerMiddleware {
	return func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			msg.SetContext(context.WithValue(msg.Context(), tenantKey{where}, msg.Metadata.Get("tenant")))
			return h(msg)
		}
	}
}

// The README's rule for middleware that reads a message into its context:
// one added before the inbox ran for the delivery that was held, not for
// the held message, which runs with the context of the delivery that
// released it; one added after the inbox runs for every message it
// applies. Seq 2 (tenant b) is held, and runs when seq 1 (tenant a) is
// applied: the inner middleware gives it tenant b, the outer one's value is
// a's.
func TestOrderedInbox_HeldMessage_MiddlewareAfterTheInboxSeesItsOwnValues(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		in := orderedInbox(t, db, outbox.InboxConfig{ConsumerName: "ledger"})
		pubsub := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 16}, watermill.NopLogger{})
		router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, watermill.NopLogger{})
		if err != nil {
			t.Fatal(err)
		}
		router.AddMiddleware(tenantFromMetadata("outer"), in.Middleware, tenantFromMetadata("inner"))
		var (
			mu  sync.Mutex
			ran []string
		)
		router.AddConsumerHandler("ledger", "payment", pubsub, func(msg *message.Message) error {
			mu.Lock()
			defer mu.Unlock()
			outer, _ := msg.Context().Value(tenantKey{"outer"}).(string)
			inner, _ := msg.Context().Value(tenantKey{"inner"}).(string)
			ran = append(ran, msg.Metadata.Get(outbox.HeaderSeq)+" outer="+outer+" inner="+inner)
			return nil
		})
		t.Cleanup(func() { _ = pubsub.Close() }) // after the router's stop
		stop := runRouter(t, router)
		t.Cleanup(func() {
			if err := stop(); err != nil {
				t.Error(err)
			}
		})

		second := keyedMsg("payment-7", 2)
		second.Metadata.Set("tenant", "b")
		if err := pubsub.Publish("payment", second); err != nil {
			t.Fatal(err)
		}
		waitFor(t, 10*time.Second, "seq 2 held", func() bool { return countHeld(t, db) == 1 })
		first := keyedMsg("payment-7", 1)
		first.Metadata.Set("tenant", "a")
		if err := pubsub.Publish("payment", first); err != nil {
			t.Fatal(err)
		}
		waitFor(t, 10*time.Second, "both applied", func() bool { mu.Lock(); defer mu.Unlock(); return len(ran) >= 2 })
		mu.Lock()
		defer mu.Unlock()
		if want := []string{"1 outer=a inner=a", "2 outer=a inner=b"}; !reflect.DeepEqual(ran, want) {
			t.Errorf("ran %q, want %q", ran, want)
		}
	})
}

// A held message whose transaction's context ends under its handler (an
// ApplyHeld under a deadline) fails with ErrHandlerTxDone matching the
// context's cause, as a delivery's does: the context the failure was
// checked against was the handler's, which may never end (a code review).
func TestOrderedInbox_HeldApplyDeadlinePassesUnderTheHandler_ErrorMatchesItsCause(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.SQLite)
	var mode atomic.Int32 // 0: seq 2 fails; 1: seq 2 waits for its transaction to end
	in := orderedInbox(t, db, outbox.InboxConfig{ConsumerName: "held-deadline"})
	h := in.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		if msg.Metadata.Get(outbox.HeaderSeq) != "2" {
			return nil, nil
		}
		if mode.Load() == 0 {
			return nil, errors.New("not yet")
		}
		tx, _ := outbox.TxFromContext(msg.Context())
		deadline := time.Now().Add(10 * time.Second)
		for tx.Tx.QueryRowContext(context.Background(), "SELECT 1").Scan(new(int)) == nil && time.Now().Before(deadline) {
			time.Sleep(time.Millisecond)
		}
		return nil, nil
	})
	deliver(t, h, "k", 2, 1) // 2 held, 1 applied, 2's apply fails: still held
	if n := countHeld(t, db); n != 1 {
		t.Fatalf("%d held, want 1", n)
	}
	mode.Store(1)
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	_, err := in.ApplyHeld(ctx)
	// ApplyHeld joins its own stop, which matches DeadlineExceeded: the
	// key's failure is looked at alone.
	var failed error
	if j, ok := err.(interface{ Unwrap() []error }); ok {
		for _, e := range j.Unwrap() {
			if errors.Is(e, outbox.ErrHandlerTxDone) {
				failed = e
			}
		}
	}
	if failed == nil || !errors.Is(failed, context.DeadlineExceeded) {
		t.Errorf("the held message's failure: %v, want ErrHandlerTxDone matching context.DeadlineExceeded (ApplyHeld: %v)", failed, err)
	}
}
