package outbox

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/acemq/watermill-outbox/internal/testamqp"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// A record whose exchange name is over AMQP's 255 bytes (a row written by
// another library: varchar(255) counts characters, and "é" is two bytes)
// fails permanently before its exchange is checked. It was checked first
// (checkExchange), before encodable refused it: amqp091-go's
// ExchangeDeclarePassive failed to marshal the short string and shut the
// whole connection down over it (FrameError), 1823 of another window's
// 2000 records lost their confirms, and the record was charged as a lost
// connection, on every try.
func TestAMQPDestination_ExchangeNameOver255Bytes_FailsPermanently_WindowInFlightKeepsItsConfirms(t *testing.T) {
	b := testamqp.New(t)
	q := b.Queue("t")
	d, err := NewAMQPDestination(AMQPConfig{URLs: []string{testdb.AMQPURL()}})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	recs := func(n int) []Record {
		r := make([]Record, n)
		for i := range r {
			r[i] = Record{ID: watermill.NewUUID(), Exchange: b.Exchange, RoutingKey: "t", Body: make([]byte, 8192)}
		}
		return r
	}
	if res := d.Publish(context.Background(), recs(1)); res[0] != nil {
		t.Fatal(res[0])
	}
	d.mu.Lock()
	conn := d.conn
	d.mu.Unlock()

	p := d.Pipeline()
	sent := p.Send(context.Background(), recs(2000)) // Run's window in flight
	bad := Record{ID: watermill.NewUUID(), Exchange: strings.Repeat("é", 128), RoutingKey: "t", Body: []byte("x")}
	res := d.Publish(context.Background(), []Record{bad}) // a Sweep's batch, or a caller's
	t.Logf("record with a 256-byte exchange name: %v", res[0])
	if !IsPermanent(res[0]) {
		t.Errorf("record with a 256-byte exchange name failed with %v, want a permanent failure (encodable refuses it: no retry sends it)", res[0])
	}

	wctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	lost, first := 0, error(nil)
	for _, err := range p.Wait(wctx, sent) {
		if err != nil {
			lost++
			if first == nil {
				first = err
			}
		}
	}
	if lost > 0 {
		t.Errorf("%d of 2000 records of the window in flight failed (%v) over another caller's record", lost, first)
	}
	time.Sleep(100 * time.Millisecond)
	if conn.IsClosed() {
		t.Errorf("the connection was closed over a record's exchange name")
	}
	if n := b.Count(q); n < 2001 {
		t.Errorf("%d in the queue, want the 2001 confirmed at least", n)
	}
}
