package outbox

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/acemq/watermill-outbox/internal/testdb"
)

// confirmingDest confirms every record and remembers the ids.
type confirmingDest struct {
	mu  sync.Mutex
	ids []string
}

func (d *confirmingDest) Publish(_ context.Context, recs []Record) []error {
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, r := range recs {
		d.ids = append(d.ids, r.ID)
	}
	return make([]error, len(recs))
}

func (d *confirmingDest) got(prefix string) int {
	d.mu.Lock()
	defer d.mu.Unlock()
	n := 0
	for _, id := range d.ids {
		if strings.HasPrefix(id, prefix) {
			n++
		}
	}
	return n
}

// A windowed claim that took nothing (its window behind a stuck key's
// backlog, its keys' slice all stuck heads) moves the keys' cursor on, and
// the relay's abandon of the empty claim leaves it moved: put back (a
// review found it so), every claim read the same slice and the fresh keys
// after it were never claimed, with the defaults (BatchSize 100: window
// 456, 656 keys a slice).
func TestRelay_EmptyClaimAbandoned_CursorPassesAStuckSlice(t *testing.T) {
	eachWindowing(t, func(t *testing.T, db *testdb.DB, c windowing) {
		kind, d := c.kind, c.d
		ctx := context.Background()
		base := time.Now().Add(-time.Hour).UTC().Truncate(time.Second)
		writeStuckBacklog(t, db, kind, base, 500) // key "hot": head stuck, 500 records
		q := db.Rebind(keyedRowInsert)
		tx := db.MustBegin()
		for k := 0; k < 700; k++ { // an outage left these keys' heads stuck
			tx.MustExec(tx.Rebind(keyedRowInsert), fmt.Sprintf("stuck%03d#1", k), keyedAt(kind, base, 1000+k), fmt.Sprintf("s%03d", k), 1, DefaultMaxAttempts)
		}
		if err := tx.Commit(); err != nil {
			t.Fatal(err)
		}
		for k := 0; k < 5; k++ { // fresh keys, after the outage
			db.MustExec(q, fmt.Sprintf("fresh%d#1", k), keyedAt(kind, base, 5000+k), fmt.Sprintf("z%d", k), 1, 0)
		}
		dest := &confirmingDest{}
		f, err := NewForwarder(db.DB, dest, ForwarderConfig{Dialect: d, DisableListen: true, PollInterval: 20 * time.Millisecond})
		if err != nil {
			t.Fatal(err)
		}
		for i := 0; i < 20; i++ {
			if _, err := f.Sweep(ctx); err != nil {
				t.Fatal(err)
			}
		}
		sweeps := dest.got("fresh")
		// Run too: its probe reads every key, finds the fresh heads, and
		// claims, for ever.
		runCtx, cancel := context.WithTimeout(ctx, 3*time.Second)
		defer cancel()
		before := f.store.sent.Load()
		done := make(chan error, 1)
		go func() { done <- f.Run(runCtx) }()
		<-runCtx.Done()
		_ = f.Close()
		<-done
		stmts := f.store.sent.Load() - before
		if got := dest.got("fresh"); got < 5 {
			t.Errorf("%s: fresh keys' records published: %d of 5 after 20 Sweeps (%d), then 3 s of Run, which sent %d statements meanwhile; keys cursor %v",
				kind, got, sweeps, stmts, f.store.keysAfter)
		}
	})
}

var _ = atomic.Int64{}
