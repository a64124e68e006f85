package outbox

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/acemq/watermill-outbox/internal/testdb"
)

// foreverRefusing refuses the records of refuse on every send (a queue
// that nacks them, which counts no attempt to MaxAttempts), publishes the
// rest, and notes a key's record out of its order.
type foreverRefusing struct {
	mu        sync.Mutex
	refuse    map[string]bool
	unkeyed   map[string]bool
	keyLast   map[string]int64
	disorder  []string
	refusedAt int
}

func (d *foreverRefusing) Publish(_ context.Context, recs []Record) []error {
	d.mu.Lock()
	defer d.mu.Unlock()
	errs := make([]error, len(recs))
	for i, r := range recs {
		switch {
		case d.refuse[r.ID]:
			d.refusedAt++
			errs[i] = fmt.Errorf("refused")
		case r.AggregateID == "":
			d.unkeyed[r.ID] = true
		case r.Seq > d.keyLast[r.AggregateID]+1:
			d.disorder = append(d.disorder, fmt.Sprintf("%s: seq %d after %d", r.AggregateID, r.Seq, d.keyLast[r.AggregateID]))
			fallthrough
		default:
			d.keyLast[r.AggregateID] = max(d.keyLast[r.AggregateID], r.Seq)
		}
	}
	return errs
}

func (d *foreverRefusing) published() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return len(d.unkeyed)
}

// 200 keys whose first records a broker refuses for ever, at a backoff of
// 5 ms, before 5,000 unkeyed rows. A drain went back for each record whose
// backoff ended at its very next claim, which the records filled, each
// refused again: the drain published none of the unkeyed rows (0 of 20,000
// in 60 s on PostgreSQL and MariaDB, a review found). It goes back once
// the gap since its last going back has passed now, and the rows go out.
func TestForwarder_KeysRefusedForEverAtShortBackoffs_DrainStillPublishesTheRest(t *testing.T) {
	for _, c := range []struct {
		kind string
		d    Dialect
	}{{testdb.Postgres, Postgres}, {testdb.MySQL, MySQL}} {
		t.Run(c.kind, func(t *testing.T) {
			t.Parallel()
			db := testdb.New(t, c.kind)
			if err := Migrate(context.Background(), db.DB, c.d); err != nil {
				t.Fatal(err)
			}
			const keys, n = 200, 5000
			base := time.Now().Add(-30 * time.Minute).UTC().Truncate(time.Second)
			dest := &foreverRefusing{refuse: map[string]bool{}, unkeyed: map[string]bool{}, keyLast: map[string]int64{}}
			insertRows(t, db, 2*keys+n, func(i int) (string, time.Time, any, any, any) {
				at := base.Add(time.Duration(i) * time.Millisecond)
				if i < 2*keys {
					k, seq := fmt.Sprintf("K%03d", i/2), int64(i%2+1)
					id := fmt.Sprintf("%s#%d", k, seq)
					if seq == 1 {
						dest.refuse[id] = true
					}
					return id, at, k, seq, nil
				}
				return fmt.Sprintf("u%05d", i), at, nil, nil, nil
			})
			f, err := NewForwarder(db.DB, dest, ForwarderConfig{Dialect: c.d, BatchSize: 100, MaxBatchSize: 100, MaxAttempts: 1 << 30,
				RetryMin: 5 * time.Millisecond, RetryMax: 5 * time.Millisecond, PollInterval: 50 * time.Millisecond, OnError: func(error, ErrorContext) {}})
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan error, 1)
			go func() { done <- f.Run(ctx) }()
			defer func() { cancel(); <-done; _ = f.Close() }()
			deadline := time.Now().Add(60 * time.Second)
			for dest.published() < n && time.Now().Before(deadline) {
				time.Sleep(20 * time.Millisecond)
			}
			dest.mu.Lock()
			defer dest.mu.Unlock()
			if len(dest.unkeyed) < n {
				t.Errorf("%d of %d unkeyed rows published in 60 s beside %d keys refused for ever (%d refusals)", len(dest.unkeyed), n, keys, dest.refusedAt)
			}
			if len(dest.disorder) > 0 {
				t.Errorf("keys out of order: %v", dest.disorder[:min(10, len(dest.disorder))])
			}
		})
	}
}
