package outbox_test

import (
	"database/sql"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// inTxKill ends the connection of the handler's transaction from db's pool.
func inTxKill(t *testing.T, db *testdb.DB, msg *message.Message) {
	t.Helper()
	tx, ok := outbox.TxFromContext(msg.Context())
	if !ok {
		t.Error("no transaction in the handler's context")
		return
	}
	var id int64
	q := "SELECT pg_backend_pid()"
	if db.Kind == testdb.MySQL {
		q = "SELECT CONNECTION_ID()"
	}
	if err := tx.QueryRow(q).Scan(&id); errors.Is(err, sql.ErrTxDone) {
		// Over already: the delivery's deadline passed before the handler
		// ran (a CI run, the database slow under load), and database/sql
		// rolled it back; its connection is no longer the delivery's.
		t.Logf("the handler's transaction was over before the kill: %v", err)
		return
	} else if err != nil {
		t.Error(err)
		return
	}
	kill := fmt.Sprintf("SELECT pg_terminate_backend(%d)", id)
	if db.Kind == testdb.MySQL {
		kill = fmt.Sprintf("KILL CONNECTION %d", id)
	}
	if _, err := db.Exec(kill); err != nil {
		t.Error(err)
	}
	time.Sleep(50 * time.Millisecond) // the server closes it
}

// eachServer runs fn on a migrated PostgreSQL and MySQL database: SQLite
// has no connection to lose.
func eachServer(t *testing.T, fn func(t *testing.T, db *testdb.DB)) {
	for _, kind := range []string{testdb.Postgres, testdb.MySQL} {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			fn(t, migrated(t, kind))
		})
	}
}

// The database drops the handler's connection as it runs (a backend
// terminated, a connection killed): the inbox runs the delivery again on
// another connection once the database answers, and it is applied once,
// not failed. Behind the README's chain, each of Retry's tries failed at
// once in an outage, and PoisonQueue set the message aside and marked its
// record processed (a review killing a ledger's connections for 3-6 s set
// 3-9 messages of 2,000 aside, their ordered keys held behind them).
func TestInbox_ConnectionKilledMidHandler_RunAgainAppliedOnceNotSetAside(t *testing.T) {
	t.Parallel()
	eachServer(t, func(t *testing.T, db *testdb.DB) {
		id, in, poison, pq := poisonedChainSetup(t, db, "order.placed")
		runs := 0
		h := pq(middleware.Retry{MaxRetries: 0, ResetContextOnRetry: true}.Middleware(
			middleware.Timeout(20 * time.Second)(in.Middleware(func(msg *message.Message) ([]*message.Message, error) {
				runs++
				if runs == 1 {
					inTxKill(t, db, msg)
				}
				tx, _ := outbox.TxFromContext(msg.Context())
				_, err := tx.Exec(db.Rebind("INSERT INTO effects (message_id, note) VALUES (?, ?)"), msg.UUID, "placed")
				return nil, err
			}))))
		if _, err := h(message.NewMessage(id, []byte("x"))); err != nil {
			t.Fatalf("the delivery whose connection was killed failed: %v", err)
		}
		if n := countEffects(t, db, id); n != 1 || runs != 2 || poison.count() != 0 || !outboxStateOf(t, db, id).Processed {
			t.Errorf("effects %d, handler runs %d, poisoned %d, processed %v; want 1, 2, 0, true", n, runs, poison.count(), outboxStateOf(t, db, id).Processed)
		}
	})
}

// A database that keeps dropping the connection past the delivery's
// context (Timeout's deadline): the delivery fails, but PoisonPublisher
// does not set the message aside, nor mark its record processed; it is
// delivered again.
func TestInbox_DatabaseGonePastTheDeliverysContext_NotSetAside(t *testing.T) {
	t.Parallel()
	eachServer(t, func(t *testing.T, db *testdb.DB) {
		id, in, poison, pq := poisonedChainSetup(t, db, "order.placed")
		h := pq(middleware.Retry{MaxRetries: 1, InitialInterval: 10 * time.Millisecond, ResetContextOnRetry: true}.Middleware(
			middleware.Timeout(time.Second)(in.Middleware(func(msg *message.Message) ([]*message.Message, error) {
				inTxKill(t, db, msg)
				tx, _ := outbox.TxFromContext(msg.Context())
				_, err := tx.Exec(db.Rebind("INSERT INTO effects (message_id, note) VALUES (?, ?)"), msg.UUID, "placed")
				return nil, err
			}))))
		_, err := h(message.NewMessage(id, []byte("x")))
		if err == nil {
			t.Errorf("a delivery the database never answered was acked (poisoned %d)", poison.count())
		}
		if poison.count() != 0 || outboxStateOf(t, db, id).Processed || countEffects(t, db, id) != 0 {
			t.Errorf("poisoned %d, processed %v, effects %d; want 0, false, 0: it is delivered again (%v)",
				poison.count(), outboxStateOf(t, db, id).Processed, countEffects(t, db, id), err)
		}
	})
}

// A held message whose connection is lost as it runs after its
// predecessor commits is run again once the database answers, as a
// delivery is: it waited for ApplyHeld's next tick (10 s by default), its
// failure logged at ERROR (a review's restarts with connections killed
// left 3–11 keys so).
func TestOrderedInbox_HeldMessagesConnectionKilled_RunAgainWithTheDrain(t *testing.T) {
	t.Parallel()
	eachServer(t, func(t *testing.T, db *testdb.DB) {
		createEffects(t, db)
		in := orderedInbox(t, db, outbox.InboxConfig{ApplyHeldEvery: time.Hour})
		runs := map[string]int{}
		var log applyLog
		h := in.Middleware(func(msg *message.Message) ([]*message.Message, error) {
			seq := msg.Metadata.Get(outbox.HeaderSeq)
			if runs[seq]++; seq == "2" && runs[seq] == 1 {
				inTxKill(t, db, msg)
			}
			return log.handler(t, db)(msg)
		})
		deliver(t, h, "acct-9", 2, 1) // 2 is held; 1 releases it, and its connection is killed
		if got := log.of("acct-9"); len(got) != 2 || got[0] != 1 || got[1] != 2 || runs["2"] != 2 || countHeld(t, db) != 0 {
			t.Errorf("applied %v, seq 2 ran %d times, %d held; want [1 2], twice, none", got, runs["2"], countHeld(t, db))
		}
		assertEffectsOnce(t, db, "acct-9", 2)
	})
}
