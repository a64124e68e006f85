// Package testamqp gives tests a RabbitMQ topology of their own: an exchange
// and durable queues with unique names, deleted when the test ends, and a
// way to read what arrived.
package testamqp

import (
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/acemq/watermill-outbox/internal/testdb"
)

// Broker is a connection for a test's own use, beside the code under test.
type Broker struct {
	t    testing.TB
	Conn *amqp.Connection
	Ch   *amqp.Channel
	// Exchange is a durable direct exchange of the test's own.
	Exchange string
}

// New connects to the test broker, and declares the test's exchange.
func New(t testing.TB) *Broker {
	t.Helper()
	testdb.Require(t, "amqp")
	conn, err := amqp.Dial(testdb.AMQPURL())
	if err != nil {
		t.Fatalf("testamqp: %v", err)
	}
	ch, err := conn.Channel()
	if err != nil {
		t.Fatalf("testamqp: %v", err)
	}
	b := &Broker{t: t, Conn: conn, Ch: ch, Exchange: "test-ex-" + testdb.RandomName()}
	if err := ch.ExchangeDeclare(b.Exchange, amqp.ExchangeDirect, true, false, false, false, nil); err != nil {
		t.Fatalf("testamqp: declare exchange: %v", err)
	}
	t.Cleanup(func() {
		if ch, err := conn.Channel(); err == nil {
			_ = ch.ExchangeDelete(b.Exchange, false, false)
		}
		_ = conn.Close()
	})
	return b
}

// Queue declares a durable queue of the test's own, bound to the test's
// exchange for each routing key, and deleted when the test ends.
func (b *Broker) Queue(routingKeys ...string) string {
	b.t.Helper()
	name := "test-q-" + testdb.RandomName()
	if _, err := b.Ch.QueueDeclare(name, true, false, false, false, nil); err != nil {
		b.t.Fatalf("testamqp: declare queue: %v", err)
	}
	for _, rk := range routingKeys {
		if err := b.Ch.QueueBind(name, rk, b.Exchange, false, nil); err != nil {
			b.t.Fatalf("testamqp: bind queue: %v", err)
		}
	}
	b.t.Cleanup(func() {
		if ch, err := b.Conn.Channel(); err == nil {
			_, _ = ch.QueueDelete(name, false, false, false)
			_ = ch.Close()
		}
	})
	return name
}

// Drain reads from queue until want messages arrived or the timeout passed
// with nothing new, and acks them. It returns what arrived.
func (b *Broker) Drain(queue string, want int, timeout time.Duration) []amqp.Delivery {
	b.t.Helper()
	ch, err := b.Conn.Channel()
	if err != nil {
		b.t.Fatalf("testamqp: %v", err)
	}
	defer ch.Close()
	var got []amqp.Delivery
	deadline := time.Now().Add(timeout)
	for len(got) < want && time.Now().Before(deadline) {
		d, ok, err := ch.Get(queue, true)
		if err != nil {
			b.t.Fatalf("testamqp: get from %s: %v", queue, err)
		}
		if !ok {
			time.Sleep(10 * time.Millisecond) // polling the broker, not synchronising goroutines
			continue
		}
		got = append(got, d)
	}
	return got
}

// Count is how many messages wait in queue.
func (b *Broker) Count(queue string) int {
	b.t.Helper()
	ch, err := b.Conn.Channel()
	if err != nil {
		b.t.Fatalf("testamqp: %v", err)
	}
	defer ch.Close()
	q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
	if err != nil {
		b.t.Fatalf("testamqp: inspect %s: %v", queue, err)
	}
	return q.Messages
}
