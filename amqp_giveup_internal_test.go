package outbox

import (
	"context"
	"testing"
	"time"

	"github.com/acemq/watermill-outbox/internal/testamqp"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// A Sweep's Publish given up on while another window is out keeps the
// connection; the return of its unroutable record comes after. Filed under
// the record's id on a channel that went on, it was taken by the record's
// next send (routable now: a binding was added), which failed as
// unroutable though the broker routed it. The channel is retired instead,
// and goes, with what it filed, before the next window.
func TestAMQPDestination_GivenUpWindowsLateReturn_NotTakenByItsRecordsNextSend(t *testing.T) {
	b := testamqp.New(t)
	b.Queue("t")
	d, err := NewAMQPDestination(AMQPConfig{URLs: []string{testdb.AMQPURL()}})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	rec := func(rk string) Record {
		return Record{ID: "r-" + testdb.RandomName(), Exchange: b.Exchange, RoutingKey: rk, Body: []byte("x")}
	}
	if res := d.Publish(context.Background(), []Record{rec("t")}); res[0] != nil {
		t.Fatal(res[0])
	}
	p := d.Pipeline()
	w := p.Send(context.Background(), []Record{rec("t")}) // Run's window, not collected yet
	x := rec("later")                                     // no queue bound for it yet
	ctx, cancel := context.WithCancel(context.Background())
	cancel() // the Sweep's caller is gone
	t.Logf("given up: %v", d.Publish(withWriteBound(ctx, time.Now().Add(15*time.Second)), []Record{x})[0])
	wctx, wcancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer wcancel()
	time.Sleep(200 * time.Millisecond) // x's return is in
	_ = p.Wait(wctx, w)                // files it
	q2 := b.Queue("later")             // x is routable now
	res := d.Publish(context.Background(), []Record{x})
	if res[0] != nil {
		t.Errorf("x, routed to %s (%d there), failed: %v", q2, b.Count(q2), res[0])
	}
}

// A Publish its caller gives up on while another window is out (not yet
// collected): its record the broker refuses closed the channel under a
// window sent after it, and with the given-up window gone from the ones
// out, the close was blamed on the innocent record of that window, which
// failed permanently. Nothing goes out on the retired channel now, and
// the given-up window stays one of those out until it goes.
func TestAMQPDestination_GivenUpWindowsRefusedRecord_NotBlamedOnAnInnocentRecord(t *testing.T) {
	b := testamqp.New(t)
	b.Queue("t")
	saved := routingHeaders
	routingHeaders = nil // as if encodable did not know this refusal
	defer func() { routingHeaders = saved }()
	d, err := NewAMQPDestination(AMQPConfig{URLs: []string{testdb.AMQPURL()}})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	rec := func(id string) Record {
		return Record{ID: id + "-" + testdb.RandomName(), Exchange: b.Exchange, RoutingKey: "t", Body: []byte("x")}
	}
	if res := d.Publish(context.Background(), []Record{rec("warm")}); res[0] != nil {
		t.Fatal(res[0])
	}
	p := d.Pipeline()
	w := p.Send(context.Background(), []Record{rec("w")}) // Run's window, confirmed, not collected yet
	time.Sleep(100 * time.Millisecond)
	bad := rec("refused")
	bad.Body = make([]byte, 8<<20) // the broker takes a moment to read it
	bad.Headers = map[string]any{"CC": "ops"}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()                                                                             // a Sweep whose request is gone
	cut := d.Publish(withWriteBound(ctx, time.Now().Add(15*time.Second)), []Record{bad}) // as Forwarder.publish marks a Sweep's
	t.Logf("refused record, given up on: %v", cut[0])
	innocent := rec("innocent")
	n := p.Send(context.Background(), []Record{innocent}) // Run's next window
	wctx, wcancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer wcancel()
	_ = p.Wait(wctx, w)
	res := p.Wait(wctx, n)
	if IsPermanent(res[0]) {
		t.Errorf("an innocent record failed permanently: %v", res[0])
	} else if res[0] != nil {
		t.Logf("innocent: %v", res[0])
	}
}
