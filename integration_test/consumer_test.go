package integration_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// consumers is how many instances of the service consume the order.placed
// queue at once, as competing consumers: two deliveries of one message can
// then be handled at the same moment, and the inbox must still let one
// through.
const consumers = 2

// consumer is a group of instances of the service's consuming side: a
// Watermill router each with a watermill-amqp subscriber on one durable
// queue of the test's, a counting middleware outside the inbox (and, if
// nackRate is set, one that fails a delivery at random before the inbox
// sees it), one inbox shared by the group, and the group's handler, which
// makes effect rows in the inbox's transaction. The chaos restarts an
// instance (a new router and subscriber, as a redeployed service would
// have); the counters span every instance and incarnation.
type consumer struct {
	consumerConfig
	t *testing.T

	mu       sync.Mutex
	running  []*routerRun // by instance; nil while restarting
	closed   bool
	restarts int
	stopTick chan struct{} // ends the ApplyHeld ticker of an ordered group
	tickDone chan struct{}

	deliveries  atomic.Int64 // every message the router handed to the handler chain
	handlerRuns atomic.Int64 // the inbox let it through to the handler
	applied     atomic.Int64 // the handler ran and the inbox committed
	duplicates  atomic.Int64 // acked by the inbox without running the handler (held, too)
	nacked      atomic.Int64 // the chain returned an error: the broker redelivers
	randomNacks atomic.Int64 // of which the random-nack middleware's
	inflight    atomic.Int64
	reconnects  atomic.Int64 // the subscriber's connection was closed under it
	heldApplied atomic.Int64 // applied by the ApplyHeld ticker
	applyErrs   atomic.Int64 // ApplyHeld calls that returned an error
}

// consumerConfig is what sets a consumer group apart.
type consumerConfig struct {
	name      string // in logs, the connection names, the router's handler name
	instances int
	prefetch  int
	topic     string
	queue     string
	exchange  string
	marshaler wamqp.Marshaler
	inbox     *outbox.Inbox
	handle    message.NoPublishHandlerFunc
	// nackRate is the share of deliveries failed at random before the
	// inbox runs: the broker redelivers them, later than their successors.
	nackRate float64
	connName func(i int) string
	// nodes, if set, are the broker URLs instance i dials, first to last,
	// through outbox.FailoverDial (a cluster's); nil: the test broker.
	nodes func(i int) []string
	// queueArgs are the queue's arguments ({"x-queue-type": "quorum"}).
	queueArgs amqp.Table
}

// routerRun is one incarnation of a consumer instance.
type routerRun struct {
	router *message.Router
	sub    *wamqp.Subscriber
	done   chan error
}

// ranKey is the context key of the delivery the handler chain runs for.
type ranKey struct{}

// delivery is what the counting middleware puts into a delivered message's
// context: its id, and whether the handler ran for it.
type delivery struct {
	uuid string
	ran  atomic.Bool
}

// deliveryOf is the delivery a handler runs in, nil outside one.
func deliveryOf(msg *message.Message) *delivery {
	d, _ := msg.Context().Value(ranKey{}).(*delivery)
	return d
}

// startOrderConsumer starts the order.placed consumers.
func startOrderConsumer(t *testing.T, r *run) *consumer {
	inbox, err := outbox.NewInbox(r.app, outbox.InboxConfig{
		ConsumerName: consumerName,
		// The service consumes its own events, from its own database: the
		// inbox marks the outbox record processed in the same transaction.
		MarkOutboxProcessed: true,
	})
	if err != nil {
		t.Fatal(err)
	}
	oc := &orderConsumer{insertEffect: r.app.Rebind("INSERT INTO effects (order_id, message_id, applied_us) VALUES (?, ?, ?)")}
	return startConsumer(t, consumerConfig{
		name: "orders", instances: consumers, prefetch: 10, topic: topic, queue: r.queue, exchange: r.exchange,
		marshaler: wamqp.DefaultMarshaler{}, inbox: inbox, handle: oc.handle,
		connName: func(i int) string { return r.connName("consumer-" + strconv.Itoa(i)) },
	})
}

func startConsumer(t *testing.T, cfg consumerConfig) *consumer {
	c := &consumer{consumerConfig: cfg, t: t, running: make([]*routerRun, cfg.instances)}
	t.Cleanup(c.close)
	for i := range cfg.instances {
		if err := c.start(i); err != nil {
			t.Fatal(err)
		}
	}
	return c
}

// tickApplyHeld runs the inbox's ApplyHeld every interval until close, as
// the README tells a service with an ordered inbox to: it retries the held
// messages whose handler failed when their turn came.
func (c *consumer) tickApplyHeld(interval time.Duration) {
	stop, done := make(chan struct{}), make(chan struct{})
	c.mu.Lock()
	c.stopTick, c.tickDone = stop, done
	c.mu.Unlock()
	go func() {
		defer close(done)
		tick := time.NewTicker(interval)
		defer tick.Stop()
		for {
			select {
			case <-stop:
				return
			case <-tick.C:
			}
			ctx, cancel := context.WithTimeout(context.Background(), opTimeout)
			n, err := c.inbox.ApplyHeld(ctx)
			cancel()
			c.heldApplied.Add(int64(n))
			if err != nil {
				c.applyErrs.Add(1)
			}
		}
	}()
}

// start starts instance i.
func (c *consumer) start(i int) error {
	log := &watchLogger{LoggerAdapter: debugLogger(), match: "Received close notification from AMQP, reconnecting", n: &c.reconnects}
	amqpCfg := amqp.Config{Properties: amqp.NewConnectionProperties()}
	amqpCfg.Properties.SetClientConnectionName(c.connName(i))
	uri := testdb.AMQPURL()
	if c.nodes != nil {
		nodes := c.nodes(i)
		dial, err := outbox.FailoverDial(nodes, 3*time.Second, debugLogger())
		if err != nil {
			return err
		}
		amqpCfg.Dial, uri = dial, nodes[0]
	}
	sub, err := wamqp.NewSubscriber(wamqp.Config{
		Connection: wamqp.ConnectionConfig{
			AmqpURI:    uri,
			AmqpConfig: &amqpCfg,
			Reconnect: &wamqp.ReconnectConfig{
				BackoffInitialInterval: 100 * time.Millisecond, BackoffRandomizationFactor: 0.5,
				BackoffMultiplier: 1.5, BackoffMaxInterval: 2 * time.Second,
			},
		},
		Marshaler: c.marshaler,
		Exchange:  wamqp.ExchangeConfig{GenerateName: wamqp.GenerateExchangeNameConstant(c.exchange), Type: amqp.ExchangeDirect, Durable: true},
		Queue:     wamqp.QueueConfig{GenerateName: wamqp.GenerateQueueNameConstant(c.queue), Durable: true, Arguments: c.queueArgs},
		QueueBind: wamqp.QueueBindConfig{GenerateRoutingKey: func(topic string) string { return topic }},
		Publish:   wamqp.PublishConfig{GenerateRoutingKey: func(topic string) string { return topic }},
		Consume:   wamqp.ConsumeConfig{Qos: wamqp.QosConfig{PrefetchCount: c.prefetch}},

		TopologyBuilder: &wamqp.DefaultTopologyBuilder{},
	}, log)
	if err != nil {
		return err
	}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 15 * time.Second}, debugLogger())
	if err != nil {
		_ = sub.Close()
		return err
	}
	router.AddMiddleware(c.count, c.randomNack, c.inbox.Middleware) // the first is the outermost
	router.AddConsumerHandler("consume-"+c.name, c.topic, sub, func(msg *message.Message) error {
		c.handlerRuns.Add(1)
		return c.handle(msg)
	})
	rr := &routerRun{router: router, sub: sub, done: make(chan error, 1)}
	go func() { rr.done <- router.Run(context.Background()) }()
	select {
	case <-router.Running():
	case err := <-rr.done:
		_ = sub.Close()
		return fmt.Errorf("router stopped at start: %v", err)
	case <-time.After(30 * time.Second):
		c.stopRun(rr)
		return errors.New("router did not start within 30 s")
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		c.stopRun(rr)
		return nil
	}
	c.running[i] = rr
	return nil
}

// restart stops instance i's router, which nacks what it holds (the broker
// redelivers it), and starts a new one.
func (c *consumer) restart(i int) error {
	c.mu.Lock()
	rr := c.running[i]
	c.running[i] = nil
	c.restarts++
	c.mu.Unlock()
	if rr != nil {
		c.stopRun(rr)
	}
	return c.start(i)
}

func (c *consumer) stopRun(rr *routerRun) {
	if err := rr.router.Close(); err != nil {
		c.t.Errorf("close router: %v", err)
	}
	if err := <-rr.done; err != nil {
		c.t.Errorf("router: %v", err)
	}
	_ = rr.sub.Close()
}

func (c *consumer) close() {
	c.mu.Lock()
	running := c.running
	c.running, c.closed = make([]*routerRun, c.instances), true
	stop, done := c.stopTick, c.tickDone
	c.stopTick = nil
	c.mu.Unlock()
	if stop != nil {
		close(stop)
		<-done
	}
	for _, rr := range running {
		if rr != nil {
			c.stopRun(rr)
		}
	}
}

// count sees every delivery, before the inbox decides anything.
func (c *consumer) count(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		c.deliveries.Add(1)
		c.inflight.Add(1)
		defer c.inflight.Add(-1)
		d := &delivery{uuid: msg.UUID}
		msg.SetContext(context.WithValue(msg.Context(), ranKey{}, d))
		out, err := h(msg)
		switch {
		case err != nil:
			c.nacked.Add(1)
		case d.ran.Load():
			c.applied.Add(1)
		default:
			c.duplicates.Add(1)
		}
		return out, err
	}
}

// errRandomNack is the random-nack middleware's failure.
var errRandomNack = errors.New("e2e: delivery failed at random before the inbox")

// randomNack fails a share nackRate of deliveries before the inbox sees
// them: the broker redelivers them, after messages of theirs that other
// instances hold already.
func (c *consumer) randomNack(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		if c.nackRate > 0 && rand.Float64() < c.nackRate {
			c.randomNacks.Add(1)
			return nil, errRandomNack
		}
		return h(msg)
	}
}

// orderConsumer makes one effect row per order.placed message.
type orderConsumer struct {
	insertEffect string
}

func (c *orderConsumer) handle(msg *message.Message) error {
	if d := deliveryOf(msg); d != nil {
		d.ran.Store(true)
	}
	tx, ok := outbox.TxFromContext(msg.Context())
	if !ok {
		return errors.New("no inbox transaction in the message context")
	}
	var o orderPlaced
	if err := json.Unmarshal(msg.Payload, &o); err != nil || o.OrderID == "" {
		return fmt.Errorf("payload %q: %v", msg.Payload, err)
	}
	_, err := tx.ExecContext(msg.Context(), c.insertEffect, o.OrderID, msg.UUID, time.Now().UnixMicro())
	return err
}

// watchLogger counts the Error messages equal to match.
type watchLogger struct {
	watermill.LoggerAdapter
	match string
	n     *atomic.Int64
}

func (l *watchLogger) Error(msg string, err error, fields watermill.LogFields) {
	if msg == l.match {
		l.n.Add(1)
	}
	l.LoggerAdapter.Error(msg, err, fields)
}

func (l *watchLogger) With(fields watermill.LogFields) watermill.LoggerAdapter {
	return &watchLogger{LoggerAdapter: l.LoggerAdapter.With(fields), match: l.match, n: l.n}
}

func debugLogger() watermill.LoggerAdapter {
	if os.Getenv(envRelayDebug) != "" {
		return watermill.NewStdLogger(true, false)
	}
	return watermill.NopLogger{}
}
