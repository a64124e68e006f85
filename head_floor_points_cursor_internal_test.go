package outbox

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/acemq/watermill-outbox/internal/sqldialect"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// belowPoints sends a drain whose cursor is the one a batch of points
// alone resumes at (batch.last: {f.at, ""}) to a claim from the floor,
// not a drain whose last row's created_at is the floor's: where the floor
// stands at the first pending row and the claims' rows share its
// created_at (a bulk insert's now(), a DATETIME(0) column), every claim
// of the drain went back to the floor, two statements more each (381
// statements in 48 claims against 285; a review's catch), for as long as
// a point stayed (one another relay holds stays until the next measure).
func TestClaim_DrainAtTheFloorsCreatedAt_GoesOnFromItsCursor(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, testdb.Postgres)
	ctx := context.Background()
	if err := Migrate(ctx, db.DB, Postgres); err != nil {
		t.Fatal(err)
	}
	s := pointsBesideASnapshot(t, db, Postgres, 5000)
	writeAt(t, db, "p", time.Now().Add(-2*time.Hour))
	// Another relay holds the point, in flight.
	other, err := db.DB.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = other.Rollback() }()
	if _, err := other.Exec("SELECT id FROM acemq_outbox WHERE id = 'p' FOR UPDATE"); err != nil {
		t.Fatal(err)
	}
	// A backlog of rows of one created_at (one transaction's now()).
	const n, claimOf = 5000, 100
	at := time.Now().UTC().Truncate(time.Microsecond)
	insertRows(t, db, n, func(i int) (string, time.Time, any, any, any) {
		return fmt.Sprintf("r%04d", i), at, nil, nil, nil
	})
	claim := func(after *sqldialect.Cursor) (*claim, int) {
		cl, err := s.claimBatch(ctx, claimOf, "r", time.Minute, after, nil)
		if err != nil {
			t.Fatal(err)
		}
		read := pendingEntriesRead(t, cl.tx)
		ids := rowIDs(cl.rows)
		if err := s.finish(ctx, cl, ids, nil); err != nil {
			t.Fatal(err)
		}
		return cl, read
	}
	claim(nil) // measures: the point p, the floor lag before now
	if _, _, pts := floorState(s); len(pts) != 1 {
		t.Fatalf("points %v, want [p]", pts)
	}
	// The backlog is older than lag now: the floor stands at its first row.
	// The drain goes back only for what this test is about, not every
	// second (drainLookBack), which a drain of 48 claims under
	// -race outlasts.
	s.floor.mu.Lock()
	s.floor.lag, s.floor.lookBack = time.Millisecond, time.Hour
	s.floor.mu.Unlock()
	time.Sleep(5 * time.Millisecond)
	cl, _ := claim(nil) // the drain's first claim, from the floor
	b := &batch{claim: cl}
	after := b.last()
	var reads []int
	toFloor := 0
	sent := s.sent.Load()
	for range n/claimOf - 2 {
		cl, read := claim(after)
		if cl.from == nil || cl.from.ID == "" {
			toFloor++
		}
		reads = append(reads, read)
		if len(cl.rows) < claimOf {
			break
		}
		after = (&batch{claim: cl}).last()
	}
	_, fat, pts := floorState(s)
	// What one claim costs now, from the floor and from the drain's cursor.
	blocks := func(from *sqldialect.Cursor) string {
		n, ms, _ := explainClaim(t, db, s, sqldialect.ClaimParams{Limit: claimOf, MaxAttempts: s.cfg.MaxAttempts, Now: time.Now(), After: from})
		return fmt.Sprintf("%d blocks, %.2f ms", n, ms)
	}
	t.Logf("floor at %v (rows at %v), points %v; %d statements in %d claims", fat, at, pts, s.sent.Load()-sent, len(reads))
	if toFloor > 0 {
		t.Errorf("%d of %d claims of the drain went back to the floor; a claim from the floor now reads %s, from the drain's cursor %s", toFloor, len(reads), blocks(&sqldialect.Cursor{CreatedAt: fat}), blocks(after))
	}
}
