package outbox

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/acemq/watermill-outbox/internal/sqldialect"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// nopCountingDest publishes every record.
type nopCountingDest struct{}

func (nopCountingDest) Publish(_ context.Context, recs []Record) []error {
	return make([]error, len(recs))
}

// Any session of the database (no privilege on the table needed) sends
// NOTIFY acemq_outbox_retry with the table's name. A listening relay's
// floors were lowered at each (lowerFloors), which made floorDue 0: with
// the floor on, every drain claim then went back to the head (and
// measured), bypassing rewindGap (250 ms at the least), which is to keep
// the walks from the head under a tenth of the relay's time. A floor is
// now lowered at most once per rewindGap for what another process says.
func TestForwarder_RetryNotifications_DrainGoesBackNoMoreOftenThanRewindGap(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, testdb.Postgres)
	if err := Migrate(context.Background(), db.DB, Postgres); err != nil {
		t.Fatal(err)
	}
	s := floorStore(t, db, Postgres, time.Hour)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	f := listenBeside(t, db) // a relay's listener over the same pool and table (its Store shares the floors)
	base := time.Now().Add(-time.Hour)
	for i := 0; i < 400; i++ {
		writeAt(t, db, fmt.Sprintf("r-%04d", i), base.Add(time.Duration(i)*time.Millisecond))
	}
	cl, err := s.claimBatch(ctx, 10, "r", time.Minute, nil, nil) // measures: the floor is on
	if err != nil {
		t.Fatal(err)
	}
	ids := []string{}
	for _, r := range cl.rows {
		ids = append(ids, r.ID)
	}
	if err := s.finish(ctx, cl, ids, nil); err != nil {
		t.Fatal(err)
	}
	cursor := &sqldialect.Cursor{CreatedAt: cl.rows[len(cl.rows)-1].CreatedAt, ID: cl.rows[len(cl.rows)-1].ID}
	back, claims := 0, 0
	start := time.Now()
	for claims < 20 {
		if _, err := db.Exec("SELECT pg_notify('acemq_outbox_retry', current_schema() || '.acemq_outbox')"); err != nil {
			t.Fatal(err)
		}
		time.Sleep(20 * time.Millisecond) // the listener hears it
		if claims == 0 {
			s.floor.mu.Lock()
			t.Logf("keys equal %v; after the notification: rewind %v lowered %v next %v on %v", f.store.floorKeyOf() == s.floorKeyOf(), s.floor.rewind, s.floor.lowered, s.floor.next, s.floor.on)
			s.floor.mu.Unlock()
		}
		cl, err := s.claimBatch(ctx, 10, "r", time.Minute, cursor, nil)
		if err != nil {
			t.Fatal(err)
		}
		claims++
		if cl.from != cursor {
			back++
		}
		ids := []string{}
		for _, r := range cl.rows {
			ids = append(ids, r.ID)
		}
		if len(cl.rows) == 0 {
			t.Fatal("nothing claimed")
		}
		if err := s.finish(ctx, cl, ids, nil); err != nil {
			t.Fatal(err)
		}
		cursor = &sqldialect.Cursor{CreatedAt: cl.rows[len(cl.rows)-1].CreatedAt, ID: cl.rows[len(cl.rows)-1].ID}
	}
	took := time.Since(start)
	allowed := int(took/rewindGapMin) + 1
	t.Logf("%d drain claims in %s, one notification before each: %d went back from their cursor (rewindGap allows %d)", claims, took.Round(time.Millisecond), back, allowed)
	if back > allowed {
		t.Errorf("%d of %d drain claims in %s went back to the floor/head after NOTIFY acemq_outbox_retry; rewindGap (%s at the least) allows %d", back, claims, took.Round(time.Millisecond), rewindGapMin, allowed)
	}
}

// listenBeside runs a relay's listener (no Run) over db's pool and table
// until the test ends, from once its LISTEN shows.
func listenBeside(t *testing.T, db *testdb.DB) *Forwarder {
	t.Helper()
	f, err := NewForwarder(db.DB, nopCountingDest{}, ForwarderConfig{Dialect: Postgres})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); f.listen(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	deadline := time.Now().Add(10 * time.Second)
	for {
		var n int
		_ = db.QueryRow("SELECT count(*) FROM pg_stat_activity WHERE query = 'LISTEN acemq_outbox' AND datname = current_database()").Scan(&n)
		if n > 0 {
			return f
		}
		if time.Now().After(deadline) {
			t.Fatal("no LISTEN")
		}
		time.Sleep(20 * time.Millisecond)
	}
}
