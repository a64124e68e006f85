package testutil_test

import (
	"fmt"
	"strings"
	"sync"
	"testing"

	"github.com/acemq/watermill-outbox/internal/testutil"
)

// Writers in goroutines of their own, and a reader among them, lose nothing
// and (under -race) race with nothing.
func TestLockedBuffer_ConcurrentWriters_EveryWriteKept(t *testing.T) {
	var b testutil.LockedBuffer
	var wg sync.WaitGroup
	for w := 0; w < 4; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < 100; i++ {
				fmt.Fprintf(&b, "w%d line %d\n", w, i)
				_ = b.Tail(1)
			}
		}()
	}
	wg.Wait()
	if got := strings.Count(b.String(), "\n"); got != 400 {
		t.Fatalf("%d lines kept, want 400", got)
	}
}

// Tail gives the last n lines without the final newline, and every line
// when there are fewer.
func TestLockedBuffer_Tail_LastNLines(t *testing.T) {
	var b testutil.LockedBuffer
	b.Write([]byte("one\ntwo\nthree\n"))
	if got := b.Tail(2); got != "two\nthree" {
		t.Errorf("Tail(2) = %q, want %q", got, "two\nthree")
	}
	if got := b.Tail(10); got != "one\ntwo\nthree" {
		t.Errorf("Tail(10) = %q, want every line", got)
	}
}
