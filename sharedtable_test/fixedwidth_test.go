package sharedtable_test

import (
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testamqp"
	"github.com/acemq/watermill-outbox/internal/testdb"
	"github.com/acemq/watermill-outbox/internal/testrails"
)

// Another library made acemq_outbox on PostgreSQL with fixed-width columns:
// character(64) ids (UUIDs in a fixed-width column), character(255) names.
// PostgreSQL pads their values with spaces: the relay sent the id with 28
// spaces after it as message_id and x-acemq-id, which every inbox refuses
// (nacked, delivered again for ever), and to a padded routing key, which
// no queue is bound to; and TxPublisher's retry of a message read the row
// back padded, and took it for another message's. Read as text, the values
// are the ones written.
func TestPostgres_FixedWidthColumns_IDsAndNamesAsWritten(t *testing.T) {
	c := alteredTable(t, "postgres", testdb.Postgres, "ALTER TABLE acemq_outbox ALTER id TYPE character(64), ALTER exchange_name TYPE character(255),"+
		" ALTER routing_key TYPE character(255), ALTER content_type TYPE character(100)")
	if _, err := c.db.Exec("ALTER TABLE acemq_outbox ALTER aggregate_id TYPE character(64)"); err != nil {
		t.Fatal(err)
	}
	b := testamqp.New(t)
	queue := b.Queue("ok")

	foreign := "0b7f4f7e-5a7e-4c57-9f0e-3d3f6c1a2b4c"
	testrails.Insert(t, c.db, testrails.Row{ID: foreign, Exchange: b.Exchange, RoutingKey: "ok", Body: "x", CreatedAt: time.Now().Add(-time.Second)})
	ours := message.NewMessage("c1d2e3f4-0000-4000-8000-000000000001", []byte("y"))
	ours.Metadata.Set(outbox.MetadataExchange, b.Exchange)
	keyed := message.NewMessage("c1d2e3f4-0000-4000-8000-000000000002", []byte("z"))
	keyed.Metadata.Set(outbox.MetadataExchange, b.Exchange)
	keyed.Metadata.Set(outbox.MetadataAggregateID, "order-1")
	for try := range 2 { // the second a retry of the first: one row each
		if err := c.publish(t, func(pub *outbox.TxPublisher) error { return pub.Publish("ok", ours.Copy(), keyed.Copy()) }); err != nil {
			t.Fatalf("publish, try %d: %v, want nil (a retry is one row)", try+1, err)
		}
	}

	f := c.forwarder(t, outbox.ForwarderConfig{})
	if n := sweepAll(t, f); n != 3 {
		t.Fatalf("relayed %d, want 3", n)
	}
	got := map[string]bool{}
	for _, d := range b.Drain(queue, 3, 10*time.Second) {
		if d.MessageId != d.Headers[outbox.HeaderMessageID] {
			t.Errorf("message_id %q, x-acemq-id %q: want the same", d.MessageId, d.Headers[outbox.HeaderMessageID])
		}
		if key, ok := d.Headers[outbox.HeaderAggregateID]; ok && key != "order-1" {
			t.Errorf("aggregateId %q, want %q", key, "order-1")
		}
		got[d.MessageId] = true
	}
	for _, id := range []string{foreign, ours.UUID, keyed.UUID} {
		if !got[id] {
			t.Errorf("message %q did not arrive as written (arrived: %v)", id, got)
		}
	}
}
