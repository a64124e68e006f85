package outbox_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// One inbox added twice around a handler (the quick start's
// router.AddMiddleware(inbox.Middleware) and Middleware order's list,
// which names it again): the inner one began a transaction of its own and
// waited on the outer one's locks for as long as the message's context
// lasted, the handler never run (SQLite's write lock; PostgreSQL's row of
// the key); under AtMostOnce it found the outer's key and dropped the
// message as a duplicate. The inner one lets the outer's delivery through.
func TestInbox_AddedTwiceAroundAHandler_RunsOnceInTheOuterTransaction(t *testing.T) {
	t.Parallel()
	for _, atMostOnce := range []bool{false, true} {
		name := "transactional"
		if atMostOnce {
			name = "at most once"
		}
		t.Run(name, func(t *testing.T) {
			eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
				createEffects(t, db)
				var ran atomic.Int32
				handler := writeEffect(t, db, &ran)
				if atMostOnce {
					handler = sendEffect(t, db, &ran)
				}
				in := newInbox(t, db, outbox.InboxConfig{AtMostOnce: atMostOnce})
				h := in.Middleware(in.Middleware(handler))
				msg := message.NewMessage(watermill.NewUUID(), []byte("order 1"))
				for i := range 2 {
					ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
					m := msg.Copy()
					m.SetContext(ctx)
					_, err := h(m)
					cancel()
					if err != nil {
						t.Fatalf("delivery %d: %v, want nil (ack)", i+1, err)
					}
				}
				if ran.Load() != 1 || countEffects(t, db, msg.UUID) != 1 || countProcessed(t, db, msg.UUID) != 1 {
					t.Fatalf("handler ran %d times, %d effects, %d keys; want 1 each", ran.Load(), countEffects(t, db, msg.UUID), countProcessed(t, db, msg.UUID))
				}
			})
		})
	}
}
