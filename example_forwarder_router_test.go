package outbox_test

import (
	"context"
	"errors"
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

// The relay runs with the router of the process that should relay: it starts
// with the router's handlers and stops, its batch finished, when the router
// closes. A process that should not relay leaves the plugin out.
func ExampleForwarder_Plugin() {
	dir, _ := os.MkdirTemp("", "outbox-example")
	defer os.RemoveAll(dir)
	db := sqlx.MustOpen("sqlite3", "file:"+filepath.Join(dir, "shop.db")+"?_txlock=immediate&_busy_timeout=5000")
	defer db.Close()

	ctx := context.Background()
	if err := outbox.Migrate(ctx, db.DB, outbox.SQLite); err != nil {
		log.Fatal(err)
	}

	broker := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	fwd, err := outbox.NewForwarder(db, outbox.NewPublisherDestination(broker, nil), outbox.ForwarderConfig{})
	if err != nil {
		log.Fatal(err)
	}
	defer fwd.Close() // the router closes it; this covers a router that never started

	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	if err != nil {
		log.Fatal(err)
	}
	router.AddPlugin(fwd.Plugin())
	received := make(chan string, 1)
	router.AddConsumerHandler("fulfil-orders", "order.placed", broker, func(msg *message.Message) error {
		received <- string(msg.Payload)
		return nil
	})
	routerDone := make(chan error, 1)
	go func() { routerDone <- router.Run(ctx) }()
	<-router.Running()

	tx := db.MustBegin()
	pub, err := outbox.NewTxPublisher(tx)
	if err != nil {
		log.Fatal(err)
	}
	if err := pub.Publish("order.placed", message.NewMessage(watermill.NewUUID(), []byte(`{"order":"o-1"}`))); err != nil {
		log.Fatal(err)
	}
	if err := tx.Commit(); err != nil {
		log.Fatal(err)
	}
	fwd.Notify() // wake the relay now rather than at its next poll
	fmt.Println("received:", <-received)

	if err := router.Close(); err != nil {
		log.Fatal(err)
	}
	if err := <-routerDone; err != nil {
		log.Fatal(err)
	}
	_, err = fwd.Sweep(ctx)
	fmt.Println("the relay closed with the router:", errors.Is(err, outbox.ErrForwarderClosed))
	// Output:
	// received: {"order":"o-1"}
	// the relay closed with the router: true
}
