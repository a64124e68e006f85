package outbox_test

import (
	"context"
	"fmt"
	"log"
	"os"
	"path/filepath"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jmoiron/sqlx"
	_ "github.com/mattn/go-sqlite3"

	outbox "github.com/acemq/watermill-outbox"
)

// A key's events on two topics, applied in the key's order: the publisher
// numbers an order's order.placed and order.paid (MetadataAggregateID), and
// one ordered inbox, shared by the handlers of both topics under one
// ConsumerName, holds a paid that arrives first until its placed is
// applied. Each topic has a queue of its own in a service (here
// Watermill's in-memory pub/sub).
func ExampleInbox_ordered() {
	dir, _ := os.MkdirTemp("", "outbox-example")
	defer os.RemoveAll(dir)
	db := sqlx.MustOpen("sqlite3", "file:"+filepath.Join(dir, "ledger.db")+"?_txlock=immediate&_busy_timeout=5000")
	defer db.Close()
	ctx := context.Background()
	if err := outbox.Migrate(ctx, db.DB, outbox.SQLite); err != nil {
		log.Fatal(err)
	}

	// The orders service: both events of order o-1 in one transaction,
	// keyed by the order, numbered 1 and 2 in the outbox.
	tx := db.MustBegin()
	pub, err := outbox.NewTxPublisher(tx)
	if err != nil {
		log.Fatal(err)
	}
	var sent []*message.Message
	for _, topic := range []string{"order.placed", "order.paid"} {
		msg := message.NewMessage(watermill.NewUUID(), []byte("o-1"))
		msg.Metadata.Set(outbox.MetadataAggregateID, "o-1")
		if err := pub.Publish(topic, msg); err != nil {
			log.Fatal(err)
		}
		sent = append(sent, msg)
	}
	if err := tx.Commit(); err != nil {
		log.Fatal(err)
	}

	// The ledger: one ordered inbox, both topics' handlers under it.
	inbox, err := outbox.NewInbox(db, outbox.InboxConfig{ConsumerName: "ledger", Ordered: true})
	if err != nil {
		log.Fatal(err)
	}
	bus := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	if err != nil {
		log.Fatal(err)
	}
	router.AddMiddleware(inbox.Middleware) // PoisonQueue, Retry and Timeout go before it
	router.AddPlugin(inbox.Plugin())
	applied := make(chan string, 2)
	for _, topic := range []string{"order.placed", "order.paid"} {
		// inbox.Subscriber: after a restart, a message held on one topic
		// and released on the other runs with no delivery of its own
		// topic to wait for.
		router.AddConsumerHandler("ledger-"+topic, topic, inbox.Subscriber(bus), func(msg *message.Message) error {
			applied <- topic + " " + string(msg.Payload)
			return nil
		})
	}
	go func() { _ = router.Run(ctx) }()
	defer router.Close()
	<-router.Running()

	// The relay sends each record with its key and number, the headers
	// aggregateId and seq; here order.paid reaches the ledger first.
	deliver := func(topic string, msg *message.Message) {
		var key, seq string
		if err := db.QueryRow("SELECT aggregate_id, seq FROM acemq_outbox WHERE id = ?", msg.UUID).Scan(&key, &seq); err != nil {
			log.Fatal(err)
		}
		out := message.NewMessage(msg.UUID, msg.Payload)
		out.Metadata.Set(outbox.HeaderAggregateID, key)
		out.Metadata.Set(outbox.HeaderSeq, seq)
		if err := bus.Publish(topic, out); err != nil {
			log.Fatal(err)
		}
	}
	deliver("order.paid", sent[1])
	for held := 0; held == 0; time.Sleep(10 * time.Millisecond) {
		if err := db.Get(&held, "SELECT COUNT(*) FROM acemq_inbox_held"); err != nil {
			log.Fatal(err)
		}
	}
	fmt.Println("order.paid held, waiting for 1")
	deliver("order.placed", sent[0])
	fmt.Println("applied:", <-applied)
	fmt.Println("applied:", <-applied)
	// Output:
	// order.paid held, waiting for 1
	// applied: order.placed o-1
	// applied: order.paid o-1
}
