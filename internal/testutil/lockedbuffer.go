// Package testutil holds small helpers that tests of more than one package
// share.
package testutil

import (
	"bufio"
	"bytes"
	"strings"
	"sync"
)

// LockedBuffer is a bytes.Buffer that one goroutine may write while another
// reads: the output of a child process, say, copied in by exec's goroutine
// and read by the test. The zero value is ready to use.
type LockedBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

// Write appends p.
func (b *LockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

// String returns everything written so far.
func (b *LockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// Tail returns the last n lines written so far, without the final newline.
// A line over 1 MiB ends the lines read there.
func (b *LockedBuffer) Tail(n int) string {
	b.mu.Lock()
	defer b.mu.Unlock()
	var lines []string
	sc := bufio.NewScanner(bytes.NewReader(b.buf.Bytes()))
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for sc.Scan() {
		lines = append(lines, sc.Text())
	}
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
