package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os/exec"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/tests"
	"github.com/jmoiron/sqlx"
	amqp "github.com/rabbitmq/amqp091-go"
	"go.uber.org/goleak"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// TestPubSub_OutboxThroughRelayToWatermillAMQP_PassesWatermillSuite runs
// Watermill's own pub/sub test suite over the whole path: every Publish is a
// committed database transaction written by outbox.TxPublisher, one Forwarder
// relays the rows to RabbitMQ, and watermill-amqp's subscriber consumes them.
//
// Features, against what watermill-amqp declares for its own durable queue
// config (ConsumerGroups false there, because a queue is shared by everyone;
// we add the consumer-group constructor of its durable pub/sub config, so
// true here):
//   - ExactlyOnceDelivery false: the relay is at-least-once on purpose (a
//     relay dying between confirm and mark publishes again); the inbox, not
//     the transport, makes it exactly-once in effect.
//   - GuaranteedOrder and GuaranteedOrderWithSingleSubscriber true: one
//     relay claims rows in created_at order, which the TxPublisher stamps
//     strictly increasing within the process, and publishes them in that
//     order on one channel; a queue keeps it for a single consumer. (With
//     several relays, or when a record fails mid-window, later records can
//     overtake it; the suite exercises neither.)
//   - Persistent true: rows, durable queues, persistent delivery.
//   - ContextPreserved false: the message context does not cross a broker.
//   - RestartServiceCommand empty: restarting the shared broker is not this
//     file's business; TestReconnect skips.
//
// PostgreSQL runs the full suite (some 20,000 messages, one transaction
// each for most); MySQL and SQLite run its short form, which takes every path
// the full one does with fewer messages. The three run side by side; with
// -short, all three run the short form.
func TestPubSub_OutboxThroughRelayToWatermillAMQP_PassesWatermillSuite(t *testing.T) {
	testdb.Require(t, "amqp")
	// Registered before the databases' subtests, so it runs after all of
	// them: the relays, subscribers and pools closed, nothing of theirs may
	// still run.
	leakBaseline := goleak.IgnoreCurrent()
	t.Cleanup(func() { verifyNoLeak(t, append([]goleak.Option{leakBaseline}, ignoreSuiteMultiplier...)...) })

	for _, kind := range testdb.Kinds {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			h := newSuiteHarness(t, kind)
			runSuite(t, tests.Features{
				ConsumerGroups:                      true,
				ExactlyOnceDelivery:                 false,
				GuaranteedOrder:                     true,
				GuaranteedOrderWithSingleSubscriber: true,
				Persistent:                          true,
				ContextPreserved:                    false,
				ForceShort:                          kind != testdb.Postgres,
			}, h.queuePubSub, h.consumerGroupPubSub)
		})
	}
}

// verifyNoLeak is goleak.VerifyNone with a longer wait. The reader and
// heartbeater goroutines of a closed amqp091-go connection end after Close
// returns, once they see the socket shut, and so do the goroutines of a
// subscriber that is winding down; on this machine, loaded by the other
// test packages, that can take longer than goleak's own wait (about a
// second). What still runs after leakWait was never stopped, and fails
// the test; the broker's list of connections, logged then, names the ones
// that have a connection_name.
func verifyNoLeak(t *testing.T, opts ...goleak.Option) {
	t.Helper()
	deadline := time.Now().Add(leakWait)
	for {
		err := goleak.Find(opts...)
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			if out, lerr := exec.Command("rabbitmqctl", "-q", "list_connections", "name", "client_properties").CombinedOutput(); lerr == nil {
				t.Logf("the broker's connections now:\n%s", out)
			}
			t.Error(err)
			return
		}
		time.Sleep(100 * time.Millisecond) // polling the goroutines, not synchronising with them
	}
}

// leakWait bounds verifyNoLeak's wait for goroutines that are ending.
const leakWait = 15 * time.Second

// ignoreSuiteMultiplier leaves out the suite's own leak: the subscriber
// its tests multiply (watermill's internal/subscriber multiplier) copies
// each subscriber's messages to an unbuffered channel with no way to stop,
// so a copy that takes a message after its test stopped reading blocks on
// the send for good, with the goroutine that waits to close the channel.
// Seen once in four runs of this test; neither goroutine is ours or holds
// a connection.
var ignoreSuiteMultiplier = []goleak.Option{
	goleak.IgnoreTopFunction("github.com/ThreeDotsLabs/watermill/internal/subscriber.(*multiplier).Subscribe.func2"),
	goleak.IgnoreAnyFunction("github.com/ThreeDotsLabs/watermill/internal/subscriber.(*multiplier).Subscribe.func3"),
}

// runSuite is tests.TestPubSub less one test, which runs every other in the
// same way (in parallel, each under a fresh test id).
//
// Left out: TestConcurrentSubscribeMultipleTopics publishes copies of the
// same messages (Watermill's Copy keeps the UUID) to ten topics. The message
// id is the outbox row's primary key and every consumer's dedupe key, so the
// outbox refuses the copies with ErrDuplicateID rather than write one row
// and lose nine messages without a word; a user fanning a message out gives
// each copy its own UUID. TestTxPublisher_SameIDToAnotherDestination_*
// covers that refusal.
func runSuite(t *testing.T, features tests.Features, pubSub tests.PubSubConstructor, groups tests.ConsumerGroupPubSubConstructor) {
	type suiteTest struct {
		name string
		fn   func(*testing.T, tests.TestContext, tests.PubSubConstructor)
	}
	for _, st := range []suiteTest{
		{"TestPublishSubscribe", tests.TestPublishSubscribe},
		{"TestConcurrentSubscribe", tests.TestConcurrentSubscribe},
		{"TestResendOnError", tests.TestResendOnError},
		{"TestNoAck", tests.TestNoAck},
		{"TestContinueAfterSubscribeClose", tests.TestContinueAfterSubscribeClose},
		{"TestConcurrentClose", tests.TestConcurrentClose},
		{"TestContinueAfterErrors", tests.TestContinueAfterErrors},
		{"TestPublishSubscribeInOrder", tests.TestPublishSubscribeInOrder},
		{"TestPublisherClose", tests.TestPublisherClose},
		{"TestTopic", tests.TestTopic},
		{"TestMessageCtx", tests.TestMessageCtx},
		{"TestSubscribeCtx", tests.TestSubscribeCtx},
		{"TestNewSubscriberReceivesOldMessages", tests.TestNewSubscriberReceivesOldMessages},
	} {
		t.Run(st.name, func(t *testing.T) {
			t.Parallel()
			st.fn(t, tests.TestContext{TestID: tests.NewTestID(), Features: features}, pubSub)
		})
	}
	t.Run("TestConsumerGroups", func(t *testing.T) {
		t.Parallel()
		tests.TestConsumerGroups(t, tests.TestContext{TestID: tests.NewTestID(), Features: features}, groups)
	})
}

// suiteHarness is one database, one relay and one declaring AMQP connection,
// shared by every pub/sub the suite constructs in one TestPubSub run. Its
// topics are unique per subtest, so sharing costs no isolation; one relay is
// also what keeps the order the suite checks.
type suiteHarness struct {
	t     *testing.T
	db    *testdb.DB
	relay *outbox.Forwarder

	mu       sync.Mutex
	conn     *amqp.Connection // declarations only; opened on first use
	declared map[string]bool  // "q:name" / "x:name" declared by a publisher
	queues   map[string]bool  // to delete when the run ends
	exchs    map[string]bool
	closed   bool

	errMu     sync.Mutex
	relayErrs []error        // refusals: a topology the harness failed to declare
	transient []error        // lost connections: the relay's to retry
	confirmed []string       // ids, in the order the relay's batches were confirmed
	txOf      map[string]int // id: the transaction that wrote it, numbered
	delivered []delivery     // what the subscribers' consumers were given, in order
}

// delivery is one message as a subscriber's consumer got it from the broker.
type delivery struct {
	id, consumer string
	redelivered  bool
}

// recordingMarshaler notes every delivery a subscriber unmarshals, for
// deliveryOrder.
type recordingMarshaler struct {
	wamqp.Marshaler
	h *suiteHarness
}

func (m recordingMarshaler) Unmarshal(d amqp.Delivery) (*message.Message, error) {
	m.h.errMu.Lock()
	m.h.delivered = append(m.h.delivered, delivery{id: d.MessageId, consumer: d.ConsumerTag, redelivered: d.Redelivered})
	m.h.errMu.Unlock()
	return m.Marshaler.Unmarshal(d)
}

// deliveryOrder logs, when a test of the run failed, where a consumer got
// a row of a transaction for the first time after a later row of it, and
// whether the broker marked either redelivered (requeued from a consumer
// that had it unacked): with relayOrder's lines, it tells a broker or
// consumer that reordered from a relay that did.
func (h *suiteHarness) deliveryOrder(rank map[string]int) {
	h.errMu.Lock()
	defer h.errMu.Unlock()
	type stream struct {
		tx       int
		consumer string
	}
	inv, _ := inversions(len(h.delivered), func(i int) (string, stream, bool) {
		d := h.delivered[i]
		tx, ok := h.txOf[d.id]
		return d.id, stream{tx, d.consumer}, ok
	}, rank)
	for _, v := range inv[:min(len(inv), 10)] {
		d, prev := h.delivered[v.at], h.delivered[v.after]
		h.t.Logf("delivery order: consumer %s got row %s (rank %d, redelivered %v) at delivery %d, after row %s of its transaction (rank %d, redelivered %v)",
			d.consumer, d.id, rank[d.id], d.redelivered, v.at, prev.id, rank[prev.id], prev.redelivered)
	}
	if len(inv) > 0 {
		h.t.Logf("delivery order: %d rows delivered to a consumer after a later row of their transaction", len(inv))
	}
}

// inversion is an item of a sequence that came after an item of its stream
// ranked above it (at and after are their indexes).
type inversion struct{ at, after int }

// inversions walks a sequence of n items, item i being row id of stream
// (none when ok is false), and returns the items that were their row's
// first in its stream and came after a row of that stream ranked above
// them, and how many items repeated a row of theirs (of its stream, or
// of none).
func inversions[S comparable](n int, item func(i int) (id string, stream S, ok bool), rank map[string]int) (inv []inversion, again int) {
	type row struct {
		stream S
		id     string
	}
	seen := map[row]bool{}
	top := map[S]int{} // by stream: the index of its highest-ranked item
	for i := 0; i < n; i++ {
		id, s, ok := item(i) // !ok: s only tells the row's repeats apart
		if seen[row{s, id}] {
			again++
			continue
		}
		seen[row{s, id}] = true
		if !ok {
			continue
		}
		j, ok := top[s]
		if !ok {
			top[s] = i
			continue
		}
		topID, _, _ := item(j)
		switch {
		case rank[id] < rank[topID]:
			inv = append(inv, inversion{at: i, after: j})
		case rank[id] > rank[topID]:
			top[s] = i
		}
	}
	return inv, again
}

// relayOrder logs where the relay confirmed the rows of one transaction out
// of their created_at order, and how many rows it sent more than once: on
// its own, either is what a failure mid-window does (README: rows in
// flight behind a failed record are sent again after it). Rows of
// different transactions may go in any order (a row stamped first may
// commit last). Shown when a test of the run fails, these lines tell a
// relay that reordered from a reordering after the broker
// (TestPublishSubscribeInOrder, whose 100 messages are one transaction,
// failed about once in 70 runs on MariaDB: these lines showed the relay
// confirming its first rows after its last, a claim that raced the
// transaction's commit; see sqldialect's mysql claim).
func (h *suiteHarness) relayOrder() {
	rows, err := h.db.Query("SELECT id FROM acemq_outbox ORDER BY created_at, id")
	if err != nil {
		h.t.Logf("relay order: %v", err)
		return
	}
	defer rows.Close()
	rank := map[string]int{}
	for rows.Next() {
		var id string
		if err := rows.Scan(&id); err != nil {
			h.t.Logf("relay order: %v", err)
			return
		}
		rank[id] = len(rank)
	}
	if h.t.Failed() {
		h.deliveryOrder(rank)
	}
	h.errMu.Lock()
	defer h.errMu.Unlock()
	inv, again := inversions(len(h.confirmed), func(i int) (string, int, bool) {
		tx, ok := h.txOf[h.confirmed[i]]
		return h.confirmed[i], tx, ok
	}, rank)
	for _, v := range inv[:min(len(inv), 5)] {
		id := h.confirmed[v.at]
		h.t.Logf("relay order: row %s (created_at rank %d) confirmed at position %d, after a row of its transaction of rank %d", id, rank[id], v.at, rank[h.confirmed[v.after]])
	}
	if len(inv) > 0 || again > 0 {
		h.t.Logf("relay order: %d rows confirmed after a later row of their transaction, %d confirmations of rows confirmed before", len(inv), again)
	}
}

func newSuiteHarness(t *testing.T, kind string) *suiteHarness {
	t.Helper()
	db := testdb.New(t, kind)
	dialect := migrate(t, db)
	// The suite runs up to ~120 publishing goroutines at once; bound what
	// they take of the server (PostgreSQL allows 100 connections).
	db.SetMaxOpenConns(16)

	// The relay has a pool of its own, as it would in its own process.
	relayDB, err := sqlx.Open(db.DriverName(), db.DSN)
	if err != nil {
		t.Fatal(err)
	}
	relayDB.SetMaxOpenConns(4)
	t.Cleanup(func() { // after the relay's cleanup below
		if err := relayDB.Close(); err != nil {
			t.Errorf("close relay pool: %v", err)
		}
	})

	h := &suiteHarness{
		t: t, db: db,
		declared: map[string]bool{},
		queues:   map[string]bool{},
		exchs:    map[string]bool{},
		txOf:     map[string]int{},
	}
	dest, err := outbox.NewAMQPDestination(outbox.AMQPConfig{URLs: []string{testdb.AMQPURL()}, ConnectionName: "pubsub suite relay"})
	if err != nil {
		t.Fatal(err)
	}
	h.relay, err = outbox.NewForwarder(relayDB, dest, outbox.ForwarderConfig{
		Dialect:      dialect,
		MaxAttempts:  1000, // a refusal must show as an error below, not as a stuck row
		PollInterval: 50 * time.Millisecond,
		RetryMin:     10 * time.Millisecond,
		RetryMax:     200 * time.Millisecond,
		OnError: func(err error, dest outbox.ErrorContext) {
			err = fmt.Errorf("exchange %q, routing key %q, message %q: %w", dest.Exchange, dest.RoutingKey, dest.MessageID, err)
			var unroutable *outbox.UnroutableError
			var missing *outbox.MissingExchangeError
			h.errMu.Lock()
			defer h.errMu.Unlock()
			if errors.As(err, &unroutable) || errors.As(err, &missing) || outbox.IsPermanent(err) {
				h.relayErrs = append(h.relayErrs, err)
			} else {
				// A connection closed under the relay (another test on
				// the same servers may close them all): retried, and the
				// suite's own checks say whether anything was lost.
				h.transient = append(h.transient, err)
			}
		},
	})
	if err != nil {
		t.Fatal(err)
	}

	// The order the relay confirms rows in, batch after batch, for
	// relayOrder to compare with their created_at order.
	outbox.SetAfterPublishHook(h.relay, func(published []string) error {
		h.errMu.Lock()
		defer h.errMu.Unlock()
		h.confirmed = append(h.confirmed, published...)
		return nil
	})
	runErr := make(chan error, 1)
	go func() { runErr <- h.relay.Run(context.Background()) }()
	select {
	case <-h.relay.Running():
	case err := <-runErr:
		t.Fatalf("relay did not start: %v", err)
	}

	t.Cleanup(func() {
		// Every subtest has ended, with its subscribers: stop the relay
		// (it finishes and marks the batch in flight), then look at what
		// it left.
		if err := h.relay.Close(); err != nil {
			t.Errorf("close relay: %v", err)
		}
		if err := <-runErr; err != nil {
			t.Errorf("relay Run returned %v", err)
		}
		st, err := h.relay.Store().Stats(context.Background())
		if err != nil {
			t.Errorf("outbox stats: %v", err)
		} else if st.Pending != 0 || st.Stuck != 0 {
			t.Errorf("after the suite the outbox holds %d pending and %d stuck rows, want none: every committed row must have gone out", st.Pending, st.Stuck)
		}
		h.errMu.Lock()
		for i, err := range h.relayErrs {
			if i == 10 {
				t.Errorf("… and %d more refusals", len(h.relayErrs)-10)
				break
			}
			t.Errorf("the broker refused a record (every queue and exchange is declared before its rows are written): %v", err)
		}
		for _, err := range h.transient {
			t.Logf("relay retried after: %v", err)
		}
		h.errMu.Unlock()
		h.relayOrder()
		h.deleteTopology()
	})
	return h
}

// queuePubSub is watermill-amqp's durable queue config: default exchange,
// routing key = topic = queue name, competing consumers.
func (h *suiteHarness) queuePubSub(t *testing.T) (message.Publisher, message.Subscriber) {
	return h.pubSub(t, wamqp.NewDurableQueueConfig(testdb.AMQPURL()))
}

// consumerGroupPubSub is watermill-amqp's durable pub/sub config: a fanout
// exchange per topic, a queue per topic and consumer group.
func (h *suiteHarness) consumerGroupPubSub(t *testing.T, group string) (message.Publisher, message.Subscriber) {
	return h.pubSub(t, wamqp.NewDurablePubSubConfig(testdb.AMQPURL(), wamqp.GenerateQueueNameTopicNameWithSuffix(group)))
}

func (h *suiteHarness) pubSub(t *testing.T, cfg wamqp.Config) (message.Publisher, message.Subscriber) {
	t.Helper()
	dialer := &subscriberDialer{}
	cfg.Marshaler = recordingMarshaler{Marshaler: cfg.Marshaler, h: h}
	cfg.Connection.AmqpConfig = &amqp.Config{
		Heartbeat: 10 * time.Second, Locale: "en_US", // amqp.Dial's defaults
		Dial:       dialer.dial,
		Properties: amqp.Table{"connection_name": "pubsub suite subscriber"},
	}
	sub, err := wamqp.NewSubscriber(cfg, watermill.NopLogger{})
	if err != nil {
		t.Fatalf("watermill-amqp subscriber: %v", err)
	}
	pub := &outboxPublisher{h: h, cfg: cfg}
	// The suite closes most of what it constructs, not all (a multiplied
	// subscriber closed before it subscribed keeps its subscribers): close
	// again here, which is a no-op for the closed ones.
	t.Cleanup(func() {
		_ = pub.Close()
		if err := sub.Close(); err != nil {
			t.Errorf("close subscriber: %v", err)
		}
		if n := dialer.closeAll(); n > 0 {
			t.Logf("%d connection(s) of a closed watermill-amqp subscriber still open (a Close under way, or a reconnect after Close): closing them %v after their handshake (see subscriberDialer)", n, connSettle)
		}
	})
	return pub, &trackedSubscriber{Subscriber: sub, h: h, cfg: cfg}
}

// subscriberDialer dials a watermill-amqp subscriber's connections, and
// closes them for good once the subscriber is closed.
//
// watermill-amqp v3.0.2 (the newest served) can leave a connection open
// after Subscriber.Close. Its handleConnectionClose goroutine registers
// NotifyClose on the connection and then selects between that and the
// wrapper's closing channel. When Close comes before the goroutine is
// parked in that select (a subscriber closed just after it was made, on a
// loaded machine), both are ready when it gets there: NotifyClose on a
// closed connection is closed at once. select then takes the NotifyClose
// arm half the time, and reconnect dials a connection that nothing
// closes, since connect never looks at Closed. A broker closing the
// connection just before Close leaks the same way. A reproduction that
// closed the socket and then the subscriber leaked in 18 of 40 runs; the
// suite's leak check failed on it in two clean-clone CI runs.
//
// The reconnect must still succeed: one that fails after Close leaves
// handleConnectionClose waiting on its connected channel for good. So a
// connection is closed here only connSettle after both the subscriber's
// cleanup and the end of its AMQP handshake (amqp091-go clears the dial's
// deadline then), when the goroutine, finding the connection open and
// its closing channel closed, has long returned; a handshake that fails
// is closed by amqp091-go itself. That wait also lets a Close still under
// way finish first: TestMessageCtx closes in a goroutine of its own, so
// the cleanup's Close returns before that one has closed the connection.
// The relay's own connections are still checked: this closes only what a
// subscriber dialed.
type subscriberDialer struct {
	mu      sync.Mutex
	closing bool
	conns   []*trackedConn
}

// connSettle is how long after the subscriber's cleanup and the end of
// its handshake a connection is closed here; see subscriberDialer.
const connSettle = 2 * time.Second

type trackedConn struct {
	net.Conn
	closed atomic.Bool

	mu     sync.Mutex
	open   bool // the AMQP handshake is over
	doomed bool // to be closed connSettle after it
}

func (c *trackedConn) Close() error {
	c.closed.Store(true)
	return c.Conn.Close()
}

// SetDeadline sees the end of the handshake: amqp091-go's openComplete
// clears the deadline the dial set.
func (c *trackedConn) SetDeadline(t time.Time) error {
	if t.IsZero() {
		c.mu.Lock()
		if !c.open {
			c.open = true
			if c.doomed {
				c.closeLater()
			}
		}
		c.mu.Unlock()
	}
	return c.Conn.SetDeadline(t)
}

// closeWhenSettled closes c connSettle after its handshake, or from now if
// that is over.
func (c *trackedConn) closeWhenSettled() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.doomed {
		return
	}
	c.doomed = true
	if c.open {
		c.closeLater()
	}
}

func (c *trackedConn) closeLater() {
	time.AfterFunc(connSettle, func() { _ = c.Close() })
}

func (d *subscriberDialer) dial(network, addr string) (net.Conn, error) {
	conn, err := amqp.DefaultDial(30*time.Second)(network, addr)
	if err != nil {
		return nil, err
	}
	tc := &trackedConn{Conn: conn}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closing { // a reconnect after closeAll
		tc.closeWhenSettled()
	}
	d.conns = append(d.conns, tc)
	return tc, nil
}

// closeAll closes every connection the subscriber dialed and has not
// closed, and any it dials later, each once settled; it returns how many
// were open.
func (d *subscriberDialer) closeAll() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.closing = true
	open := 0
	for _, c := range d.conns {
		if !c.closed.Load() {
			open++
			c.closeWhenSettled()
		}
	}
	return open
}

// outboxPublisher is what a service does to publish through the outbox: a
// transaction, TxPublisher into it, commit, wake the relay.
type outboxPublisher struct {
	h   *suiteHarness
	cfg wamqp.Config

	mu     sync.RWMutex
	closed bool
}

func (p *outboxPublisher) Publish(topic string, msgs ...*message.Message) error {
	p.mu.RLock()
	defer p.mu.RUnlock()
	if p.closed {
		return errors.New("outbox publisher closed")
	}
	// The relay publishes with mandatory set and declares nothing: declare
	// before writing what the broker needs to route the row. watermill-amqp's
	// publisher declares the exchange of a pub/sub config (the first branch),
	// and nothing for the queue config, whose messages it lets the default
	// exchange drop while no queue exists; ours would come back unroutable
	// and hold the relay, so the queue is declared as its subscriber does.
	if err := p.h.declare(p.cfg, topic); err != nil {
		return err
	}

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	tx, err := p.h.db.BeginTxx(ctx, nil)
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback() }()
	txPub, err := outbox.NewTxPublisher(tx, outbox.TxPublisherConfig{TopicMapper: func(topic string) (string, string) {
		return p.cfg.Exchange.GenerateName(topic), p.cfg.Publish.GenerateRoutingKey(topic)
	}})
	if err != nil {
		return err
	}
	if err := txPub.Publish(topic, msgs...); err != nil {
		return err
	}
	if err := tx.Commit(); err != nil {
		return err
	}
	p.h.committed(msgs)
	p.h.relay.Notify()
	return nil
}

// committed records that msgs were written by one transaction.
func (h *suiteHarness) committed(msgs []*message.Message) {
	h.errMu.Lock()
	defer h.errMu.Unlock()
	n := len(h.txOf)
	for _, m := range msgs {
		h.txOf[m.UUID] = n
	}
}

// Close refuses further Publish calls once those in flight are done. What
// they committed is the relay's, which goes on: closing a publisher loses
// nothing (the suite's TestPublisherClose).
func (p *outboxPublisher) Close() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.closed = true
	return nil
}

// trackedSubscriber records the queues and exchanges the subscriber
// declares, so that the run deletes them.
type trackedSubscriber struct {
	*wamqp.Subscriber
	h   *suiteHarness
	cfg wamqp.Config
}

func (s *trackedSubscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	s.h.track(s.cfg, topic)
	return s.Subscriber.Subscribe(ctx, topic)
}

func (s *trackedSubscriber) SubscribeInitialize(topic string) error {
	s.h.track(s.cfg, topic)
	return s.Subscriber.SubscribeInitialize(topic)
}

func (h *suiteHarness) track(cfg wamqp.Config, topic string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if cfg.Queue.GenerateName != nil {
		h.queues[cfg.Queue.GenerateName(topic)] = true
	}
	if x := cfg.Exchange.GenerateName(topic); x != "" {
		h.exchs[x] = true
	}
}

// declare makes the broker able to route topic under cfg: the exchange of a
// pub/sub config, as watermill-amqp's publisher declares it, or the queue of
// a queue config, as its subscriber declares it. Once per name and run.
func (h *suiteHarness) declare(cfg wamqp.Config, topic string) error {
	exchange := cfg.Exchange.GenerateName(topic)
	key := "x:" + exchange
	if exchange == "" {
		key = "q:" + cfg.Queue.GenerateName(topic)
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.declared[key] {
		return nil
	}
	ch, err := h.channelLocked()
	if err != nil {
		return err
	}
	defer ch.Close()
	if exchange != "" {
		err = cfg.TopologyBuilder.ExchangeDeclare(ch, exchange, cfg)
		h.exchs[exchange] = true
	} else {
		queue := cfg.Queue.GenerateName(topic)
		err = cfg.TopologyBuilder.BuildTopology(ch, wamqp.BuildTopologyParams{Topic: topic, QueueName: queue}, cfg, watermill.NopLogger{})
		h.queues[queue] = true
	}
	if err != nil {
		return fmt.Errorf("declare for topic %s: %w", topic, err)
	}
	h.declared[key] = true
	return nil
}

func (h *suiteHarness) channelLocked() (*amqp.Channel, error) {
	if h.closed {
		return nil, errors.New("suite harness closed")
	}
	if h.conn == nil || h.conn.IsClosed() {
		conn, err := amqp.Dial(testdb.AMQPURL())
		if err != nil {
			return nil, err
		}
		h.conn = conn
	}
	return h.conn.Channel()
}

// deleteTopology deletes what the run declared, and closes the connection.
func (h *suiteHarness) deleteTopology() {
	h.mu.Lock()
	defer h.mu.Unlock()
	for q := range h.queues {
		if ch, err := h.channelLocked(); err == nil {
			if _, err := ch.QueueDelete(q, false, false, false); err != nil {
				h.t.Logf("delete queue %s: %v", q, err)
			}
			_ = ch.Close()
		}
	}
	for x := range h.exchs {
		if ch, err := h.channelLocked(); err == nil {
			if err := ch.ExchangeDelete(x, false, false); err != nil {
				h.t.Logf("delete exchange %s: %v", x, err)
			}
			_ = ch.Close()
		}
	}
	h.closed = true
	if h.conn != nil {
		_ = h.conn.Close()
	}
}
