package integration_test

// Focused end-to-end checks beside the chaos run, for what it cannot tell
// apart (a duplicate the relay makes on its own
// is absorbed by the inbox like one a crash makes) or never exercises
// (Republish, which neither the chaos run nor the examples' tests give a
// lost message to resend).

import (
	"context"
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"
	amqp "github.com/rabbitmq/amqp091-go"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testamqp"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

func dialectOfKind(t *testing.T, kind string) outbox.Dialect {
	d, ok := map[string]outbox.Dialect{testdb.Postgres: outbox.Postgres, testdb.MySQL: outbox.MySQL, testdb.SQLite: outbox.SQLite}[kind]
	if !ok {
		t.Fatalf("no dialect for database kind %q", kind)
	}
	return d
}

// placeOrders commits n orders, each with its order.placed message, per
// transaction perTx of them, and returns their message ids by order id.
func placeOrders(t *testing.T, app *sqlx.DB, exchange string, n, perTx int) map[string]string {
	t.Helper()
	ctx := context.Background()
	insert := app.Rebind("INSERT INTO orders (id, message_id, total, placed_us) VALUES (?, ?, ?, ?)")
	placed := map[string]string{}
	for i := 0; i < n; {
		tx, err := app.BeginTxx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		pub, err := outbox.NewTxPublisher(tx, outbox.TxPublisherConfig{Exchange: exchange})
		if err != nil {
			t.Fatal(err)
		}
		ids := map[string]string{}
		for j := 0; j < perTx && i < n; j, i = j+1, i+1 {
			orderID, msgID := fmt.Sprintf("order-%05d", i), watermill.NewUUID()
			if _, err := tx.ExecContext(ctx, insert, orderID, msgID, 100+i, time.Now().UnixMicro()); err != nil {
				t.Fatal(err)
			}
			payload, _ := json.Marshal(orderPlaced{OrderID: orderID, Total: 100 + i})
			msg := message.NewMessage(msgID, payload)
			msg.SetContext(ctx)
			if err := pub.Publish(topic, msg); err != nil {
				t.Fatal(err)
			}
			ids[orderID] = msgID
		}
		if err := tx.Commit(); err != nil {
			t.Fatal(err)
		}
		for k, v := range ids {
			placed[k] = v
		}
	}
	return placed
}

// orderRig is what each proof runs on: an isolated database of kind with
// the orders schema, a broker of the test's own, and the application's
// pool of the database.
func orderRig(t *testing.T, kind string) (*testdb.DB, *testamqp.Broker, *sqlx.DB) {
	t.Helper()
	db := testdb.New(t, kind)
	migrateOrders(t, db)
	b := testamqp.New(t)
	app := sqlx.MustOpen(db.DriverName(), db.DSN)
	t.Cleanup(func() { _ = app.Close() })
	return db, b, app
}

// amqpDest is a destination on the test broker.
func amqpDest(t *testing.T) *outbox.AMQPDestination {
	t.Helper()
	dest, err := outbox.NewAMQPDestination(outbox.AMQPConfig{URLs: []string{testdb.AMQPURL()}})
	if err != nil {
		t.Fatal(err)
	}
	return dest
}

func migrateOrders(t *testing.T, db *testdb.DB) {
	t.Helper()
	if err := outbox.Migrate(context.Background(), db.DB.DB, dialectOfKind(t, db.Kind)); err != nil {
		t.Fatal(err)
	}
	db.MustExec("CREATE TABLE orders (id varchar(64) PRIMARY KEY, message_id varchar(64) NOT NULL, total integer NOT NULL, placed_us bigint NOT NULL)")
	db.MustExec("CREATE TABLE effects (order_id varchar(64) NOT NULL, message_id varchar(64) NOT NULL, applied_us bigint NOT NULL)")
}

// drainAll sweeps until nothing is pending.
func drainAll(t *testing.T, f *outbox.Forwarder) {
	t.Helper()
	ctx := context.Background()
	var st outbox.Stats
	if !waitUntil(30*time.Second, func() bool {
		_, _ = f.Sweep(ctx)
		s, err := f.Store().Stats(ctx)
		st = s
		return err == nil && s.Pending == 0
	}) {
		t.Fatalf("the outbox did not drain within 30 s: %+v", st)
	}
}

// The broker loses messages the relay had published and marked (here: the
// queue is purged, as a broker that lost its disk or a queue deleted and
// declared again would). Republish, as the service's next boot runs it,
// makes them pending; the relay sends them again; the consumer behind the
// inbox applies every order exactly once. Without a working Republish the
// orders are lost for good, and nothing else in integration_test or
// examples/ notices: the chaos run never loses a published message, and the
// orders example boots on an outbox with nothing to republish.
func TestEndToEnd_Republish_MessagesTheBrokerLost_SentAgainEachAppliedOnce(t *testing.T) {
	for _, kind := range testdb.Kinds {
		t.Run(kind, func(t *testing.T) {
			const n = 30
			ctx := context.Background()
			db, b, app := orderRig(t, kind)
			queue := b.Queue(topic)

			placed := placeOrders(t, app, b.Exchange, n, 5)
			dest := amqpDest(t)
			f, err := outbox.NewForwarder(db.DB, dest, outbox.ForwarderConfig{})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = f.Close() })
			drainAll(t, f)

			// The broker loses them all.
			var purged int
			b.With(func(ch *amqp.Channel) error {
				var err error
				purged, err = ch.QueuePurge(queue, false)
				return err
			})
			if purged != n {
				t.Fatalf("purged %d messages, want the %d the relay published", purged, n)
			}

			// The service boots again: Republish, then the relay.
			const grace = 50 * time.Millisecond
			rp, err := outbox.NewRepublisher(db.DB, outbox.RepublisherConfig{TrackedTopics: outbox.NewTrackedTopics(topic), Grace: grace})
			if err != nil {
				t.Fatal(err)
			}
			time.Sleep(2 * grace) // published longer than the grace ago
			republished, err := rp.Republish(ctx)
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("republished %d", republished)
			drainAll(t, f)

			inbox, err := outbox.NewInbox(app, outbox.InboxConfig{ConsumerName: consumerName, MarkOutboxProcessed: true})
			if err != nil {
				t.Fatal(err)
			}
			oc := &orderConsumer{insertEffect: app.Rebind("INSERT INTO effects (order_id, message_id, applied_us) VALUES (?, ?, ?)")}
			runID := testdb.RandomName()
			c := startConsumer(t, consumerConfig{
				name: "proof-republish", instances: 1, prefetch: 10, topic: topic, queue: queue, exchange: b.Exchange,
				marshaler: wamqp.DefaultMarshaler{}, inbox: inbox, handle: oc.handle,
				connName: func(i int) string { return "proof-" + runID + "-consumer" },
			})
			var effects int
			waitUntil(15*time.Second, func() bool {
				return db.Get(&effects, "SELECT COUNT(*) FROM effects") == nil && effects >= n
			})
			time.Sleep(500 * time.Millisecond) // a duplicate would show by now
			c.close()

			var rows []struct {
				OrderID string `db:"order_id"`
				MsgID   string `db:"message_id"`
			}
			if err := db.Select(&rows, "SELECT order_id, message_id FROM effects"); err != nil {
				t.Fatal(err)
			}
			got := map[string]int{}
			for _, r := range rows {
				if placed[r.OrderID] != r.MsgID {
					t.Errorf("effect of %s carries message %s, want %s", r.OrderID, r.MsgID, placed[r.OrderID])
				}
				got[r.OrderID]++
			}
			for id := range placed {
				if got[id] != 1 {
					t.Errorf("order %s: %d effects after its message was lost by the broker and Republish ran, want 1", id, got[id])
				}
			}
			var unprocessed int
			if err := db.Get(&unprocessed, "SELECT COUNT(*) FROM acemq_outbox WHERE processed_at IS NULL"); err != nil {
				t.Fatal(err)
			}
			if unprocessed != 0 {
				t.Errorf("%d outbox rows no consumer marked processed", unprocessed)
			}
		})
	}
}

// Without any chaos the relay puts each record on the broker exactly once.
// The chaos run cannot check this: it makes duplicates on purpose (a relay
// dies between confirm and mark) and the inbox absorbs every copy, so a
// relay that published some records twice on its own passes it, the inbox
// doing work it should not have to and the table merely counting a few more
// "duplicates absorbed". Run, pipelined, as a service runs it.
func TestEndToEnd_Relay_NoChaos_EachRecordOnTheBrokerExactlyOnce(t *testing.T) {
	const n = 500
	ctx := context.Background()
	db, b, app := orderRig(t, testdb.Postgres)
	queue := b.Queue(topic)

	placed := placeOrders(t, app, b.Exchange, n, 25)
	dest := amqpDest(t)
	f, err := outbox.NewForwarder(db.DB, dest, outbox.ForwarderConfig{BatchSize: 25, PollInterval: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- f.Run(runCtx) }()
	var st outbox.Stats
	drained := waitUntil(30*time.Second, func() bool {
		s, err := f.Store().Stats(ctx)
		st = s
		return err == nil && s.Pending == 0
	})
	stop()
	if err := <-done; err != nil {
		t.Errorf("Run: %v", err)
	}
	if err := f.Close(); err != nil {
		t.Errorf("Close: %v", err)
	}
	if !drained {
		t.Fatalf("the outbox did not drain within 30 s: %+v", st)
	}

	got := b.Drain(queue, n, 10*time.Second)
	seen := map[string]int{}
	for _, d := range got {
		seen[d.MessageId]++
	}
	want := map[string]bool{}
	for _, msgID := range placed {
		want[msgID] = true
		if seen[msgID] != 1 {
			t.Errorf("message %s on the broker %d times, want exactly once", msgID, seen[msgID])
		}
	}
	for id := range seen {
		if !want[id] {
			t.Errorf("message %s on the broker, but no order published it", id)
		}
	}
	if len(got) != n {
		t.Errorf("%d messages on the broker for %d records, want %d", len(got), n, n)
	}
}

// The broker refuses messages (the queue is full and rejects publishes,
// x-overflow reject-publish: RabbitMQ nacks them): the relay must not mark
// a refused record published, and sends it again until the consumer made
// room. The chaos run never has the broker refuse anything (its "random
// nacks" are the consumers'), so it passes a relay that marks a record
// published on a nack, or without waiting for the confirm at all; here
// those records are lost.
func TestEndToEnd_BrokerRefusesPublishes_RefusedRecordsSentAgainEachAppliedOnce(t *testing.T) {
	const n, room = 20, 5
	ctx := context.Background()
	db, b, app := orderRig(t, testdb.Postgres)
	args := amqp.Table{"x-max-length": int32(room), "x-overflow": "reject-publish"}
	queue := "test-q-" + testdb.RandomName()
	b.With(func(ch *amqp.Channel) error {
		if _, err := ch.QueueDeclare(queue, true, false, false, false, args); err != nil {
			return err
		}
		return ch.QueueBind(queue, topic, b.Exchange, false, nil)
	})
	t.Cleanup(func() {
		b.With(func(ch *amqp.Channel) error { _, err := ch.QueueDelete(queue, false, false, false); return err })
	})
	placed := placeOrders(t, app, b.Exchange, n, 4)

	dest := amqpDest(t)
	f, err := outbox.NewForwarder(db.DB, dest, outbox.ForwarderConfig{
		BatchSize: 4, PollInterval: 50 * time.Millisecond, RetryMin: 20 * time.Millisecond, RetryMax: 200 * time.Millisecond, MaxAttempts: 1000,
	})
	if err != nil {
		t.Fatal(err)
	}
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- f.Run(runCtx) }()
	t.Cleanup(func() {
		stop()
		<-done
		_ = f.Close()
	})

	// The queue fills; the rest is refused, and must stay unpublished.
	if !waitUntil(10*time.Second, func() bool { return b.Count(queue) >= room }) {
		t.Fatalf("the queue never filled: %d messages", b.Count(queue))
	}
	time.Sleep(time.Second) // the relay tries the refused ones again meanwhile
	var published int
	if err := db.Get(&published, "SELECT COUNT(*) FROM acemq_outbox WHERE published_at IS NOT NULL"); err != nil {
		t.Fatal(err)
	}
	if published > room {
		t.Errorf("%d rows marked published while the broker holds %d and refused the rest", published, b.Count(queue))
	}

	inbox, err := outbox.NewInbox(app, outbox.InboxConfig{ConsumerName: consumerName, MarkOutboxProcessed: true})
	if err != nil {
		t.Fatal(err)
	}
	oc := &orderConsumer{insertEffect: app.Rebind("INSERT INTO effects (order_id, message_id, applied_us) VALUES (?, ?, ?)")}
	runID := testdb.RandomName()
	c := startConsumer(t, consumerConfig{
		name: "proof-refused", instances: 1, prefetch: 1, topic: topic, queue: queue, exchange: b.Exchange,
		marshaler: wamqp.DefaultMarshaler{}, inbox: inbox, handle: oc.handle, queueArgs: args,
		connName: func(i int) string { return "proof-" + runID + "-consumer" },
	})
	var effects int
	waitUntil(30*time.Second, func() bool {
		return db.Get(&effects, "SELECT COUNT(*) FROM effects") == nil && effects >= n
	})
	time.Sleep(500 * time.Millisecond)
	c.close()

	var rows []struct {
		OrderID string `db:"order_id"`
	}
	if err := db.Select(&rows, "SELECT order_id FROM effects"); err != nil {
		t.Fatal(err)
	}
	got := map[string]int{}
	for _, r := range rows {
		got[r.OrderID]++
	}
	for id := range placed {
		if got[id] != 1 {
			t.Errorf("order %s: %d effects, want 1 (the broker refused its message at first)", id, got[id])
		}
	}
}
