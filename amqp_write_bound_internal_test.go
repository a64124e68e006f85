package outbox

import (
	"context"
	"errors"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/acemq/watermill-outbox/internal/testamqp"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// A Sweep's send that took the destination with little of its write bound
// left, behind Run's wait for confirms (which holds d.mu up to
// PublishTimeout), checked its exchange against a broker slow to answer:
// the bound ran out during the check, and the connection was dropped, with
// the confirms of every window out on it (sent again: duplicates). It now
// sends nothing, and the connection stays.
func TestAMQPDestination_SendHoldsTheDestinationWithItsBoundNearlySpent_SendsNothingOthersKeepTheirConfirms(t *testing.T) {
	t.Parallel()
	b := testamqp.New(t)
	b.Queue("t")
	proxy := testamqp.NewProxy(t)
	d, err := NewAMQPDestination(AMQPConfig{URLs: []string{testdb.AMQPURL()}, AMQP: amqp.Config{Dial: proxy.Dial}})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	rec := func(exchange string) Record {
		return Record{ID: "r-" + testdb.RandomName(), Exchange: exchange, RoutingKey: "t", Body: []byte("x")}
	}
	p := d.Pipeline()
	run := p.Send(context.Background(), []Record{rec(b.Exchange)}) // Run's window, out on the channel
	if err := run.(*sent).res[0]; err != nil {
		t.Fatal(err)
	}

	// The Sweep's send waits for the destination, held by Run's wait, until
	// 40 ms of its 2 s bound are left.
	d.mu.Lock()
	until := time.Now().Add(2 * time.Second)
	swept := make(chan Sent, 1)
	go func() {
		ctx := withWriteBound(context.Background(), until)
		swept <- p.Send(ctx, []Record{rec("amq.direct")}) // an exchange not checked yet: a round trip
	}()
	time.Sleep(time.Until(until.Add(-40 * time.Millisecond)))
	proxy.Stall() // the broker answers the check only after the bound
	d.mu.Unlock()
	var s Sent
	select {
	case s = <-swept:
	case <-time.After(10 * time.Second):
		t.Fatal("the Sweep's send did not return")
	}
	proxy.Resume()
	if err := s.(*sent).res[0]; !errors.Is(err, errWriteTimeSpent) {
		t.Errorf("Sweep's send with its bound nearly spent: %v, want errWriteTimeSpent (nothing sent)", err)
	}
	wctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if res := p.Wait(wctx, run); res[0] != nil {
		t.Errorf("Run's window, out when the Sweep's send took the destination: %v, want confirmed", res[0])
	}
	_ = p.Wait(wctx, s)
	if res := d.Publish(context.Background(), []Record{rec(b.Exchange)}); res[0] != nil {
		t.Fatal(res[0])
	}
	if n := proxy.Dialed(); n != 1 {
		t.Errorf("connections dialled: %d, want 1 (the Sweep's send dropped none)", n)
	}
}
