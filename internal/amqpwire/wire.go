// Package amqpwire is the relay's socket to the broker under amqp091-go: a
// net.Conn that holds the writes of a batch's publishes and sends them
// together, under the batch's deadline.
package amqpwire

import (
	"context"
	"net"
	"sync"
	"time"
)

// flushAt is how many held bytes a Wire writes out before the batch
// ends: a batch of large messages still goes out as it is published, in
// writes of about this size.
const flushAt = 64 << 10

// Wire is the relay's connection to the broker, under amqp091-go. The client
// flushes every publish, which is a write system call and a TCP segment the
// broker reads and handles on its own; while a batch is published the wire
// holds those writes and sends them together, so that the broker reads a
// batch in a few segments. Measured on two cores (outbox-bench -scenario
// relay), the relay's send of a batch of 100 took half the time, and the
// drain went about 10% faster.
//
// Held writes go out under the batch's deadline, and a context that ends
// unblocks them: a broker that stops reading (a memory alarm) cannot hang
// the relay. After a failed write the wire fails every write with that
// error, so that amqp091-go shuts the connection down.
type Wire struct {
	net.Conn

	mu      sync.Mutex
	holding bool
	held    []byte
	err     error // the first failed write

	cut   sync.Mutex // orders the ctx's cut with hold and release
	armed bool       // between hold and release: a ctx that ends cuts writes
	gen   uint64     // which hold is armed
}

// Write sends p, or holds it while a batch is published.
func (w *Wire) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.err != nil {
		return 0, w.err
	}
	if !w.holding {
		n, err := w.Conn.Write(p)
		w.err = err
		return n, err
	}
	w.held = append(w.held, p...)
	if len(w.held) >= flushAt {
		if err := w.flushLocked(); err != nil {
			return 0, err
		}
	}
	return len(p), nil
}

// Hold holds the writes from here until release, which writes them out.
// They go out by ctx's deadline, and a ctx that ends cuts a blocked write
// short: also one made outside a hold (a heartbeat into a full socket) that
// the hold would otherwise wait behind.
func (w *Wire) Hold(ctx context.Context) (release func() error) {
	w.cut.Lock()
	w.gen++
	gen := w.gen
	w.armed = true
	w.cut.Unlock()
	stop := context.AfterFunc(ctx, func() {
		w.cut.Lock()
		defer w.cut.Unlock()
		if w.armed && w.gen == gen { // not a later hold's
			_ = w.Conn.SetWriteDeadline(time.Now()) // a blocked write fails now
		}
	})
	w.mu.Lock()
	w.holding = true
	w.cut.Lock()
	deadline, _ := ctx.Deadline() // zero: none
	if ctx.Err() != nil {
		deadline = time.Now() // ended before the hold began: cut at once
	}
	_ = w.Conn.SetWriteDeadline(deadline)
	w.cut.Unlock()
	w.mu.Unlock()
	return func() error {
		defer stop()
		w.mu.Lock()
		defer w.mu.Unlock()
		w.holding = false
		err := w.flushLocked()
		if err == nil {
			err = w.err // a held write that failed on the way
		}
		w.cut.Lock()
		defer w.cut.Unlock()
		w.armed = false
		if err == nil {
			_ = w.Conn.SetWriteDeadline(time.Time{})
		}
		return err
	}
}

func (w *Wire) flushLocked() error {
	if len(w.held) == 0 {
		return nil
	}
	_, err := w.Conn.Write(w.held)
	w.held = w.held[:0]
	if err != nil {
		w.err = err
	}
	return err
}

// Dial wraps dial (amqp.Config's Dial) so that each connection it opens is
// a Wire, reported through opened.
func Dial(dial func(network, addr string) (net.Conn, error), opened func(*Wire)) func(network, addr string) (net.Conn, error) {
	return func(network, addr string) (net.Conn, error) {
		c, err := dial(network, addr)
		if err != nil {
			return nil, err
		}
		w := &Wire{Conn: c}
		opened(w)
		return w, nil
	}
}
