package outbox_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testamqp"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// newForwarder returns a forwarder over db to the test broker, closed when
// the test ends.
func newForwarder(t testing.TB, db *testdb.DB, cfg outbox.ForwarderConfig, amqpCfg ...outbox.AMQPConfig) *outbox.Forwarder {
	t.Helper()
	ac := outbox.AMQPConfig{}
	if len(amqpCfg) > 0 {
		ac = amqpCfg[0]
	}
	ac.URL = testdb.AMQPURL()
	dest, err := outbox.NewAMQPDestination(ac)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Logger == nil {
		cfg.Logger = watermill.NewStdLogger(false, false)
	}
	f, err := outbox.NewForwarder(db.DB, dest, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := f.Close(); err != nil {
			t.Errorf("close forwarder: %v", err)
		}
	})
	return f
}

// publishN commits n messages on topic, one transaction each, and returns
// their ids in order.
func publishN(t testing.TB, db *testdb.DB, exchange, topic string, n int) []string {
	t.Helper()
	ids := make([]string, n)
	for i := range ids {
		msg := message.NewMessage(watermill.NewUUID(), []byte(fmt.Sprintf(`{"n":%d}`, i)))
		ids[i] = msg.UUID
		publishInTx(t, db, topic, []*message.Message{msg}, outbox.WithExchange(exchange))
	}
	return ids
}

// sweepAll sweeps until a sweep publishes nothing, and returns the total.
func sweepAll(t testing.TB, f *outbox.Forwarder) int {
	t.Helper()
	total := 0
	for {
		n, err := f.Sweep(context.Background())
		total += n
		if err != nil {
			t.Fatalf("sweep: %v", err)
		}
		if n == 0 {
			return total
		}
	}
}

type rowState struct {
	Published bool
	Attempts  int
	LastError string
}

func stateOf(t testing.TB, db *testdb.DB, id string) rowState {
	t.Helper()
	var r struct {
		Published bool    `db:"published"`
		Attempts  int     `db:"attempts"`
		LastError *string `db:"last_error"`
	}
	q := "SELECT published_at IS NOT NULL AS published, attempts, last_error FROM acemq_outbox WHERE id = " + placeholder(db, 1)
	if err := db.Get(&r, q, id); err != nil {
		t.Fatalf("row %s: %v", id, err)
	}
	s := rowState{Published: r.Published, Attempts: r.Attempts}
	if r.LastError != nil {
		s.LastError = *r.LastError
	}
	return s
}

func TestForwarder_CommittedRowsArriveWithEveryProperty_RolledBackNever(t *testing.T) {
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		b := testamqp.New(t)
		queue := b.Queue("order.placed")

		msg := message.NewMessage(watermill.NewUUID(), []byte("\xff\x00 binary body"))
		msg.Metadata.Set("tenant", "acme")
		msg.Metadata.Set(outbox.MetadataContentType, "application/x-test")
		publishInTx(t, db, "order.placed", []*message.Message{msg}, outbox.WithExchange(b.Exchange))

		tx, _ := db.Beginx()
		pub, _ := outbox.NewTxPublisher(tx, outbox.WithExchange(b.Exchange))
		if err := pub.Publish("order.placed", message.NewMessage("rolled-back", []byte("no"))); err != nil {
			t.Fatal(err)
		}
		_ = tx.Rollback()

		f := newForwarder(t, db, outbox.ForwarderConfig{})
		if n := sweepAll(t, f); n != 1 {
			t.Fatalf("published %d, want 1", n)
		}
		got := b.Drain(queue, 2, 2*time.Second)
		if len(got) != 1 {
			t.Fatalf("queue received %d messages, want 1 (the rolled-back one must never arrive)", len(got))
		}
		d := got[0]
		if string(d.Body) != "\xff\x00 binary body" {
			t.Errorf("body = %q", d.Body)
		}
		if d.MessageId != msg.UUID || d.Headers[outbox.HeaderID] != msg.UUID || d.Headers[outbox.WatermillUUIDHeader] != msg.UUID {
			t.Errorf("ids: message_id %q, x-acemq-id %v, watermill uuid %v; want %s", d.MessageId, d.Headers[outbox.HeaderID], d.Headers[outbox.WatermillUUIDHeader], msg.UUID)
		}
		if d.Headers["tenant"] != "acme" || d.ContentType != "application/x-test" {
			t.Errorf("headers %v, content type %q", d.Headers, d.ContentType)
		}
		if d.DeliveryMode != 2 {
			t.Errorf("delivery mode %d, want persistent (2)", d.DeliveryMode)
		}
		if d.Exchange != b.Exchange || d.RoutingKey != "order.placed" {
			t.Errorf("arrived via %q/%q", d.Exchange, d.RoutingKey)
		}
		if d.Timestamp.IsZero() || time.Since(d.Timestamp) > time.Minute {
			t.Errorf("timestamp %v, want the row's created_at", d.Timestamp)
		}
		if s := stateOf(t, db, msg.UUID); !s.Published || s.Attempts != 0 {
			t.Errorf("row state %+v, want published with 0 attempts", s)
		}
	})
}
