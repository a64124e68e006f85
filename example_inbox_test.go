package outbox_test

import (
	"context"
	"fmt"
	"log"
	"os"
	"path/filepath"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jmoiron/sqlx"
	_ "github.com/mattn/go-sqlite3"

	outbox "github.com/acemq/watermill-outbox"
)

// Delivery is at-least-once, so a consumer sees the same message twice. The
// inbox records the message id in the transaction that makes the handler's
// effect, and acks the second delivery without running the handler.
func ExampleInbox() {
	dir, _ := os.MkdirTemp("", "outbox-example")
	defer os.RemoveAll(dir)
	db := sqlx.MustOpen("sqlite3", "file:"+filepath.Join(dir, "warehouse.db")+"?_txlock=immediate&_busy_timeout=5000")
	defer db.Close()

	ctx := context.Background()
	if err := outbox.Migrate(ctx, db.DB, outbox.SQLite); err != nil {
		log.Fatal(err)
	}
	// No key on order_id: only the inbox stands between a redelivery and a
	// second shipment.
	db.MustExec("CREATE TABLE shipments (order_id TEXT)")

	// Under a router, ConsumerName defaults to the handler's name and the
	// middleware is added with router.AddMiddleware(inbox.Middleware).
	inbox, err := outbox.NewInbox(db, outbox.InboxConfig{ConsumerName: "fulfil-orders"})
	if err != nil {
		log.Fatal(err)
	}
	runs := 0
	ship := inbox.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		runs++
		// The effect goes through the inbox's transaction, so it commits
		// with the dedupe key or not at all.
		tx, _ := outbox.TxFromContext(msg.Context())
		_, err := tx.Exec("INSERT INTO shipments (order_id) VALUES (?)", string(msg.Payload))
		return nil, err
	})

	msg := message.NewMessage(watermill.NewUUID(), []byte("o-1"))
	for range 2 { // the delivery, then the broker's redelivery
		if _, err := ship(msg.Copy()); err != nil {
			log.Fatal(err)
		}
	}

	var shipments int
	if err := db.Get(&shipments, "SELECT COUNT(*) FROM shipments"); err != nil {
		log.Fatal(err)
	}
	fmt.Println("handler runs:", runs)
	fmt.Println("shipments:", shipments)
	// Output:
	// handler runs: 1
	// shipments: 1
}

// A message whose handler keeps failing goes to a poison topic, where an
// operator deals with it. Given PoisonQueue's publisher through
// PoisonPublisher, the inbox marks the message's outbox record processed
// once the poison topic has it, so a Republish at the next boot does not
// send it again.
func ExampleInbox_PoisonPublisher() {
	dir, _ := os.MkdirTemp("", "outbox-example")
	defer os.RemoveAll(dir)
	db := sqlx.MustOpen("sqlite3", "file:"+filepath.Join(dir, "warehouse.db")+"?_txlock=immediate&_busy_timeout=5000")
	defer db.Close()
	if err := outbox.Migrate(context.Background(), db.DB, outbox.SQLite); err != nil {
		log.Fatal(err)
	}

	inbox, err := outbox.NewInbox(db, outbox.InboxConfig{ConsumerName: "fulfil-orders", MarkOutboxProcessed: true})
	if err != nil {
		log.Fatal(err)
	}
	// The poison topic: here Watermill's in-memory pub/sub; in a service
	// the broker's publisher, or an outbox of its own.
	poison := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
	poisonQueue, err := middleware.PoisonQueue(inbox.PoisonPublisher(poison), "orders.poison")
	if err != nil {
		log.Fatal(err)
	}
	// Under a router: router.AddMiddleware(poisonQueue, …, inbox.Middleware).
	handle := poisonQueue(inbox.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		return nil, fmt.Errorf("order %s: no such warehouse", msg.Payload)
	}))
	// The message as the relay delivers it, from an outbox record of this
	// database.
	msg := message.NewMessage(watermill.NewUUID(), []byte("o-1"))
	tx := db.MustBegin()
	pub, err := outbox.NewTxPublisher(tx)
	if err != nil {
		log.Fatal(err)
	}
	if err := pub.Publish("orders.placed", msg); err != nil {
		log.Fatal(err)
	}
	if err := tx.Commit(); err != nil {
		log.Fatal(err)
	}
	if _, err := handle(msg.Copy()); err != nil {
		log.Fatal(err)
	}
	set, err := poison.Subscribe(context.Background(), "orders.poison")
	if err != nil {
		log.Fatal(err)
	}
	poisoned := <-set
	poisoned.Ack()
	var processed bool
	if err := db.Get(&processed, "SELECT processed_at IS NOT NULL FROM acemq_outbox WHERE id = ?", msg.UUID); err != nil {
		log.Fatal(err)
	}
	fmt.Println("poisoned:", string(poisoned.Payload), "-", poisoned.Metadata.Get(middleware.ReasonForPoisonedKey))
	fmt.Println("record processed:", processed)
	// Output:
	// poisoned: o-1 - order o-1: no such warehouse
	// record processed: true
}

// A message whose handler keeps failing, set aside through the outbox:
// PoisonOutbox writes its copy, to the poison topic, in one transaction
// with its record's processed mark, and the relay publishes it with the
// broker's confirm (a poison topic no queue is bound to shows as a stuck
// record, not a message the broker dropped).
func ExampleInbox_PoisonOutbox() {
	dir, _ := os.MkdirTemp("", "outbox-example")
	defer os.RemoveAll(dir)
	db := sqlx.MustOpen("sqlite3", "file:"+filepath.Join(dir, "warehouse.db")+"?_txlock=immediate&_busy_timeout=5000")
	defer db.Close()
	if err := outbox.Migrate(context.Background(), db.DB, outbox.SQLite); err != nil {
		log.Fatal(err)
	}
	inbox, err := outbox.NewInbox(db, outbox.InboxConfig{ConsumerName: "fulfil-orders", MarkOutboxProcessed: true})
	if err != nil {
		log.Fatal(err)
	}
	poisonQueue, err := middleware.PoisonQueue(inbox.PoisonOutbox(), "orders.poison")
	if err != nil {
		log.Fatal(err)
	}
	// Under a router: router.AddMiddleware(poisonQueue, …, inbox.Middleware).
	handle := poisonQueue(inbox.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		return nil, fmt.Errorf("order %s: no such warehouse", msg.Payload)
	}))
	// The message as the relay delivers it, from an outbox record of this
	// database.
	msg := message.NewMessage(watermill.NewUUID(), []byte("o-1"))
	tx := db.MustBegin()
	pub, err := outbox.NewTxPublisher(tx)
	if err != nil {
		log.Fatal(err)
	}
	if err := pub.Publish("orders.placed", msg); err != nil {
		log.Fatal(err)
	}
	if err := tx.Commit(); err != nil {
		log.Fatal(err)
	}
	if _, err := handle(msg.Copy()); err != nil {
		log.Fatal(err)
	}
	var processed bool
	if err := db.Get(&processed, "SELECT processed_at IS NOT NULL FROM acemq_outbox WHERE id = ?", msg.UUID); err != nil {
		log.Fatal(err)
	}
	var copies int
	if err := db.Get(&copies, "SELECT COUNT(*) FROM acemq_outbox WHERE routing_key = 'orders.poison' AND headers LIKE ?", "%"+msg.UUID+"%"); err != nil {
		log.Fatal(err)
	}
	fmt.Println("copies for the relay to send to orders.poison:", copies)
	fmt.Println("record processed:", processed)
	// Output:
	// copies for the relay to send to orders.poison: 1
	// record processed: true
}
