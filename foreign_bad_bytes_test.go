package outbox_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/prometheus/client_golang/prometheus"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testamqp"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// badExchangeBeforeAGoodRow writes, as another language's library may on
// SQLite (Python's sqlite3 binds bytes; SQLite's TEXT holds any), a row
// bad-exchange whose exchange_name is the bytes C3 28, not UTF-8, a second
// older than now, and behind it a row good to the test broker's exchange,
// routed to the returned queue.
func badExchangeBeforeAGoodRow(t *testing.T) (db *testdb.DB, broker *testamqp.Broker, queue string) {
	t.Helper()
	db = migrated(t, testdb.SQLite)
	broker = testamqp.New(t)
	queue = broker.Queue("ok")
	if _, err := db.Exec("INSERT INTO acemq_outbox (id, exchange_name, routing_key, body, body_encoding, content_type, headers, created_at)" +
		" VALUES ('bad-exchange', CAST(X'C328' AS TEXT), 'ok', 'x', 'utf-8', 'text/plain', '{}', strftime('%Y-%m-%d %H:%M:%f000', 'now', '-1 second'))"); err != nil {
		t.Fatal(err)
	}
	insertRaw(t, db, "good", broker.Exchange, "ok", "{}", "utf-8")
	return db, broker, queue
}

// sweepRecovering is f.Sweep with a panic returned rather than raised.
func sweepRecovering(f *outbox.Forwarder) (n int, err error, panicked any) {
	defer func() { panicked = recover() }()
	n, err = f.Sweep(context.Background())
	return n, err, nil
}

// With Metrics, a row whose exchange is not UTF-8 was counted under an
// exchange label, and Prometheus panics on a label value that is not
// UTF-8: the panic went up through Sweep and Run and took the service
// down, at each restart, for as long as the row was claimed. It fails
// alone now, and the row behind it goes out.
func TestForwarder_ForeignExchangeNotUTF8_WithMetrics_NoPanicRowsBehindGo(t *testing.T) {
	t.Parallel()
	db, broker, queue := badExchangeBeforeAGoodRow(t)
	m, err := outbox.NewMetrics(prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	f := newForwarder(t, db, outbox.ForwarderConfig{Metrics: m, MaxAttempts: 2})
	for i := 0; i < 3; i++ {
		if _, _, p := sweepRecovering(f); p != nil {
			t.Fatalf("sweep %d panicked: %v", i, p)
		}
	}
	if s := stateOf(t, db, "good"); !s.Published {
		t.Errorf("the row behind it: %+v, want published", s)
	}
	if s := stateOf(t, db, "bad-exchange"); s.Published || s.LastError == "" {
		t.Errorf("the row with the exchange not UTF-8: %+v, want failed with a last_error", s)
	}
	if d := broker.Drain(queue, 1, 5*time.Second); len(d) != 1 {
		t.Errorf("queue received %d messages, want the good one", len(d))
	}
}

// RabbitMQ answers the check of an exchange that is not UTF-8 by closing
// the whole connection (501 FRAME_ERROR): the relay took it for a lost
// connection, charged nothing the first times, and tore its connection
// down at each try while the rows behind it waited (63 s at the defaults).
// It is a name the broker can never take, as one over 255 bytes: stuck at
// once, naming the exchange, and the row behind it goes out at the next
// sweep.
func TestForwarder_ForeignExchangeNotUTF8_StuckAtOnce(t *testing.T) {
	t.Parallel()
	db, broker, queue := badExchangeBeforeAGoodRow(t)
	f := newForwarder(t, db, outbox.ForwarderConfig{})
	_, _ = f.Sweep(context.Background())
	bad := stateOf(t, db, "bad-exchange")
	if bad.Published || bad.Attempts != outbox.DefaultMaxAttempts || !strings.Contains(bad.LastError, "not valid UTF-8") {
		t.Errorf("after one sweep: %+v; want stuck at once (%d attempts), last_error saying the exchange is not UTF-8",
			bad, outbox.DefaultMaxAttempts)
	}
	if n, err := f.Sweep(context.Background()); n != 1 || err != nil {
		t.Errorf("second sweep: %d published, %v; want the good row", n, err)
	}
	if d := broker.Drain(queue, 1, 5*time.Second); len(d) != 1 {
		t.Errorf("queue received %d messages, want the good one", len(d))
	}
}

// x-acemq-inbox-interrupted is the inbox's own mark of a delivery whose
// context the router's Close cancelled, which PoisonPublisher refuses to
// set aside. A header of that name from the wire (a service in another
// language that forwards the headers it received) kept a message failing
// for good from its poison queue for ever, nacked and delivered again,
// "its context was cancelled while its handler ran".
func TestInbox_InterruptedHeaderFromTheWire_PoisonMessageStillSetAside(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.SQLite)
	id, in, poison, pq := poisonedChainSetup(t, db, "order.placed")
	h := pq(middleware.Retry{MaxRetries: 1, InitialInterval: time.Millisecond}.Middleware(in.Middleware(
		func(*message.Message) ([]*message.Message, error) { return nil, errors.New("the order is malformed") })))
	msg := message.NewMessage(id, []byte("x"))
	msg.Metadata.Set("x-acemq-inbox-interrupted", "true") // as the broker delivered it
	if _, err := h(msg); err != nil || poison.count() != 1 {
		t.Errorf("a message failing for good, the header from the wire: %v, set aside %d; want nil and 1", err, poison.count())
	}
}

// A keyed row another library wrote without its number (seq NULL): stuck
// at once, and its last_error says the column is NULL, as the row holds
// it, not "seq 0", a value an operator would not find there.
func TestForwarder_KeyedRowSeqNULL_StuckSayingNULL(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		insertRaw(t, db, "keyed-no-seq", "", "ok", "{}", "utf-8")
		if _, err := db.Exec(db.Rebind("UPDATE acemq_outbox SET aggregate_id = 'order-7', seq = NULL WHERE id = ?"), "keyed-no-seq"); err != nil {
			t.Fatal(err)
		}
		_, _ = newForwarder(t, db, outbox.ForwarderConfig{}).Sweep(context.Background())
		s := stateOf(t, db, "keyed-no-seq")
		if s.Published || s.Attempts != outbox.DefaultMaxAttempts {
			t.Fatalf("%+v, want stuck at once", s)
		}
		if !strings.Contains(s.LastError, "seq NULL") || strings.Contains(s.LastError, "seq 0") {
			t.Errorf("last_error %q; want it to say seq is NULL", s.LastError)
		}
	})
}

// A broker down behind a TCP load balancer (HAProxy in TCP mode with no
// backend takes the connection and closes it; amqp091-go says 504
// "channel/connection is not open") was told a refusal "(credentials, a
// vhost, permissions)", and outboxctl relay exited at once on it rather
// than wait for the broker. It is unreachable, as a closed port is.
func TestAMQPDestination_LoadBalancerWithNoBroker_Unreachable(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.SQLite)
	publishN(t, db, "x", "rk", 1)
	dest, err := outbox.NewAMQPDestination(outbox.AMQPConfig{URLs: []string{testamqp.NoBackendNode(t)}})
	if err != nil {
		t.Fatal(err)
	}
	f, err := outbox.NewForwarder(db.DB, dest, outbox.ForwarderConfig{Logger: &recordingLogger{}})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.Sweep(context.Background()); !errors.Is(err, outbox.ErrBrokerUnreachable) {
		t.Errorf("sweep through a load balancer with no broker: %v, want ErrBrokerUnreachable", err)
	}
}

// The inbox's marks by name from the wire, on a message that a middleware
// before the inbox refuses for good (a schema check), so that the inbox
// never drops them: PoisonPublisher refused it still ("its context was
// cancelled", "the database did not answer"), nacked for ever. Only the
// process's own mark counts.
func TestInbox_MarkHeadersFromTheWire_FailedBeforeTheInbox_StillSetAside(t *testing.T) {
	t.Parallel()
	for _, header := range []string{"x-acemq-inbox-interrupted", "x-acemq-inbox-db-lost"} {
		t.Run(header, func(t *testing.T) {
			db := migrated(t, testdb.SQLite)
			id, in, poison, pq := poisonedChainSetup(t, db, "order.placed")
			refuse := func(message.HandlerFunc) message.HandlerFunc {
				return func(*message.Message) ([]*message.Message, error) {
					return nil, errors.New("schema: the order is malformed") // before the inbox
				}
			}
			h := pq(refuse(in.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, nil })))
			msg := message.NewMessage(id, []byte("x"))
			msg.Metadata.Set(header, "true") // as the broker delivered it
			if _, err := h(msg); err != nil || poison.count() != 1 {
				t.Errorf("refused before the inbox, %s from the wire: %v, set aside %d; want nil and 1", header, err, poison.count())
			}
		})
	}
}
