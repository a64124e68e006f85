package outbox

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/acemq/watermill-outbox/internal/testdb"
)

// More points than a claim takes (a batch of 3, 6 old rows): the claim
// takes the first of them in claim order (created_at, id), as every
// claim does. On PostgreSQL the points statement, without ORDER BY, kept
// whichever rows the plan gave first (by id, through the primary key),
// and the newest old rows went out before the oldest (a review's catch).
func TestClaim_MorePointsThanTheClaim_OldestFirst(t *testing.T) {
	t.Parallel()
	eachFloorKind(t, func(t *testing.T, db *testdb.DB, d Dialect) {
		holdSnapshot(t, db)
		publishOld(t, db, 5000)
		s := pointsStore(t, db, d)
		if db.Kind == testdb.MySQL {
			s.index, s.keyIndex = indexesOf(t, s)
		}
		// ids in the other order than their created_at.
		for i := 5; i >= 0; i-- { // the newest first, in the heap too
			writeAt(t, db, fmt.Sprintf("z%d", 9-i), time.Now().Add(-3*time.Hour).Add(time.Duration(i)*time.Minute))
		}
		writeAt(t, db, "new", time.Now())
		if db.Kind == testdb.Postgres {
			db.MustExec("ANALYZE acemq_outbox")
		}
		ctx := context.Background()
		cl, err := s.claimBatch(ctx, 3, "r", time.Minute, nil, nil)
		if err != nil {
			t.Fatal(err)
		}
		ids := rowIDs(cl.rows)
		_ = s.abandon(ctx, cl)
		if want := []string{"z9", "z8", "z7"}; !slices.Equal(ids, want) {
			t.Errorf("a claim of 3 took %v (%d points), want the 3 oldest %v", ids, cl.points, want)
		}
	})
}
