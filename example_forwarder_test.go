package outbox_test

import (
	"context"
	"fmt"
	"log"
	"os"
	"path/filepath"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jmoiron/sqlx"
	_ "github.com/mattn/go-sqlite3"

	outbox "github.com/acemq/watermill-outbox"
)

// The relay publishes what the service committed, and marks it published
// once the broker took it. Watermill's in-process gochannel stands in for the
// broker here; with RabbitMQ the destination is outbox.NewAMQPDestination.
func ExampleForwarder() {
	dir, _ := os.MkdirTemp("", "outbox-example")
	defer os.RemoveAll(dir)
	db := sqlx.MustOpen("sqlite3", "file:"+filepath.Join(dir, "shop.db")+"?_txlock=immediate&_busy_timeout=5000")
	defer db.Close()

	ctx := context.Background()
	if err := outbox.Migrate(ctx, db.DB, outbox.SQLite); err != nil {
		log.Fatal(err)
	}

	// The service commits a message with its change. Nothing is sent yet.
	sent := message.NewMessage(watermill.NewUUID(), []byte(`{"order":"o-1"}`))
	tx := db.MustBegin()
	pub, err := outbox.NewTxPublisher(tx)
	if err != nil {
		log.Fatal(err)
	}
	if err := pub.Publish("order.placed", sent); err != nil {
		log.Fatal(err)
	}
	if err := tx.Commit(); err != nil {
		log.Fatal(err)
	}

	broker := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	received, err := broker.Subscribe(ctx, "order.placed")
	if err != nil {
		log.Fatal(err)
	}

	// nil maps each record to its routing key, the topic given to Publish.
	fwd, err := outbox.NewForwarder(db, outbox.NewPublisherDestination(broker, nil), outbox.ForwarderConfig{})
	if err != nil {
		log.Fatal(err)
	}
	defer fwd.Close() // also closes the destination, and so the gochannel

	// A service runs go fwd.Run(ctx). Sweep publishes one batch now and
	// returns once its rows are marked published.
	n, err := fwd.Sweep(ctx)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("relayed:", n)

	got := <-received
	got.Ack()
	fmt.Println("payload:", string(got.Payload))
	// Consumers dedupe on the id, which the relay carries as the UUID and
	// in the x-acemq-id header.
	fmt.Println("same UUID:", got.UUID == sent.UUID)
	fmt.Println("x-acemq-id is the UUID:", got.Metadata.Get(outbox.HeaderMessageID) == sent.UUID)

	stats, err := fwd.Store().Stats(ctx)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("pending:", stats.Pending)
	// Output:
	// relayed: 1
	// payload: {"order":"o-1"}
	// same UUID: true
	// x-acemq-id is the UUID: true
	// pending: 0
}
