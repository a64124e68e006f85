package outbox

import (
	"context"
	"io"
	"net"
	"net/url"
	"sync/atomic"
	"testing"
	"time"

	"github.com/acemq/watermill-outbox/internal/testamqp"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// deafProxy passes bytes both ways until deaf is set; then it reads and
// drops what the client sends and keeps the broker's heartbeat monitor fed:
// a broker that reads nothing more from the connection (a memory alarm, under
// which RabbitMQ keeps a blocked connection open) and still sends heartbeats.
func deafProxy(t *testing.T) (string, *atomic.Bool) {
	u, _ := url.Parse(testdb.AMQPURL())
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	var deaf atomic.Bool
	broker := u.Host
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			up, err := net.Dial("tcp", broker)
			if err != nil {
				c.Close()
				continue
			}
			t.Cleanup(func() { c.Close(); up.Close() })
			go func() { _, _ = io.Copy(c, up) }()
			go func() {
				buf := make([]byte, 64<<10)
				hb := false
				for {
					n, err := c.Read(buf)
					if err != nil {
						return
					}
					if deaf.Load() {
						if !hb {
							hb = true
							go func() {
								for range time.Tick(time.Second) {
									if _, err := up.Write([]byte{8, 0, 0, 0, 0, 0, 0, 0xCE}); err != nil {
										return
									}
								}
							}()
						}
						continue
					}
					if _, err := up.Write(buf[:n]); err != nil {
						return
					}
				}
			}()
		}
	}()
	u.Host = ln.Addr().String()
	return u.String(), &deaf
}

// Under a memory alarm (the broker reads nothing, keeps the connection and
// sends heartbeats), a Sweep bounded by its request gives up on its window
// while Run's window, confirmed before the alarm, is out: the channel is
// retired. Collecting
// Run's window closes the retired channel with amqp091's Channel.Close, an
// RPC without a bound, under d.mu: Run's wait, bounded by PublishTimeout,
// and every other call on the destination, hang until the alarm clears.
// A channel retired (a Sweep given up beside Run's window) while the broker
// stops reading (a memory alarm: the connection stays, heartbeats come):
// Run's wait for its window, confirmed already, returns at once. The
// retired channel's close waited for the broker's close-ok under the
// destination's lock, and the wait was still blocked after 15 s.
func TestAMQPDestination_ChannelRetiredWhileTheBrokerStopsReading_RunsWaitReturns(t *testing.T) {
	t.Parallel()
	b := testamqp.New(t)
	b.Queue("t")
	addr, deaf := deafProxy(t)
	d, err := NewAMQPDestination(AMQPConfig{URLs: []string{addr}})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	rec := func() Record {
		return Record{ID: "r-" + testdb.RandomName(), Exchange: b.Exchange, RoutingKey: "t", Body: []byte("x")}
	}
	if res := d.Publish(context.Background(), []Record{rec()}); res[0] != nil {
		t.Fatal(res[0])
	}
	p := d.Pipeline()
	w := p.Send(context.Background(), []Record{rec()})                             // Run's window
	time.Sleep(200 * time.Millisecond)                                             // its confirm is in
	deaf.Store(true)                                                               // a memory alarm: the broker reads nothing more from the connection
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond) // a Sweep bounded by its request
	t.Logf("sweep: %v", d.Publish(withWriteBound(ctx, time.Now().Add(2*time.Second)), []Record{rec()})[0])
	cancel()
	done := make(chan []error, 1)
	start := time.Now()
	go func() {
		wctx, wcancel := context.WithTimeoutCause(context.Background(), 2*time.Second, errNoConfirmInTime) // Run's PublishTimeout
		defer wcancel()
		done <- p.Wait(wctx, w)
	}()
	select {
	case res := <-done:
		t.Logf("Run's wait returned in %v: %v", time.Since(start), res[0])
	case <-time.After(15 * time.Second):
		t.Errorf("Run's wait for a confirmed window, bounded by a 2 s PublishTimeout, still blocked after 15 s")
	}
}
