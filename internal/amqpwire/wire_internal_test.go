package amqpwire

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"os"
	"runtime"
	"testing"
	"time"
)

// pipeWire is a Wire over one end of an in-memory pipe, and the other end.
func pipeWire(t *testing.T) (*Wire, net.Conn) {
	t.Helper()
	a, b := net.Pipe()
	t.Cleanup(func() { _ = a.Close(); _ = b.Close() })
	return &Wire{Conn: a}, b
}

// Held writes reach the peer in order, in one write, when released; writes
// outside a hold go through at once.
func TestWire_HeldWritesGoOutTogetherInOrder(t *testing.T) {
	w, peer := pipeWire(t)
	got := make(chan []byte, 1)
	go func() {
		buf := make([]byte, 64)
		n, _ := peer.Read(buf) // one Read: net.Pipe hands over one Write at a time
		got <- buf[:n]
	}()
	release := w.Hold(context.Background())
	for _, s := range []string{"one ", "two ", "three"} {
		if n, err := w.Write([]byte(s)); err != nil || n != len(s) {
			t.Fatalf("held write: %d, %v", n, err)
		}
	}
	select {
	case b := <-got:
		t.Fatalf("%q reached the peer before the release", b)
	case <-time.After(20 * time.Millisecond):
	}
	if err := release(); err != nil {
		t.Fatal(err)
	}
	if b := <-got; string(b) != "one two three" {
		t.Fatalf("peer read %q in its first read, want the three writes in one", b)
	}

	go func() { _, _ = w.Write([]byte("after")) }()
	buf := make([]byte, 16)
	if n, err := peer.Read(buf); err != nil || string(buf[:n]) != "after" {
		t.Fatalf("write outside a hold: %q, %v", buf[:n], err)
	}
}

// A batch larger than flushAt goes out while it is published, not all at
// the release.
func TestWire_LargeBatch_WrittenAsItGrows(t *testing.T) {
	w, peer := pipeWire(t)
	read := make(chan int, 1)
	go func() {
		n, _ := io.ReadFull(peer, make([]byte, flushAt))
		read <- n
	}()
	release := w.Hold(context.Background())
	chunk := bytes.Repeat([]byte("x"), 1024)
	for i := 0; i < flushAt/len(chunk); i++ {
		if _, err := w.Write(chunk); err != nil {
			t.Fatal(err)
		}
	}
	if n := <-read; n != flushAt {
		t.Fatalf("peer read %d bytes before the release, want %d", n, flushAt)
	}
	if err := release(); err != nil {
		t.Fatal(err)
	}
}

// A peer that stops reading (a broker under a memory alarm) cannot hang the
// relay: the release fails by the batch's deadline, and so does every later
// write, so that the client shuts the connection down.
func TestWire_PeerStopsReading_ReleaseFailsByTheDeadline(t *testing.T) {
	w, _ := pipeWire(t) // nobody reads
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	release := w.Hold(ctx)
	if _, err := w.Write([]byte("publish")); err != nil {
		t.Fatal(err)
	}
	started := time.Now()
	err := release()
	if !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("release: %v, want the deadline exceeded", err)
	}
	if took := time.Since(started); took > 5*time.Second {
		t.Fatalf("release took %s", took)
	}
	if _, err := w.Write([]byte("heartbeat")); err == nil {
		t.Fatal("a write after the failed release succeeded")
	}
}

// A context cancelled (no deadline) cuts a blocked write short too.
func TestWire_ContextCancelled_BlockedWriteFails(t *testing.T) {
	w, _ := pipeWire(t)
	ctx, cancel := context.WithCancel(context.Background())
	release := w.Hold(ctx)
	if _, err := w.Write(bytes.Repeat([]byte("x"), flushAt-1)); err != nil {
		t.Fatal(err)
	}
	errc := make(chan error, 1)
	go func() {
		_, err := w.Write([]byte("xx")) // reaches flushAt: written now, and blocks
		errc <- err
	}()
	time.AfterFunc(50*time.Millisecond, cancel)
	select {
	case err := <-errc:
		if err == nil {
			t.Fatal("the blocked write succeeded with nobody reading")
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the blocked write was not cut short by the cancelled context")
	}
	if err := release(); err == nil {
		t.Fatal("release after a failed write succeeded")
	}
}

// A write made outside a hold (a heartbeat into a full socket) does not make
// the next batch's hold wait for ever: the batch's context cuts it.
func TestWire_WriteBlockedOutsideAHold_HoldCutByItsContext(t *testing.T) {
	w, _ := pipeWire(t) // nobody reads
	blocked := make(chan error, 1)
	go func() {
		_, err := w.Write([]byte("heartbeat")) // blocks, holding the wire
		blocked <- err
	}()
	for w.mu.TryLock() { // until the write holds the wire
		w.mu.Unlock()
		runtime.Gosched()
	}
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	done := make(chan error, 1)
	go func() {
		release := w.Hold(ctx)
		_, _ = w.Write([]byte("publish"))
		done <- release()
	}()
	select {
	case err := <-done:
		if err == nil {
			t.Fatal("the batch was released with nobody reading")
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the hold waited behind the blocked write past its context")
	}
	if err := <-blocked; err == nil {
		t.Fatal("the blocked write succeeded with nobody reading")
	}
}
