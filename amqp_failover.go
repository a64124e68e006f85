package outbox

import (
	"fmt"
	"net"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
)

// FailoverDial returns an amqp.Config Dial that connects to the nodes of
// urls, a cluster's, in turn: each call starts at the node after the one
// the previous call connected to, and moves on to the next while a node
// does not answer within timeout (0: 10 s), until one does or every node
// failed. A client that redials after a lost connection through its
// Config.Dial thereby fails over to another node. watermill-amqp's
// ConnectionWrapper, under its Subscriber and Publisher, does so:
//
//	dial, err := outbox.FailoverDial(urls, 0, logger)
//	cfg := wamqp.NewDurableQueueConfig(urls[0])
//	cfg.Connection.AmqpConfig = &amqp.Config{Dial: dial}
//	sub, err := wamqp.NewSubscriber(cfg, logger)
//
// Only the host and port of urls are used: the client still logs in with
// the user, password and vhost of the one URL it was given, so every node
// must take them (in a cluster they are shared). Over TLS (amqps), the
// client checks each node's certificate against the host of that one URL
// unless its TLSClientConfig sets a ServerName: give the nodes certificates
// that carry a name they share, and set it there. AMQPDestination needs
// none of this: it dials each node with its own URL.
//
// It logs the node each connection goes to, with the nodes that did not
// answer before it, on logger (nil: no logging); a call that finds no node
// returns an error naming each, for the client to log. One Dial may serve several clients;
// their connections then spread over the nodes.
func FailoverDial(urls []string, timeout time.Duration, logger watermill.LoggerAdapter) (func(network, addr string) (net.Conn, error), error) {
	if len(urls) == 0 {
		return nil, &ConfigError{Field: "urls", Reason: "required: at least one broker URL"}
	}
	if timeout < 0 {
		return nil, &ConfigError{Field: "timeout", Reason: "negative"}
	}
	if timeout == 0 {
		timeout = dialTimeout
	}
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	f := &failoverDialer{timeout: timeout, log: logger}
	for i, u := range urls {
		n, err := parseNode(u)
		if err != nil {
			return nil, &ConfigError{Field: fmt.Sprintf("urls[%d]", i), Reason: err.Error()}
		}
		f.addrs = append(f.addrs, n.addr)
	}
	return f.dial, nil
}

// failoverDialer is FailoverDial's state: where the next call starts.
type failoverDialer struct {
	addrs   []string
	timeout time.Duration
	log     watermill.LoggerAdapter

	mu   sync.Mutex
	next int
}

// dial ignores addr, the host of the URL the client was given: the nodes
// are the failoverDialer's.
func (f *failoverDialer) dial(network, _ string) (net.Conn, error) {
	f.mu.Lock()
	start := f.next
	f.mu.Unlock()
	var failed nodeErrors
	for i := range f.addrs {
		k := (start + i) % len(f.addrs)
		conn, err := net.DialTimeout(network, f.addrs[k], f.timeout)
		if err != nil {
			failed = append(failed, fmt.Errorf("%s: %w", f.addrs[k], err))
			continue
		}
		// As amqp091-go's DefaultDial: a deadline for the handshake, which
		// the client clears once the connection is open.
		if err := conn.SetDeadline(time.Now().Add(f.timeout)); err != nil {
			_ = conn.Close()
			failed = append(failed, fmt.Errorf("%s: %w", f.addrs[k], err))
			continue
		}
		// The next call starts after this node: it is made when this
		// connection is lost, or when its handshake failed (a node that
		// takes connections before it serves them).
		f.mu.Lock()
		f.next = (k + 1) % len(f.addrs)
		f.mu.Unlock()
		fields := watermill.LogFields{"node": f.addrs[k]}
		if len(failed) > 0 {
			fields["unanswered"] = failed.Error()
		}
		f.log.Info("Dialled RabbitMQ node", fields)
		return conn, nil
	}
	return nil, fmt.Errorf("no RabbitMQ node answers: %w", failed)
}
