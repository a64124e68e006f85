package outbox

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/acemq/watermill-outbox/internal/testdb"
)

// The first n points of a claim of n are a key's later records (not
// claimable while k#1 is pending), and an unkeyed old row u after them is
// claimable: the claim from the floor takes k#1 and u, as one from the
// head does. Given the first n points only, it took k#1 alone, and with
// k#1 held (another relay's claim in flight, or a keyed record the broker
// keeps refusing at short backoffs) u was never given to a claim, while
// the probe said it was there (a review's catch).
func TestClaim_FirstPointsAKeysLaterRecords_ClaimableOneAfterThemTaken(t *testing.T) {
	t.Parallel()
	eachFloorKind(t, func(t *testing.T, db *testdb.DB, d Dialect) {
		ctx := context.Background()
		s := pointsBesideASnapshot(t, db, d, 5000)
		if db.Kind == testdb.MySQL {
			s.index, s.keyIndex = indexesOf(t, s)
		}
		old := time.Now().Add(-2 * time.Hour)
		for i := 1; i <= 5; i++ {
			writeKeyed(t, db, fmt.Sprintf("k#%d", i), "k", int64(i), old.Add(time.Duration(i)*time.Millisecond), 0)
		}
		writeAt(t, db, "u", old.Add(10*time.Millisecond))

		ids := func(n int) ([]string, int) {
			cl, err := s.claimBatch(ctx, n, "r", time.Minute, nil, nil)
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = s.abandon(ctx, cl) }()
			out := rowIDs(cl.rows)
			return out, cl.points
		}
		got, pts := ids(5) // measures
		_, _, points := floorState(s)
		t.Logf("floor points %v", points)
		if !slices.Equal(got, []string{"k#1", "u"}) {
			t.Errorf("a claim of 5 from the floor took %v (%d points), want [k#1 u], as one from the head", got, pts)
		}

		// k#1 held by another transaction (another relay's claim).
		tx, err := db.DB.BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = tx.Rollback() }()
		var id string
		if err := tx.QueryRow(db.Rebind("SELECT id FROM acemq_outbox WHERE id = ? FOR UPDATE"), "k#1").Scan(&id); err != nil {
			t.Fatal(err)
		}
		conn, err := db.DB.Conn(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = conn.Close() }()
		for round := range 3 {
			s.floor.mu.Lock()
			s.floor.next = time.Time{} // a new measure each round
			s.floor.mu.Unlock()
			found, perr := s.probe(ctx, conn)
			got, pts := ids(5)
			if !slices.Contains(got, "u") {
				t.Errorf("round %d, k#1 held: the probe found %v (%v), the claim of 5 took %v (%d points): u, claimable, is not taken", round, found, perr, got, pts)
			}
		}
		cl, err := s.claimBatch(ctx, 5, "r", time.Minute, atHead, nil)
		if err != nil {
			t.Fatal(err)
		}
		head := rowIDs(cl.rows)
		_ = s.abandon(ctx, cl)
		t.Logf("a claim of 5 from the head (Sweep's) took %v", head)
	})
}
