package outbox

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/acemq/watermill-outbox/internal/testdb"
)

// A claim from the floor offers all its points (up to maxStragglers). On
// PostgreSQL, with 128 points (and 64, 100) and statistics fresh (ANALYZE
// after the dead entries were published: the planner takes the partial
// pending index for a small one), the points statement looked them up by
// id alone as a condition on the index's second column: it read every
// entry the held snapshot keeps, 13,000 blocks and 40–100 ms a claim over
// 20,000 dead entries (a review's catch). With their created_at too, an
// index condition, it reads some 600.
func TestClaim_Postgres_ManyPointsFreshStatistics_LookedUpNotWalked(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, testdb.Postgres)
	if err := Migrate(context.Background(), db.DB, Postgres); err != nil {
		t.Fatal(err)
	}
	db.MustExec("ALTER TABLE acemq_outbox SET (autovacuum_enabled = false)")
	const npts = maxStragglers
	old := time.Now().Add(-2 * time.Hour).UTC().Truncate(time.Second)
	insertRows(t, db, npts, func(i int) (string, time.Time, any, any, any) {
		return fmt.Sprintf("pt%06d", i), old.Add(time.Duration(i) * time.Millisecond), nil, nil, nil
	})
	holdSnapshot(t, db)
	publishOld(t, db, 20000) // publishes the points too: write them again
	db.MustExec("UPDATE acemq_outbox SET published_at = NULL WHERE id LIKE 'pt%'")
	writeAt(t, db, "new", time.Now())
	db.MustExec("ANALYZE acemq_outbox")
	s := pointsStore(t, db, Postgres)
	ctx := context.Background()
	_, pts, err := s.headBound(ctx, db.DB, "", "", false)
	if err != nil {
		t.Fatal(err)
	}
	if len(pts) != npts {
		t.Fatalf("points: %d, want %d", len(pts), npts)
	}
	// A lookup: some 5 blocks a point (615 for 128 on 2026-12-05).
	if blocks, ms, _ := pointsClaimBlocks(t, db, s, pts); blocks > 8*npts {
		t.Errorf("the points statement of %d points read %d blocks in %.1f ms (a lookup reads ~%d): it walked the pending index", npts, blocks, ms, 5*npts)
	}
}
