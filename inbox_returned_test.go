package outbox_test

import (
	"context"
	"database/sql"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	amqp "github.com/rabbitmq/amqp091-go"
	"go.opentelemetry.io/otel/propagation"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testamqp"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// The most common Watermill shape: a handler added with a publish topic and
// a publisher returns the message it produces. A router publish after the
// inbox's commit can fail; the nack brings a redelivery that is a duplicate
// and would produce nothing, so the message would be lost. Under the inbox
// the returned message is an outbox row of the handler's transaction: the
// router's publisher (here one whose first call fails) is never called, the
// row is there once, and the relay delivers it once.
func TestInbox_Router_RouterPublishWouldFailAfterCommit_ReturnedMessageInOutboxOnceAndDelivered(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		createEffects(t, db)
		b := testamqp.New(t)
		input := b.Queue()
		shipped := b.Queue("shipping.order.shipped")
		in := newInbox(t, db, outbox.InboxConfig{ConsumerName: "ship-orders", Outbox: outbox.TxPublisherConfig{
			TopicMapper: func(topic string) (string, string) { return b.Exchange, "shipping." + topic },
		}})

		router := newRouter(t)
		var handled atomic.Int32 // deliveries the inbox let the router ack
		router.AddMiddleware(countSucceeded(&handled), in.Middleware)
		var ran atomic.Int32
		effect := writeEffect(t, db, &ran)
		pub := &failingOncePublisher{}
		router.AddHandler("ship-orders", input, amqpSubscriber(t), "order.shipped", pub, func(msg *message.Message) ([]*message.Message, error) {
			if _, err := effect(msg); err != nil {
				return nil, err
			}
			return []*message.Message{message.NewMessage("shipped-"+msg.UUID, []byte("shipped"))}, nil
		})
		startRouter(t, router)

		id := "order-" + testdb.RandomName()
		for range 2 { // the message, and the broker delivering it again
			publishRaw(t, b, input, id)
		}
		waitFor(t, 20*time.Second, "both deliveries to be acked", func() bool { return handled.Load() >= 2 })

		if n := pub.calls.Load(); n != 0 {
			t.Errorf("the router's publisher was called %d times, want never", n)
		}
		if ran.Load() != 1 || countEffects(t, db, id) != 1 || countProcessed(t, db, id) != 1 {
			t.Errorf("handler ran %d times, %d effects, %d keys; want 1 each", ran.Load(), countEffects(t, db, id), countProcessed(t, db, id))
		}
		if n := countRows(t, db); n != 1 {
			t.Fatalf("%d outbox rows, want the returned message once", n)
		}
		var dest struct {
			Exchange   string `db:"exchange_name"`
			RoutingKey string `db:"routing_key"`
		}
		if err := db.Get(&dest, db.Rebind("SELECT exchange_name, routing_key FROM acemq_outbox WHERE id = ?"), "shipped-"+id); err != nil {
			t.Fatalf("the returned message's row: %v", err)
		}
		if dest.Exchange != b.Exchange || dest.RoutingKey != "shipping.order.shipped" {
			t.Errorf("row goes to exchange %q routing key %q, want %q and the mapped publish topic", dest.Exchange, dest.RoutingKey, b.Exchange)
		}

		if n := sweepAll(t, newForwarder(t, db, outbox.ForwarderConfig{})); n != 1 {
			t.Errorf("the relay published %d, want 1", n)
		}
		got := countIDs(b.Drain(shipped, 1, 10*time.Second))
		if len(got) != 1 || got["shipped-"+id] != 1 {
			t.Errorf("broker delivered %v, want shipped-%s once", got, id)
		}
	})
}

// Wired wrong, loudly: a handler not behind the inbox's middleware but
// registered with its publisher returns a message; the router's publish
// fails with ErrNotUnderInbox and nacks, so the message is neither written,
// nor sent, nor dropped. One database shows it: the property is the
// publisher's, which touches none.
func TestInbox_PublisherWithoutMiddleware_PublishFailsNotUnderInboxNothingWrittenSentOrDropped(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.SQLite)
	b := testamqp.New(t)
	input := b.Queue()
	shipped := b.Queue("order.shipped")
	in := newInbox(t, db, outbox.InboxConfig{Outbox: outbox.TxPublisherConfig{Exchange: b.Exchange}})
	pub := &recordingPublisher{next: in.Publisher()}

	router := newRouter(t)
	var ran atomic.Int32
	router.AddHandler("ship-orders", input, amqpSubscriber(t), "order.shipped", pub, func(msg *message.Message) ([]*message.Message, error) {
		ran.Add(1)
		return []*message.Message{message.NewMessage("shipped-"+msg.UUID, []byte("shipped"))}, nil
	})
	stop := startRouter(t, router)
	id := "order-" + testdb.RandomName()
	publishRaw(t, b, input, id)
	waitFor(t, 20*time.Second, "the message to be nacked and delivered again", func() bool { return ran.Load() >= 2 })
	stop()

	errs := pub.errors()
	if len(errs) == 0 || !errors.Is(errs[0], outbox.ErrNotUnderInbox) {
		t.Fatalf("the router's publish returned %v, want ErrNotUnderInbox", errs)
	}
	if !strings.Contains(errs[0].Error(), "Inbox.Middleware") {
		t.Errorf("error %q does not say what is missing", errs[0])
	}
	if countRows(t, db) != 0 || countProcessed(t, db, id) != 0 {
		t.Errorf("%d outbox rows, %d keys; want none", countRows(t, db), countProcessed(t, db, id))
	}
	if n := b.Count(shipped); n != 0 {
		t.Errorf("%d messages reached the broker, want none", n)
	}
	waitFor(t, 10*time.Second, "the unacked message to be back in its queue", func() bool { return b.Count(input) == 1 })
	if err := in.Publisher().Close(); err != nil { // the router closed it once already
		t.Errorf("closing the inbox's publisher again: %v", err)
	}
}

// The middleware called outside a router (or a handler added without a
// publish topic) has nowhere to write what the handler returns: an error
// that says so, and the effect, the key and any row rolled back.
func TestInbox_ReturnedMessagesWithoutPublishTopic_ErrorAndEverythingRolledBack(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		createEffects(t, db)
		var ran atomic.Int32
		effect := writeEffect(t, db, &ran)
		h := newInbox(t, db, outbox.InboxConfig{}).Middleware(func(msg *message.Message) ([]*message.Message, error) {
			if _, err := effect(msg); err != nil {
				return nil, err
			}
			return []*message.Message{message.NewMessage(watermill.NewUUID(), []byte("x"))}, nil
		})
		msg := message.NewMessage(watermill.NewUUID(), []byte("x"))
		out, err := h(msg)
		if err == nil || !strings.Contains(err.Error(), "no publish topic") {
			t.Fatalf("err = %v, want one saying the handler has no publish topic", err)
		}
		if len(out) != 0 {
			t.Errorf("the middleware returned %d messages to the router, want none", len(out))
		}
		if ran.Load() != 1 || countEffects(t, db, msg.UUID) != 0 || countProcessed(t, db, msg.UUID) != 0 || countRows(t, db) != 0 {
			t.Errorf("handler ran %d times, left %d effects, %d keys, %d rows; want 1 run and nothing left",
				ran.Load(), countEffects(t, db, msg.UUID), countProcessed(t, db, msg.UUID), countRows(t, db))
		}
	})
}

// A message returned without a context of its own is written with the
// handler's, so the row carries the trace the handler ran under, in either
// mode of the inbox; Exchange and the publish topic name its destination.
// InboxConfig.Propagator alone carries it on too: the returned messages
// had no trace unless Outbox.Propagator was set as well (an API review).
func TestInbox_Router_ReturnedMessageWithoutContext_RowCarriesHandlersTrace(t *testing.T) {
	const traceID = "4bf92f3577b34da6a3ce929d0e0e4736"
	for _, c := range []struct {
		name                  string
		atMostOnce, inboxOnly bool
	}{{"transactional", false, false}, {"at-most-once", true, false}, {"inbox-propagator-only", false, true}} {
		atMostOnce := c.atMostOnce
		t.Run(c.name, func(t *testing.T) {
			db := migrated(t, testdb.SQLite)
			returned := outbox.TxPublisherConfig{Exchange: "shop-events", Propagator: propagation.TraceContext{}}
			if c.inboxOnly {
				returned.Propagator = nil
			}
			in := newInbox(t, db, outbox.InboxConfig{AtMostOnce: atMostOnce, Propagator: propagation.TraceContext{}, Outbox: returned})
			ps := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
			router := newRouter(t)
			router.AddMiddleware(in.Middleware)
			router.AddHandler("ship-orders", "order.paid", ps, "order.shipped", in.Publisher(), func(msg *message.Message) ([]*message.Message, error) {
				if _, inTx := outbox.TxFromContext(msg.Context()); inTx == atMostOnce {
					return nil, errors.New("transaction in the handler's context: want one exactly when not at-most-once")
				}
				return []*message.Message{message.NewMessage("shipped-1", []byte("x"))}, nil
			})
			startRouter(t, router)

			msg := message.NewMessage(watermill.NewUUID(), []byte("x"))
			msg.Metadata.Set("traceparent", "00-"+traceID+"-00f067aa0ba902b7-01")
			if err := ps.Publish("order.paid", msg); err != nil {
				t.Fatal(err)
			}
			waitFor(t, 10*time.Second, "the returned message's row", func() bool { return countRows(t, db) == 1 })
			var row struct {
				Exchange   string `db:"exchange_name"`
				RoutingKey string `db:"routing_key"`
				Headers    string `db:"headers"`
			}
			if err := db.Get(&row, "SELECT exchange_name, routing_key, headers FROM acemq_outbox WHERE id = 'shipped-1'"); err != nil {
				t.Fatal(err)
			}
			if row.Exchange != "shop-events" || row.RoutingKey != "order.shipped" {
				t.Errorf("row goes to exchange %q routing key %q, want shop-events and the publish topic", row.Exchange, row.RoutingKey)
			}
			if !strings.Contains(row.Headers, traceID) {
				t.Errorf("row headers %s lack the handler's trace %s", row.Headers, traceID)
			}
		})
	}
}

// SQLite: a handler whose transaction SQLite rolled back (an interrupted
// statement, a full disk) and that took the error returns a message. The
// connection is then outside any transaction, and the returned message's
// row committed on its own, to be sent, while the COMMIT that followed
// failed and the delivery, nacked, ran again and returned it again. The
// inbox now fails the delivery before it writes the message.
func TestInbox_SQLiteTransactionEndedUnderTheHandler_ReturnedMessagesNotWritten(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.SQLite)
	err := routedDeliveryFailure(t, newInbox(t, db, outbox.InboxConfig{}), func(msg *message.Message) ([]*message.Message, error) {
		tx, _ := outbox.TxFromContext(msg.Context())
		// As SQLite does after an interrupt: the transaction is gone, the
		// handler's error taken.
		_, _ = tx.Exec("ROLLBACK")
		return []*message.Message{message.NewMessage("shipped-"+msg.UUID, []byte("x"))}, nil
	})
	if !errors.Is(err, outbox.ErrTxRolledBackUnderHandler) {
		t.Errorf("delivery failed with %v, want ErrTxRolledBackUnderHandler", err)
	}
	if n := countRows(t, db); n != 0 {
		t.Errorf("%d outbox rows committed for a delivery whose transaction was gone, want 0", n)
	}
}

// A handler that returns a message carrying on its delivery's metadata,
// an application's own aggregateId without seq among it, on an inbox that
// orders nothing: the message is written as it is and the delivery acked.
// Publish's refusal of such metadata (the caller's mistake) failed every
// delivery here, 47,034 in 5 s (a code review).
func TestInbox_ReturnedMessageWithAnAggregateIDOfItsOwn_WrittenDeliveryAcked(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.SQLite)
	in := newInbox(t, db, outbox.InboxConfig{ConsumerName: "returns-app-key"})
	ps := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	var failed atomic.Int32
	r := newRouter(t)
	r.AddMiddleware(func(h message.HandlerFunc) message.HandlerFunc {
		return func(m *message.Message) ([]*message.Message, error) {
			out, err := h(m)
			if err != nil {
				failed.Add(1)
			}
			return out, err
		}
	}, in.Middleware)
	r.AddHandler("ship", "order.paid", ps, "order.shipped", in.Publisher(), func(msg *message.Message) ([]*message.Message, error) {
		out := message.NewMessage("out-"+msg.UUID, msg.Payload)
		for k, v := range msg.Metadata {
			out.Metadata.Set(k, v)
		}
		return []*message.Message{out}, nil
	})
	startRouter(t, r)
	m := message.NewMessage(watermill.NewUUID(), []byte("x"))
	m.Metadata.Set(outbox.HeaderAggregateID, "order-1") // the application's own
	if err := ps.Publish("order.paid", m); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "the returned message's row", func() bool { return countRows(t, db) == 1 })
	if n := failed.Load(); n != 0 {
		t.Errorf("%d failed deliveries, want none", n)
	}
}

// A handler that commits (or rolls back) the transaction TxFromContext gave
// it and returns messages fails its delivery with ErrHandlerTxDone, which
// names the mistake, on every database: it failed with database/sql's bare
// "transaction has already been committed or rolled back", or on MySQL and
// SQLite with "read back the key".
func TestInbox_HandlerEndsItsTransaction_FailsNamingIt(t *testing.T) {
	t.Parallel()
	for _, end := range []string{"commit", "rollback"} {
		t.Run(end, func(t *testing.T) {
			eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
				err := routedDeliveryFailure(t, newInbox(t, db, outbox.InboxConfig{}), func(msg *message.Message) ([]*message.Message, error) {
					tx, _ := outbox.TxFromContext(msg.Context())
					var err error
					if end == "commit" {
						err = tx.Commit()
					} else {
						err = tx.Rollback()
					}
					if err != nil {
						return nil, err
					}
					return []*message.Message{message.NewMessage("shipped-"+msg.UUID, []byte("x"))}, nil
				})
				if !errors.Is(err, outbox.ErrHandlerTxDone) {
					t.Errorf("delivery failed with %v, want ErrHandlerTxDone", err)
				}
			})
		})
	}
}

// A delivery whose context ends while its handler runs (a Timeout
// middleware's deadline) has its transaction rolled back by database/sql,
// and fails with ErrHandlerTxDone that also matches the context's cause:
// errors.Is(err, context.DeadlineExceeded) did not find it (an API
// review). SQLite's statements do not end with the delivery's context.
func TestInbox_DeliveryContextEndsUnderTheHandler_ErrorMatchesItsCause(t *testing.T) {
	t.Parallel()
	for _, kind := range []string{testdb.Postgres, testdb.MySQL} {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			db := migrated(t, kind)
			h := newInbox(t, db, outbox.InboxConfig{ConsumerName: "timed"}).Middleware(func(msg *message.Message) ([]*message.Message, error) {
				<-msg.Context().Done()
				tx, _ := outbox.TxFromContext(msg.Context())
				// database/sql rolls the transaction back on a goroutine of
				// its own once the context ends: wait for it.
				for tx.Tx.QueryRowContext(context.Background(), "SELECT 1").Scan(new(int)) == nil {
					time.Sleep(time.Millisecond)
				}
				return nil, nil
			})
			msg := message.NewMessage(watermill.NewUUID(), []byte("x"))
			ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
			defer cancel()
			msg.SetContext(ctx)
			_, err := h(msg)
			if !errors.Is(err, outbox.ErrHandlerTxDone) || !errors.Is(err, context.DeadlineExceeded) {
				t.Errorf("delivery failed with %v, want ErrHandlerTxDone and context.DeadlineExceeded", err)
			}
		})
	}
}

// The same for an ordered inbox on the path that reads the key first (the
// key holds messages): the statements after the handler, which clear the
// held messages and advance the key, failed with database/sql's bare error
// on PostgreSQL and SQLite. A message the redelivery then finds applied is
// a duplicate, as on every path.
func TestOrderedInbox_HandlerEndsItsTransaction_KeyHoldingMessages_FailsNamingIt(t *testing.T) {
	t.Parallel()
	for _, end := range []string{"commit", "rollback"} {
		t.Run(end, func(t *testing.T) {
			eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
				h := orderedInbox(t, db, outbox.InboxConfig{}).Middleware(func(msg *message.Message) ([]*message.Message, error) {
					tx, _ := outbox.TxFromContext(msg.Context())
					if end == "commit" {
						return nil, tx.Commit()
					}
					return nil, tx.Rollback()
				})
				if _, err := h(keyedMsg("k", 3)); err != nil { // held: the key holds a message
					t.Fatal(err)
				}
				if _, err := h(keyedMsg("k", 1)); !errors.Is(err, outbox.ErrHandlerTxDone) {
					t.Errorf("seq 1 of a key holding a message: %v, want ErrHandlerTxDone", err)
				}
			})
		})
	}
}

// InboxConfig.Outbox takes its dialect and table from the inbox, whose
// transaction the rows go through: another value is refused, naming the
// field, and so is an invalid publisher setting.
func TestNewInbox_OutboxConfigAtOddsWithInbox_ConfigErrorNamesField(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.SQLite)
	for field, cfg := range map[string]outbox.InboxConfig{
		"Outbox.Dialect":  {Outbox: outbox.TxPublisherConfig{Dialect: outbox.Postgres}},
		"Outbox.Table":    {Outbox: outbox.TxPublisherConfig{Table: "other_outbox"}},
		"Outbox.Exchange": {Outbox: outbox.TxPublisherConfig{Exchange: "\xff"}},
	} {
		_, err := outbox.NewInbox(db.DB, cfg)
		var ce *outbox.ConfigError
		if !errors.As(err, &ce) || ce.Field != field {
			t.Errorf("%s: err = %v, want a *ConfigError naming %s", field, err, field)
		}
	}
	if _, err := outbox.NewInbox(db.DB, outbox.InboxConfig{OutboxTable: "app_outbox",
		Outbox: outbox.TxPublisherConfig{Dialect: outbox.SQLite, Table: "app_outbox"}}); err != nil {
		t.Errorf("the inbox's own dialect and table, repeated: %v", err)
	}
}

// An isolation level database/sql names but the databases' drivers refuse
// at BEGIN (PostgreSQL's and MySQL's; SQLite's ignores it) is refused by
// NewInbox, naming the field: it was taken, and every delivery then failed
// at BEGIN and was nacked for ever.
func TestNewInbox_IsolationNoDriverTakes_ConfigErrorNamesField(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.SQLite)
	for _, iso := range []sql.IsolationLevel{sql.LevelLinearizable, sql.LevelSnapshot, sql.LevelWriteCommitted, sql.IsolationLevel(99)} {
		_, err := outbox.NewInbox(db.DB, outbox.InboxConfig{ConsumerName: "c", Isolation: iso})
		var ce *outbox.ConfigError
		if !errors.As(err, &ce) || ce.Field != "Isolation" {
			t.Errorf("%v: err = %v, want a *ConfigError naming Isolation", iso, err)
		}
	}
	for _, iso := range []sql.IsolationLevel{sql.LevelDefault, sql.LevelReadCommitted, sql.LevelRepeatableRead, sql.LevelSerializable} {
		if _, err := outbox.NewInbox(db.DB, outbox.InboxConfig{ConsumerName: "c", Isolation: iso}); err != nil {
			t.Errorf("%v: %v", iso, err)
		}
	}
}

// routedDeliveryFailure runs one message through a router handler h
// behind in, with a publish topic for what h returns, and returns the error
// the delivery failed with; it fails the test if the delivery does not
// fail within 10 s.
func routedDeliveryFailure(t *testing.T, in *outbox.Inbox, h message.HandlerFunc) error {
	t.Helper()
	ps := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	router := newRouter(t)
	failed := make(chan error, 1)
	router.AddMiddleware(func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			out, err := h(msg)
			if err != nil {
				select {
				case failed <- err:
				default:
				}
			}
			return out, err
		}
	}, in.Middleware)
	router.AddHandler("ship-orders", "order.paid", ps, "order.shipped", in.Publisher(), h)
	startRouter(t, router)
	if err := ps.Publish("order.paid", message.NewMessage(watermill.NewUUID(), []byte("x"))); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-failed:
		return err
	case <-time.After(10 * time.Second):
		t.Fatal("the delivery did not fail")
		return nil
	}
}

// newRouter returns a router that logs only with OUTBOX_TEST_DEBUG.
func newRouter(t testing.TB) *message.Router {
	t.Helper()
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	return router
}

// startRouter runs router and returns once it runs; the returned stop (also
// run when the test ends) closes it and waits for Run to return.
func startRouter(t testing.TB, router *message.Router) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = router.Run(ctx)
	}()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			_ = router.Close()
			<-done
		})
	}
	t.Cleanup(stop)
	<-router.Running()
	return stop
}

// amqpSubscriber is a watermill-amqp subscriber of durable queues named by
// the topic, reading AceMQ messages with AMQPMarshaler.
func amqpSubscriber(t testing.TB) message.Subscriber {
	t.Helper()
	sub, err := newAMQPSubscriber()
	if err != nil {
		t.Fatal(err)
	}
	return sub
}

func newAMQPSubscriber() (message.Subscriber, error) {
	cfg := wamqp.NewDurableQueueConfig(testdb.AMQPURL())
	cfg.Marshaler = outbox.AMQPMarshaler{}
	return wamqp.NewSubscriber(cfg, watermill.NopLogger{})
}

// publishRaw sends a persistent message of id straight to queue, as any
// AceMQ relay sends it: the id as message_id and x-acemq-id.
func publishRaw(t testing.TB, b *testamqp.Broker, queue, id string) {
	t.Helper()
	b.With(func(ch *amqp.Channel) error {
		return ch.PublishWithContext(context.Background(), "", queue, true, false, amqp.Publishing{
			MessageId: id, Headers: amqp.Table{outbox.HeaderMessageID: id},
			DeliveryMode: amqp.Persistent, Body: []byte(id),
		})
	})
}

// countSucceeded is a middleware that counts the deliveries its handler
// returned no error for: those the router goes on to ack.
func countSucceeded(n *atomic.Int32) message.HandlerMiddleware {
	return func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			out, err := h(msg)
			if err == nil {
				n.Add(1)
			}
			return out, err
		}
	}
}

// failingOncePublisher stands for the router's broker publisher in the
// wiring the inbox replaces: its first publish fails, as a broker
// connection lost between the inbox's commit and the router's publish
// would; it counts every call.
type failingOncePublisher struct{ calls atomic.Int32 }

func (p *failingOncePublisher) Publish(string, ...*message.Message) error {
	if p.calls.Add(1) == 1 {
		return errors.New("broker connection lost after the handler committed")
	}
	return nil
}

func (p *failingOncePublisher) Close() error { return nil }

// recordingPublisher records the errors of next's Publish, which the router
// only logs.
type recordingPublisher struct {
	next message.Publisher
	mu   sync.Mutex
	errs []error
}

func (p *recordingPublisher) Publish(topic string, msgs ...*message.Message) error {
	err := p.next.Publish(topic, msgs...)
	if err != nil {
		p.mu.Lock()
		p.errs = append(p.errs, err)
		p.mu.Unlock()
	}
	return err
}

func (p *recordingPublisher) Close() error { return p.next.Close() }

func (p *recordingPublisher) errors() []error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]error(nil), p.errs...)
}

// A message published with a routing-key override reached its consumer
// with the override in its metadata, and a handler that builds its output
// with msg.Copy() (Watermill's idiom, which copies metadata) had it
// written to the incoming message's routing key, not its publish topic:
// here back into its own input queue, a loop. The publisher's steering
// keys are the row's columns now, not headers. (From an audit.)
func TestInbox_ReturnedCopyOfASteeredMessage_GoesToThePublishTopic(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.Postgres)
	b := testamqp.New(t)
	input := b.Queue("order.placed")
	shipped := b.Queue("order.shipped")
	placed := message.NewMessage("placed-"+testdb.RandomName(), []byte("o-1"))
	placed.Metadata.Set(outbox.MetadataRoutingKey, "order.placed")
	placed.Metadata.Set(outbox.MetadataAggregateID, "order-1")
	publishInTx(t, db, "orders", []*message.Message{placed}, outbox.TxPublisherConfig{Exchange: b.Exchange})
	fwd := newForwarder(t, db, outbox.ForwarderConfig{})
	if n := sweepAll(t, fwd); n != 1 {
		t.Fatalf("relayed %d, want 1", n)
	}

	in := newInbox(t, db, outbox.InboxConfig{ConsumerName: "ship", Outbox: outbox.TxPublisherConfig{Exchange: b.Exchange}})
	router := newRouter(t)
	var acked atomic.Int32
	var received message.Metadata
	router.AddMiddleware(countSucceeded(&acked), in.Middleware)
	router.AddHandler("ship", input, amqpSubscriber(t), "order.shipped", in.Publisher(), func(msg *message.Message) ([]*message.Message, error) {
		received = msg.Metadata
		out := msg.Copy()
		out.UUID = "shipped-" + msg.UUID
		return []*message.Message{out}, nil
	})
	startRouter(t, router)
	waitFor(t, 20*time.Second, "the delivery to be acked", func() bool { return acked.Load() >= 1 })
	for _, k := range []string{outbox.MetadataRoutingKey, outbox.MetadataAggregateID, outbox.MetadataExchange} {
		if v, ok := received[k]; ok {
			t.Errorf("the consumer received the publisher's %s = %q", k, v)
		}
	}
	var rk string
	var key sql.NullString
	if err := db.QueryRow(db.Rebind("SELECT routing_key, aggregate_id FROM acemq_outbox WHERE id = ?"), "shipped-"+placed.UUID).Scan(&rk, &key); err != nil {
		t.Fatal(err)
	}
	if rk != "order.shipped" || key.Valid {
		t.Errorf("the returned copy was written to routing key %q under key %v, want order.shipped and no key", rk, key)
	}
	if n := sweepAll(t, fwd); n != 1 {
		t.Fatalf("relayed %d of the returned message, want 1", n)
	}
	got := b.Drain(shipped, 1, 10*time.Second)
	if len(got) != 1 {
		t.Fatalf("%d copies in order.shipped, want 1", len(got))
	}
	// The delivery it copied was keyed: the copy, unkeyed, must not carry
	// the original's key and number to an ordered inbox downstream.
	if received[outbox.HeaderAggregateID] != "order-1" || received[outbox.HeaderSeq] != "1" {
		t.Fatalf("the consumer received aggregateId %q seq %q, want order-1 and 1", received[outbox.HeaderAggregateID], received[outbox.HeaderSeq])
	}
	for _, k := range []string{outbox.HeaderAggregateID, outbox.HeaderSeq} {
		if v, ok := got[0].Headers[k]; ok {
			t.Errorf("the unkeyed copy went out with header %s = %v, its original's", k, v)
		}
	}
}
