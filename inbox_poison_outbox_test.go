package outbox_test

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testamqp"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// poisonOutboxRouter runs, until the test ends, the README's chain with
// PoisonOutbox for poisonTopic, over a handler that always fails, on
// queue; it returns a channel of the router's messages as delivered and
// how many times the handler ran.
func poisonOutboxRouter(t *testing.T, in *outbox.Inbox, queue, poisonTopic string) (delivered chan *message.Message, runs *atomic.Int32) {
	t.Helper()
	poisonQueue, err := middleware.PoisonQueue(in.PoisonOutbox(), poisonTopic)
	if err != nil {
		t.Fatal(err)
	}
	r := newRouter(t)
	delivered = make(chan *message.Message, 8)
	r.AddMiddleware(
		func(h message.HandlerFunc) message.HandlerFunc {
			return func(msg *message.Message) ([]*message.Message, error) {
				delivered <- msg
				return h(msg)
			}
		},
		poisonQueue,
		middleware.Retry{MaxRetries: 2, InitialInterval: time.Millisecond, ResetContextOnRetry: true}.Middleware,
		middleware.Timeout(30*time.Second),
		in.Middleware,
	)
	r.AddPlugin(in.Plugin())
	runs = new(atomic.Int32)
	r.AddConsumerHandler("fulfil-orders", queue, amqpSubscriber(t), func(*message.Message) error {
		runs.Add(1)
		return errors.New("no such warehouse")
	})
	startRouter(t, r)
	return delivered, runs
}

// ackedWithin waits for the next delivery on delivered to be acked.
func ackedWithin(t *testing.T, delivered chan *message.Message, d time.Duration) {
	t.Helper()
	select {
	case msg := <-delivered:
		select {
		case <-msg.Acked():
		case <-msg.Nacked():
			t.Fatal("the message was nacked, not set aside")
		case <-time.After(d):
			t.Fatal("the message was neither acked nor nacked")
		}
	case <-time.After(d):
		t.Fatal("the message was never delivered")
	}
}

// PoisonOutbox writes the message set aside into the outbox, with its
// record's processed mark, in one transaction; the relay publishes it with
// its confirm. A redelivery set aside again (its ack lost) writes nothing
// more. Through PoisonPublisher(pub), the mark followed whatever pub did:
// watermill-amqp's publisher, with no queue bound to the poison topic, lost
// the message (a review: 22 of 138), its record marked processed.
func TestInbox_PoisonOutbox_SetAsideThroughTheOutbox_RelayPublishesItOnce(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		testdb.Require(t, "amqp")
		b := testamqp.New(t)
		orders, poisoned := b.Queue(), b.Queue("orders.poison")
		id := publishN(t, db, "", "order.placed", 1)[0]
		db.MustExec(db.Rebind("UPDATE acemq_outbox SET published_at = created_at WHERE id = ?"), id) // the relay sent it
		in := newInbox(t, db, outbox.InboxConfig{MarkOutboxProcessed: true, Outbox: outbox.TxPublisherConfig{Exchange: b.Exchange}})
		delivered, runs := poisonOutboxRouter(t, in, orders, "orders.poison")

		publishRaw(t, b, orders, id)
		ackedWithin(t, delivered, 20*time.Second)
		var copies []struct {
			ID       string `db:"id"`
			Exchange string `db:"exchange_name"`
		}
		if err := db.Select(&copies, db.Rebind("SELECT id, exchange_name FROM acemq_outbox WHERE routing_key = ?"), "orders.poison"); err != nil {
			t.Fatal(err)
		}
		if len(copies) != 1 || copies[0].ID == id || copies[0].Exchange != b.Exchange || !outboxStateOf(t, db, id).Processed || runs.Load() != 3 {
			t.Fatalf("after 3 runs (%d): poison rows %+v, record processed %v; want one row of its own id to %s, the record processed",
				runs.Load(), copies, outboxStateOf(t, db, id).Processed, b.Exchange)
		}

		// Delivered again (the ack lost), set aside again: nothing more.
		publishRaw(t, b, orders, id)
		ackedWithin(t, delivered, 20*time.Second)
		f := newForwarder(t, db, outbox.ForwarderConfig{})
		if n := sweepAll(t, f); n != 1 {
			t.Errorf("the relay published %d records, want the one poison copy", n)
		}
		got := b.Drain(poisoned, 1, 5*time.Second)
		if len(got) != 1 || got[0].MessageId != copies[0].ID || got[0].Headers[outbox.PoisonedIDMetadataKey] != id ||
			!strings.Contains(got[0].Headers[middleware.ReasonForPoisonedKey].(string), "no such warehouse") {
			t.Fatalf("the poison queue holds %d messages (%+v); want the copy %s of %s, with its reason", len(got), got, copies[0].ID, id)
		}
		if extra := b.Drain(poisoned, 1, 300*time.Millisecond); len(extra) != 0 {
			t.Errorf("the poison queue holds %d more", len(extra))
		}
	})
}

// A poison topic no queue is bound to: the copy is a record the relay
// cannot route, failed with the broker's reason for outboxctl stuck to
// show, not a message the broker dropped without a word.
func TestInbox_PoisonOutbox_PoisonTopicUnbound_CopyFailsUnroutableInTheOutbox(t *testing.T) {
	t.Parallel()
	testdb.Require(t, "amqp")
	db := migrated(t, testdb.Postgres)
	b := testamqp.New(t)
	orders := b.Queue()
	in := newInbox(t, db, outbox.InboxConfig{MarkOutboxProcessed: true, Outbox: outbox.TxPublisherConfig{Exchange: b.Exchange}})
	delivered, _ := poisonOutboxRouter(t, in, orders, "orders.poison")
	publishRaw(t, b, orders, watermill.NewUUID())
	ackedWithin(t, delivered, 20*time.Second)
	f := newForwarder(t, db, outbox.ForwarderConfig{PublishTimeout: 5 * time.Second})
	_, _ = f.Sweep(context.Background())
	var lastError string
	if err := db.Get(&lastError, "SELECT COALESCE(last_error, '') FROM acemq_outbox WHERE routing_key = 'orders.poison' AND published_at IS NULL AND attempts > 0"); err != nil {
		t.Fatalf("no failed poison copy in the outbox: %v", err)
	}
	if !strings.Contains(lastError, "unroutable") {
		t.Errorf("the poison copy's last error %q; want the broker's unroutable", lastError)
	}
}

// The database drops the connection as the copy is written: the write
// and the mark run again on another, and the message is set aside once.
// Through PoisonPublisher the mark that failed so was only logged, and
// the next boot's Republish sent the message again (a review: 1 of ~40
// set aside while its connections were killed).
func TestInbox_PoisonOutbox_ConnectionLostAsTheCopyIsWritten_WrittenAgainOnce(t *testing.T) {
	t.Parallel()
	testdb.Require(t, "amqp")
	db := migrated(t, testdb.Postgres)
	// The first poison row's insert ends its own connection (a sequence:
	// not rolled back with the transaction).
	db.MustExec(`CREATE SEQUENCE poison_kills`)
	db.MustExec(`CREATE FUNCTION kill_first_poison() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
			IF NEW.routing_key = 'orders.poison' AND nextval('poison_kills') = 1 THEN
				PERFORM pg_terminate_backend(pg_backend_pid());
			END IF;
			RETURN NEW;
		END $$`)
	db.MustExec(`CREATE TRIGGER kill_first_poison BEFORE INSERT ON acemq_outbox FOR EACH ROW EXECUTE FUNCTION kill_first_poison()`)
	b := testamqp.New(t)
	orders := b.Queue()
	id := publishN(t, db, "", "order.placed", 1)[0]
	in := newInbox(t, db, outbox.InboxConfig{MarkOutboxProcessed: true, Outbox: outbox.TxPublisherConfig{Exchange: b.Exchange}})
	delivered, _ := poisonOutboxRouter(t, in, orders, "orders.poison")
	publishRaw(t, b, orders, id)
	ackedWithin(t, delivered, 20*time.Second)
	var kills, copies int
	if err := db.Get(&kills, "SELECT last_value FROM poison_kills"); err != nil {
		t.Fatal(err)
	}
	if err := db.Get(&copies, "SELECT COUNT(*) FROM acemq_outbox WHERE routing_key = 'orders.poison'"); err != nil {
		t.Fatal(err)
	}
	if kills < 2 || copies != 1 || !outboxStateOf(t, db, id).Processed {
		t.Errorf("after %d poison inserts (the first killed): %d poison rows, record processed %v; want 1, processed", kills, copies, outboxStateOf(t, db, id).Processed)
	}
}

// PoisonPublisher's mark of the record, after its publisher took the
// message, on connections the database drops: waited out, the record
// marked. It was only logged, and the next boot's Republish sent the
// message again (a user review: 1 of ~40 with connections killed).
func TestInbox_PoisonPublisher_ConnectionLostAsTheRecordIsMarked_MarkedAfterAll(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.Postgres)
	// Once the poison topic has the message (armed), the next three marks
	// end their connections.
	db.MustExec(`CREATE TABLE mark_armed (armed int)`)
	db.MustExec(`CREATE SEQUENCE mark_kills`)
	db.MustExec(`CREATE FUNCTION kill_marks() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
			IF NEW.processed_at IS NOT NULL AND OLD.processed_at IS NULL AND EXISTS (SELECT 1 FROM mark_armed) AND nextval('mark_kills') <= 3 THEN
				PERFORM pg_terminate_backend(pg_backend_pid());
			END IF;
			RETURN NEW;
		END $$`)
	db.MustExec(`CREATE TRIGGER kill_marks BEFORE UPDATE ON acemq_outbox FOR EACH ROW EXECUTE FUNCTION kill_marks()`)
	id := publishN(t, db, "", "order.placed", 1)[0]
	in := newInbox(t, db, outbox.InboxConfig{MarkOutboxProcessed: true})
	bus := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	poisonBus := gochannel.NewGoChannel(gochannel.Config{BlockPublishUntilSubscriberAck: true}, watermill.NopLogger{})
	poisoned, err := poisonBus.Subscribe(context.Background(), "orders.poison")
	if err != nil {
		t.Fatal(err)
	}
	failingBehindPoisonQueue(t, in, in.PoisonPublisher(poisonBus), bus)
	if err := bus.Publish("orders", message.NewMessage(id, []byte("order"))); err != nil {
		t.Fatal(err)
	}
	select {
	case msg := <-poisoned:
		db.MustExec("INSERT INTO mark_armed VALUES (1)")
		msg.Ack()
	case <-time.After(20 * time.Second):
		t.Fatal("nothing set aside")
	}
	waitFor(t, 20*time.Second, "the record marked processed", func() bool { return outboxStateOf(t, db, id).Processed })
	var kills int
	if err := db.Get(&kills, "SELECT last_value FROM mark_kills"); err != nil || kills < 4 {
		t.Errorf("%d marks tried (%v); want the three killed and another", kills, err)
	}
}

// failingBehindPoisonQueue runs, until the test ends, a router whose
// handler of "orders" on sub always fails, behind PoisonQueue to
// "orders.poison" through poison, the inbox and its plugin.
func failingBehindPoisonQueue(t *testing.T, in *outbox.Inbox, poison message.Publisher, sub message.Subscriber) {
	t.Helper()
	poisonQueue, err := middleware.PoisonQueue(poison, "orders.poison")
	if err != nil {
		t.Fatal(err)
	}
	r := newRouter(t)
	r.AddMiddleware(poisonQueue, in.Middleware)
	r.AddPlugin(in.Plugin())
	r.AddConsumerHandler("fulfil-orders", "orders", sub, func(*message.Message) error { return errors.New("no such warehouse") })
	startRouter(t, r)
}

// poisonRows counts the outbox rows routed to the poison topic.
func poisonRows(t *testing.T, db *testdb.DB, topic string) int {
	t.Helper()
	var n int
	if err := db.Get(&n, db.Rebind("SELECT COUNT(*) FROM acemq_outbox WHERE routing_key = ?"), topic); err != nil {
		t.Fatal(err)
	}
	return n
}

// Two different messages without an id (no UUID, no x-acemq-id: the
// inbox fails them with ErrNoMessageID, and PoisonQueue sets them aside)
// got the same copy id, derived from the consumer and topic alone: the
// second copy's insert found the first's row and was taken for a retry,
// and the second message, acked and logged "set aside", was nowhere.
func TestInbox_PoisonOutbox_TwoMessagesWithoutAnID_BothSetAside(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.Postgres)
	in := newInbox(t, db, outbox.InboxConfig{MarkOutboxProcessed: true, Outbox: outbox.TxPublisherConfig{Exchange: "orders"}})
	bus := gochannel.NewGoChannel(gochannel.Config{BlockPublishUntilSubscriberAck: true}, watermill.NopLogger{})
	failingBehindPoisonQueue(t, in, in.PoisonOutbox(), bus)
	for _, body := range []string{`{"order":1}`, `{"order":2}`} {
		done := make(chan error, 1)
		go func() { done <- bus.Publish("orders", message.NewMessage("", []byte(body))) }()
		select {
		case err := <-done: // BlockPublishUntilSubscriberAck: acked
			if err != nil {
				t.Fatal(err)
			}
		case <-time.After(20 * time.Second):
			t.Fatal("the message without an id was not acked")
		}
	}
	if n := poisonRows(t, db, "orders.poison"); n != 2 {
		t.Fatalf("two different messages without an id set aside (both acked): %d poison rows in the outbox, want 2", n)
	}
}

// Review: the inbox takes messages whose id is not UTF-8 (another
// language's relay on MySQL/SQLite; see markable and InboxKey), and an
// ordered inbox refuses a keyed message whose aggregateId is not UTF-8
// with ErrInvalidKey, which "a router's poison queue middleware can take
// aside". PoisonOutbox copies both into the copy's headers
// (x-acemq-poisoned-id, x-acemq-poisoned-aggregate-id), EncodeHeaders
// refuses them, and Publish fails: PoisonQueue nacks the message, which
// comes back, fails, and is never set aside (a redelivery loop). Likewise
// a delivery carrying RabbitMQ's CC header (sender-selected distribution,
// which the broker keeps on the delivered message): sendable refuses the
// key "CC".
func TestInbox_PoisonOutbox_MetadataTheOutboxCannotCarry_StillSetAside(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.Postgres)
	in := newInbox(t, db, outbox.InboxConfig{MarkOutboxProcessed: true, Outbox: outbox.TxPublisherConfig{Exchange: "orders"}})
	poisoned := func(id string, md map[string]string) *message.Message {
		msg := message.NewMessage(id, []byte(`{"order":1}`))
		for k, v := range md {
			msg.Metadata.Set(k, v)
		}
		msg.Metadata.Set(middleware.ReasonForPoisonedKey, "no such warehouse")
		msg.SetContext(context.Background())
		return msg
	}
	for name, msg := range map[string]*message.Message{
		"id not UTF-8":          poisoned("ord-\xff\xfe-1", nil),
		"aggregateId not UTF-8": poisoned(watermill.NewUUID(), map[string]string{outbox.HeaderAggregateID: "cust-\xff", outbox.HeaderSeq: "1"}),
		"CC header":             poisoned(watermill.NewUUID(), map[string]string{"CC": "[orders.audit]"}),
		"headers over a frame":  poisoned(watermill.NewUUID(), map[string]string{"trace": strings.Repeat("x", 200<<10)}),
	} {
		t.Run(name, func(t *testing.T) {
			topic := "orders.poison." + testdb.RandomName()
			if err := in.PoisonOutbox().Publish(topic, msg); err != nil {
				t.Fatalf("not set aside (PoisonQueue nacks it, and it comes back for ever): %v", err)
			}
			var headers string
			if err := db.Get(&headers, db.Rebind("SELECT headers FROM acemq_outbox WHERE routing_key = ?"), topic); err != nil {
				t.Fatal(err)
			}
			want := map[string]string{
				"id not UTF-8":          `"x-acemq-poisoned-id-quoted":"\"ord-\\xff\\xfe-1\""`,
				"aggregateId not UTF-8": `"x-acemq-poisoned-aggregate-id-quoted":"\"cust-\\xff\""`,
				"CC header":             `"x-acemq-poisoned-header-CC":"[orders.audit]"`,
				"headers over a frame":  `"x-acemq-poisoned-headers-dropped":"true"`,
			}[name]
			if !strings.Contains(headers, want) || !strings.Contains(headers, "no such warehouse") {
				t.Errorf("the copy's headers %.300s; want %s, and the reason", headers, want)
			}
		})
	}
}
