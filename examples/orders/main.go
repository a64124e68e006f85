// Command orders is the shop of the outbox pattern, in one process: placing
// an order inserts the order and its order.placed message in one
// transaction, a stock reservation that fails rolls both back, a relay
// publishes what committed to RabbitMQ, and a fulfilment consumer behind the
// inbox processes each order once.
//
//	go run ./examples/orders                     # SQLite in a temporary file
//	go run ./examples/orders -db 'postgres://postgres@localhost:5432/test?sslmode=disable'
//	go run ./examples/orders -db 'root@tcp(localhost:3306)/test'
//
// It needs RabbitMQ (docker compose up -d rabbitmq), at -amqp.
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/examples/internal/demo"
)

const (
	prog     = "examples/orders"
	exchange = "shop-events"  // a durable topic exchange
	topic    = "order.placed" // the routing key
	queue    = "fulfilment"   // the consumer's durable queue, and its name in the inbox
)

func main() { demo.Main(run) }

func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	cmd := demo.NewCommand(prog, stderr)
	var (
		orders  = cmd.Flags.Int("orders", 10, "how many orders to place (1 to 1000); those the stock cannot cover are rejected")
		timeout = cmd.Flags.Duration("timeout", 30*time.Second, "how long to wait for every placed order to be fulfilled")
	)
	if err := cmd.Flags.Parse(args); err != nil {
		return 2
	}
	if *orders < 1 || *orders > 1000 {
		fmt.Fprintf(cmd.Stderr, "%s: -orders %d: want 1 to 1000\n", prog, *orders)
		return 2
	}
	return cmd.Run(ctx, "shop.db", stdout, func(svc *demo.Service) error {
		s := &shop{Service: svc, stock: newInventory()}
		return s.run(ctx, *orders, *timeout, stdout)
	})
}

// schema is the shop's own tables; the outbox's come from outbox.Migrate.
// IF NOT EXISTS and ids unique to each order, so that a second run against
// the same database works and counts only its own orders.
var schema = []string{
	`CREATE TABLE IF NOT EXISTS orders (
    id          varchar(64) NOT NULL PRIMARY KEY,
    sku         varchar(32) NOT NULL,
    quantity    integer     NOT NULL,
    total_cents bigint      NOT NULL
)`,
	// No key on order_id, on purpose: the inbox is what keeps fulfilment to
	// one row per order, and a second delivery that got through would show
	// here as a second row.
	`CREATE TABLE IF NOT EXISTS fulfilments (
    order_id   varchar(64) NOT NULL,
    sku        varchar(32) NOT NULL,
    quantity   integer     NOT NULL,
    message_id varchar(64) NOT NULL
)`,
}

type shop struct {
	*demo.Service
	stock *inventory
	fwd   *outbox.Forwarder
}

// order is also the order.placed message's payload.
type order struct {
	ID         string `json:"order_id"`
	SKU        string `json:"sku"`
	Quantity   int    `json:"quantity"`
	TotalCents int64  `json:"total_cents"`
}

// attempt is one order the program tried to place, and what became of it.
type attempt struct {
	n         int
	order     order
	messageID string
	rejected  error // the reservation's failure: order and message rolled back
}

func (s *shop) run(ctx context.Context, n int, timeout time.Duration, stdout io.Writer) error {
	if err := s.Migrate(ctx, "the shop's tables", schema); err != nil {
		return err
	}

	// The consumer first, so that the relay never publishes to a route that
	// is not there. Behind the inbox, each order is fulfilled once, however
	// often its message is delivered.
	err := s.StartConsumer(ctx, demo.Consumer{Exchange: exchange, Queue: queue, Topic: topic, Handler: demo.InboxHandler(topic, fulfil)})
	if err != nil {
		return err
	}
	// The relay, in this process, is the only thing that publishes the
	// outbox's rows to RabbitMQ.
	if s.fwd, err = s.StartRelay(ctx, demo.Relay{Name: "relay"}); err != nil {
		return err
	}

	attempts := make([]*attempt, n)
	for i := range attempts {
		a := &attempt{n: i + 1, order: newOrder(i)}
		attempts[i] = a
		a.messageID, a.rejected = s.placeOrder(ctx, a.order)
		switch {
		case errors.Is(a.rejected, errOutOfStock):
		case a.rejected != nil:
			return fmt.Errorf("order %d: %w", a.n, a.rejected)
		default:
			s.fwd.Notify() // committed: wake the relay rather than wait for its poll
		}
	}

	waitErr := s.waitFulfilled(ctx, attempts, timeout)
	if err := s.report(ctx, stdout, attempts); err != nil {
		return err
	}
	return waitErr
}

// placeOrder is the business transaction: the order row, its order.placed
// message, and the stock reservation commit together, or none of them does.
func (s *shop) placeOrder(ctx context.Context, o order) (messageID string, err error) {
	tx, err := s.DB.BeginTxx(ctx, nil)
	if err != nil {
		return "", err
	}
	defer tx.Rollback() // after Commit, does nothing

	if _, err := tx.ExecContext(ctx, tx.Rebind("INSERT INTO orders (id, sku, quantity, total_cents) VALUES (?, ?, ?, ?)"),
		o.ID, o.SKU, o.Quantity, o.TotalCents); err != nil {
		return "", fmt.Errorf("insert the order: %w", err)
	}

	// Where the service published to RabbitMQ, it publishes into its own
	// transaction: a row of acemq_outbox, and nothing on the network.
	if messageID, err = demo.PublishJSON(ctx, tx, exchange, topic, o); err != nil {
		return "", err
	}

	// The message is written, and still goes nowhere: a failure from here
	// on rolls it back with the order.
	if err := s.stock.reserve(o.SKU, o.Quantity); err != nil {
		return messageID, err
	}
	if err := tx.Commit(); err != nil {
		s.stock.release(o.SKU, o.Quantity)
		return messageID, fmt.Errorf("commit: %w", err)
	}
	return messageID, nil
}

// fulfil is the consumer's handler, behind the inbox: the fulfilment row
// commits with the inbox's key for the message.
func fulfil(msg *message.Message, tx *sqlx.Tx, o order) error {
	_, err := tx.ExecContext(msg.Context(), tx.Rebind("INSERT INTO fulfilments (order_id, sku, quantity, message_id) VALUES (?, ?, ?, ?)"),
		o.ID, o.SKU, o.Quantity, msg.UUID)
	return err
}

// waitFulfilled waits until every placed order has its fulfilment and its
// message is marked published. The consumer can finish before the relay
// marks the last batch, so both are waited for.
func (s *shop) waitFulfilled(ctx context.Context, attempts []*attempt, timeout time.Duration) error {
	var orderIDs, messageIDs []string
	for _, a := range attempts {
		if a.rejected == nil {
			orderIDs = append(orderIDs, a.order.ID)
			messageIDs = append(messageIDs, a.messageID)
		}
	}
	if len(orderIDs) == 0 {
		return nil
	}
	var fulfilled, published int
	err := demo.WaitFor(ctx, timeout, func(ctx context.Context) (bool, error) {
		var err error
		if fulfilled, err = s.DB.CountIn(ctx, "SELECT COUNT(DISTINCT order_id) FROM fulfilments WHERE order_id IN (?)", orderIDs); err != nil {
			return false, err
		}
		if published, err = s.DB.CountPublished(ctx, messageIDs); err != nil {
			return false, err
		}
		return fulfilled == len(orderIDs) && published == len(messageIDs), nil
	})
	if errors.Is(err, context.DeadlineExceeded) {
		return fmt.Errorf("after %s, %d of %d placed orders fulfilled and %d published", timeout, fulfilled, len(orderIDs), published)
	}
	return err
}

// report prints every order and the totals, and fails if an order was
// fulfilled twice or a rejected order left a row behind.
func (s *shop) report(ctx context.Context, stdout io.Writer, attempts []*attempt) error {
	var placedIDs, placedMsgs, rejectedIDs, rejectedMsgs []string
	for _, a := range attempts {
		if a.rejected == nil {
			placedIDs, placedMsgs = append(placedIDs, a.order.ID), append(placedMsgs, a.messageID)
		} else {
			rejectedIDs, rejectedMsgs = append(rejectedIDs, a.order.ID), append(rejectedMsgs, a.messageID)
		}
	}
	perOrder, err := s.DB.CountPerID(ctx, "SELECT order_id, COUNT(*) FROM fulfilments WHERE order_id IN (?) GROUP BY order_id", placedIDs)
	if err != nil {
		return err
	}
	published, err := s.DB.CountPublished(ctx, placedMsgs)
	if err != nil {
		return err
	}
	leftOrders, err := s.DB.CountIn(ctx, "SELECT COUNT(*) FROM orders WHERE id IN (?)", rejectedIDs)
	if err != nil {
		return err
	}
	leftMessages, err := s.DB.CountIn(ctx, "SELECT COUNT(*) FROM acemq_outbox WHERE id IN (?)", rejectedMsgs)
	if err != nil {
		return err
	}

	var problems []error
	fulfilled := 0
	w := demo.NewTable(stdout)
	fmt.Fprintln(w, "order\tproduct\tqty\t total\toutcome")
	for _, a := range attempts {
		p := products[a.order.SKU]
		outcome := ""
		switch n := perOrder[a.order.ID]; {
		case a.rejected != nil:
			outcome = "rejected: " + a.rejected.Error()
		case n == 1:
			outcome = "fulfilled once"
			fulfilled++
		case n == 0:
			outcome = "not fulfilled"
		default:
			outcome = fmt.Sprintf("fulfilled %d times", n)
			problems = append(problems, fmt.Errorf("order %d was fulfilled %d times", a.n, n))
		}
		fmt.Fprintf(w, "%d\t%s\t%d\t%3d.%02d\t%s\n", a.n, p.name, a.order.Quantity, a.order.TotalCents/100, a.order.TotalCents%100, outcome)
	}
	fmt.Fprintln(w)
	fmt.Fprintf(w, "placed\t%d\n", len(placedIDs))
	fmt.Fprintf(w, "rejected\t%d\t(left %d order rows, %d outbox rows)\n", len(rejectedIDs), leftOrders, leftMessages)
	fmt.Fprintf(w, "published\t%d\n", published)
	fmt.Fprintf(w, "fulfilled\t%d\t(each once)\n", fulfilled)
	if err := w.Flush(); err != nil {
		return err
	}
	if leftOrders+leftMessages > 0 {
		problems = append(problems, fmt.Errorf("rejected orders left %d order rows and %d outbox rows", leftOrders, leftMessages))
	}
	return errors.Join(problems...)
}
