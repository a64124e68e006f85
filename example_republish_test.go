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

// A service that consumes its own events sends again, when it boots, what it
// published and never processed: a message the broker lost, or one that sat
// in a queue no consumer was bound to.
func ExampleRepublisher() {
	dir, _ := os.MkdirTemp("", "outbox-example")
	defer os.RemoveAll(dir)
	db := sqlx.MustOpen("sqlite3", "file:"+filepath.Join(dir, "shop.db")+"?_txlock=immediate&_busy_timeout=5000")
	defer db.Close()

	ctx := context.Background()
	if err := outbox.Migrate(ctx, db.DB, outbox.SQLite); err != nil {
		log.Fatal(err)
	}

	for _, id := range []string{"msg-o-1", "msg-o-2"} {
		tx := db.MustBegin()
		pub, err := outbox.NewTxPublisher(tx)
		if err != nil {
			log.Fatal(err)
		}
		if err := pub.Publish("order.placed", message.NewMessage(id, nil)); err != nil {
			log.Fatal(err)
		}
		if err := tx.Commit(); err != nil {
			log.Fatal(err)
		}
	}

	// The broker takes both messages, and no subscriber hears of them.
	broker := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	fwd, err := outbox.NewForwarder(db, outbox.NewPublisherDestination(broker, nil), outbox.ForwarderConfig{})
	if err != nil {
		log.Fatal(err)
	}
	defer fwd.Close()
	n, err := fwd.Sweep(ctx)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("relayed:", n)

	// msg-o-1 reaches its consumer after all (a redelivery, another
	// queue): the inbox marks its outbox record processed in the handler's
	// transaction. Under a router, TrackedTopics limits that to the tracked
	// topics; called directly, the message carries no topic, so it is nil.
	inbox, err := outbox.NewInbox(db, outbox.InboxConfig{ConsumerName: "fulfil-orders", MarkOutboxProcessed: true})
	if err != nil {
		log.Fatal(err)
	}
	handle := inbox.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, nil })
	if _, err := handle(message.NewMessage("msg-o-1", nil)); err != nil {
		log.Fatal(err)
	}

	// The example moves the relay's marks into the past rather than wait out
	// Grace (a record younger than Grace may still be on its way). SQLite
	// keeps the outbox's times as fixed-width UTC text.
	db.MustExec("UPDATE acemq_outbox SET published_at = '2000-01-01 00:00:00.000000'")

	// The service restarts. Under a router: router.AddPlugin(rp.Plugin()),
	// which runs before the handlers start.
	topics := outbox.NewTrackedTopics("order.placed")
	rp, err := outbox.NewRepublisher(db, outbox.RepublisherConfig{TrackedTopics: topics, Grace: 5 * time.Minute, Notify: fwd.Notify})
	if err != nil {
		log.Fatal(err)
	}
	n64, err := rp.Republish(ctx)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("made pending again:", n64)
	st, err := fwd.Store().Stats(ctx)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("pending:", st.Pending)

	// The relay, still the only publisher, sends it again; this time a
	// subscriber is there.
	received, err := broker.Subscribe(ctx, "order.placed")
	if err != nil {
		log.Fatal(err)
	}
	if _, err := fwd.Sweep(ctx); err != nil {
		log.Fatal(err)
	}
	got := <-received
	got.Ack()
	fmt.Println("sent again:", got.UUID)
	// Output:
	// relayed: 2
	// made pending again: 1
	// pending: 1
	// sent again: msg-o-2
}
