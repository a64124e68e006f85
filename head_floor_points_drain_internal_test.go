package outbox

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/acemq/watermill-outbox/internal/sqldialect"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// More points than a claim takes (6 old rows, claims of 3) and a flow of
// fresh rows. The first claim takes 3 points and nothing else; its batch
// resumes the drain at the floor (batch.last), and the drain's next claim,
// from the floor, takes the other 3 points first, which come first in
// claim order. Its claims from the floor's cursor took the fresh rows and
// left those points for the drain's end or the floor's period (a review's
// catch).
func TestClaim_MorePointsThanAClaim_DrainTakesTheRestFirst(t *testing.T) {
	t.Parallel()
	eachFloorKind(t, func(t *testing.T, db *testdb.DB, d Dialect) {
		ctx := context.Background()
		s := pointsBesideASnapshot(t, db, d, 5000)
		if db.Kind == testdb.MySQL {
			s.index, s.keyIndex = indexesOf(t, s)
		}
		old := time.Now().Add(-2 * time.Hour)
		for i := range 6 {
			writeAt(t, db, fmt.Sprintf("p%d", i), old.Add(time.Duration(i)*time.Minute))
		}
		now := time.Now()
		for i := range 9 {
			writeAt(t, db, fmt.Sprintf("f%d", i), now.Add(time.Duration(i)*time.Millisecond))
		}
		var (
			order []string
			after *sqldialect.Cursor // the first claim: from the floor (measures)
		)
		for range 8 {
			cl, err := s.claimBatch(ctx, 3, "r", time.Minute, after, nil)
			if err != nil {
				t.Fatal(err)
			}
			ids := rowIDs(cl.rows)
			if len(ids) == 0 {
				_ = s.abandon(ctx, cl)
				break
			}
			order = append(order, ids...)
			b := &batch{claim: cl}
			full, last := b.full(3), b.last()
			if err := s.finish(ctx, cl, ids, nil); err != nil {
				t.Fatal(err)
			}
			if !full {
				break
			}
			after = last // the drain
		}
		want := []string{"p0", "p1", "p2", "p3", "p4", "p5", "f0", "f1", "f2", "f3", "f4", "f5", "f6", "f7", "f8"}
		if !slices.Equal(order, want) {
			t.Errorf("the drain of claims of 3 took %v, want %v: p3..p5 passed over while the drain went on", order, want)
		}
	})
}
