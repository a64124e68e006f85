package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testamqp"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// foreignRow is an acemq_outbox row as another AceMQ library writes it.
type foreignRow struct {
	id, body, bodyEncoding, contentType, headers string
	payload                                      []byte     // what body stands for
	wire                                         amqp.Table // the headers as an AMQP client reads them
	metadata                                     map[string]string
}

// foreignRows are rows written as seed 000's Rails store writes them
// (headers: JSON.generate(record.headers || {}); a body that is not UTF-8
// base64 with [body].pack("m0")) and with the headers seed 003's relay
// sends ({aggregateId, seq}), and the edges of the typing: integers exact
// beyond 2^53 to the ends of int64, 1.0 a double, the deepest and widest
// header values amqp091-go reads.
func foreignRows() []foreignRow {
	deep, deepWire := strings.Repeat("[", 32)+"1"+strings.Repeat("]", 32), any(int64(1))
	for range 32 {
		deepWire = []any{deepWire}
	}
	wide, wideWire := "["+strings.TrimSuffix(strings.Repeat("0,", 8192), ",")+"]", make([]any, 8192)
	for i := range wideWire {
		wideWire[i] = int64(0)
	}
	return []foreignRow{{
		id: "rails-utf8", body: `{"order":7,"note":"ü"}`, bodyEncoding: "utf-8", contentType: "application/json",
		headers:  `{"attempt":3,"priority":true,"ratio":0.5,"tags":["a","b"],"trace":{"id":"t1"},"note":null}`,
		payload:  []byte(`{"order":7,"note":"ü"}`),
		wire:     amqp.Table{"attempt": int64(3), "priority": true, "ratio": 0.5, "tags": []any{"a", "b"}, "trace": amqp.Table{"id": "t1"}, "note": nil},
		metadata: map[string]string{"attempt": "3", "priority": "true", "ratio": "0.5", "tags": `["a","b"]`, "trace": `{"id":"t1"}`, "note": "null"},
	}, {
		id: "rails-base64", body: "/wABeA==", bodyEncoding: "base64", contentType: "application/octet-stream",
		headers:  `{"tenant":"acme","attempt":1}`,
		payload:  []byte{0xff, 0x00, 0x01, 'x'},
		wire:     amqp.Table{"tenant": "acme", "attempt": int64(1)},
		metadata: map[string]string{"tenant": "acme", "attempt": "1"},
	}, {
		id: "nest-pay-1-7", body: `{"amount":"42.50","currency":"GBP"}`, bodyEncoding: "utf-8", contentType: "application/json",
		headers:  `{"aggregateId":"pay-1","seq":7}`,
		payload:  []byte(`{"amount":"42.50","currency":"GBP"}`),
		wire:     amqp.Table{"aggregateId": "pay-1", "seq": int64(7)},
		metadata: map[string]string{"aggregateId": "pay-1", "seq": "7"},
	}, {
		id: "edges", body: "edges", bodyEncoding: "utf-8", contentType: "text/plain",
		headers: `{"exact":9007199254740993,"max":9223372036854775807,"min":-9223372036854775808,"one":1.0,"deep":` + deep + `,"wide":` + wide + `}`,
		payload: []byte("edges"),
		wire: amqp.Table{"exact": int64(9007199254740993), "max": int64(9223372036854775807), "min": int64(-9223372036854775808),
			"one": float64(1), "deep": deepWire, "wide": wideWire},
		metadata: map[string]string{"exact": "9007199254740993", "max": "9223372036854775807", "min": "-9223372036854775808", "one": "1", "deep": deep, "wide": wide},
	}}
}

// insertForeign writes r into acemq_outbox with the columns and values the
// Rails store gives them, created_at in UTC as ActiveRecord writes it.
func insertForeign(t testing.TB, db *testdb.DB, exchange, routingKey string, r foreignRow) {
	t.Helper()
	q := db.Rebind("INSERT INTO acemq_outbox (id, exchange_name, routing_key, body, body_encoding, content_type, headers, created_at, attempts) VALUES (?, ?, ?, ?, ?, ?, ?, ?, 0)")
	var created any = time.Now().UTC()
	if db.Kind != testdb.Postgres {
		created = time.Now().UTC().Format("2006-01-02 15:04:05.000000")
	}
	if _, err := db.Exec(q, r.id, exchange, routingKey, r.body, r.bodyEncoding, r.contentType, r.headers, created); err != nil {
		t.Fatal(err)
	}
}

// Rows other AceMQ libraries wrote, with headers of every JSON type, are
// published, and an AMQP client without Watermill reads each header with
// the AMQP type and value the JSON wrote: integer int64, other number
// double, boolean, array, table, null void; bodies as their encoding says.
func TestForwarder_ForeignRowsWithTypedHeaders_ArriveWithAMQPTypes(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		b := testamqp.New(t)
		queue := b.Queue("payments")
		rows := foreignRows()
		for _, r := range rows {
			insertForeign(t, db, b.Exchange, "payments", r)
		}
		f := newForwarder(t, db, outbox.ForwarderConfig{})
		if n := sweepAll(t, f); n != len(rows) {
			t.Fatalf("published %d of %d rows", n, len(rows))
		}
		got := map[string]amqp.Delivery{}
		for _, d := range b.Drain(queue, len(rows), 10*time.Second) {
			got[d.MessageId] = d
		}
		for _, r := range rows {
			d, ok := got[r.id]
			if !ok {
				t.Errorf("%s did not arrive", r.id)
				continue
			}
			if string(d.Body) != string(r.payload) || d.ContentType != r.contentType {
				t.Errorf("%s: body %q content type %q, want %q %q", r.id, d.Body, d.ContentType, r.payload, r.contentType)
			}
			if d.Headers[outbox.HeaderMessageID] != r.id || d.Headers[outbox.HeaderWatermillUUID] != r.id {
				t.Errorf("%s: id headers %v %v", r.id, d.Headers[outbox.HeaderMessageID], d.Headers[outbox.HeaderWatermillUUID])
			}
			if len(d.Headers) != len(r.wire)+2 {
				t.Errorf("%s: %d headers, want %d and the two ids", r.id, len(d.Headers), len(r.wire))
			}
			for k, want := range r.wire {
				v, present := d.Headers[k]
				if !present || !reflect.DeepEqual(v, want) {
					t.Errorf("%s: header %s = %.80s (present %v), want %.80s", r.id, k, typed(v), present, typed(want))
				}
			}
		}
	})
}

// typed shows a value with its Go type, as an AMQP client decoded it.
func typed(v any) string { return fmt.Sprintf("%T %v", v, v) }

// The same rows through a watermill-amqp subscriber with AMQPMarshaler:
// each message has the row's id as UUID, its payload, and every header in
// the metadata, a string as it is and any other value as its JSON text.
func TestForwarder_ForeignRowsWithTypedHeaders_WatermillSubscriberWithAMQPMarshalerReadsThem(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		testdb.Require(t, "amqp")
		topic := "estate-" + testdb.RandomName()
		cfg := wamqp.NewDurableQueueConfig(testdb.AMQPURL())
		cfg.Marshaler = outbox.AMQPMarshaler{}
		sub, err := wamqp.NewSubscriber(cfg, watermill.NopLogger{})
		if err != nil {
			t.Fatal(err)
		}
		defer sub.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		msgs, err := sub.Subscribe(ctx, topic) // declares the durable queue named topic
		if err != nil {
			t.Fatal(err)
		}
		defer testamqpDeleteQueue(t, topic)

		rows := foreignRows()
		for _, r := range rows {
			insertForeign(t, db, "", topic, r) // the default exchange routes to the queue named topic
		}
		f := newForwarder(t, db, outbox.ForwarderConfig{})
		if n := sweepAll(t, f); n != len(rows) {
			t.Fatalf("published %d of %d rows", n, len(rows))
		}
		got := map[string]*message.Message{}
		for len(got) < len(rows) {
			select {
			case m := <-msgs:
				m.Ack()
				got[m.UUID] = m
			case <-ctx.Done():
				t.Fatalf("received %d of %d messages", len(got), len(rows))
			}
		}
		for _, r := range rows {
			m, ok := got[r.id]
			if !ok {
				t.Errorf("no message with UUID %s (got %d messages)", r.id, len(got))
				continue
			}
			if string(m.Payload) != string(r.payload) {
				t.Errorf("%s: payload %q, want %q", r.id, m.Payload, r.payload)
			}
			if m.Metadata.Get(outbox.HeaderMessageID) != r.id {
				t.Errorf("%s: x-acemq-id = %q", r.id, m.Metadata.Get(outbox.HeaderMessageID))
			}
			if len(m.Metadata) != len(r.metadata)+1 {
				t.Errorf("%s: %d metadata entries, want %d and x-acemq-id", r.id, len(m.Metadata), len(r.metadata))
			}
			for k, want := range r.metadata {
				if v, present := m.Metadata[k]; !present || v != want {
					t.Errorf("%s: metadata %s = %.80q (present %v), want %.80q", r.id, k, v, present, want)
				}
			}
		}
	})
}

// Under the pipelined Run, a row whose headers decode but, as AMQP field
// values, outgrow the broker's frame (integers take 9 bytes on the wire
// and 2 in the JSON) is stuck at once, never taken for a lost connection;
// the rows around it arrive.
func TestForwarder_Run_TypedHeadersLargerThanTheFrame_StuckAtOnce(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		b := testamqp.New(t)
		queue := b.Queue("ok")
		before := publishN(t, db, b.Exchange, "ok", 5)
		ints := "[" + strings.TrimSuffix(strings.Repeat("0,", 8000), ",") + "]"
		insertRaw(t, db, "wide-headers", b.Exchange, "ok", `{"a":`+ints+`,"b":`+ints+`}`, "utf-8") // 144 KB as AMQP fields
		after := publishN(t, db, b.Exchange, "ok", 5)

		f := newForwarder(t, db, outbox.ForwarderConfig{BatchSize: 4, RetryMin: 10 * time.Millisecond, RetryMax: 50 * time.Millisecond})
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- f.Run(ctx) }()
		waitFor(t, 30*time.Second, "the row to be stuck and the rest published", func() bool {
			return stateOf(t, db, "wide-headers").Attempts == outbox.DefaultMaxAttempts && pendingCount(t, f) == 0
		})
		cancel()
		if err := <-done; err != nil {
			t.Fatal(err)
		}
		if s := stateOf(t, db, "wide-headers"); s.Published || !strings.Contains(s.LastError, "do not fit the broker's frame") {
			t.Errorf("row: %+v, want stuck with last_error about the frame", s)
		}
		got := countIDs(b.Drain(queue, 10, 10*time.Second))
		for _, id := range append(before, after...) {
			if got[id] == 0 {
				t.Fatalf("message %s never arrived (%d of 10)", id, len(got))
			}
		}
	})
}

// A message another AceMQ relay sent, published here by an AMQP client
// without Watermill with only the message_id property and the x-acemq-id
// header, is handled once by a router behind the inbox, with watermill-amqp's
// default marshaler (no UUID: the inbox keys on x-acemq-id) and with
// AMQPMarshaler (UUID from x-acemq-id); its redelivery after a crash
// between commit and ack is acked without running the handler.
func TestInbox_Router_MessageFromAnotherAceMQRelay_HandledOnceRedeliveryAcked(t *testing.T) {
	t.Parallel()
	for _, m := range []struct {
		name      string
		marshaler wamqp.Marshaler
	}{{"default marshaler", wamqp.DefaultMarshaler{}}, {"AMQPMarshaler", outbox.AMQPMarshaler{}}} {
		t.Run(m.name, func(t *testing.T) {
			eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
				testdb.Require(t, "amqp")
				createEffects(t, db)
				cfg := wamqp.NewDurableQueueConfig(testdb.AMQPURL())
				cfg.Marshaler = m.marshaler
				id := "pay-1-captured-" + testdb.RandomName()
				r := deliverCrashingOnce(t, db, cfg, "foreign-"+testdb.RandomName(), id)
				var effects int
				if err := db.Get(&effects, "SELECT COUNT(*) FROM effects"); err != nil {
					t.Fatal(err)
				}
				if r.ran.Load() != 1 || effects != 1 || countProcessed(t, db, id) != 1 {
					t.Fatalf("handler ran %d times, %d effects, key %s recorded %d times; want 1, 1, 1", r.ran.Load(), effects, id, countProcessed(t, db, id))
				}
			})
		})
	}
}

// A quorum queue (RabbitMQ's replicated queue type) stamps every
// redelivery after a nack or a lost consumer with x-delivery-count, an
// integer header. watermill-amqp's DefaultMarshaler refuses it, and its
// subscriber nacks with requeue what it cannot unmarshal: the message
// loops between broker and subscriber and never reaches the handler (a
// cluster test lost an order so, its consumer's node stopped under it).
// Under AMQPMarshaler the redelivery after the inbox's nack is handled.
func TestInbox_Router_QuorumQueueRedelivery_ReachesHandlerUnderAMQPMarshaler(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.Postgres)
	testdb.Require(t, "amqp")
	createEffects(t, db)
	cfg := wamqp.NewDurableQueueConfig(testdb.AMQPURL())
	cfg.Queue.Arguments = amqp.Table{"x-queue-type": "quorum"}
	cfg.Marshaler = outbox.AMQPMarshaler{}
	id := "pay-2-captured-" + testdb.RandomName()
	r := deliverCrashingOnce(t, db, cfg, "quorum-"+testdb.RandomName(), id)
	if r.ran.Load() != 1 || countProcessed(t, db, id) != 1 {
		t.Fatalf("handler ran %d times, key %s recorded %d times; want 1, 1", r.ran.Load(), id, countProcessed(t, db, id))
	}
}

// deliverCrashingOnce subscribes with cfg to topic's queue behind an inbox
// and a crash after the first commit (runInboxRouterCrashingOnce),
// publishes one message with id as another AceMQ relay sends it (message_id
// and x-acemq-id, no Watermill UUID), and waits until a delivery after the
// crash succeeded. The queue is deleted when the test ends.
func deliverCrashingOnce(t *testing.T, db *testdb.DB, cfg wamqp.Config, topic, id string) *crashingRouter {
	t.Helper()
	sub, err := wamqp.NewSubscriber(cfg, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	// Registered first, so run after the router's stop: deleted under a
	// running subscriber, the queue was declared again and left behind.
	t.Cleanup(func() { testamqpDeleteQueue(t, topic) })
	r := runInboxRouterCrashingOnce(t, db, newInbox(t, db, outbox.InboxConfig{}), "settle", topic, sub)
	testamqp.New(t).With(func(ch *amqp.Channel) error {
		return ch.PublishWithContext(context.Background(), "", topic, true, false, amqp.Publishing{
			MessageId: id, Headers: amqp.Table{outbox.HeaderMessageID: id},
			DeliveryMode: amqp.Persistent, Body: []byte(`{"amount":"42.50"}`),
		})
	})
	select {
	case <-r.done:
	case <-time.After(20 * time.Second):
		t.Fatalf("the redelivery after the crash did not go through the inbox (%d deliveries, handler ran %d times)", r.deliveries.Load(), r.ran.Load())
	}
	return r
}

// crashingRouter is a router behind an inbox whose first delivery
// "crashes" after the inbox committed, so that the broker gets a nack and
// redelivers.
type crashingRouter struct {
	ran        atomic.Int32  // runs of the handler, which writes an effect each
	deliveries atomic.Int32  // deliveries the inbox was given
	done       chan struct{} // closed once a delivery after the first succeeded
}

// runInboxRouterCrashingOnce runs a router whose handler named handlerName
// consumes topic from sub behind in and a crash after its first commit, and
// returns once it is subscribed. The router stops when the test ends.
func runInboxRouterCrashingOnce(t testing.TB, db *testdb.DB, in *outbox.Inbox, handlerName, topic string, sub message.Subscriber) *crashingRouter {
	t.Helper()
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	r := &crashingRouter{done: make(chan struct{})}
	var once sync.Once
	crashAfterCommit := func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			out, err := h(msg)
			if r.deliveries.Add(1) == 1 {
				return nil, errors.New("process died before the ack")
			}
			if err == nil {
				once.Do(func() { close(r.done) })
			}
			return out, err
		}
	}
	effect := writeEffect(t, db, &r.ran)
	handler := router.AddConsumerHandler(handlerName, topic, sub, func(msg *message.Message) error {
		_, err := effect(msg)
		return err
	})
	handler.AddMiddleware(crashAfterCommit, in.Middleware)
	ctx, cancel := context.WithCancel(context.Background())
	go func() { _ = router.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		_ = router.Close()
	})
	<-router.Running()
	return r
}

// Without a UUID the inbox dedupes on the x-acemq-id metadata, with or
// without AllowMissingID; only a message with no id at all is refused. (An
// id the key column cannot hold is kept under its digest:
// inbox_long_ids_test.go.)
func TestInbox_NoUUIDButAcemqID_DedupedOnIt(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		for _, allow := range []bool{false, true} {
			var ran int
			h := newInbox(t, db, outbox.InboxConfig{AllowMissingID: allow}).Middleware(func(*message.Message) ([]*message.Message, error) {
				ran++
				return nil, nil
			})
			id := "foreign-" + testdb.RandomName()
			for range 2 {
				msg := message.NewMessage("", []byte("x"))
				msg.Metadata.Set(outbox.HeaderMessageID, id)
				if _, err := h(msg); err != nil {
					t.Fatalf("AllowMissingID %v: %v", allow, err)
				}
			}
			if ran != 1 || countProcessed(t, db, id) != 1 {
				t.Errorf("AllowMissingID %v: handler ran %d times, key recorded %d times; want 1 and 1", allow, ran, countProcessed(t, db, id))
			}
		}
	})
}

// Under watermill-amqp's DefaultMarshaler a message's UUID is its
// _watermill_message_uuid header, which a service in another language may
// carry on from the message it received (it copies headers), while its
// relay sets x-acemq-id to the new message's id: two messages of one stale
// UUID are two messages to the inbox, keyed by their x-acemq-id.
func TestInbox_StaleWatermillUUIDCopiedOn_DedupedOnAcemqID(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		var ran []string
		h := newInbox(t, db, outbox.InboxConfig{}).Middleware(func(msg *message.Message) ([]*message.Message, error) {
			ran = append(ran, msg.Metadata.Get(outbox.HeaderMessageID))
			return nil, nil
		})
		stale := "received-" + testdb.RandomName()
		for _, id := range []string{"b1-" + testdb.RandomName(), "b2-" + testdb.RandomName()} {
			msg := message.NewMessage(stale, []byte("x"))
			msg.Metadata.Set(outbox.HeaderMessageID, id)
			if _, err := h(msg); err != nil {
				t.Fatal(err)
			}
			if n := countProcessed(t, db, id); n != 1 {
				t.Errorf("message %s: %d keys, want 1", id, n)
			}
		}
		if len(ran) != 2 {
			t.Errorf("handler ran for %v, want both messages", ran)
		}
	})
}
