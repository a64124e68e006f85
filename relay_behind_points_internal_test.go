package outbox

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/acemq/watermill-outbox/internal/testdb"
)

// A floor with points (old rows below it: a Retry of old records, late
// commits) and a pipelined relay on PostgreSQL. The first claim from the
// floor takes BatchSize points alone and sends them down the pipeline; its
// cursor is the floor (batch.last), which belowPoints sends back to the
// floor. That claim finds the points locked by the relay's own batch in
// flight and comes back empty: taken as "behind" (a review's catch), the
// drain went on from the same cursor, which went back again, without a
// wait and without ever collecting the batch in flight. Its records must
// be marked published.
func TestRelay_Postgres_PointsBatchInFlight_IsMarked(t *testing.T) {
	db := testdb.New(t, testdb.Postgres)
	ctx := context.Background()
	if err := Migrate(ctx, db.DB, Postgres); err != nil {
		t.Fatal(err)
	}
	for i := range 10 {
		writeAt(t, db, fmt.Sprintf("old%02d", i), time.Now().Add(-2*time.Hour))
	}
	dest := &pacedPipeDest{capacity: 100, wait: time.Millisecond}
	f, err := NewForwarder(db.DB, dest, ForwarderConfig{Dialect: Postgres, BatchSize: 10, MaxBatchSize: 10, PublishTimeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	floorAlwaysOn(f.store, time.Hour)
	f.store.floor.pointsAbove = 0
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- f.Run(runCtx) }()
	var pending int
	sent := f.store.sent.Load()
	deadline := time.Now().Add(5 * time.Second)
	for time.Now().Before(deadline) {
		if err := db.DB.QueryRow("SELECT count(*) FROM acemq_outbox WHERE published_at IS NULL").Scan(&pending); err != nil {
			t.Fatal(err)
		}
		if pending == 0 {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	statements := f.store.sent.Load() - sent
	_, at, pts := floorState(f.store)
	cancel()
	<-done
	_ = f.Close()
	if pending > 0 {
		t.Fatalf("%d of 10 records still unpublished after 5 s (sent to the broker: %d; %d statements meanwhile; floor at %v, points %v)", pending, dest.count(), statements, at, pts)
	}
}
