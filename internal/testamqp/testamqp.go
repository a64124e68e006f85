// Package testamqp gives tests a RabbitMQ topology of their own: an exchange
// and durable queues with unique names, deleted when the test ends, and a
// way to read what arrived. Every operation dials afresh, so a test that
// closes the broker's connections under the code it tests still reads its
// queues afterwards.
package testamqp

import (
	"context"
	"fmt"
	"os/exec"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/acemq/watermill-outbox/internal/testdb"
)

// Broker is a test's own corner of the test broker.
type Broker struct {
	t testing.TB
	// Exchange is a durable direct exchange of the test's own.
	Exchange string
}

// New declares the test's exchange, deleted when the test ends.
func New(t testing.TB) *Broker {
	t.Helper()
	testdb.Require(t, "amqp")
	b := &Broker{t: t, Exchange: "test-ex-" + testdb.RandomName()}
	b.With(func(ch *amqp.Channel) error {
		return ch.ExchangeDeclare(b.Exchange, amqp.ExchangeDirect, true, false, false, false, nil)
	})
	t.Cleanup(func() {
		b.try(func(ch *amqp.Channel) error { return ch.ExchangeDelete(b.Exchange, false, false) })
	})
	return b
}

// With runs fn on a channel of a fresh connection, failing the test on error.
func (b *Broker) With(fn func(ch *amqp.Channel) error) {
	b.t.Helper()
	if err := b.try(fn); err != nil {
		b.t.Fatalf("testamqp: %v", err)
	}
}

func (b *Broker) try(fn func(ch *amqp.Channel) error) error {
	conn, err := amqp.Dial(testdb.AMQPURL())
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

// Queue declares a durable queue of the test's own, bound to the test's
// exchange for each routing key, and deleted when the test ends.
func (b *Broker) Queue(routingKeys ...string) string {
	b.t.Helper()
	name := "test-q-" + testdb.RandomName()
	b.With(func(ch *amqp.Channel) error {
		if _, err := ch.QueueDeclare(name, true, false, false, false, nil); err != nil {
			return err
		}
		for _, rk := range routingKeys {
			if err := ch.QueueBind(name, rk, b.Exchange, false, nil); err != nil {
				return err
			}
		}
		return nil
	})
	b.t.Cleanup(func() {
		_ = b.try(func(ch *amqp.Channel) error { _, err := ch.QueueDelete(name, false, false, false); return err })
	})
	return name
}

// FullQueue declares a queue bound to the test's exchange for routingKey
// that holds one message and has it: it refuses every publish (x-overflow
// reject-publish, which the broker nacks) until it is purged. It returns
// the queue's name.
func (b *Broker) FullQueue(routingKey string) string {
	b.t.Helper()
	name := "test-q-full-" + testdb.RandomName()
	b.With(func(ch *amqp.Channel) error {
		if _, err := ch.QueueDeclare(name, true, false, false, false, amqp.Table{"x-max-length": int32(1), "x-overflow": "reject-publish"}); err != nil {
			return err
		}
		if err := ch.QueueBind(name, routingKey, b.Exchange, false, nil); err != nil {
			return err
		}
		return ch.PublishWithContext(context.Background(), b.Exchange, routingKey, false, false, amqp.Publishing{Body: []byte("filler")})
	})
	b.t.Cleanup(func() {
		_ = b.try(func(ch *amqp.Channel) error { _, err := ch.QueueDelete(name, false, false, false); return err })
	})
	deadline := time.Now().Add(5 * time.Second)
	for b.Count(name) != 1 {
		if time.Now().After(deadline) {
			b.t.Fatalf("queue %s: the filler is not in it after 5 s", name)
		}
		time.Sleep(10 * time.Millisecond)
	}
	return name
}

// Bind binds queue to the test's exchange for routingKey.
func (b *Broker) Bind(queue, routingKey string) {
	b.t.Helper()
	b.With(func(ch *amqp.Channel) error { return ch.QueueBind(queue, routingKey, b.Exchange, false, nil) })
}

// Drain reads from queue until at least want messages arrived (or timeout
// passed) and then until the queue is empty, acking them. It returns what
// arrived: a duplicate or a message that should not exist is in it too.
func (b *Broker) Drain(queue string, want int, timeout time.Duration) []amqp.Delivery {
	b.t.Helper()
	var got []amqp.Delivery
	b.With(func(ch *amqp.Channel) error {
		deadline := time.Now().Add(timeout)
		for {
			d, ok, err := ch.Get(queue, true)
			if err != nil {
				return err
			}
			if ok {
				got = append(got, d)
				continue
			}
			if len(got) >= want || time.Now().After(deadline) {
				return nil
			}
			time.Sleep(10 * time.Millisecond) // polling the broker, not synchronising goroutines
		}
	})
	return got
}

// Count is how many messages wait in queue.
func (b *Broker) Count(queue string) int {
	b.t.Helper()
	var n int
	b.With(func(ch *amqp.Channel) error {
		q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
		n = q.Messages
		return err
	})
	return n
}

// CloseConnections makes the broker close every client connection named
// connectionName (amqp091-go's connection_name client property), as a
// broker restart or a network cut would, and returns how many. Only those:
// the tests of other packages share the broker and run at the same time.
func CloseConnections(t testing.TB, connectionName string) int {
	t.Helper()
	out, err := exec.Command("rabbitmqctl", "-q", "list_connections", "pid", "client_properties").CombinedOutput()
	if err != nil {
		t.Fatalf("rabbitmqctl list_connections: %v: %s", err, out)
	}
	marker := `{"connection_name","` + connectionName + `"}`
	closed := 0
	for _, line := range strings.Split(string(out), "\n") {
		pid, props, ok := strings.Cut(line, "\t")
		if !ok || !strings.Contains(props, marker) {
			continue
		}
		if out, err := exec.Command("rabbitmqctl", "-q", "close_connection", pid, "outbox test: connection closed on purpose").CombinedOutput(); err != nil {
			t.Logf("rabbitmqctl close_connection %s: %v: %s", pid, err, out) // it may be gone already
			continue
		}
		closed++
	}
	return closed
}

// MaxMessageSize is the test broker's max_message_size, the largest body
// it takes, as rabbitmqctl reads it (read only: the broker is shared), or
// RabbitMQ 3.x's default of 128 MiB where rabbitmqctl cannot tell (4.x's
// default, 16 MiB, is below it: a body above 128 MiB is above both).
func MaxMessageSize(t testing.TB) int {
	t.Helper()
	out, err := exec.Command("rabbitmqctl", "-q", "eval", "application:get_env(rabbit, max_message_size).").CombinedOutput()
	if err == nil {
		var n int
		if _, err := fmt.Sscanf(strings.TrimSpace(string(out)), "{ok,%d}", &n); err == nil && n > 0 {
			return n
		}
	}
	t.Logf("testamqp: the broker's max_message_size unknown (%v: %s); taking 128 MiB", err, out)
	return 128 << 20
}
