package testamqp

import (
	"io"
	"net"
	"net/url"
	"sync"
	"testing"

	"github.com/acemq/watermill-outbox/internal/testdb"
)

// Node stands for one node of a cluster in failover tests: a listener of
// its own that passes every connection on to the test broker, so a client
// given several Nodes' URLs sees several nodes, and a test can take one
// down (Kill) or cut its clients off while it keeps answering (Drop)
// without touching the broker that other tests share.
type Node struct {
	t  testing.TB
	ln net.Listener
	// URL is the test broker's URL with this node's address: the broker's
	// user, password and vhost.
	URL string
	// Addr is the node's host:port, as logs and metrics name it.
	Addr string

	broker string // host:port

	mu     sync.Mutex
	conns  map[net.Conn]bool
	killed bool
	wg     sync.WaitGroup // the accept loop and the copies
}

// NewNode starts a node, killed when the test ends.
func NewNode(t testing.TB) *Node {
	t.Helper()
	u, err := url.Parse(testdb.AMQPURL())
	if err != nil {
		t.Fatalf("testamqp: broker URL: %v", err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("testamqp: node listener: %v", err)
	}
	broker := u.Host
	if u.Port() == "" {
		broker = net.JoinHostPort(u.Hostname(), "5672")
	}
	n := &Node{t: t, ln: ln, Addr: ln.Addr().String(), broker: broker, conns: map[net.Conn]bool{}}
	u.Host = n.Addr
	n.URL = u.String()
	n.wg.Add(1)
	go n.accept()
	t.Cleanup(n.Kill)
	return n
}

func (n *Node) accept() {
	defer n.wg.Done()
	for {
		client, err := n.ln.Accept()
		if err != nil {
			return // killed
		}
		upstream, err := net.Dial("tcp", n.broker)
		if err != nil {
			_ = client.Close()
			continue
		}
		n.mu.Lock()
		if n.killed {
			n.mu.Unlock()
			_ = client.Close()
			_ = upstream.Close()
			return
		}
		n.conns[client], n.conns[upstream] = true, true
		n.wg.Add(2)
		n.mu.Unlock()
		go n.pipe(client, upstream)
		go n.pipe(upstream, client)
	}
}

// pipe copies from src to dst until either closes, then closes both.
func (n *Node) pipe(dst, src net.Conn) {
	defer n.wg.Done()
	_, _ = io.Copy(dst, src)
	_ = dst.Close()
	_ = src.Close()
	n.mu.Lock()
	delete(n.conns, dst)
	delete(n.conns, src)
	n.mu.Unlock()
}

// Drop closes the connections through the node, as a node restart would,
// and keeps taking new ones.
func (n *Node) Drop() {
	n.mu.Lock()
	for c := range n.conns {
		_ = c.Close()
	}
	n.mu.Unlock()
}

// Kill takes the node down: it refuses new connections from here on and
// closes those it has. It returns once its goroutines have ended. Calling
// it again does nothing.
func (n *Node) Kill() {
	n.mu.Lock()
	n.killed = true
	n.mu.Unlock()
	_ = n.ln.Close()
	n.Drop()
	n.wg.Wait()
}

// Connections is how many client connections go through the node.
func (n *Node) Connections() int {
	n.mu.Lock()
	defer n.mu.Unlock()
	return len(n.conns) / 2
}
