package outbox_test

import (
	"context"
	"fmt"
	"log"
	"os"
	"path/filepath"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"
	_ "github.com/mattn/go-sqlite3"

	outbox "github.com/acemq/watermill-outbox"
)

// An order and its order.placed message commit together, or not at all.
func ExampleNewTxPublisher() {
	dir, _ := os.MkdirTemp("", "outbox-example")
	defer os.RemoveAll(dir)
	db := sqlx.MustOpen("sqlite3", "file:"+filepath.Join(dir, "shop.db")+"?_txlock=immediate&_busy_timeout=5000")
	defer db.Close()

	ctx := context.Background()
	if err := outbox.Migrate(ctx, db.DB, outbox.SQLite); err != nil {
		log.Fatal(err)
	}
	db.MustExec("CREATE TABLE orders (id TEXT PRIMARY KEY, total INTEGER)")

	placeOrder := func(id string, total int, reserveStock func() error) error {
		tx, err := db.Beginx()
		if err != nil {
			return err
		}
		defer tx.Rollback()

		if _, err := tx.Exec("INSERT INTO orders (id, total) VALUES (?, ?)", id, total); err != nil {
			return err
		}
		// The Watermill publisher the service used before, swapped for one
		// that writes into this transaction.
		pub, err := outbox.NewTxPublisher(tx, outbox.TxPublisherConfig{Exchange: "shop-events"})
		if err != nil {
			return err
		}
		msg := message.NewMessage("msg-"+id, []byte(fmt.Sprintf(`{"order":%q,"total":%d}`, id, total)))
		if err := pub.Publish("order.placed", msg); err != nil {
			return err
		}
		if err := reserveStock(); err != nil {
			return err // rolls back the order and its message together
		}
		return tx.Commit()
	}

	fmt.Println(placeOrder("o-1", 4250, func() error { return nil }))
	fmt.Println(placeOrder("o-2", 990, func() error { return fmt.Errorf("out of stock") }))

	rows, err := db.Query("SELECT id, exchange_name, routing_key, body, published_at IS NULL FROM acemq_outbox")
	if err != nil {
		log.Fatal(err)
	}
	defer rows.Close()
	for rows.Next() {
		var id, exchange, routingKey, body string
		var pending bool
		if err := rows.Scan(&id, &exchange, &routingKey, &body, &pending); err != nil {
			log.Fatal(err)
		}
		fmt.Println(id, exchange, routingKey, body, "pending:", pending)
	}
	// Output:
	// <nil>
	// out of stock
	// msg-o-1 shop-events order.placed {"order":"o-1","total":4250} pending: true
}
