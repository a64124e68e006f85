package outbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testamqp"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// The metrics' figures are read beside the relay, not in its loop: a
// reading is a COUNT over the pending index (110–190 ms at 1,000,000
// pending rows on PostgreSQL), and one that takes long, here held for the
// whole test, holds no record back. In Run's loop it held every sweep.
func TestForwarder_SlowStatsReading_HoldsNoRecordBack(t *testing.T) {
	for _, kind := range []string{testdb.Postgres, testdb.SQLite} {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			db := migrated(t, kind)
			b := testamqp.New(t)
			queue := b.Queue("t")
			m, err := outbox.NewMetrics(prometheus.NewRegistry())
			if err != nil {
				t.Fatal(err)
			}
			f := newForwarder(t, db, outbox.ForwarderConfig{Metrics: m, StatsInterval: 10 * time.Millisecond, PollInterval: 20 * time.Millisecond})
			release := make(chan struct{})
			reading := make(chan struct{}, 1)
			outbox.SetBeforeStats(f, func() {
				select {
				case reading <- struct{}{}:
				default:
				}
				<-release
			})
			defer close(release)
			go func() { _ = f.Run(context.Background()) }()
			<-f.Running()
			select {
			case <-reading:
			case <-time.After(10 * time.Second):
				t.Fatal("no reading of the metrics' figures started")
			}
			publishBatch(t, db, b.Exchange, "t", 3)
			if got := len(b.Drain(queue, 3, 10*time.Second)); got != 3 {
				t.Fatalf("%d of 3 records reached the broker while a reading of the metrics' figures took long", got)
			}
		})
	}
}

// A panic while the metrics' figures are read (a Logger's) comes out of
// Run, on its caller's goroutine, as it did when Run's loop read them: it
// neither crashes the process from a goroutine of the library's nor is
// lost.
func TestForwarder_PanicReadingStats_ComesOutOfRun(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	m, err := outbox.NewMetrics(prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	f := newForwarder(t, db, outbox.ForwarderConfig{Metrics: m, StatsInterval: 10 * time.Millisecond, PollInterval: time.Hour})
	outbox.SetBeforeStats(f, func() { panic("a Logger's bug") })
	runUntilPanic(t, f)
}
