package outbox_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// A panic of the metrics' goroutine (a Logger's) in a reading under way
// when Run was told to stop comes out of Run: its loop had returned
// (stopping) and only joined the goroutine, and Run returned nil (a
// review, before the stopping path raised it).
func TestForwarder_StatsPanicWhileStopping_ComesOutOfRun(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	m, err := outbox.NewMetrics(prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	f := newForwarder(t, db, outbox.ForwarderConfig{Metrics: m, StatsInterval: 10 * time.Millisecond, PollInterval: 20 * time.Millisecond})
	entered, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	outbox.SetBeforeStats(f, func() {
		first := false
		once.Do(func() { first = true })
		if !first {
			return
		}
		close(entered)
		<-release
		panic("a Logger's bug")
	})
	ctx, cancel := context.WithCancel(context.Background())
	type result struct {
		err error
		p   any
	}
	done := make(chan result, 1)
	go func() {
		var r result
		defer func() { r.p = recover(); done <- r }()
		r.err = f.Run(ctx)
	}()
	<-entered
	cancel()
	time.Sleep(300 * time.Millisecond) // Run's loop has stopped; it waits on the stats goroutine
	close(release)
	select {
	case r := <-done:
		if r.p == nil {
			t.Fatalf("the stats goroutine's panic was lost: Run returned %v without panicking", r.err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not return")
	}
}
