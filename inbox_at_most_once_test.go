package outbox_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jmoiron/sqlx"
	"github.com/prometheus/client_golang/prometheus"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testamqp"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// sendEffect is an at-most-once handler's effect that no transaction holds
// (an email): a row written outside any transaction, after checking that
// the key is committed already, seen from another connection, and that the
// handler has no transaction to make it in.
func sendEffect(t testing.TB, db *testdb.DB, ran *atomic.Int32) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		ran.Add(1)
		if _, ok := outbox.TxFromContext(msg.Context()); ok {
			return nil, errors.New("an at-most-once handler was given a transaction")
		}
		var keys int
		if err := db.Get(&keys, db.Rebind("SELECT COUNT(*) FROM processed_messages WHERE message_id = ?"), msg.UUID); err != nil {
			return nil, err
		}
		if keys != 1 {
			return nil, fmt.Errorf("the key is not committed before the handler runs (%d rows)", keys)
		}
		_, err := db.Exec(db.Rebind("INSERT INTO effects (message_id, note) VALUES (?, ?)"), msg.UUID, "sent")
		return nil, err
	}
}

// The key commits before the handler, which runs with no transaction; a
// redelivery is acked without running it.
func TestInbox_AtMostOnce_KeyCommittedBeforeHandlerWithoutTx_DuplicateNotRun(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		createEffects(t, db)
		var ran atomic.Int32
		h := newInbox(t, db, outbox.InboxConfig{AtMostOnce: true}).Middleware(sendEffect(t, db, &ran))
		msg := message.NewMessage(watermill.NewUUID(), []byte("receipt"))
		for i := range 2 {
			if _, err := h(msg.Copy()); err != nil {
				t.Fatalf("delivery %d: %v", i+1, err)
			}
		}
		if ran.Load() != 1 || countEffects(t, db, msg.UUID) != 1 || countProcessed(t, db, msg.UUID) != 1 {
			t.Fatalf("handler ran %d times, %d effects, %d keys; want 1 each", ran.Load(), countEffects(t, db, msg.UUID), countProcessed(t, db, msg.UUID))
		}
	})
}

// A handler that fails (returns an error or panics) says its effect did not
// happen: the key is taken back, the retry runs, and the effect is made once.
func TestInbox_AtMostOnce_HandlerFailsOrPanics_KeyTakenBackRetryMakesEffectOnce(t *testing.T) {
	for _, failure := range []string{"error", "panic"} {
		t.Run(failure, func(t *testing.T) {
			eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
				createEffects(t, db)
				var ran atomic.Int32
				send := sendEffect(t, db, &ran)
				h := newInbox(t, db, outbox.InboxConfig{AtMostOnce: true}).Middleware(func(msg *message.Message) ([]*message.Message, error) {
					if ran.Load() == 0 {
						ran.Add(1)
						if failure == "panic" {
							panic("SMTP client not configured")
						}
						return nil, errors.New("SMTP server refused the connection")
					}
					return send(msg)
				})
				msg := message.NewMessage(watermill.NewUUID(), []byte("receipt"))
				if _, err := h(msg.Copy()); err == nil {
					t.Fatal("first delivery: want the handler's failure (nack)")
				}
				if countProcessed(t, db, msg.UUID) != 0 {
					t.Fatal("the key of a failed at-most-once handler stayed: its retry would be dropped")
				}
				for i := range 2 { // the retry, then a duplicate
					if _, err := h(msg.Copy()); err != nil {
						t.Fatalf("delivery %d: %v", i+2, err)
					}
				}
				if ran.Load() != 2 || countEffects(t, db, msg.UUID) != 1 || countProcessed(t, db, msg.UUID) != 1 {
					t.Fatalf("handler ran %d times, %d effects, %d keys; want 2 runs, 1 effect, 1 key", ran.Load(), countEffects(t, db, msg.UUID), countProcessed(t, db, msg.UUID))
				}
			})
		})
	}
}

// The cost of at-most-once for the messages a handler returns: written
// after the handler, in a transaction of their own; when that fails the key
// stays (the effect happened), the error is returned, and the redelivery is
// dropped rather than run again.
// A copy delivered while the first one's handler still runs (the broker
// redelivers after the first's channel closed: a consumer's reconnect)
// found the key committed and was acked as a duplicate; the first then
// failed, took its key back and was nacked to a channel that is gone: the
// message was lost. The copy now waits for the first, and runs once the
// key is taken back; had the first succeeded, it would be a duplicate.
func TestInbox_AtMostOnce_CopyWhileTheFirstRuns_WaitsAndRunsIfTheFirstFailed(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		copyWhileTheFirstRuns(t, db, 200*time.Millisecond, func(h message.HandlerFunc) (first, second message.HandlerFunc) {
			in := newInbox(t, db, outbox.InboxConfig{AtMostOnce: true}).Middleware(h)
			return in, in
		})
	})
}

// The copy delivered to another process (the first one's channel closed
// while its handler ran, and RabbitMQ redelivered): it waits while the
// first one's key is running, renewed past its lease, and then runs if the
// first failed (its key taken back), or is a duplicate if it succeeded.
// Two Inboxes over two pools stand for the two processes.
func TestInbox_AtMostOnce_CopyInAnotherProcessWhileTheFirstRuns_WaitsAndRunsIfTheFirstFailed(t *testing.T) {
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		// The databases' runs wait side by side, and beside nothing else:
		// the test stays serial, so that no busy test delays the renewals.
		t.Parallel()
		const lease = 600 * time.Millisecond
		// The copy waits past three leases: the first one's is renewed.
		copyWhileTheFirstRuns(t, db, 3*lease, func(h message.HandlerFunc) (first, second message.HandlerFunc) {
			other := sqlx.MustOpen(db.DriverName(), db.DSN)
			t.Cleanup(func() { _ = other.Close() })
			in, err := outbox.NewInbox(other, outbox.InboxConfig{ConsumerName: "fulfilment", AtMostOnce: true, AtMostOnceLease: lease})
			if err != nil {
				t.Fatal(err)
			}
			return newInbox(t, db, outbox.InboxConfig{AtMostOnce: true, AtMostOnceLease: lease}).Middleware(h), in.Middleware(h)
		})
	})
}

// copyWhileTheFirstRuns delivers a message to the first of the two
// at-most-once inboxes that inboxes makes around one handler, and a copy
// to the second while the first one's handler runs; the copy must still
// wait after quiet. The first then fails or succeeds: the copy runs, or is
// a duplicate, and the key is there once.
func copyWhileTheFirstRuns(t *testing.T, db *testdb.DB, quiet time.Duration, inboxes func(message.HandlerFunc) (first, second message.HandlerFunc)) {
	t.Helper()
	for _, firstFails := range []bool{true, false} {
		var ran atomic.Int32
		started, release := make(chan struct{}), make(chan struct{})
		a, b := inboxes(func(*message.Message) ([]*message.Message, error) {
			if ran.Add(1) == 1 {
				close(started)
				<-release
				if firstFails {
					return nil, errors.New("SMTP down: not sent")
				}
			}
			return nil, nil
		})
		msg := message.NewMessage(watermill.NewUUID(), []byte("x"))
		first := make(chan error, 1)
		go func() { _, err := a(msg.Copy()); first <- err }()
		<-started
		second := make(chan error, 1)
		go func() { _, err := b(msg.Copy()); second <- err }()
		select {
		case err := <-second:
			t.Fatalf("first fails %v: the copy returned (%v) while the first still ran", firstFails, err)
		case <-time.After(quiet):
		}
		close(release)
		if err := <-first; (err != nil) != firstFails {
			t.Fatalf("first fails %v: first returned %v", firstFails, err)
		}
		if err := <-second; err != nil {
			t.Fatalf("first fails %v: the copy returned %v, want nil (ack)", firstFails, err)
		}
		want := int32(1)
		if firstFails {
			want = 2
		}
		if got := ran.Load(); got != want {
			t.Errorf("first fails %v: handler ran %d times, want %d", firstFails, got, want)
		}
		if n := countProcessed(t, db, msg.UUID); n != 1 {
			t.Errorf("first fails %v: %d keys, want 1", firstFails, n)
		}
	}
}

func TestInbox_AtMostOnce_ReturnedMessagesNotWritten_KeyStaysRedeliveryDropped(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		var ran atomic.Int32
		h := newInbox(t, db, outbox.InboxConfig{AtMostOnce: true}).Middleware(func(*message.Message) ([]*message.Message, error) {
			ran.Add(1)
			return []*message.Message{message.NewMessage(watermill.NewUUID(), []byte("x"))}, nil // no publish topic: outside a router
		})
		msg := message.NewMessage(watermill.NewUUID(), []byte("x"))
		if _, err := h(msg.Copy()); err == nil || !strings.Contains(err.Error(), "no publish topic") {
			t.Fatalf("err = %v, want the failure to write the returned message", err)
		}
		if _, err := h(msg.Copy()); err != nil {
			t.Fatalf("redelivery: %v, want it acked", err)
		}
		if ran.Load() != 1 || countProcessed(t, db, msg.UUID) != 1 || countRows(t, db) != 0 {
			t.Fatalf("handler ran %d times, %d keys, %d rows; want 1, 1, 0", ran.Load(), countProcessed(t, db, msg.UUID), countRows(t, db))
		}
	})
}

// The process dies for real between the key's commit and the effect: a
// child process consumes the message through a router behind an
// at-most-once inbox and is SIGKILLed in its handler. RabbitMQ requeues the
// unacked message when the child's connection dies; the redelivery, consumed
// here under the same consumer name, waits out the dead child's lease on the
// key and is acked without running the handler: the effect is dropped, not
// repeated.
func TestInbox_AtMostOnce_ProcessKilledAfterKeyCommit_RedeliveryAckedWithoutRunning(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		b := testamqp.New(t)
		queue := b.Queue()
		id := "receipt-" + testdb.RandomName()
		publishRaw(t, b, queue, id)

		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		cmd := exec.CommandContext(ctx, os.Args[0])
		cmd.Env = append(os.Environ(), "OUTBOX_INBOX_PROCESS=1", "OUTBOX_INBOX_DSN="+db.DSN, "OUTBOX_INBOX_DRIVER="+db.DriverName(), "OUTBOX_INBOX_QUEUE="+queue)
		out, err := cmd.CombinedOutput()
		var exit *exec.ExitError
		if !errors.As(err, &exit) || exit.Sys().(syscall.WaitStatus).Signal() != syscall.SIGKILL {
			t.Fatalf("inbox process: %v, want death by SIGKILL in its handler; output:\n%s", err, out)
		}
		if n := countProcessed(t, db, id); n != 1 {
			t.Fatalf("%d keys after the child died in its handler, want the one committed before it", n)
		}
		waitFor(t, 10*time.Second, "the broker to requeue the dead consumer's message", func() bool { return b.Count(queue) == 1 })

		reg := prometheus.NewRegistry()
		m, err := outbox.NewMetrics(reg)
		if err != nil {
			t.Fatal(err)
		}
		in := newInbox(t, db, outbox.InboxConfig{ConsumerName: receiptConsumer, AtMostOnce: true, AtMostOnceLease: receiptLease, Metrics: m})
		router := newRouter(t)
		router.AddMiddleware(in.Middleware)
		var ran atomic.Int32
		router.AddConsumerHandler(receiptConsumer, queue, amqpSubscriber(t), func(*message.Message) error {
			ran.Add(1)
			return nil
		})
		stop := startRouter(t, router)
		waitFor(t, 20*time.Second, "the redelivery to be taken for a duplicate", func() bool {
			return metricValue(t, reg, "outbox_inbox_duplicates_total", receiptConsumer) == 1
		})
		stop()
		if ran.Load() != 0 || countProcessed(t, db, id) != 1 {
			t.Fatalf("handler ran %d times on the redelivery, %d keys; want 0 runs and the one key", ran.Load(), countProcessed(t, db, id))
		}
		for name, want := range map[string]float64{"outbox_inbox_at_most_once_total": 0, "outbox_inbox_processed_total": 0, "outbox_inbox_failed_total": 0} {
			if got := metricValue(t, reg, name, receiptConsumer); got != want {
				t.Errorf("%s{consumer=%s} = %v, want %v", name, receiptConsumer, got, want)
			}
		}
	})
}

// receiptConsumer is the consumer of the killed child and of the test after
// it, and receiptLease the lease of its running key, which the redelivery
// waits out.
const (
	receiptConsumer = "send-receipt"
	receiptLease    = 2 * time.Second
)

// inboxProcess consumes one message from OUTBOX_INBOX_QUEUE through a router
// behind an at-most-once inbox, and SIGKILLs itself in the handler: after the
// key's commit, before the effect. Reaching the end is a failure (exit 3).
func inboxProcess() int {
	db, err := sqlx.Open(os.Getenv("OUTBOX_INBOX_DRIVER"), os.Getenv("OUTBOX_INBOX_DSN"))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	in, err := outbox.NewInbox(db, outbox.InboxConfig{ConsumerName: receiptConsumer, AtMostOnce: true, AtMostOnceLease: receiptLease})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	sub, err := newAMQPSubscriber()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NewStdLogger(false, false))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	router.AddMiddleware(in.Middleware)
	router.AddConsumerHandler(receiptConsumer, os.Getenv("OUTBOX_INBOX_QUEUE"), sub, func(*message.Message) error {
		_ = syscall.Kill(os.Getpid(), syscall.SIGKILL) // the key is committed, the email not sent
		select {}                                      // the signal is on its way
	})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	err = router.Run(ctx)
	fmt.Fprintf(os.Stderr, "inbox process survived: its handler never ran (%v)\n", err)
	return 3
}

// The messages an at-most-once handler returned are written in a
// transaction of their own after its key committed. A serialization
// failure there (PostgreSQL under REPEATABLE READ, the returned message's
// key counter raised by another transaction meanwhile) ran the whole
// delivery again: it found the key, was acked as a duplicate, and the
// messages were lost. The write is tried again instead.
func TestInbox_AtMostOnce_ReturnedWriteRefusedForAConcurrentOne_WrittenOnRetry(t *testing.T) {
	db := migrated(t, testdb.Postgres)
	reg := prometheus.NewRegistry()
	m, err := outbox.NewMetrics(reg)
	if err != nil {
		t.Fatal(err)
	}
	in := newInbox(t, db, outbox.InboxConfig{ConsumerName: "notify", AtMostOnce: true, Isolation: sql.LevelRepeatableRead, Metrics: m})

	// Another transaction holds aggregate K's counter row.
	holder, err := db.Beginx()
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = holder.Rollback() }()
	hp, err := outbox.NewTxPublisher(holder)
	if err != nil {
		t.Fatal(err)
	}
	if err := hp.Publish("k-events", keyed("K")); err != nil {
		t.Fatal(err)
	}

	ps := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	router := newRouter(t)
	var runs atomic.Int32
	returning := make(chan struct{}, 8)
	router.AddMiddleware(in.Middleware)
	returned := keyed("K")
	router.AddHandler("notify", "in", ps, "k-events", in.Publisher(), func(msg *message.Message) ([]*message.Message, error) {
		runs.Add(1)
		returning <- struct{}{}
		return []*message.Message{returned}, nil
	})
	stop := startRouter(t, router)
	defer stop()
	if err := ps.Publish("in", message.NewMessage(watermill.NewUUID(), []byte("order"))); err != nil {
		t.Fatal(err)
	}
	<-returning
	time.Sleep(300 * time.Millisecond) // the returned message's write waits on K's row
	if err := holder.Commit(); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "the delivery's outcome", func() bool {
		return metricValue(t, reg, "outbox_inbox_processed_total", "notify")+metricValue(t, reg, "outbox_inbox_duplicates_total", "notify")+
			metricValue(t, reg, "outbox_inbox_failed_total", "notify") > 0
	})
	var rows int
	if err := db.Get(&rows, "SELECT COUNT(*) FROM acemq_outbox WHERE id = $1", returned.UUID); err != nil {
		t.Fatal(err)
	}
	if rows != 1 || runs.Load() != 1 {
		t.Errorf("the handler ran %d times and its returned message is in the outbox %d times, want 1 and 1 (duplicates counted %v, failed %v)",
			runs.Load(), rows, metricValue(t, reg, "outbox_inbox_duplicates_total", "notify"), metricValue(t, reg, "outbox_inbox_failed_total", "notify"))
	}
}
