package integration_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
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

// consumers is how many instances of the service consume the queue at
// once, as competing consumers: two deliveries of one message can then be
// handled at the same moment, and the inbox must still let one through.
const consumers = 2

// consumer is the service's consuming side: instances of a Watermill router
// with a watermill-amqp subscriber on the test's durable queue, a counting
// middleware outside the inbox, the inbox, and a handler that makes one
// effect row per order in the inbox's transaction. The chaos restarts an
// instance (a new router and subscriber, as a redeployed service would
// have); the counters span every instance and incarnation.
type consumer struct {
	t        *testing.T
	exchange string
	queue    string
	connName func(i int) string
	inbox    *outbox.Inbox

	mu       sync.Mutex
	running  [consumers]*routerRun // nil while restarting
	closed   bool
	restarts int

	insertEffect string
	deliveries   atomic.Int64 // every message the router handed to the handler chain
	handlerRuns  atomic.Int64 // the inbox let it through to the handler
	applied      atomic.Int64 // the handler ran and the inbox committed
	duplicates   atomic.Int64 // acked by the inbox without running the handler
	nacked       atomic.Int64 // the chain returned an error: the broker redelivers
	inflight     atomic.Int64
	reconnects   atomic.Int64 // the subscriber's connection was closed under it
}

// routerRun is one incarnation of the consumer.
type routerRun struct {
	router *message.Router
	sub    *wamqp.Subscriber
	done   chan error
}

type ranKey struct{}

func startConsumer(t *testing.T, r *run) *consumer {
	inbox, err := outbox.NewInbox(r.app, outbox.InboxConfig{
		ConsumerName: consumerName,
		// The service consumes its own events, from its own database: the
		// inbox marks the outbox record processed in the same transaction.
		MarkOutboxProcessed: true,
	})
	if err != nil {
		t.Fatal(err)
	}
	c := &consumer{
		t: t, exchange: r.exchange, queue: r.queue, inbox: inbox,
		connName:     func(i int) string { return r.connName("consumer-" + strconv.Itoa(i)) },
		insertEffect: r.app.Rebind("INSERT INTO effects (order_id, message_id, applied_us) VALUES (?, ?, ?)"),
	}
	t.Cleanup(c.close)
	for i := range consumers {
		if err := c.start(i); err != nil {
			t.Fatal(err)
		}
	}
	return c
}

// start starts instance i.
func (c *consumer) start(i int) error {
	log := &watchLogger{LoggerAdapter: debugLogger(), match: "Received close notification from AMQP, reconnecting", n: &c.reconnects}
	amqpCfg := amqp.Config{Properties: amqp.NewConnectionProperties()}
	amqpCfg.Properties.SetClientConnectionName(c.connName(i))
	sub, err := wamqp.NewSubscriber(wamqp.Config{
		Connection: wamqp.ConnectionConfig{
			AmqpURI:    testdb.AMQPURL(),
			AmqpConfig: &amqpCfg,
			Reconnect: &wamqp.ReconnectConfig{
				BackoffInitialInterval: 100 * time.Millisecond, BackoffRandomizationFactor: 0.5,
				BackoffMultiplier: 1.5, BackoffMaxInterval: 2 * time.Second,
			},
		},
		Marshaler: wamqp.DefaultMarshaler{},
		Exchange:  wamqp.ExchangeConfig{GenerateName: wamqp.GenerateExchangeNameConstant(c.exchange), Type: amqp.ExchangeDirect, Durable: true},
		Queue:     wamqp.QueueConfig{GenerateName: wamqp.GenerateQueueNameConstant(c.queue), Durable: true},
		QueueBind: wamqp.QueueBindConfig{GenerateRoutingKey: func(topic string) string { return topic }},
		Publish:   wamqp.PublishConfig{GenerateRoutingKey: func(topic string) string { return topic }},
		Consume:   wamqp.ConsumeConfig{Qos: wamqp.QosConfig{PrefetchCount: 10}},

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
	router.AddMiddleware(c.count, c.inbox.Middleware) // the first is the outermost
	router.AddConsumerHandler("fulfil-orders", topic, sub, c.handle)
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
	c.running, c.closed = [consumers]*routerRun{}, true
	c.mu.Unlock()
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
		ran := new(atomic.Bool)
		msg.SetContext(context.WithValue(msg.Context(), ranKey{}, ran))
		out, err := h(msg)
		switch {
		case err != nil:
			c.nacked.Add(1)
		case ran.Load():
			c.applied.Add(1)
		default:
			c.duplicates.Add(1)
		}
		return out, err
	}
}

func (c *consumer) handle(msg *message.Message) error {
	c.handlerRuns.Add(1)
	if ran, ok := msg.Context().Value(ranKey{}).(*atomic.Bool); ok {
		ran.Store(true)
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
