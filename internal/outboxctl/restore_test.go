package outboxctl

import (
	"encoding/json"
	"reflect"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"

	outbox "github.com/acemq/watermill-outbox"
)

// A consumer in another database set a keyed message aside, and its
// producer purged the record (it cannot tell a message set aside from one
// applied): resend had nothing to send, and a user review republished the
// poison copy by hand with amqp091, aggregateId and seq and the message's
// id written in, to free 3,346 messages held behind it. restore writes the
// copy back into the outbox as the message: its id, topic, headers, and
// key and number as the relay sends a keyed row's.
func TestRestore_PoisonCopyWrittenBackAsItsMessage(t *testing.T) {
	eachKind(t, func(t *testing.T, kind string) {
		db := migrated(t, kind)
		tx, err := db.Beginx()
		if err != nil {
			t.Fatal(err)
		}
		pub, err := outbox.NewTxPublisher(tx, outbox.TxPublisherConfig{Exchange: "shop-events"})
		if err != nil {
			t.Fatal(err)
		}
		copyMsg := message.NewMessage("poison-copy-1", []byte(`{"amount":"42.50"}`))
		for k, v := range map[string]string{
			outbox.PoisonedIDMetadataKey: "pay-5-seq-2", outbox.PoisonedKeyMetadataKey: "pay-5", outbox.PoisonedSeqMetadataKey: "2",
			"topic_poisoned": "payment.captured", "reason_poisoned": "no such ledger", "handler_poisoned": "ledger", "subscriber_poisoned": "amqp",
			"tenant": "t-1", "x-acemq-poisoned-header-CC": "audit",
		} {
			copyMsg.Metadata.Set(k, v)
		}
		plain := message.NewMessage("not-a-copy", []byte("{}"))
		if err := pub.Publish("payment.captured.poison", copyMsg, plain); err != nil {
			t.Fatal(err)
		}
		if err := tx.Commit(); err != nil {
			t.Fatal(err)
		}

		out := mustCtl(t, "restore", "--db", db.DSN, "poison-copy-1")
		if !strings.Contains(out, "poison-copy-1: written into acemq_outbox as its message pay-5-seq-2, to shop-events / payment.captured, key pay-5 seq 2: the relay publishes it") {
			t.Errorf("restore:\n%s", out)
		}
		var row struct {
			Exchange, RoutingKey, Body, Headers string
			Key                                 *string
		}
		if err := db.QueryRowx(db.Rebind("SELECT exchange_name, routing_key, body, headers, aggregate_id FROM acemq_outbox WHERE id = ? AND published_at IS NULL"), "pay-5-seq-2").Scan(
			&row.Exchange, &row.RoutingKey, &row.Body, &row.Headers, &row.Key); err != nil {
			t.Fatalf("the restored message's row: %v", err)
		}
		var headers map[string]any
		if err := json.Unmarshal([]byte(row.Headers), &headers); err != nil {
			t.Fatal(err)
		}
		if want := map[string]any{"aggregateId": "pay-5", "seq": float64(2), "tenant": "t-1", "CC": "audit"}; !reflect.DeepEqual(headers, want) ||
			row.Exchange != "shop-events" || row.RoutingKey != "payment.captured" || row.Body != `{"amount":"42.50"}` || row.Key != nil {
			t.Errorf("restored row: %+v, headers %v; want the message to shop-events / payment.captured, headers %v, the key in the headers only", row, headers, want)
		}

		ctl(t, nil, "restore", "--db", db.DSN, "poison-copy-1").wantFailure(t, 1, "its message pay-5-seq-2 has its record in acemq_outbox: outboxctl resend pay-5-seq-2")
		ctl(t, nil, "restore", "--db", db.DSN, "not-a-copy").wantFailure(t, 1, "not-a-copy is no poison copy")
		ctl(t, nil, "restore", "--db", db.DSN, "no-such-id").wantFailure(t, 1, "no-such-id is not in acemq_outbox")
	})
}
