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

// A handler that writes through the pool rather than TxFromContext's
// transaction waits for the write lock that transaction holds, and fails
// with its own "database is locked" at every run: a failure of the
// handler's, set aside by the README's chain, not waited out as the
// database's (a code review: it ran again until the delivery's context
// ended, was refused by the poison publisher as "the database did not
// answer", and was delivered again for ever). Its error says what to
// write through.
func TestInbox_SQLiteHandlerWritesThroughThePool_SetAsideNotWaitedOut(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.SQLite)
	createEffects(t, db)
	id := publishN(t, db, "", "order.placed", 1)[0]
	short := strings.Replace(db.DSN, "_busy_timeout=10000", "_busy_timeout=100", 1)
	pool, err := sqlx.Open("sqlite3", short)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	in, err := outbox.NewInbox(pool, outbox.InboxConfig{Dialect: outbox.SQLite, ConsumerName: "orders"})
	if err != nil {
		t.Fatal(err)
	}
	recorder := &poisonRecorder{}
	pq, err := middleware.PoisonQueue(in.PoisonPublisher(recorder), "order.placed.poison")
	if err != nil {
		t.Fatal(err)
	}
	h := pq(middleware.Retry{MaxRetries: 1, InitialInterval: 10 * time.Millisecond, ResetContextOnRetry: true}.Middleware(
		middleware.Timeout(10 * time.Second)(in.Middleware(func(msg *message.Message) ([]*message.Message, error) {
			_, err := pool.Exec("INSERT INTO effects (message_id, note) VALUES (?, ?)", msg.UUID, "placed") // not the transaction's
			return nil, err
		}))))
	started := time.Now()
	if _, err := h(message.NewMessage(id, []byte("x"))); err != nil {
		t.Errorf("the delivery failed (%v): want it set aside and acked", err)
	}
	if recorder.count() != 1 {
		t.Errorf("set aside %d times, want once", recorder.count())
	}
	if took := time.Since(started); took > 5*time.Second {
		t.Errorf("the delivery took %s: the handler's lock was waited out toward the 10 s Timeout", took.Round(time.Millisecond))
	}
	recorder.mu.Lock()
	defer recorder.mu.Unlock()
	if len(recorder.msgs) == 1 {
		if reason := recorder.msgs[0].Metadata.Get(middleware.ReasonForPoisonedKey); !strings.Contains(reason, "outbox.TxFromContext's transaction") {
			t.Errorf("the reason set aside: %q, want it to say what to write through", reason)
		}
	}
}
