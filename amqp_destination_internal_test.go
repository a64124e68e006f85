package outbox

import (
	"context"
	"errors"
	"testing"

	"github.com/acemq/watermill-outbox/internal/testamqp"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// A window's basic.return is read on the channel the window went out on. A
// relay that has moved to a new channel meanwhile (the next batch's connect
// replaced a closed one) still fails the unroutable record instead of
// marking it published.
func TestAMQPDestination_ReturnOnAReplacedChannel_StillFailsItsRecord(t *testing.T) {
	b := testamqp.New(t) // its exchange has no queue bound for "nowhere"
	d, err := NewAMQPDestination(AMQPConfig{URL: testdb.AMQPURL()})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	ctx := context.Background()
	rec := Record{ID: "returned-" + testdb.RandomName(), Exchange: b.Exchange, RoutingKey: "nowhere", Body: []byte("x")}
	p := d.send(ctx, []Record{rec})
	if p.res[0] != nil || len(p.confirms) != 1 {
		t.Fatalf("send: %v", p.res[0])
	}
	<-p.confirms[0].Done() // the broker's ack, which follows its return

	d.mu.Lock()
	d.dropChannelLocked()
	d.mu.Unlock()
	if err := d.Connect(ctx); err != nil {
		t.Fatal(err)
	}
	if d.cc == p.on {
		t.Fatal("the destination did not move to a new channel")
	}

	res := d.wait(ctx, p)
	var unroutable *UnroutableError
	if !errors.As(res[0], &unroutable) {
		t.Fatalf("result %v, want the record failed as unroutable", res[0])
	}
}
