package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

func countProcessed(t testing.TB, db *testdb.DB, id string) int {
	t.Helper()
	var n int
	if err := db.Get(&n, db.Rebind("SELECT COUNT(*) FROM processed_messages WHERE message_id = ?"), id); err != nil {
		t.Fatal(err)
	}
	return n
}

// recordProcessed reports whether the outbox record id is marked processed.
func recordProcessed(t testing.TB, db *testdb.DB, id string) bool {
	t.Helper()
	var p bool
	if err := db.Get(&p, db.Rebind("SELECT processed_at IS NOT NULL FROM acemq_outbox WHERE id = ?"), id); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestInbox_Duplicate_AckedHandlerNotRun(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		createEffects(t, db)
		var ran atomic.Int32
		h := newInbox(t, db, outbox.InboxConfig{}).Middleware(writeEffect(t, db, &ran))
		msg := message.NewMessage(watermill.NewUUID(), []byte("order 1"))
		for i := 0; i < 3; i++ {
			if _, err := h(msg.Copy()); err != nil {
				t.Fatalf("delivery %d: %v, want nil (ack)", i+1, err)
			}
		}
		if ran.Load() != 1 || countEffects(t, db, msg.UUID) != 1 || countProcessed(t, db, msg.UUID) != 1 {
			t.Fatalf("handler ran %d times, %d effects, %d keys; want 1 each", ran.Load(), countEffects(t, db, msg.UUID), countProcessed(t, db, msg.UUID))
		}
	})
}

// The case Watermill's Deduplicator loses: it records the key before the
// handler runs, so the retry of a failed handler is dropped as a duplicate.
func TestInbox_HandlerFailsOnceThenSucceeds_EffectExactlyOnce(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		createEffects(t, db)
		var ran atomic.Int32
		effect := writeEffect(t, db, &ran)
		h := newInbox(t, db, outbox.InboxConfig{}).Middleware(func(msg *message.Message) ([]*message.Message, error) {
			if _, err := effect(msg); err != nil {
				return nil, err
			}
			if ran.Load() == 1 {
				return nil, errors.New("payment service timed out")
			}
			return nil, nil
		})
		msg := message.NewMessage(watermill.NewUUID(), []byte("x"))
		if _, err := h(msg.Copy()); err == nil {
			t.Fatal("first delivery: want the handler's error (nack)")
		}
		if countEffects(t, db, msg.UUID) != 0 || countProcessed(t, db, msg.UUID) != 0 {
			t.Fatal("a failed handler left its effect or its key")
		}
		if _, err := h(msg.Copy()); err != nil {
			t.Fatalf("redelivery: %v", err)
		}
		if ran.Load() != 2 || countEffects(t, db, msg.UUID) != 1 {
			t.Fatalf("handler ran %d times with %d effects; want the retry run, one effect", ran.Load(), countEffects(t, db, msg.UUID))
		}
	})
}

func TestInbox_HandlerPanics_RolledBackErrorReturned(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		createEffects(t, db)
		var ran atomic.Int32
		effect := writeEffect(t, db, &ran)
		h := newInbox(t, db, outbox.InboxConfig{}).Middleware(func(msg *message.Message) ([]*message.Message, error) {
			_, _ = effect(msg)
			panic("nil map in the handler")
		})
		msg := message.NewMessage(watermill.NewUUID(), []byte("x"))
		if _, err := h(msg); err == nil || !strings.Contains(err.Error(), "panicked") {
			t.Fatalf("err = %v, want the panic as an error", err)
		}
		if countEffects(t, db, msg.UUID) != 0 || countProcessed(t, db, msg.UUID) != 0 {
			t.Fatal("a panicking handler left its effect or its key")
		}
	})
}

// A commit that fails stores neither the key nor the effect, and nacks.
func TestInbox_CommitFails_NeitherKeyNorEffectStored(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		createEffects(t, db)
		// PostgreSQL and SQLite check a deferred foreign key at commit; MySQL
		// has none, so there the handler's connection dies before the commit
		// (and the inbox's read-back of its key, just before the commit,
		// meets the dead connection first).
		switch db.Kind {
		case testdb.Postgres:
			db.MustExec("CREATE TABLE parents (id varchar(64) PRIMARY KEY)")
			db.MustExec("CREATE TABLE children (parent_id varchar(64) REFERENCES parents (id) DEFERRABLE INITIALLY DEFERRED)")
		case testdb.SQLite:
			db.MustExec("CREATE TABLE parents (id varchar(64) PRIMARY KEY)")
			db.MustExec("CREATE TABLE children (parent_id varchar(64) REFERENCES parents (id) DEFERRABLE INITIALLY DEFERRED)")
		}
		var ran atomic.Int32
		effect := writeEffect(t, db, &ran)
		h := newInbox(t, db, outbox.InboxConfig{}).Middleware(func(msg *message.Message) ([]*message.Message, error) {
			if _, err := effect(msg); err != nil {
				return nil, err
			}
			tx, _ := outbox.TxFromContext(msg.Context())
			if db.Kind == testdb.MySQL {
				var id int64
				if err := tx.Get(&id, "SELECT CONNECTION_ID()"); err != nil {
					return nil, err
				}
				_, err := db.Exec(fmt.Sprintf("KILL %d", id))
				return nil, err
			}
			_, err := tx.Exec("INSERT INTO children (parent_id) VALUES ('no such parent')")
			return nil, err // the violation waits for the commit
		})
		msg := message.NewMessage(watermill.NewUUID(), []byte("x"))
		last := "commit"
		if db.Kind == testdb.MySQL {
			// A connection killed at every run is a database that does not
			// answer: the inbox runs the delivery again until its context
			// ends, and says so.
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			defer cancel()
			msg.SetContext(ctx)
			last = "the database did not answer before the delivery's context ended: "
		}
		_, err := h(msg)
		if err == nil || !strings.Contains(err.Error(), last) {
			t.Fatalf("err = %v, want the failure of the %s (nack)", err, last)
		}
		if countEffects(t, db, msg.UUID) != 0 || countProcessed(t, db, msg.UUID) != 0 {
			t.Fatal("a failed commit left the effect or the key")
		}
	})
}

// Two deliveries of one id at once (two consumers, a redelivery racing the
// original): the effect happens once.
func TestInbox_ConcurrentDuplicates_OneEffect(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		createEffects(t, db)
		var ran atomic.Int32
		h := newInbox(t, db, outbox.InboxConfig{}).Middleware(writeEffect(t, db, &ran))
		msg := message.NewMessage(watermill.NewUUID(), []byte("x"))
		const deliveries = 8
		var wg sync.WaitGroup
		errs := make(chan error, deliveries)
		start := make(chan struct{})
		for i := 0; i < deliveries; i++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-start
				_, err := h(msg.Copy())
				errs <- err
			}()
		}
		close(start)
		wg.Wait()
		close(errs)
		for err := range errs {
			if err != nil {
				t.Errorf("delivery: %v", err)
			}
		}
		if n := countEffects(t, db, msg.UUID); n != 1 {
			t.Fatalf("%d effects of %d concurrent deliveries, want 1", n, deliveries)
		}
	})
}

// A consumer that also produces: what it publishes through NewTxPublisher
// on the inbox's transaction commits with its effect, and a failure after
// the publish leaves neither.
func TestInbox_ConsumerPublishesThenFails_NeitherEffectNorOutgoingMessage(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		createEffects(t, db)
		var ran atomic.Int32
		effect := writeEffect(t, db, &ran)
		fail := true
		h := newInbox(t, db, outbox.InboxConfig{}).Middleware(func(msg *message.Message) ([]*message.Message, error) {
			if _, err := effect(msg); err != nil {
				return nil, err
			}
			tx, _ := outbox.TxFromContext(msg.Context())
			pub, err := outbox.NewTxPublisher(tx)
			if err != nil {
				return nil, err
			}
			if err := pub.Publish("order.shipped", message.NewMessage("shipped-"+msg.UUID[:8], []byte("x"))); err != nil {
				return nil, err
			}
			if fail {
				return nil, errors.New("carrier API down")
			}
			return nil, nil
		})
		msg := message.NewMessage(watermill.NewUUID(), []byte("x"))
		if _, err := h(msg.Copy()); err == nil {
			t.Fatal("want the failure")
		}
		if countEffects(t, db, msg.UUID) != 0 || countRows(t, db) != 0 {
			t.Fatalf("after the failure: %d effects, %d outgoing rows; want none", countEffects(t, db, msg.UUID), countRows(t, db))
		}
		fail = false
		if _, err := h(msg.Copy()); err != nil {
			t.Fatal(err)
		}
		if countEffects(t, db, msg.UUID) != 1 || countRows(t, db) != 1 {
			t.Fatalf("after the retry: %d effects, %d outgoing rows; want 1 and 1", countEffects(t, db, msg.UUID), countRows(t, db))
		}
	})
}

// A service consuming its own events marks the outbox record processed in
// the same transaction; with the option off, the outbox is not touched.
func TestInbox_MarkOutboxProcessed_SetsProcessedAtOnlyWhenConfigured(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		createEffects(t, db)
		ids := publishN(t, db, "", "order.placed", 2)
		var ran atomic.Int32
		marking := newInbox(t, db, outbox.InboxConfig{MarkOutboxProcessed: true}).Middleware(writeEffect(t, db, &ran))
		plain := newInbox(t, db, outbox.InboxConfig{ConsumerName: "other"}).Middleware(writeEffect(t, db, &ran))
		if _, err := marking(message.NewMessage(ids[0], []byte("x"))); err != nil {
			t.Fatal(err)
		}
		if _, err := plain(message.NewMessage(ids[1], []byte("x"))); err != nil {
			t.Fatal(err)
		}
		if !recordProcessed(t, db, ids[0]) {
			t.Error("the record was not marked processed")
		}
		if recordProcessed(t, db, ids[1]) {
			t.Error("an inbox without MarkOutboxProcessed touched the outbox")
		}
	})
}

// The mark of MarkOutboxProcessed commits with the handler's effect, in the
// inbox's transaction, plain and ordered: a handler that made its effect
// and then failed leaves the record unprocessed (a Republish sends it
// again), and its redelivery, which succeeds, marks it. A mark made on a
// connection of its own stayed after the failure on PostgreSQL and MySQL
// (the message counted as processed, its effect rolled back), and on
// SQLite waited for the inbox's write lock and failed every delivery.
func TestInbox_MarkOutboxProcessed_HandlerFailsAfterEffect_RecordStaysUnprocessed(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		createEffects(t, db)
		for _, ordered := range []bool{false, true} {
			t.Run(fmt.Sprintf("ordered=%v", ordered), func(t *testing.T) {
				id := publishN(t, db, "", "order.placed", 1)[0]
				var ran atomic.Int32
				effect := writeEffect(t, db, &ran)
				fail := true
				h := newInbox(t, db, outbox.InboxConfig{MarkOutboxProcessed: true, Ordered: ordered}).Middleware(func(msg *message.Message) ([]*message.Message, error) {
					if _, err := effect(msg); err != nil {
						return nil, err
					}
					if fail {
						return nil, errors.New("carrier API down")
					}
					return nil, nil
				})
				msg := message.NewMessage(id, []byte("x"))
				if ordered {
					msg.Metadata.Set(outbox.HeaderAggregateID, "a")
					msg.Metadata.Set(outbox.HeaderSeq, "1")
				}
				if _, err := h(msg.Copy()); err == nil || !strings.Contains(err.Error(), "carrier API down") {
					t.Fatalf("err = %v, want the handler's failure", err)
				}
				if recordProcessed(t, db, id) || countEffects(t, db, id) != 0 {
					t.Fatalf("after the failure: processed %v, %d effects; want false and 0", recordProcessed(t, db, id), countEffects(t, db, id))
				}
				fail = false
				if _, err := h(msg.Copy()); err != nil {
					t.Fatalf("redelivery: %v, want nil (ack)", err)
				}
				if !recordProcessed(t, db, id) || countEffects(t, db, id) != 1 {
					t.Fatalf("after the redelivery: processed %v, %d effects; want true and 1", recordProcessed(t, db, id), countEffects(t, db, id))
				}
			})
		}
	})
}

func TestInbox_MessageWithoutID_RefusedUnlessAllowed(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.SQLite)
	ran := 0
	h := func(*message.Message) ([]*message.Message, error) { ran++; return nil, nil }
	if _, err := newInbox(t, db, outbox.InboxConfig{}).Middleware(h)(message.NewMessage("", nil)); !errors.Is(err, outbox.ErrNoMessageID) || ran != 0 {
		t.Fatalf("err = %v, ran %d; want ErrNoMessageID and the handler not run", err, ran)
	}
	if _, err := newInbox(t, db, outbox.InboxConfig{AllowMissingID: true}).Middleware(h)(message.NewMessage("", nil)); err != nil || ran != 1 {
		t.Fatalf("err = %v, ran %d; want it passed through", err, ran)
	}
}

func TestInbox_PurgeProcessed_OldKeysOnlyInBatches(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		in := newInbox(t, db, outbox.InboxConfig{PurgeBatch: 2})
		old := time.Now().Add(-30 * 24 * time.Hour).UTC()
		var oldArg any = old
		if db.Kind != testdb.Postgres {
			oldArg = old.Format("2006-01-02 15:04:05.000000")
		}
		for i := 0; i < 5; i++ {
			db.MustExec(db.Rebind("INSERT INTO processed_messages (consumer_name, message_id, processed_at) VALUES ('c', ?, ?)"), fmt.Sprint("old-", i), oldArg)
		}
		// and five more, a minute apart: batches that go on from the last
		// one's end (see TestStore_PurgePublished_BatchesGoOn…)
		for i := 0; i < 5; i++ {
			at := old.Add(time.Duration(i+1) * time.Minute)
			var atArg any = at
			if db.Kind != testdb.Postgres {
				atArg = at.Format("2006-01-02 15:04:05.000000")
			}
			db.MustExec(db.Rebind("INSERT INTO processed_messages (consumer_name, message_id, processed_at) VALUES ('c', ?, ?)"), fmt.Sprint("apart-", i), atArg)
		}
		h := in.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, nil })
		if _, err := h(message.NewMessage("fresh", nil)); err != nil {
			t.Fatal(err)
		}
		n, err := in.PurgeProcessed(context.Background(), 7*24*time.Hour)
		if err != nil || n != 10 {
			t.Fatalf("purged %d (%v), want 10", n, err)
		}
		if countProcessed(t, db, "fresh") != 1 {
			t.Fatal("a fresh key was purged")
		}
	})
}

// Through a real router and RabbitMQ: the consumer name defaults to the
// handler's name, and a crash after the commit and before the ack (the broker
// redelivers) is acked without a second effect.
func TestInbox_Router_CrashAfterCommitBeforeAck_RedeliveryAckedNoSecondEffect(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		testdb.Require(t, "amqp")
		createEffects(t, db)
		topic := "inbox-" + testdb.RandomName()
		t.Cleanup(func() { testamqpDeleteQueue(t, topic) }) // after the router's stop
		amqpCfg := wamqp.NewDurableQueueConfig(testdb.AMQPURL())
		sub, err := wamqp.NewSubscriber(amqpCfg, watermill.NopLogger{})
		if err != nil {
			t.Fatal(err)
		}
		pub, err := wamqp.NewPublisher(amqpCfg, watermill.NopLogger{})
		if err != nil {
			t.Fatal(err)
		}
		defer pub.Close()

		in, err := outbox.NewInbox(db.DB, outbox.InboxConfig{}) // consumer name: the handler's
		if err != nil {
			t.Fatal(err)
		}
		r := runInboxRouterCrashingOnce(t, db, in, "fulfil-orders", topic, sub)

		msg := message.NewMessage(watermill.NewUUID(), []byte("order 7"))
		if err := pub.Publish(topic, msg); err != nil {
			t.Fatal(err)
		}
		select {
		case <-r.done:
		case <-time.After(20 * time.Second):
			t.Fatalf("the redelivery was not acked (%d deliveries)", r.deliveries.Load())
		}
		if r.ran.Load() != 1 || countEffects(t, db, msg.UUID) != 1 {
			t.Fatalf("handler ran %d times, %d effects; want 1 and 1", r.ran.Load(), countEffects(t, db, msg.UUID))
		}
		var consumer string
		if err := db.Get(&consumer, db.Rebind("SELECT consumer_name FROM processed_messages WHERE message_id = ?"), msg.UUID); err != nil || consumer != "fulfil-orders" {
			t.Fatalf("consumer_name = %q (%v), want the handler's name", consumer, err)
		}
		testamqpDeleteQueue(t, topic)
	})
}

// Consumer names that differ only in trailing spaces are one name to
// MySQL's inbox tables (utf8mb4_bin compares PAD SPACE): "ship " would be
// handed the keys of "ship", and a message both handle acked by the second
// as a duplicate without running. MySQL refuses such a name; PostgreSQL and
// SQLite keep the two apart.
func TestInbox_ConsumerNamesDifferingInTrailingSpaces_RefusedOnMySQLTwoConsumersElsewhere(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, d outbox.Dialect) {
		if d == outbox.MySQL {
			_, err := outbox.NewInbox(db.DB, outbox.InboxConfig{ConsumerName: "ship "})
			if !errors.Is(err, outbox.ErrInvalidConfig) || !strings.Contains(err.Error(), "ends in a space") {
				t.Fatalf("NewInbox with ConsumerName %q on MySQL: %v, want a ConfigError saying it ends in a space", "ship ", err)
			}
			return
		}
		var ran atomic.Int32
		h := func(*message.Message) ([]*message.Message, error) { ran.Add(1); return nil, nil }
		msg := message.NewMessage(watermill.NewUUID(), []byte("x"))
		for _, name := range []string{"ship", "ship "} {
			if _, err := newInbox(t, db, outbox.InboxConfig{ConsumerName: name}).Middleware(h)(msg.Copy()); err != nil {
				t.Fatal(err)
			}
		}
		if ran.Load() != 2 {
			t.Fatalf("handler ran %d times for two consumers; want 2", ran.Load())
		}
	})
}

// A handler's panic behind the inbox reached the router as the panic's
// value alone: the inbox recovers it (to roll back), so a Recoverer
// outside never sees it, and the stack was kept nowhere. The error is now
// Watermill's RecoveredPanicError, stack and all. (From an audit.)
func TestInbox_HandlerPanics_ErrorKeepsTheStack(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	in := newInbox(t, db, outbox.InboxConfig{ConsumerName: "boom"})
	h := in.Middleware(func(*message.Message) ([]*message.Message, error) {
		var m map[string]int
		m["x"] = 1 // a nil map's write
		return nil, nil
	})
	msg := message.NewMessage(watermill.NewUUID(), nil)
	_, err := h(msg)
	var p middleware.RecoveredPanicError
	if !errors.As(err, &p) {
		t.Fatalf("error %v, want a middleware.RecoveredPanicError", err)
	}
	if !strings.Contains(p.Stacktrace, "TestInbox_HandlerPanics_ErrorKeepsTheStack") {
		t.Errorf("stack %q does not name the panicking function", p.Stacktrace)
	}
	if n := countProcessed(t, db, msg.UUID); n != 0 {
		t.Errorf("%d keys after the panic, want 0 (rolled back)", n)
	}
}

// On MySQL a deadlock rolls the handler's whole transaction back, the
// dedupe key with it, and leaves the connection outside any transaction:
// a handler that took the error (or a Retry or PoisonQueue added after
// inbox.Middleware) and returned nil had its later statements committed one
// by one, and the inbox's COMMIT, of no transaction, succeeded. The
// delivery was acked with no key recorded, and an ordered key stayed
// behind its number for ever. The inbox now fails such a delivery
// (ErrTxRolledBackUnderHandler), so that it is delivered again.
func TestInbox_MySQL_DeadlockSwallowedByTheHandler_DeliveryFails(t *testing.T) {
	for _, ordered := range []bool{false, true} {
		t.Run(map[bool]string{false: "plain", true: "ordered"}[ordered], func(t *testing.T) {
			db := migrated(t, testdb.MySQL)
			createEffects(t, db)
			if _, err := db.Exec("CREATE TABLE locks (id int PRIMARY KEY, n int NOT NULL)"); err != nil {
				t.Fatal(err)
			}
			if _, err := db.Exec("INSERT INTO locks VALUES (1, 0), (2, 0)"); err != nil {
				t.Fatal(err)
			}
			in := newInbox(t, db, outbox.InboxConfig{ConsumerName: "deadlock", Ordered: ordered})
			// Two deliveries take rows 1 and 2 in opposite orders, each after
			// the other took its first: InnoDB rolls one back (1213). Each
			// handler takes the error, writes one more effect and returns
			// nil.
			var took sync.WaitGroup
			took.Add(2)
			var victims atomic.Int32
			handler := func(msg *message.Message) ([]*message.Message, error) {
				tx, _ := outbox.TxFromContext(msg.Context())
				first, second := 1, 2
				if strings.HasPrefix(msg.UUID, "b") {
					first, second = 2, 1
				}
				if _, err := tx.Exec("UPDATE locks SET n = n + 1 WHERE id = ?", first); err != nil {
					return nil, err
				}
				took.Done()
				took.Wait()
				if _, err := tx.Exec("UPDATE locks SET n = n + 1 WHERE id = ?", second); err != nil {
					if !strings.Contains(err.Error(), "1213") {
						return nil, err
					}
					victims.Add(1) // taken, as a middleware inside the inbox would
				}
				if _, err := tx.Exec("INSERT INTO effects (message_id, note) VALUES (?, 'after')", msg.UUID); err != nil {
					return nil, err
				}
				return nil, nil
			}
			// One wrapping for the deliveries and the redeliveries: outside a
			// router an ordered consumer is one handler (ErrConsumerShared).
			var redelivering atomic.Bool
			h := in.Middleware(func(msg *message.Message) ([]*message.Message, error) {
				if redelivering.Load() {
					return writeEffect(t, db, new(atomic.Int32))(msg)
				}
				return handler(msg)
			})
			msgs := []*message.Message{message.NewMessage("a-"+watermill.NewUUID(), nil), message.NewMessage("b-"+watermill.NewUUID(), nil)}
			if ordered {
				msgs = []*message.Message{keyedMsg("a-key", 1), keyedMsg("b-key", 1)}
			}
			errs := make([]error, 2)
			var wg sync.WaitGroup
			for i := range msgs {
				wg.Add(1)
				go func() {
					defer wg.Done()
					_, errs[i] = h(msgs[i])
				}()
			}
			wg.Wait()
			if victims.Load() != 1 {
				t.Fatalf("%d deliveries saw a deadlock, want 1 (errors %v)", victims.Load(), errs)
			}
			failed := 0
			for i, err := range errs {
				processed := countProcessed(t, db, msgs[i].UUID)
				t.Logf("%s: %v; key recorded %d", msgs[i].UUID, err, processed)
				switch {
				case err == nil && processed != 1:
					t.Errorf("%s acked with its dedupe key not recorded: its transaction was rolled back in the handler", msgs[i].UUID)
				case err != nil:
					failed++
					if !errors.Is(err, outbox.ErrTxRolledBackUnderHandler) {
						t.Errorf("%s failed with %v, want ErrTxRolledBackUnderHandler", msgs[i].UUID, err)
					}
				}
			}
			if failed != 1 {
				t.Fatalf("%d deliveries failed, want 1, the deadlock's victim", failed)
			}
			if ordered {
				// Delivered again, the victim applies, and its key moves on.
				redelivering.Store(true)
				for i, err := range errs {
					if err == nil {
						continue
					}
					redelivered := keyedMsg(msgs[i].Metadata.Get(outbox.HeaderAggregateID), 1)
					if _, err := h(redelivered); err != nil {
						t.Fatalf("redelivery: %v", err)
					}
					next := keyedMsg(msgs[i].Metadata.Get(outbox.HeaderAggregateID), 2)
					if _, err := h(next); err != nil {
						t.Fatalf("seq 2: %v", err)
					}
					if countProcessed(t, db, next.UUID) != 1 {
						t.Errorf("seq 2 of the victim's key was not applied after its redelivery")
					}
				}
			}
		})
	}
}

// On PostgreSQL a handler whose statement failed and that returned no
// error (its error taken by a middleware inside the inbox, as a
// PoisonQueue added after inbox.Middleware does) got "commit unexpectedly
// resulted in rollback" and nothing more. The error now says what most
// likely happened and where the middleware goes. (From an audit.)
func TestInbox_Postgres_HandlersErrorSwallowed_CommitErrorSaysWhy(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.Postgres)
	in := newInbox(t, db, outbox.InboxConfig{ConsumerName: "pay"})
	swallow := func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			_, _ = h(msg) // as PoisonQueue does, having published the copy
			return nil, nil
		}
	}
	h := in.Middleware(swallow(func(msg *message.Message) ([]*message.Message, error) {
		tx, _ := outbox.TxFromContext(msg.Context())
		_, err := tx.ExecContext(msg.Context(), "INSERT INTO no_such_table VALUES (1)")
		return nil, err
	}))
	msg := message.NewMessage(watermill.NewUUID(), nil)
	_, err := h(msg)
	if err == nil || !strings.Contains(err.Error(), "add those before inbox.Middleware") {
		t.Fatalf("error %v, want the hint", err)
	}
	if n := countProcessed(t, db, msg.UUID); n != 0 {
		t.Errorf("%d keys, want 0", n)
	}
}

// sqlStateError is a driver error with a SQLSTATE, as pgx's and lib/pq's
// errors are to the PostgreSQL dialect.
type sqlStateError string

func (e sqlStateError) Error() string {
	return "ERROR: could not serialize access (SQLSTATE " + string(e) + ")"
}
func (e sqlStateError) SQLState() string { return string(e) }

// A delivery the database refuses for a concurrent transaction at each of
// its runs fails with an error that says it was run that many times: a
// review under hundreds of InnoDB deadlocks saw only the driver's "try
// restarting transaction" in the router's log, which read as if the inbox
// never ran it again. The driver's error stays in the chain.
func TestInbox_RefusedForAConcurrentTransactionAtEveryRun_ErrorSaysHowManyRuns(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, d outbox.Dialect) {
		var refusal error
		switch d {
		case outbox.Postgres:
			refusal = sqlStateError("40001")
		case outbox.MySQL:
			refusal = errors.New("Error 1213 (40001): Deadlock found when trying to get lock; try restarting transaction")
		default:
			return // SQLite runs one writer at a time: no such refusal
		}
		var runs atomic.Int32
		h := newInbox(t, db, outbox.InboxConfig{}).Middleware(func(*message.Message) ([]*message.Message, error) {
			runs.Add(1)
			return nil, refusal
		})
		_, err := h(message.NewMessage(watermill.NewUUID(), []byte("x")))
		if runs.Load() != 8 || err == nil || !strings.Contains(err.Error(), "at each of 8 runs") || !errors.Is(err, refusal) {
			t.Fatalf("handler ran %d times, error %v; want 8 runs, an error saying so, with the driver's error in its chain", runs.Load(), err)
		}
	})
}
