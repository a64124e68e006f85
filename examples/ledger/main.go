// Command ledger is the payments side of the outbox pattern: a capture
// commits the payment's new status and its payment.captured message
// together, the relay publishes the message, and the ledger consumer posts
// its entry and its processed_messages row in one transaction.
//
// With -kill-relay the first relay is a child process that kills itself with
// SIGKILL after the broker confirmed its messages and before it marked them
// published: the one window in which the outbox sends a message twice. A
// second relay publishes the same rows again, and the inbox absorbs the
// copies: the ledger still has one entry per capture.
//
//	go run ./examples/ledger -kill-relay
//	go run ./examples/ledger -kill-relay -db 'postgres://postgres@localhost:5432/test?sslmode=disable'
//
// It needs RabbitMQ (docker compose up -d rabbitmq), at -amqp.
package main

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/examples/internal/demo"
)

const (
	prog     = "examples/ledger"
	exchange = "payments"         // a durable topic exchange
	topic    = "payment.captured" // the routing key
	queue    = "ledger"           // the ledger consumer's durable queue, and its name in the inbox
)

// The killed relay's timings. On SQLite a claim is a lease, and a relay
// under Run holds a lock file beside the database: the second relay finds
// the killed relay's file unlocked as it starts and takes its rows back at
// once. The lease is short here for where that cannot be seen (a platform
// without flock), when the rows wait for it to expire. (PostgreSQL and
// MySQL hold claims as row locks, released the moment the dead relay's
// connection drops.)
const (
	killedRelayPublishTimeout = 2 * time.Second
	killedRelayLease          = 2 * killedRelayPublishTimeout // the least the Forwarder accepts
)

func main() { demo.Main(run) }

func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	cmd := demo.NewCommand(prog, stderr)
	var (
		captures  = cmd.Flags.Int("captures", 5, "how many payments to capture (1 to 100)")
		killRelay = cmd.Flags.Bool("kill-relay", false, "run the first relay as a child process that dies after the broker's confirm and before the mark")
		timeout   = cmd.Flags.Duration("timeout", 30*time.Second, "how long to wait for each step")
	)
	hideFlags(cmd.Flags)
	role := cmd.Flags.String("role", "", "") // hidden: "relay" is the child process of -kill-relay
	if err := cmd.Flags.Parse(args); err != nil {
		return 2
	}
	if *captures < 1 || *captures > 100 {
		// At most one relay batch (100 rows), so that the killed relay has
		// published every capture when it dies.
		fmt.Fprintf(cmd.Stderr, "%s: -captures %d: want 1 to 100\n", prog, *captures)
		return 2
	}

	switch *role {
	case "":
	case "relay":
		if err := runKilledRelay(ctx, cmd.DSN, cmd.AMQPURL, *timeout, stdout, cmd.Logger()); err != nil {
			fmt.Fprintf(cmd.Stderr, "%s: relay: %v\n", prog, err)
		}
		return 1 // this relay was to die by SIGKILL, not to return
	default:
		fmt.Fprintf(cmd.Stderr, "%s: -role %q: the only role is relay\n", prog, *role)
		return 2
	}

	return cmd.Run(ctx, "payments.db", stdout, func(svc *demo.Service) error {
		l := &ledger{Service: svc, timeout: *timeout, tally: newTally()}
		return l.run(ctx, *captures, *killRelay, stdout)
	})
}

// hideFlags makes -h list the flags defined so far and no later ones.
func hideFlags(flags *flag.FlagSet) {
	shown := flag.NewFlagSet(flags.Name(), flag.ContinueOnError)
	flags.VisitAll(func(f *flag.Flag) { shown.Var(f.Value, f.Name, f.Usage) })
	flags.Usage = func() {
		fmt.Fprintf(flags.Output(), "Usage of %s:\n", flags.Name())
		shown.SetOutput(flags.Output())
		shown.PrintDefaults()
	}
}

// schema is the service's own tables; the outbox's and the inbox's come
// from outbox.Migrate. IF NOT EXISTS and ids unique to each payment, so
// that a second run against the same database works and counts only its own.
var schema = []string{
	`CREATE TABLE IF NOT EXISTS payments (
    id           varchar(64) NOT NULL PRIMARY KEY,
    status       varchar(16) NOT NULL,
    amount_cents bigint      NOT NULL,
    currency     char(3)     NOT NULL
)`,
	// No key on payment_id, on purpose: the inbox is what keeps the ledger
	// to one entry per capture, and a copy that got through would show here
	// as a second entry.
	`CREATE TABLE IF NOT EXISTS ledger_entries (
    payment_id   varchar(64) NOT NULL,
    amount_cents bigint      NOT NULL,
    currency     char(3)     NOT NULL,
    message_id   varchar(64) NOT NULL
)`,
}

// captured is the payment.captured message's payload.
type captured struct {
	PaymentID   string `json:"payment_id"`
	AmountCents int64  `json:"amount_cents"`
	Currency    string `json:"currency"`
}

// amounts cycle, so that every run captures the same payments.
var amounts = []int64{4250, 1999, 12000, 350, 7800}

type ledger struct {
	*demo.Service
	timeout time.Duration
	tally   *tally
}

func (l *ledger) run(ctx context.Context, n int, killRelay bool, stdout io.Writer) error {
	if err := l.Migrate(ctx, "the service's tables", schema); err != nil {
		return err
	}
	// The consumer first, so that no relay publishes to a route that is not
	// there. The tally, outside the inbox, sees every delivery, duplicates
	// included.
	err := l.StartConsumer(ctx, demo.Consumer{
		Exchange: exchange, Queue: queue, Topic: topic,
		Handler: demo.InboxHandler(topic, l.post),
		Outside: []message.HandlerMiddleware{l.tally.middleware},
	})
	if err != nil {
		return err
	}

	var payments, messageIDs []string
	var shown []string
	for i := range n {
		p := captured{PaymentID: watermill.NewUUID(), AmountCents: amounts[i%len(amounts)], Currency: "GBP"}
		if err := l.authorize(ctx, p); err != nil {
			return err
		}
		id, err := l.capture(ctx, p)
		if err != nil {
			return err
		}
		payments, messageIDs = append(payments, p.PaymentID), append(messageIDs, id)
		l.tally.expect(id)
		shown = append(shown, fmt.Sprintf("%s %d.%02d", p.Currency, p.AmountCents/100, p.AmountCents%100))
	}
	fmt.Fprintf(stdout, "captured %d payments: %s\n", n, strings.Join(shown, ", "))

	var first []string // ours that the killed relay had confirmed
	if killRelay {
		if first, err = l.killedRelay(ctx, messageIDs, stdout); err != nil {
			return err
		}
	}

	// Relay 2, in this process, counts what the broker confirmed for it.
	var second confirmed
	_, err = l.StartRelay(ctx, demo.Relay{
		Name: "relay 2",
		Wrap: func(dest *outbox.AMQPDestination) outbox.Destination {
			return &watchConfirms{dest: dest, confirmed: second.add}
		},
		Config: outbox.ForwarderConfig{
			PollInterval: 200 * time.Millisecond, // no Notify after the captures: they were committed before this relay started
		},
	})
	if err != nil {
		return err
	}
	if killRelay {
		wait := ""
		if l.DB.Dialect == outbox.SQLite {
			wait = ", taking back relay 1's SQLite leases as it starts: its lock file is unlocked, its process gone"
		}
		fmt.Fprintf(stdout, "relay 2 (in this process%s) publishes the pending rows again\n", wait)
	}

	// Done when every capture's message is marked published and every copy
	// the relays published has been delivered and acked.
	var published int
	err = demo.WaitFor(ctx, l.timeout+killedRelayLease, func(ctx context.Context) (bool, error) {
		var err error
		if published, err = l.DB.CountPublished(ctx, messageIDs); err != nil {
			return false, err
		}
		sent := len(first) + len(second.ours(messageIDs))
		return published == len(messageIDs) && l.tally.acked() >= sent, nil
	})
	if errors.Is(err, context.DeadlineExceeded) {
		err = fmt.Errorf("after %s, %d of %d messages published, %d deliveries acked", l.timeout+killedRelayLease, published, len(messageIDs), l.tally.acked())
	}
	return errors.Join(err, l.report(ctx, stdout, payments, messageIDs, first, second.ours(messageIDs), killRelay))
}

// authorize records the payment as authorized: no message yet.
func (l *ledger) authorize(ctx context.Context, p captured) error {
	_, err := l.DB.ExecContext(ctx, l.DB.Rebind("INSERT INTO payments (id, status, amount_cents, currency) VALUES (?, 'authorized', ?, ?)"),
		p.PaymentID, p.AmountCents, p.Currency)
	return err
}

// capture is the business transaction: the payment becomes captured and its
// payment.captured message is written, together or not at all.
func (l *ledger) capture(ctx context.Context, p captured) (messageID string, err error) {
	tx, err := l.DB.BeginTxx(ctx, nil)
	if err != nil {
		return "", err
	}
	defer tx.Rollback() // after Commit, does nothing

	res, err := tx.ExecContext(ctx, tx.Rebind("UPDATE payments SET status = 'captured' WHERE id = ? AND status = 'authorized'"), p.PaymentID)
	if err != nil {
		return "", err
	}
	if n, err := res.RowsAffected(); err != nil || n != 1 {
		return "", errors.Join(err, fmt.Errorf("payment %s is not authorized", p.PaymentID))
	}
	if messageID, err = demo.PublishJSON(ctx, tx, exchange, topic, p); err != nil {
		return "", err
	}
	return messageID, tx.Commit()
}

// killedRelay runs relay 1 as a child process of this very program, which
// kills itself after the broker's confirm and before the mark, and shows
// what it leaves: rows still pending in the outbox, messages already on the
// broker. It returns the ids of ours that the broker confirmed.
func (l *ledger) killedRelay(ctx context.Context, ours []string, stdout io.Writer) ([]string, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	childCtx, cancel := context.WithTimeout(ctx, l.timeout)
	defer cancel()
	// The child writes the ids the broker confirmed to its stdout, one a
	// line, just before it dies; its stderr is ours.
	var confirmedOut bytes.Buffer
	child := exec.CommandContext(childCtx, self, "-role", "relay", "-db", l.DB.DSN, "-amqp", l.AMQPURL, "-timeout", l.timeout.String())
	child.Stdout, child.Stderr = &confirmedOut, l.Stderr
	err = child.Run()

	var first []string
	for sc := bufio.NewScanner(&confirmedOut); sc.Scan(); {
		first = append(first, sc.Text())
	}
	first = intersect(first, ours)
	var exit *exec.ExitError
	switch {
	case childCtx.Err() != nil:
		return nil, fmt.Errorf("relay 1 (pid %d) did not die within %s (%v); killed it", child.Process.Pid, l.timeout, err)
	case !errors.As(err, &exit) || len(first) == 0:
		return nil, fmt.Errorf("relay 1 was to die by SIGKILL after the broker confirmed our messages; it ended with %v, having confirmed %d of them", err, len(first))
	}
	fmt.Fprintf(stdout, "relay 1 (child process %d): the broker confirmed %d messages, then the relay died (%v) before marking them published\n",
		child.Process.Pid, len(first), exit)

	pending, err := l.DB.CountIn(ctx, "SELECT COUNT(*) FROM acemq_outbox WHERE published_at IS NULL AND id IN (?)", first)
	if err != nil {
		return nil, err
	}
	// The consumer is running: the broker had the messages if they arrive
	// with no relay alive.
	err = demo.WaitFor(ctx, l.timeout, func(context.Context) (bool, error) { return l.tally.acked() >= len(first), nil })
	if err != nil {
		return nil, fmt.Errorf("the messages relay 1 saw confirmed did not reach the ledger consumer: %d of %d within %s", l.tally.acked(), len(first), l.timeout)
	}
	fmt.Fprintf(stdout, "outbox: %d of them still pending, while the ledger consumer has received all %d from the broker\n", pending, len(first))
	return first, nil
}

// post is the ledger's handler, behind the inbox: the entry commits with the
// inbox's key for the message, and the tally hears that it ran.
func (l *ledger) post(msg *message.Message, tx *sqlx.Tx, c captured) error {
	if _, err := tx.ExecContext(msg.Context(), tx.Rebind("INSERT INTO ledger_entries (payment_id, amount_cents, currency, message_id) VALUES (?, ?, ?, ?)"),
		c.PaymentID, c.AmountCents, c.Currency, msg.UUID); err != nil {
		return err
	}
	l.tally.ran(msg)
	return nil
}

// report prints the summary and fails unless every capture has exactly one
// ledger entry.
func (l *ledger) report(ctx context.Context, stdout io.Writer, payments, messageIDs, first, second []string, killRelay bool) error {
	entries, err := l.DB.CountPerID(ctx, "SELECT payment_id, COUNT(*) FROM ledger_entries WHERE payment_id IN (?) GROUP BY payment_id", payments)
	if err != nil {
		return err
	}
	processed, err := l.DB.CountIn(ctx, "SELECT COUNT(*) FROM processed_messages WHERE consumer_name = 'ledger' AND message_id IN (?)", messageIDs)
	if err != nil {
		return err
	}
	total, once := 0, 0
	for _, id := range payments {
		total += entries[id]
		if entries[id] == 1 {
			once++
		}
	}

	deliveries, duplicates := l.tally.counts()
	fmt.Fprintln(stdout)
	w := demo.NewTable(stdout)
	fmt.Fprintf(w, "captures\t%d\n", len(payments))
	if killRelay {
		fmt.Fprintf(w, "published by relay 1\t%d\t(confirmed, never marked)\n", len(first))
		fmt.Fprintf(w, "published by relay 2\t%d\n", len(second))
	} else {
		fmt.Fprintf(w, "published\t%d\n", len(second))
	}
	fmt.Fprintf(w, "deliveries\t%d\n", deliveries)
	fmt.Fprintf(w, "duplicates absorbed\t%d\n", duplicates)
	fmt.Fprintf(w, "processed_messages\t%d\n", processed)
	fmt.Fprintf(w, "ledger entries\t%d\t(%d of %d captures with exactly one)\n", total, once, len(payments))
	if err := w.Flush(); err != nil {
		return err
	}
	if once != len(payments) || total != len(payments) {
		return fmt.Errorf("%d ledger entries for %d captures; want exactly one each", total, len(payments))
	}
	return nil
}

// tally counts, outside the inbox, the deliveries of this run's messages
// that were acked, and how many of them the inbox acked without running the
// handler: the duplicates it absorbed.
type tally struct {
	mu         sync.Mutex
	ours       map[string]bool
	ranFor     map[*message.Message]bool // deliveries whose handler ran
	deliveries int
	duplicates int
}

func newTally() *tally {
	return &tally{ours: map[string]bool{}, ranFor: map[*message.Message]bool{}}
}

// expect adds a message id of this run; the queue may hold other runs'.
func (t *tally) expect(id string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.ours[id] = true
}

// ran is called by the handler: this delivery got through the inbox.
func (t *tally) ran(msg *message.Message) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.ranFor[msg] = true
}

func (t *tally) middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		out, err := h(msg)
		t.mu.Lock()
		defer t.mu.Unlock()
		ran := t.ranFor[msg]
		delete(t.ranFor, msg)
		if err == nil && t.ours[msg.UUID] {
			t.deliveries++
			if !ran {
				t.duplicates++
			}
		}
		return out, err
	}
}

func (t *tally) acked() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.deliveries
}

func (t *tally) counts() (deliveries, duplicates int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.deliveries, t.duplicates
}

func intersect(ids, with []string) []string {
	in := make(map[string]bool, len(with))
	for _, id := range with {
		in[id] = true
	}
	var out []string
	for _, id := range ids {
		if in[id] {
			out = append(out, id)
			delete(in, id)
		}
	}
	return out
}
