// Command orders is the shop of the outbox pattern, in one process: placing
// an order inserts the order and its order.placed message in one
// transaction, a stock reservation that fails rolls both back, a relay
// publishes what committed to RabbitMQ, and a fulfilment consumer behind the
// inbox processes each order once. Its handler returns an order.fulfilled
// message, which the inbox writes into the outbox in the fulfilment's
// transaction and the relay publishes; a notification consumer, behind an
// inbox of its own that commits the key first, emails each customer at most
// once. One Watermill router runs both consumers, republishes on boot what
// was never processed, and runs the relay: it starts with the router and
// stops with it.
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
	prog           = "examples/orders"
	exchange       = "shop-events"     // a durable topic exchange
	orderPlaced    = "order.placed"    // a routing key: an order was placed
	orderFulfilled = "order.fulfilled" // a routing key: an order was fulfilled
	// The consumers' durable queues, and their names in the inbox.
	fulfilmentQueue    = "fulfilment"
	notificationsQueue = "notifications"
)

func main() { demo.Main(run) }

func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	cmd := demo.NewCommand(prog, stderr)
	var (
		orders  = cmd.Flags.Int("orders", 10, "how many orders to place (1 to 1000); those the stock cannot cover are rejected")
		timeout = cmd.Flags.Duration("timeout", 30*time.Second, "how long to wait for every placed order to be fulfilled and its customer notified")
	)
	if err := cmd.Flags.Parse(args); err != nil {
		return 2
	}
	if *orders < 1 || *orders > 1000 {
		fmt.Fprintf(cmd.Stderr, "%s: -orders %d: want 1 to 1000\n", prog, *orders)
		return 2
	}
	return cmd.Run(ctx, "shop.db", stdout, func(svc *demo.Service) error {
		s := &shop{Service: svc, stock: newInventory(), mail: newMailer()}
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
	mail  *mailer
}

// order is also the order.placed message's payload.
type order struct {
	ID         string `json:"order_id"`
	SKU        string `json:"sku"`
	Quantity   int    `json:"quantity"`
	TotalCents int64  `json:"total_cents"`
}

// fulfilment is the order.fulfilled message's payload.
type fulfilment struct {
	OrderID  string `json:"order_id"`
	SKU      string `json:"sku"`
	Quantity int    `json:"quantity"`
}

// announcementID is the id of order orderID's order.fulfilled message, made
// from the order's, so that the report finds the message by its order. (The
// id is the outbox's key, too: an order announced twice would still be one
// row, published once.)
func announcementID(orderID string) string { return "fulfilled-" + orderID }

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

	// The relay, in this process, is the only thing that publishes the
	// outbox's rows to RabbitMQ. It runs as a plugin of the router below:
	// it starts with the consumers, after the republisher's plugin, and
	// when the router closes it finishes its batch in flight and closes
	// with it.
	fwd, err := s.NewRelay(demo.Relay{Name: "relay"})
	if err != nil {
		return err
	}
	// order.placed's consumer reports back: its inbox marks each outbox
	// record of the topic processed in the fulfilment's transaction. On
	// boot, before any handler runs, the republisher makes pending again
	// what was published longer than its grace ago and never processed (a
	// message the broker lost, or left in a queue nobody consumed), and the
	// relay sends it again. order.fulfilled is not tracked: its consumer
	// stands for another service, with an inbox in a database of its own.
	tracked := outbox.NewTrackedTopics(orderPlaced)
	// Exchanges: the exchange its consumer reads; a record of order.placed to
	// another exchange is marked processed by no consumer here, and would be
	// sent again at every boot.
	rp, err := outbox.NewRepublisher(s.DB.DB, outbox.RepublisherConfig{TrackedTopics: tracked, Exchanges: []string{exchange}, Notify: fwd.Notify, Logger: s.Log})
	if err != nil {
		return err
	}

	err = s.StartRouter(ctx, demo.Router{
		Plugins: []message.RouterPlugin{rp.Plugin(), fwd.Plugin()},
		Consumers: []demo.Consumer{{
			// Behind the inbox, each order is fulfilled once, however often
			// its message is delivered, and the order.fulfilled message the
			// handler returns is written into the outbox in the same
			// transaction: added as
			// router.AddHandler("fulfilment", "order.placed", sub, "order.fulfilled", inbox.Publisher(), handler).
			Exchange: exchange, Queue: fulfilmentQueue, Topic: orderPlaced, Publishes: orderFulfilled,
			Inbox: outbox.InboxConfig{
				MarkOutboxProcessed: true,
				TrackedTopics:       tracked,
				Outbox:              outbox.TxPublisherConfig{Exchange: exchange, ContentType: demo.ContentTypeJSON},
			},
			Handler: demo.InboxReturningHandler(orderPlaced, fulfil),
			Outside: []message.HandlerMiddleware{wakeAfterCommit(fwd)},
		}, {
			// An email is an effect no transaction holds: the inbox commits
			// the key before the handler runs, so that a crash loses an
			// email rather than sending a second one.
			Exchange: exchange, Queue: notificationsQueue, Topic: orderFulfilled,
			Inbox:   outbox.InboxConfig{AtMostOnce: true},
			Handler: demo.AtMostOnceHandler(orderFulfilled, s.mail.notify),
		}},
	})
	if err != nil {
		return err
	}

	// Orders only now that the router runs: every consumer has subscribed,
	// which bound its queue, so each message the relay publishes has a
	// route. (The relay publishes mandatory: a message no queue is bound
	// for fails, and is retried until it is stuck.)
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
			fwd.Notify() // committed: wake the relay rather than wait for its poll
		}
	}

	ids := idsOf(attempts)
	waitErr := s.waitNotified(ctx, ids, timeout)
	if err := s.report(ctx, stdout, attempts, ids); err != nil {
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
	if messageID, err = demo.PublishJSON(ctx, tx, exchange, orderPlaced, o); err != nil {
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

// fulfil is the fulfilment consumer's handler, behind the inbox: the
// fulfilment row commits with the inbox's key for the message, and so does
// the order.fulfilled message it returns, which the inbox writes into the
// outbox through the same transaction.
func fulfil(msg *message.Message, tx *sqlx.Tx, o order) ([]*message.Message, error) {
	if _, err := tx.ExecContext(msg.Context(), tx.Rebind("INSERT INTO fulfilments (order_id, sku, quantity, message_id) VALUES (?, ?, ?, ?)"),
		o.ID, o.SKU, o.Quantity, msg.UUID); err != nil {
		return nil, err
	}
	announcement, err := demo.NewJSONMessage(announcementID(o.ID), fulfilment{OrderID: o.ID, SKU: o.SKU, Quantity: o.Quantity})
	if err != nil {
		return nil, err
	}
	return []*message.Message{announcement}, nil
}

// wakeAfterCommit, outside the inbox, wakes the relay once the inbox has
// committed what a handler returned, rather than leave it to the relay's
// next poll. (On PostgreSQL the commit wakes it by itself, with NOTIFY.)
func wakeAfterCommit(fwd *outbox.Forwarder) message.HandlerMiddleware {
	return func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			out, err := h(msg)
			if err == nil {
				fwd.Notify()
			}
			return out, err
		}
	}
}

// ids are the ids of a run's orders and of their messages, which it counts:
// the database may hold other runs' rows, and the queues other runs'
// messages.
type ids struct {
	placed, placedMsgs, announcements []string // of the orders that committed
	rejected, rejectedMsgs            []string // of those that rolled back
}

func idsOf(attempts []*attempt) ids {
	var ids ids
	for _, a := range attempts {
		if a.rejected == nil {
			ids.placed, ids.placedMsgs = append(ids.placed, a.order.ID), append(ids.placedMsgs, a.messageID)
			ids.announcements = append(ids.announcements, announcementID(a.order.ID))
		} else {
			ids.rejected, ids.rejectedMsgs = append(ids.rejected, a.order.ID), append(ids.rejectedMsgs, a.messageID)
		}
	}
	return ids
}

// progress is what has become of the placed orders so far.
type progress struct {
	fulfilments map[string]int // fulfilment rows per order id
	published   int            // order.placed messages marked published
	processed   int            // order.placed messages marked processed, by the fulfilment's inbox
	announced   int            // order.fulfilled messages marked published
	notified    int            // orders whose customer was emailed
	emails      int            // emails to them
}

// progress counts what has become of the orders of ids.
func (s *shop) progress(ctx context.Context, ids ids) (p progress, err error) {
	if p.fulfilments, err = s.DB.CountPerID(ctx, "SELECT order_id, COUNT(*) FROM fulfilments WHERE order_id IN (?) GROUP BY order_id", ids.placed); err != nil {
		return p, err
	}
	if p.published, err = s.DB.CountPublished(ctx, ids.placedMsgs); err != nil {
		return p, err
	}
	if p.processed, err = s.DB.CountIn(ctx, "SELECT COUNT(*) FROM acemq_outbox WHERE processed_at IS NOT NULL AND id IN (?)", ids.placedMsgs); err != nil {
		return p, err
	}
	if p.announced, err = s.DB.CountPublished(ctx, ids.announcements); err != nil {
		return p, err
	}
	p.notified, p.emails = s.mail.sent(ids.placed)
	return p, nil
}

// waitNotified waits until every placed order has its fulfilment, its
// order.placed and order.fulfilled messages are marked published, and its
// customer has been notified. A consumer can finish before the relay marks
// its last batch, so the marks are waited for too.
func (s *shop) waitNotified(ctx context.Context, ids ids, timeout time.Duration) error {
	n := len(ids.placed)
	var p progress
	err := demo.WaitFor(ctx, timeout, func(ctx context.Context) (bool, error) {
		var err error
		p, err = s.progress(ctx, ids)
		return len(p.fulfilments) == n && p.published == n && p.announced == n && p.notified == n, err
	})
	if errors.Is(err, context.DeadlineExceeded) {
		return fmt.Errorf("after %s, of %d placed orders %d fulfilled, %d published, %d announced and %d notified",
			timeout, n, len(p.fulfilments), p.published, p.announced, p.notified)
	}
	return err
}

// report prints every order and the totals, and fails if an order was
// fulfilled twice or not marked processed, a customer was notified twice,
// or a rejected order left a row behind.
func (s *shop) report(ctx context.Context, stdout io.Writer, attempts []*attempt, ids ids) error {
	got, err := s.progress(ctx, ids)
	if err != nil {
		return err
	}
	leftOrders, err := s.DB.CountIn(ctx, "SELECT COUNT(*) FROM orders WHERE id IN (?)", ids.rejected)
	if err != nil {
		return err
	}
	leftMessages, err := s.DB.CountIn(ctx, "SELECT COUNT(*) FROM acemq_outbox WHERE id IN (?)", ids.rejectedMsgs)
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
		switch n := got.fulfilments[a.order.ID]; {
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
	fmt.Fprintf(w, "placed\t%d\n", len(ids.placed))
	fmt.Fprintf(w, "rejected\t%d\t(left %d order rows, %d outbox rows)\n", len(ids.rejected), leftOrders, leftMessages)
	fmt.Fprintf(w, "published\t%d\n", got.published)
	fmt.Fprintf(w, "fulfilled\t%d\t(each once)\n", fulfilled)
	fmt.Fprintf(w, "announced\t%d\t(%s through the outbox)\n", got.announced, orderFulfilled)
	fmt.Fprintf(w, "notified\t%d\t(at most once)\n", got.notified)
	if err := w.Flush(); err != nil {
		return err
	}
	if got.emails > got.notified {
		problems = append(problems, fmt.Errorf("%d emails to the customers of %d orders; want at most one each", got.emails, got.notified))
	}
	if got.processed != len(got.fulfilments) {
		problems = append(problems, fmt.Errorf("%d %s records marked processed for %d orders fulfilled: republish would send the others again", got.processed, orderPlaced, len(got.fulfilments)))
	}
	if leftOrders+leftMessages > 0 {
		problems = append(problems, fmt.Errorf("rejected orders left %d order rows and %d outbox rows", leftOrders, leftMessages))
	}
	return errors.Join(problems...)
}
