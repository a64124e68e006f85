package testamqp

import (
	"io"
	"net"
	"net/url"
	"sync"
	"testing"
	"time"

	"github.com/acemq/watermill-outbox/internal/testdb"
)

// Proxy stands between a client and the test broker, and can stop reading
// what the client sends while still passing on what the broker sends
// (heartbeats included): what a client sees of a broker under a memory
// alarm, which stops reading from publishing connections and answers
// nothing, without raising an alarm on the shared broker.
type Proxy struct {
	t      testing.TB
	broker string // host:port

	mu      sync.Mutex
	stalled chan struct{} // nil while the proxy passes everything on
	conns   []net.Conn
	closed  bool
}

// NewProxy returns a proxy to the test broker, closed when the test ends.
func NewProxy(t testing.TB) *Proxy {
	t.Helper()
	u, err := url.Parse(testdb.AMQPURL())
	if err != nil {
		t.Fatalf("testamqp: broker URL: %v", err)
	}
	p := &Proxy{t: t, broker: u.Host}
	t.Cleanup(p.close)
	return p
}

// Dial is an amqp.Config Dial that connects through the proxy, whatever
// address it is given.
func (p *Proxy) Dial(network, _ string) (net.Conn, error) {
	client, proxySide := net.Pipe()
	upstream, err := net.DialTimeout(network, p.broker, 10*time.Second)
	if err != nil {
		return nil, err
	}
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		_ = upstream.Close()
		return nil, net.ErrClosed
	}
	p.conns = append(p.conns, proxySide, upstream)
	p.mu.Unlock()
	go p.fromClient(proxySide, upstream)
	go func() {
		_, _ = io.Copy(proxySide, upstream)
		_ = proxySide.Close()
	}()
	return client, nil
}

// fromClient passes the client's bytes on, and reads nothing while stalled.
func (p *Proxy) fromClient(client, upstream net.Conn) {
	defer upstream.Close()
	buf := make([]byte, 32<<10)
	for {
		p.mu.Lock()
		stalled := p.stalled
		p.mu.Unlock()
		if stalled != nil {
			<-stalled
			continue
		}
		n, err := client.Read(buf)
		if n > 0 {
			if _, werr := upstream.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

// Stall stops reading from the clients (from their next read on).
func (p *Proxy) Stall() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.stalled == nil {
		p.stalled = make(chan struct{})
	}
}

// Resume reads from the clients again.
func (p *Proxy) Resume() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.stalled != nil {
		close(p.stalled)
		p.stalled = nil
	}
}

func (p *Proxy) close() {
	p.Resume()
	p.mu.Lock()
	defer p.mu.Unlock()
	p.closed = true
	for _, c := range p.conns {
		_ = c.Close()
	}
}
