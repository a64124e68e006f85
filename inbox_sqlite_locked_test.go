package outbox_test

import (
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/jmoiron/sqlx"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// SQLite's write lock held by another connection past the busy timeout
// (another process's long transaction, a VACUUM, a migration) for as long
// as the README's chain retries: "database is locked" is the database not
// answering, no fault of the message's, and the message is not set aside,
// through PoisonPublisher or PoisonOutbox, but delivered again, and then
// applied once. A review's third process held the lock 23 s under a
// service with a backlog, and a sound message went to the poison topic,
// acked, its record marked processed, never applied (3,599 of 3,600); with
// PoisonOutbox it was set aside when the lock ended during the copy's
// write. The lock here ends as Retry gives up, before PoisonQueue
// publishes.
func TestInbox_SQLiteLockedPastTheDeliverysContext_NotSetAsideAppliedOnceAfter(t *testing.T) {
	t.Parallel()
	for _, via := range []string{"PoisonPublisher", "PoisonOutbox"} {
		t.Run(via, func(t *testing.T) {
			t.Parallel()
			db := migrated(t, testdb.SQLite)
			createEffects(t, db)
			id := publishN(t, db, "", "order.placed", 1)[0]
			publishAllAt(t, db, time.Now().Add(-time.Minute))
			short := strings.Replace(db.DSN, "_busy_timeout=10000", "_busy_timeout=100", 1)
			if short == db.DSN {
				t.Fatalf("DSN %s sets no _busy_timeout=10000 to replace", db.DSN)
			}
			pool, err := sqlx.Open("sqlite3", short)
			if err != nil {
				t.Fatal(err)
			}
			defer pool.Close()
			in, err := outbox.NewInbox(pool, outbox.InboxConfig{Dialect: outbox.SQLite, MarkOutboxProcessed: true, ConsumerName: "orders"})
			if err != nil {
				t.Fatal(err)
			}
			recorder := &poisonRecorder{}
			poisonPub := in.PoisonPublisher(recorder)
			if via == "PoisonOutbox" {
				poisonPub = in.PoisonOutbox()
			}
			pq, err := middleware.PoisonQueue(poisonPub, "order.placed.poison")
			if err != nil {
				t.Fatal(err)
			}
			handler := in.Middleware(func(msg *message.Message) ([]*message.Message, error) {
				tx, _ := outbox.TxFromContext(msg.Context())
				_, err := tx.Exec("INSERT INTO effects (message_id, note) VALUES (?, ?)", msg.UUID, "placed")
				return nil, err
			})

			locker, err := sqlx.Open("sqlite3", db.DSN)
			if err != nil {
				t.Fatal(err)
			}
			defer locker.Close()
			lock, err := locker.Begin() // BEGIN IMMEDIATE: the write lock
			if err != nil {
				t.Fatal(err)
			}
			retried := middleware.Retry{MaxRetries: 1, InitialInterval: 10 * time.Millisecond, ResetContextOnRetry: true}.Middleware(
				middleware.Timeout(300 * time.Millisecond)(handler))
			h := pq(func(msg *message.Message) ([]*message.Message, error) {
				out, err := retried(msg)
				_ = lock.Rollback() // the lock ends as Retry gives up
				return out, err
			})
			if _, err := h(message.NewMessage(id, []byte("x"))); err == nil {
				t.Error("a delivery the locked database never took was acked")
			}
			var copies int
			if err := db.Get(&copies, "SELECT COUNT(*) FROM acemq_outbox WHERE routing_key = 'order.placed.poison'"); err != nil {
				t.Fatal(err)
			}
			if recorder.count() != 0 || copies != 0 || outboxStateOf(t, db, id).Processed {
				t.Errorf("set aside: %d sent, %d copies written, processed %v; want none: it is delivered again",
					recorder.count(), copies, outboxStateOf(t, db, id).Processed)
			}
			if _, err := h(message.NewMessage(id, []byte("x"))); err != nil {
				t.Fatalf("delivered again, the lock gone: %v", err)
			}
			if n := countEffects(t, db, id); n != 1 || !outboxStateOf(t, db, id).Processed {
				t.Errorf("delivered again: %d effects, processed %v; want 1, true", n, outboxStateOf(t, db, id).Processed)
			}
		})
	}
}
