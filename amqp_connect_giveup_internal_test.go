package outbox

import (
	"context"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/acemq/watermill-outbox/internal/testamqp"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// A caller's own Publish (no Forwarder: its ctx is not marked by
// withWriteBound) whose ctx ends while the destination connects: the
// connect is cut at the ctx's end, and nothing is sent. When writes were
// first kept from the caller's ctx, the connect got their 15 s too: Publish
// held the caller (and d.mu) 10 s past a 300 ms deadline, and once the
// broker answered, the window went out although its ctx had ended.
func TestAMQPDestination_CallersPublish_ContextEndsDuringTheConnect_ReturnsSendsNothing(t *testing.T) {
	t.Run("broker_never_answers", func(t *testing.T) {
		proxy := testamqp.NewProxy(t)
		b := testamqp.New(t)
		b.Queue("t")
		d, err := NewAMQPDestination(AMQPConfig{URLs: []string{testdb.AMQPURL()}, AMQP: amqp.Config{Dial: proxy.Dial}})
		if err != nil {
			t.Fatal(err)
		}
		defer d.Close()
		proxy.Stall() // the handshake is never answered
		ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
		defer cancel()
		start := time.Now()
		res := d.Publish(ctx, []Record{{ID: "c-" + testdb.RandomName(), Exchange: b.Exchange, RoutingKey: "t", Body: []byte("x")}})
		took := time.Since(start)
		t.Logf("Publish with a 300 ms ctx returned after %s: %v", took.Round(time.Millisecond), res[0])
		if took > 3*time.Second {
			t.Errorf("Publish with a 300 ms ctx returned after %s: its connect is no longer bounded by its ctx", took.Round(time.Millisecond))
		}
	})
	t.Run("broker_answers_after_the_ctx_ended", func(t *testing.T) {
		proxy := testamqp.NewProxy(t)
		b := testamqp.New(t)
		q := b.Queue("t")
		d, err := NewAMQPDestination(AMQPConfig{URLs: []string{testdb.AMQPURL()}, AMQP: amqp.Config{Dial: proxy.Dial}})
		if err != nil {
			t.Fatal(err)
		}
		defer d.Close()
		proxy.Stall()
		time.AfterFunc(time.Second, proxy.Resume)
		ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
		defer cancel()
		res := d.Publish(ctx, []Record{{ID: "c-" + testdb.RandomName(), Exchange: b.Exchange, RoutingKey: "t", Body: []byte("x")}})
		t.Logf("result: %v", res[0])
		time.Sleep(500 * time.Millisecond)
		if n := b.Count(q); n > 0 {
			t.Errorf("%d message(s) reached the queue from a Publish whose ctx ended before anything was sent (during its connect)", n)
		}
	})
}
