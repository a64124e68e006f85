package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testamqp"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// oversized is a test's outbox: rows before and after one whose body is
// over a size limit, each side unkeyed and keyed (on one key) in turn.
type oversized struct {
	db    *testdb.DB
	b     *testamqp.Broker
	queue string
	big   string   // the oversized row's id
	ids   []string // the other rows, in order
	keyed []string // of them, the keyed ones, in seq order
}

// newOversized writes n rows of each kind before and after a row written
// by writeBig (another library's row, or TxPublisher's).
func newOversized(t *testing.T, db *testdb.DB, n int, writeBig func(o *oversized)) *oversized {
	t.Helper()
	o := &oversized{db: db, b: testamqp.New(t), big: watermill.NewUUID()}
	o.queue = o.b.Queue("plain", "keyed")
	cfg := outbox.TxPublisherConfig{Exchange: o.b.Exchange}
	publish := func(when string) {
		for i := range n {
			plain := message.NewMessage(watermill.NewUUID(), []byte(fmt.Sprintf("plain %s %d", when, i)))
			onKey := message.NewMessage(watermill.NewUUID(), []byte(fmt.Sprintf("keyed %s %d", when, i)))
			onKey.Metadata.Set(outbox.MetadataAggregateID, "order-1")
			publishInTx(t, db, "plain", []*message.Message{plain}, cfg)
			publishInTx(t, db, "keyed", []*message.Message{onKey}, cfg)
			o.ids = append(o.ids, plain.UUID, onKey.UUID)
			o.keyed = append(o.keyed, onKey.UUID)
		}
	}
	publish("before")
	writeBig(o)
	publish("after")
	return o
}

// relay runs f until every row but the big one is published and the big
// one is stuck (maxAttempts), and returns how long that took.
func (o *oversized) relay(t *testing.T, f *outbox.Forwarder, maxAttempts int) time.Duration {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	start := time.Now()
	go func() { done <- f.Run(ctx) }()
	waitFor(t, 60*time.Second, "every other row published and the big one stuck", func() bool {
		return pendingCount(t, f) == 0 && stateOf(t, o.db, o.big).Attempts >= maxAttempts
	})
	took := time.Since(start)
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	return took
}

// check fails the test unless every other row arrived, the key's in order,
// and the big one did not.
func (o *oversized) check(t *testing.T) (deliveries int) {
	t.Helper()
	got := o.b.Drain(o.queue, len(o.ids), 10*time.Second)
	arrived, seen := countIDs(got), map[string]bool{}
	var keyedOrder []string
	for _, d := range got {
		if strings.HasPrefix(string(d.Body), "keyed") && !seen[d.MessageId] {
			seen[d.MessageId] = true
			keyedOrder = append(keyedOrder, d.MessageId)
		}
	}
	for _, id := range o.ids {
		if arrived[id] == 0 {
			t.Errorf("row %s never arrived (%d of %d)", id, len(arrived), len(o.ids))
		}
	}
	if arrived[o.big] != 0 {
		t.Errorf("the oversized row arrived")
	}
	if fmt.Sprint(keyedOrder) != fmt.Sprint(o.keyed) {
		t.Errorf("the key's rows arrived out of order")
	}
	return len(got)
}

// failures counts the failures OnError reports for one message id.
type failures struct {
	id   string
	mu   sync.Mutex
	errs []error
}

func (c *failures) onError(err error, dest outbox.ErrorContext) {
	if dest.MessageID == c.id {
		c.mu.Lock()
		c.errs = append(c.errs, err)
		c.mu.Unlock()
	}
}

func (c *failures) all() []error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.errs
}

// A row whose body is over the broker's max_message_size (RabbitMQ reads
// the whole body, then closes the channel over it: 406
// PRECONDITION_FAILED) among rows before and after it, keyed and unkeyed.
// It fails alone: stuck at the broker's first refusal, with the broker's
// reason in last_error; every other row arrives, a key's in order, on the
// one connection. It was sent again MaxAttempts times (5 here, 10 by
// default), the whole body each time, and each time held back every row
// behind it through a backoff: all were through after 15 to 19 s here on
// PostgreSQL (38 s on SQLite, which rewrites the whole row at each claim
// and mark), against 2 s now.
//
// The row is another library's, its body made by the database, which
// spares the test sending it there. On PostgreSQL only: the relay's part
// is the same on every database, and MariaDB's default
// max_allowed_packet (16 MiB) refuses the row.
func TestForwarder_Run_BodyOverBrokersMaxMessageSize_StuckAtFirstRefusalOthersFlow(t *testing.T) {
	limit := testamqp.MaxMessageSize(t)
	db := migrated(t, testdb.Postgres)
	o := newOversized(t, db, 15, func(o *oversized) {
		if _, err := db.Exec("INSERT INTO acemq_outbox (id, exchange_name, routing_key, body, body_encoding, content_type, headers, created_at)"+
			" VALUES ($1, $2, 'plain', repeat('x', $3), 'utf-8', 'text/plain', '{}', $4)", o.big, o.b.Exchange, limit+1, time.Now().UTC()); err != nil {
			t.Fatal(err)
		}
	})
	failed := &failures{id: o.big}
	connects := &countingLogger{LoggerAdapter: watermill.NopLogger{}, match: "Connected to RabbitMQ"}
	const maxAttempts = 5
	f := newForwarder(t, db, outbox.ForwarderConfig{
		BatchSize: 10, MaxAttempts: maxAttempts, RetryMin: 100 * time.Millisecond, RetryMax: 500 * time.Millisecond, OnError: failed.onError,
	}, outbox.AMQPConfig{Logger: connects})
	took := o.relay(t, f, maxAttempts)
	deliveries := o.check(t)

	s := stateOf(t, db, o.big)
	if s.Published || s.Attempts != maxAttempts || !strings.Contains(s.LastError, "message size") || !strings.Contains(s.LastError, fmt.Sprint(limit)) {
		t.Errorf("oversized row: %+v; want stuck (attempts %d) with the broker's refusal, naming its limit, in last_error", s, maxAttempts)
	}
	errs := failed.all()
	if len(errs) != 1 {
		t.Errorf("the oversized row failed %d times, each a send of its %d bytes holding back the rows behind it; want once: the broker's refusal says no retry will do", len(errs), limit+1)
	}
	var tooLarge *outbox.MessageTooLargeError
	if len(errs) > 0 && (!errors.As(errs[0], &tooLarge) || tooLarge.Size != limit+1 || tooLarge.Max != limit) {
		t.Errorf("failure %v; want a *MessageTooLargeError of %d bytes over %d", errs[0], limit+1, limit)
	}
	if c := connects.n.Load(); c != 1 {
		t.Errorf("%d connections opened; want 1: a channel closed over one message is no lost connection", c)
	}
	t.Logf("%d rows around one of %d bytes: the others published and it stuck after %s, %d deliveries; last_error %q",
		len(o.ids), limit+1, took.Round(time.Millisecond), deliveries, s.LastError)
}

// With AMQPConfig.MaxMessageSize, a larger body is not sent at all: stuck
// at once with a *MessageTooLargeError naming the option, and the rows
// around it arrive. A body at the limit goes.
func TestForwarder_Run_BodyOverMaxMessageSize_NeverSentOthersFlow(t *testing.T) {
	const limit = 64 << 10
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		var atLimit string
		o := newOversized(t, db, 5, func(o *oversized) {
			fits := message.NewMessage(watermill.NewUUID(), []byte("plain"+strings.Repeat("x", limit-5)))
			atLimit = fits.UUID
			publishInTx(t, db, "plain", []*message.Message{message.NewMessage(o.big, []byte(strings.Repeat("x", limit+1))), fits},
				outbox.TxPublisherConfig{Exchange: o.b.Exchange})
		})
		o.ids = append(o.ids, atLimit)
		failed := &failures{id: o.big}
		f := newForwarder(t, db, outbox.ForwarderConfig{BatchSize: 4, MaxAttempts: 3, OnError: failed.onError}, outbox.AMQPConfig{MaxMessageSize: limit})
		o.relay(t, f, 3)
		o.check(t)

		var tooLarge *outbox.MessageTooLargeError
		if errs := failed.all(); len(errs) != 1 || !errors.As(errs[0], &tooLarge) || tooLarge.Size != limit+1 || tooLarge.Max != limit ||
			!outbox.IsPermanent(errs[0]) || !strings.Contains(errs[0].Error(), "AMQPConfig.MaxMessageSize") {
			t.Errorf("failures %v; want one permanent *MessageTooLargeError naming AMQPConfig.MaxMessageSize", errs)
		}
		if s := stateOf(t, db, o.big); s.Published || !strings.Contains(s.LastError, "not sent") {
			t.Errorf("oversized row: %+v; want stuck, not sent", s)
		}
	})
}
