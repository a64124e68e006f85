package outbox_test

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// Publish refuses metadata the relay could never send (a header name over
// AMQP's 255-byte short string; headers larger than the broker's default
// frame) with an InvalidMessageError, and writes nothing of the call. It
// accepted them, and the relay made the row stuck at once; a keyed one held
// its key's later messages until an operator acted. (From an audit.)
func TestTxPublisher_MetadataTheRelayCannotSend_Refused(t *testing.T) {
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		longName := message.NewMessage("long-name", []byte("x"))
		longName.Metadata.Set(strings.Repeat("n", 300), "v")
		bigValue := message.NewMessage("big-value", []byte("x"))
		bigValue.Metadata.Set("trace-baggage", strings.Repeat("v", 200<<10))
		keyedBad := message.NewMessage("keyed-bad", []byte("x"))
		keyedBad.Metadata.Set(outbox.MetadataAggregateID, "acct-1")
		keyedBad.Metadata.Set(strings.Repeat("n", 300), "v")
		// RabbitMQ reads CC and BCC as sender-selected routing, arrays only:
		// it refused the string at every try (406), until the row was stuck.
		cc := message.NewMessage("cc", []byte("x"))
		cc.Metadata.Set("CC", "ops@example.com")
		bcc := message.NewMessage("bcc", []byte("x"))
		bcc.Metadata.Set("BCC", "audit")
		fine := message.NewMessage("fine", []byte("x"))
		fine.Metadata.Set(strings.Repeat("n", 255), strings.Repeat("v", 100<<10))
		fine.Metadata.Set("cc", "a header like any other")

		tx, err := db.Beginx()
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = tx.Rollback() }()
		pub, _ := outbox.NewTxPublisher(tx)
		for _, m := range []*message.Message{longName, bigValue, keyedBad, cc, bcc} {
			var invalid *outbox.InvalidMessageError
			if err := pub.Publish("t", fine.Copy(), m); !errors.As(err, &invalid) || invalid.Field != "metadata" {
				t.Errorf("Publish(%s): %v, want an InvalidMessageError of its metadata", m.UUID, err)
			}
		}
		if err := pub.Publish("t", fine); err != nil {
			t.Errorf("Publish of a 255-byte header name and 100 KiB of headers: %v", err)
		}
		var c int
		if err := tx.Get(&c, "SELECT COUNT(*) FROM acemq_outbox"); err != nil || c != 1 {
			t.Errorf("%d rows in the transaction (%v), want 1: the refused calls wrote nothing", c, err)
		}
	})
}

// A call of many keyed messages with distinct keys locked every key in one
// statement (LockKeys): 2 arguments per key (4 on MySQL), and past the
// database's bound on arguments the call failed. It locks them a thousand
// at a time. (From an audit.)
func TestTxPublisher_ManyDistinctKeysInOneCall_Published(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		n := 17000
		if db.Kind == testdb.Postgres {
			n = 33000
		}
		msgs := make([]*message.Message, n)
		for i := range msgs {
			msgs[i] = keyed(fmt.Sprintf("key-%06d", i))
		}
		tx, err := db.Beginx()
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = tx.Rollback() }()
		pub, _ := outbox.NewTxPublisher(tx)
		if err := pub.Publish("orders", msgs...); err != nil {
			t.Fatalf("Publish of %d keyed messages, one key each: %.300v", n, err)
		}
	})
}
