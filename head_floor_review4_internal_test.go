package outbox

import (
	"context"
	"testing"
	"time"

	"github.com/acemq/watermill-outbox/internal/testdb"
)

// An idle relay at the default PollInterval beside a held snapshot of
// 100,000 published rows: the floor turns on, and the relay stays within
// 10 statements a second whatever the floor does. On MariaDB the probe
// from the head takes a few ms, so the period is floorEveryMin: at 1 s,
// and woken between its polls at each period's end, an idle relay at a
// 100 ms poll sent 12 a second, 2 more than its polls.
func TestForwarder_IdleBesideAHeldSnapshot_UnderTenStatementsASecond(t *testing.T) {
	db := testdb.New(t, testdb.MySQL)
	if err := Migrate(context.Background(), db.DB, MySQL); err != nil {
		t.Fatal(err)
	}
	holdSnapshot(t, db)
	publishOld(t, db, 100_000)
	f, err := NewForwarder(db.DB, &confirmingDest{}, ForwarderConfig{Dialect: MySQL})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- f.Run(ctx) }()
	defer func() { cancel(); <-done }()
	<-f.Running()
	on := func() bool { f.store.floor.mu.Lock(); defer f.store.floor.mu.Unlock(); return f.store.floor.on }
	for start := time.Now(); !on() && time.Since(start) < 10*time.Second; {
		time.Sleep(10 * time.Millisecond)
	}
	if !on() { // a busy machine's measure can miss it; the statements count either way
		t.Logf("the floor did not turn on beside the snapshot")
	}
	time.Sleep(500 * time.Millisecond)
	const window = 4 * time.Second
	before := f.store.sent.Load()
	time.Sleep(window)
	n := f.store.sent.Load() - before
	t.Logf("%d statements in %v, floor on %v", n, window, on())
	if rate := float64(n) / window.Seconds(); rate > 10 {
		t.Errorf("idle at the default poll beside a held snapshot: %d statements in %v (%.1f/s, want at most 10/s; floor on: %v)", n, window, rate, on())
	}
}
