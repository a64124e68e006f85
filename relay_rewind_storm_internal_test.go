package outbox

import (
	"context"
	"fmt"
	"os"
	"strconv"
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
// With -v it prints the drain's time beside the same drain with no key
// refused, in the same run; OUTBOX_TEST_STORM_ROWS sets the unkeyed rows
// (5,000; 20,000 for the figures in the README).
func TestForwarder_KeysRefusedForEverAtShortBackoffs_DrainStillPublishesTheRest(t *testing.T) {
	for _, c := range []struct {
		kind string
		d    Dialect
	}{{testdb.Postgres, Postgres}, {testdb.MySQL, MySQL}} {
		t.Run(c.kind, func(t *testing.T) {
			t.Parallel()
			none, _ := drainBesideRefusedKeys(t, c.kind, c.d, false)
			took, refusals := drainBesideRefusedKeys(t, c.kind, c.d, true)
			t.Logf("%s: %d unkeyed rows in %s beside 200 keys refused for ever at 5 ms (%d refusals), %s with none refused: %.2fx",
				c.kind, stormRows(), took.Round(time.Millisecond), refusals, none.Round(time.Millisecond), took.Seconds()/none.Seconds())
		})
	}
}

// stormRows is the unkeyed rows of drainBesideRefusedKeys.
func stormRows() int {
	if n, err := strconv.Atoi(os.Getenv("OUTBOX_TEST_STORM_ROWS")); err == nil && n > 0 {
		return n
	}
	return 5000
}

// drainBesideRefusedKeys relays 200 keys of two records each, then 5,000
// unkeyed rows, the keys' first records refused for ever when refuse is
// set, and returns how long the unkeyed rows took and the refusals.
func drainBesideRefusedKeys(t *testing.T, kind string, d Dialect, refuse bool) (time.Duration, int) {
	db := testdb.New(t, kind)
	if err := Migrate(context.Background(), db.DB, d); err != nil {
		t.Fatal(err)
	}
	keys, n := 200, stormRows()
	base := time.Now().Add(-30 * time.Minute).UTC().Truncate(time.Second)
	dest := &foreverRefusing{refuse: map[string]bool{}, unkeyed: map[string]bool{}, keyLast: map[string]int64{}}
	insertRows(t, db, 2*keys+n, func(i int) (string, time.Time, any, any, any) {
		at := base.Add(time.Duration(i) * time.Millisecond)
		if i < 2*keys {
			k, seq := fmt.Sprintf("K%03d", i/2), int64(i%2+1)
			id := fmt.Sprintf("%s#%d", k, seq)
			if seq == 1 && refuse {
				dest.refuse[id] = true
			}
			return id, at, k, seq, nil
		}
		return fmt.Sprintf("u%05d", i), at, nil, nil, nil
	})
	f, err := NewForwarder(db.DB, dest, ForwarderConfig{Dialect: d, BatchSize: 100, MaxBatchSize: 100, MaxAttempts: 1 << 30,
		RetryMin: 5 * time.Millisecond, RetryMax: 5 * time.Millisecond, PollInterval: 50 * time.Millisecond, OnError: func(error, ErrorContext) {}})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	start := time.Now()
	go func() { done <- f.Run(ctx) }()
	defer func() { cancel(); <-done; _ = f.Close() }()
	deadline := time.Now().Add(60 * time.Second)
	for dest.published() < n && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	took := time.Since(start)
	dest.mu.Lock()
	defer dest.mu.Unlock()
	if len(dest.unkeyed) < n {
		t.Errorf("%d of %d unkeyed rows published in 60 s beside %d keys refused for ever (%d refusals)", len(dest.unkeyed), n, keys, dest.refusedAt)
	}
	if len(dest.disorder) > 0 {
		t.Errorf("keys out of order: %v", dest.disorder[:min(10, len(dest.disorder))])
	}
	return took, dest.refusedAt
}
