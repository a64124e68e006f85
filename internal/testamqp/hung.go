package testamqp

import (
	"net"
	"net/url"
	"sync"
	"testing"

	"github.com/acemq/watermill-outbox/internal/testdb"
)

// HungNode is the URL (the test broker's user, password and vhost) of a
// node that takes TCP connections and never answers AMQP: a stopped or
// wedged broker, or a host whose kernel still accepts. It and its
// connections close when the test ends.
func HungNode(t testing.TB) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var conns []net.Conn
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
		}
	}()
	t.Cleanup(func() {
		_ = ln.Close()
		mu.Lock()
		defer mu.Unlock()
		for _, c := range conns {
			_ = c.Close()
		}
	})
	u, _ := url.Parse(testdb.AMQPURL())
	u.Host = ln.Addr().String()
	return u.String()
}

// NoBackendNode is the URL of a node that takes each TCP connection and
// closes it at once: a load balancer in TCP mode with no broker behind it.
// It closes when the test ends.
func NoBackendNode(t testing.TB) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			_ = c.Close()
		}
	}()
	t.Cleanup(func() { _ = ln.Close() })
	u, _ := url.Parse(testdb.AMQPURL())
	u.Host = ln.Addr().String()
	return u.String()
}
