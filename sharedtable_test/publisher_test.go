package sharedtable_test

import (
	"errors"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testrails"
)

// TxPublisher tells the rows its own statement inserted from rows already
// there by comparing created_at with what it wrote, to the microsecond: read
// back in the driver's zone rather than as the UTC it wrote (MySQL with
// loc=Local), its own rows would look foreign, and a refused call would
// leave them in the caller's transaction.
func TestTxPublisher_SameIDToAnotherDestination_FarFromUTC_NothingOfTheCallWritten(t *testing.T) {
	eachConn(t, func(t *testing.T, c *conn) {
		testrails.CreateTable(t, c.db)
		c.migrate(t)
		first := message.NewMessage(watermill.NewUUID(), []byte("x"))
		publish := func(topic string, msgs ...*message.Message) error {
			tx, err := c.lib.Beginx()
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = tx.Rollback() }()
			pub, err := outbox.NewTxPublisher(tx)
			if err != nil {
				t.Fatal(err)
			}
			perr := pub.Publish(topic, msgs...)
			if err := tx.Commit(); err != nil { // the caller may commit what is left
				t.Fatal(err)
			}
			return perr
		}
		if err := publish("topic-a", first); err != nil {
			t.Fatal(err)
		}
		fresh := message.NewMessage(watermill.NewUUID(), []byte("y"))
		if err := publish("topic-b", fresh, first.Copy()); !errors.Is(err, outbox.ErrDuplicateID) {
			t.Fatalf("err = %v, want ErrDuplicateID", err)
		}
		var n int
		if err := c.db.Get(&n, "SELECT COUNT(*) FROM acemq_outbox"); err != nil || n != 1 {
			t.Errorf("%d rows (%v), want the first message's alone: nothing of the refused call", n, err)
		}
	})
}
