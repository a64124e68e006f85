package integration_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"
	amqp "github.com/rabbitmq/amqp091-go"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testcluster"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// The cluster run: orders committed continuously on PostgreSQL, a relay
// with the three nodes' URLs, two consumers behind the inbox reading a
// quorum queue through nodes of their own. The node the relay is connected
// to is stopped (its rabbit application; the Erlang node stays, as a
// crashed broker's host would), started again after a while, and then the
// node the relay moved to is stopped in turn.
const (
	clusterTopic      = "order.placed"
	clusterPlacers    = 2
	clusterRate       = 150 // orders a second, over all placers
	clusterRollback   = 0.1 // share of orders whose transaction rolls back
	clusterLosses     = 2   // nodes stopped, one after the other
	clusterDown       = 4 * time.Second
	clusterSteady     = 3 * time.Second // of flow before each loss, and after the last
	clusterResumeWait = 60 * time.Second
	clusterDrainWait  = 90 * time.Second
)

// TestCluster_NodeOfRelayStopped_EveryCommittedOrderOnceNothingLost is the
// proof that a relay and its consumers outlive the loss of the node they
// are connected to: every committed order's message is handled exactly once
// (the inbox absorbs what the relay sent again after a confirm it never
// got), none of a rolled-back order's, and nothing stays unpublished.
func TestCluster_NodeOfRelayStopped_EveryCommittedOrderOnceNothingLost(t *testing.T) {
	cl := testcluster.Start(t)
	ctx := context.Background()
	db := testdb.New(t, testdb.Postgres)
	if err := outbox.Migrate(ctx, db.DB.DB, outbox.Postgres); err != nil {
		t.Fatal(err)
	}
	db.MustExec("CREATE TABLE orders (id varchar(64) PRIMARY KEY, placed_us bigint NOT NULL)")
	// No unique key: a second effect of one order shows as a second row.
	db.MustExec("CREATE TABLE effects (order_id varchar(64) NOT NULL, message_id varchar(64) NOT NULL, applied_us bigint NOT NULL)")

	exchange, queue := "cluster-ex-"+testdb.RandomName(), "cluster-q-"+testdb.RandomName()
	declareQuorum(t, cl, exchange, queue)

	// The relay.
	reg := prometheus.NewRegistry()
	metrics, err := outbox.NewMetrics(reg)
	if err != nil {
		t.Fatal(err)
	}
	lossAt := &lossClock{LoggerAdapter: debugLogger()}
	relayURLs := cl.URLs()
	if !closeConsumerConnection() {
		// Under -race the consumers sit on node 2 (below), and the relay
		// knows nodes 0 and 1 alone: no loss of its node takes theirs.
		// Knowing all three, it moved from node 0 to node 2 once, the
		// second loss took the consumers' connections, and the race
		// detector failed the test on watermill-amqp's reconnect.
		relayURLs = relayURLs[:2]
	}
	dest, err := outbox.NewAMQPDestination(outbox.AMQPConfig{
		URLs:           relayURLs,
		ConnectionName: "cluster-relay",
		Logger:         lossAt,
	})
	if err != nil {
		t.Fatal(err)
	}
	fwd, err := outbox.NewForwarder(db.DB, dest, outbox.ForwarderConfig{
		BatchSize:      50,
		PublishTimeout: 3 * time.Second,
		RetryMin:       20 * time.Millisecond,
		RetryMax:       500 * time.Millisecond,
		Metrics:        metrics,
		StatsInterval:  time.Hour,
		Logger:         debugLogger(),
	})
	if err != nil {
		t.Fatal(err)
	}
	relayCtx, stopRelay := context.WithCancel(ctx)
	relayDone := make(chan error, 1)
	go func() { relayDone <- fwd.Run(relayCtx) }()
	t.Cleanup(func() {
		stopRelay()
		if err := <-relayDone; err != nil && !errors.Is(err, context.Canceled) {
			t.Errorf("relay: %v", err)
		}
		_ = fwd.Close()
	})
	<-fwd.Running()
	published := func() float64 { return counterValue(t, reg, "outbox_forwarder_published_total") }

	inbox, err := outbox.NewInbox(db.DB, outbox.InboxConfig{ConsumerName: "cluster-orders"})
	if err != nil {
		t.Fatal(err)
	}
	// Two consumers, on nodes the relay is not on at first. The relay
	// starts on node 0 and moves on to node 1, the next, so the second loss
	// takes node 1 from under the first consumer, which moves on to node 2.
	// Not under -race: watermill-amqp's reconnect races
	// (closeConsumerConnection), so there both consumers sit on node 2,
	// which the relay does not know, and read on throughout without
	// losing their connection.
	oc := &orderConsumer{insertEffect: db.Rebind("INSERT INTO effects (order_id, message_id, applied_us) VALUES (?, ?, ?)")}
	urls := cl.URLs()
	consumers := startConsumer(t, consumerConfig{
		name: "cluster-orders", instances: 2, prefetch: 20, topic: clusterTopic, queue: queue, exchange: exchange,
		// A quorum queue's redeliveries carry x-delivery-count, an integer,
		// which watermill-amqp's DefaultMarshaler refuses over and over.
		marshaler: outbox.AMQPMarshaler{}, inbox: inbox, handle: oc.handle,
		connName: func(i int) string { return "cluster-consumer-" + strconv.Itoa(i) },
		nodes: func(i int) []string {
			first := 2
			if closeConsumerConnection() {
				first = i + 1
			}
			return slices.Concat(urls[first:], urls[:first])
		},
		queueArgs: amqp.Table{"x-queue-type": "quorum"},
	})

	// Orders.
	var (
		mu         sync.Mutex
		committed  = map[string]bool{}
		rolledBack = map[string]bool{}
		placeErrs  atomic.Int64
	)
	insertOrder := db.Rebind("INSERT INTO orders (id, placed_us) VALUES (?, ?)")
	place := func(rng *rand.Rand) {
		id := watermill.NewUUID()
		rollback := rng.Float64() < clusterRollback
		err := func() error {
			tx, err := db.Beginx()
			if err != nil {
				return err
			}
			defer func() { _ = tx.Rollback() }()
			if _, err := tx.Exec(insertOrder, id, time.Now().UnixMicro()); err != nil {
				return err
			}
			pub, err := outbox.NewTxPublisher(tx, outbox.TxPublisherConfig{Exchange: exchange})
			if err != nil {
				return err
			}
			payload, _ := json.Marshal(orderPlaced{OrderID: id})
			if err := pub.Publish(clusterTopic, message.NewMessage(watermill.NewUUID(), payload)); err != nil {
				return err
			}
			if rollback {
				return tx.Rollback()
			}
			return tx.Commit()
		}()
		mu.Lock()
		defer mu.Unlock()
		switch {
		case err != nil:
			placeErrs.Add(1) // the order is not known committed: it counts as neither
		case rollback:
			rolledBack[id] = true
		default:
			committed[id] = true
		}
	}
	placeCtx, stopPlacing := context.WithCancel(ctx)
	var placers sync.WaitGroup
	for p := range clusterPlacers {
		placers.Add(1)
		go func() {
			defer placers.Done()
			rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), uint64(p)))
			tick := time.NewTicker(time.Second * clusterPlacers / clusterRate)
			defer tick.Stop()
			for {
				select {
				case <-placeCtx.Done():
					return
				case <-tick.C:
					place(rng)
				}
			}
		}()
	}
	t.Cleanup(func() { stopPlacing(); placers.Wait() })

	// The losses.
	// The node goes down somewhere within rabbitmqctl stop_app, which
	// spends a second or two starting before it stops anything: resumed
	// counts from the call, so it includes that; afterLoss counts from the
	// relay's own "Connection to RabbitMQ lost", which the broker's close
	// of the connection sets off at once, and is the relay's failover.
	type loss struct {
		node               string
		resumed, afterLoss time.Duration // to the relay's first publish elsewhere
		movedTo            string
	}
	var losses []loss
	for range clusterLosses {
		if !sleepCtx(ctx, clusterSteady) {
			t.Fatal("interrupted")
		}
		on := dest.Node()
		idx := nodeByAddr(t, cl, on)
		before := published()
		stopped := time.Now()
		if err := cl.StopApp(ctx, idx); err != nil {
			t.Fatalf("stop_app %s: %v", cl.Node(idx), err)
		}
		// Resumed: publishes confirmed through another node.
		if !waitUntil(clusterResumeWait, func() bool { return dest.Node() != on && dest.Node() != "" && published() > before }) {
			t.Fatalf("the relay did not publish through another node within %s of %s's stop (on %q, published %v → %v)",
				clusterResumeWait, cl.Node(idx), dest.Node(), before, published())
		}
		l := loss{node: cl.Node(idx), resumed: time.Since(stopped), movedTo: dest.Node()}
		if at := lossAt.after(stopped); !at.IsZero() {
			l.afterLoss = time.Since(at)
		}
		// Resumed is measured to the first counted publish after the stop,
		// which can be one confirmed just before it: ask for a second batch
		// through the new node for the figure to mean the new node.
		after := published()
		if !waitUntil(clusterResumeWait, func() bool { return published() > after }) {
			t.Fatalf("no publish through %s after the move", dest.Node())
		}
		losses = append(losses, l)
		t.Logf("%s stopped: the relay published through %s %s later", l.node, l.movedTo, l.resumed.Round(time.Millisecond))
		if !sleepCtx(ctx, clusterDown) {
			t.Fatal("interrupted")
		}
		if err := cl.StartApp(ctx, idx); err != nil {
			t.Fatalf("start_app %s: %v", cl.Node(idx), err)
		}
	}
	if !sleepCtx(ctx, clusterSteady) {
		t.Fatal("interrupted")
	}
	stopPlacing()
	placers.Wait()

	// Drain: every committed order's effect, then a moment for duplicates.
	mu.Lock()
	nCommitted, nRolledBack := len(committed), len(rolledBack)
	mu.Unlock()
	effectsOf := func() (map[string]int, error) {
		var rows []struct {
			OrderID string `db:"order_id"`
			N       int    `db:"n"`
		}
		if err := db.Select(&rows, "SELECT order_id, count(*) AS n FROM effects GROUP BY order_id"); err != nil {
			return nil, err
		}
		m := make(map[string]int, len(rows))
		for _, r := range rows {
			m[r.OrderID] = r.N
		}
		return m, nil
	}
	drained := waitUntil(clusterDrainWait, func() bool {
		m, err := effectsOf()
		if err != nil {
			return false
		}
		for id := range committed {
			if m[id] == 0 {
				return false
			}
		}
		// The consumer can apply the last message before the relay has
		// collected its confirm and marked the row: drained is both.
		var unpublished int
		return db.Get(&unpublished, "SELECT count(*) FROM acemq_outbox WHERE published_at IS NULL") == nil && unpublished == 0
	})
	effects, err := effectsOf()
	if err != nil {
		t.Fatal(err)
	}
	var lost, twice, ofRolledBack int
	for id := range committed {
		switch n := effects[id]; {
		case n == 0:
			lost++
		case n > 1:
			twice++
		}
	}
	for id := range rolledBack {
		if effects[id] > 0 {
			ofRolledBack++
		}
	}
	var unpublished int
	if err := db.Get(&unpublished, "SELECT count(*) FROM acemq_outbox WHERE published_at IS NULL"); err != nil {
		t.Fatal(err)
	}

	rows := []string{
		row("orders committed", nCommitted, fmt.Sprintf("%d rolled back, %d failed to place", nRolledBack, placeErrs.Load())),
		row("deliveries", int(consumers.deliveries.Load()), fmt.Sprintf("%d let through by the inbox, %d copies it absorbed", consumers.handlerRuns.Load(), consumers.duplicates.Load())),
		row("lost (committed, no effect)", lost, "must be 0"),
		row("effects twice", twice, "must be 0"),
		row("effects of rolled-back orders", ofRolledBack, "must be 0"),
		row("outbox rows left unpublished", unpublished, "must be 0"),
	}
	for i, l := range losses {
		afterLoss := l.afterLoss.Round(time.Millisecond).String()
		if l.afterLoss == 0 {
			afterLoss = "unseen" // no "Connection to RabbitMQ lost" logged after the stop
		}
		rows = append(rows, fmt.Sprintf("%-44s %8s  %s", fmt.Sprintf("relay resumed after node loss %d", i+1),
			afterLoss, fmt.Sprintf("from the relay's lost connection (%s from the stop_app call); stopped %s, moved to %s",
				l.resumed.Round(time.Millisecond), l.node, l.movedTo)))
	}
	say(t, "Cluster (3 RabbitMQ nodes, quorum queue, relay's node stopped %d times):\n%s", clusterLosses, strings.Join(rows, "\n"))

	if !drained || lost > 0 {
		// Published and still in the queue means a consumer that stopped
		// reading, not a message lost: say which.
		t.Errorf("%d committed orders have no effect after %s; the queue: %s", lost, clusterDrainWait, queueState(cl, queue))
		for id := range committed {
			if effects[id] == 0 {
				t.Logf("lost order %s: %s", id, outboxTrace(db, id))
			}
		}
	}
	if twice > 0 {
		t.Errorf("%d orders had their effect twice: the inbox let a copy through", twice)
	}
	if ofRolledBack > 0 {
		t.Errorf("%d rolled-back orders had an effect", ofRolledBack)
	}
	if unpublished > 0 {
		t.Errorf("%d outbox rows left unpublished", unpublished)
	}
	if nCommitted == 0 {
		t.Error("no order committed: the test proved nothing")
	}
}

// declareQuorum declares a durable direct exchange and a quorum queue bound
// to it for clusterTopic, through node 0, and deletes both when the test
// ends (if the cluster still runs).
func declareQuorum(t *testing.T, cl *testcluster.Cluster, exchange, queue string) {
	t.Helper()
	with := func(fn func(ch *amqp.Channel) error) error {
		conn, err := amqp.Dial(cl.URL(0))
		if err != nil {
			return err
		}
		defer conn.Close()
		ch, err := conn.Channel()
		if err != nil {
			return err
		}
		return fn(ch)
	}
	if err := with(func(ch *amqp.Channel) error {
		if err := ch.ExchangeDeclare(exchange, amqp.ExchangeDirect, true, false, false, false, nil); err != nil {
			return err
		}
		if _, err := ch.QueueDeclare(queue, true, false, false, false, amqp.Table{"x-queue-type": "quorum"}); err != nil {
			return err
		}
		return ch.QueueBind(queue, clusterTopic, exchange, false, nil)
	}); err != nil {
		t.Fatalf("declaring the quorum queue: %v", err)
	}
}

// nodeByAddr is the index of the node whose URL has host:port addr.
func nodeByAddr(t *testing.T, cl *testcluster.Cluster, addr string) int {
	t.Helper()
	for i, u := range cl.URLs() {
		uri, err := amqp.ParseURI(u)
		if err != nil {
			t.Fatal(err)
		}
		if net.JoinHostPort(uri.Host, strconv.Itoa(uri.Port)) == addr {
			return i
		}
	}
	t.Fatalf("the relay is on %q, none of the cluster's nodes %v", addr, cl.URLs())
	return -1
}

// counterValue is the sum of a counter's series in reg.
func counterValue(t *testing.T, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var v float64
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			v += m.GetCounter().GetValue()
		}
	}
	return v
}

// lossClock is the relay's destination's logger: it notes when the
// destination last reported its connection lost.
type lossClock struct {
	watermill.LoggerAdapter
	mu   sync.Mutex
	last time.Time
}

func (c *lossClock) Info(msg string, fields watermill.LogFields) {
	if msg == "Connection to RabbitMQ lost" {
		c.mu.Lock()
		c.last = time.Now()
		c.mu.Unlock()
	}
	c.LoggerAdapter.Info(msg, fields)
}

func (c *lossClock) With(watermill.LogFields) watermill.LoggerAdapter { return c }

// after is when the connection was last reported lost, if that was after t.
func (c *lossClock) after(t time.Time) time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.last.After(t) {
		return c.last
	}
	return time.Time{}
}

// outboxTrace is what the outbox and the inbox hold of an order's message.
func outboxTrace(db *testdb.DB, orderID string) string {
	var rows []struct {
		ID          string     `db:"id"`
		PublishedAt *time.Time `db:"published_at"`
		Attempts    int        `db:"attempts"`
		LastError   *string    `db:"last_error"`
		Processed   int        `db:"processed"`
	}
	err := db.Select(&rows, `SELECT o.id, o.published_at, o.attempts, o.last_error,
		(SELECT count(*) FROM processed_messages p WHERE p.message_id = o.id) AS processed
		FROM acemq_outbox o WHERE o.body LIKE '%' || $1 || '%'`, orderID)
	if err != nil {
		return err.Error()
	}
	var out []string
	for _, r := range rows {
		lastErr := ""
		if r.LastError != nil {
			lastErr = *r.LastError
		}
		out = append(out, fmt.Sprintf("row %s published_at %v attempts %d last_error %q processed_messages %d",
			r.ID, r.PublishedAt, r.Attempts, lastErr, r.Processed))
	}
	if len(out) == 0 {
		return "no outbox row"
	}
	return strings.Join(out, "; ")
}

// queueState is what the cluster's first answering node says of queue:
// its ready messages and consumers, or why it could not say.
func queueState(cl *testcluster.Cluster, queue string) string {
	var errs []string
	for _, url := range cl.URLs() {
		conn, err := amqp.Dial(url)
		if err != nil {
			errs = append(errs, err.Error())
			continue
		}
		defer conn.Close()
		ch, err := conn.Channel()
		if err != nil {
			errs = append(errs, err.Error())
			continue
		}
		q, err := ch.QueueDeclarePassive(queue, true, false, false, false, amqp.Table{"x-queue-type": "quorum"})
		if err != nil {
			errs = append(errs, err.Error())
			continue
		}
		return fmt.Sprintf("%d ready, %d consumers", q.Messages, q.Consumers)
	}
	return "unknown: " + strings.Join(errs, "; ")
}
