package outbox

import (
	"context"
	"encoding/json"
	"slices"
	"testing"
	"time"

	"github.com/acemq/watermill-outbox/internal/sqldialect"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// A keyed record in a retry backoff below the floor (passed by the
// measure, headFloor.backoffs) and an old unkeyed row taken as a point:
// once the backoff ends, endBackoffs lowers the floor to the keyed record,
// below the point, and the claim from the lowered floor takes the point.
// Its points statement took it too, and the row went to the broker twice
// in one batch (a review's catch): a point at or above the floor is not
// one.
func TestClaim_KeyedBackoffEndsBelowAPoint_PointClaimedOnce(t *testing.T) {
	t.Parallel()
	eachFloorKind(t, func(t *testing.T, db *testdb.DB, d Dialect) {
		ctx := context.Background()
		s := pointsBesideASnapshot(t, db, d, 5000) // period an hour: no measure but the first
		writeKeyed(t, db, "k#1", "k", 1, time.Now().Add(-3*time.Hour), 1)
		end := time.Now().Add(2 * time.Second)
		holdBack(t, db, "k#1", end)
		writeAt(t, db, "old", time.Now().Add(-2*time.Hour))
		writeAt(t, db, "new", time.Now())

		conn, err := db.DB.Conn(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = conn.Close() }()
		if found, err := s.probe(ctx, conn); err != nil || !found { // measures
			t.Fatalf("probe: %v %v", found, err)
		}
		on, _, points := floorState(s)
		if !on || !slices.Equal(points, []string{"old"}) || len(s.floor.backoffs) != 1 {
			t.Fatalf("after the measure: on %v, points %v, backoffs %v; want on, [old], k#1", on, points, s.floor.backoffs)
		}
		time.Sleep(time.Until(end.Add(20 * time.Millisecond)))

		cl, err := s.claimBatch(ctx, 100, "r", time.Minute, nil, nil)
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = s.abandon(ctx, cl) }()
		ids := rowIDs(cl.rows)
		seen := map[string]int{}
		for _, id := range ids {
			seen[id]++
		}
		for id, n := range seen {
			if n > 1 {
				t.Errorf("the claim after the backoff ended took %q %d times: %v (points %d, from %v)", id, n, ids, cl.points, cl.from)
			}
		}
	})
}

// The measure's walk from the first of the rows below lag before now
// walks after the cursor it is given. It walked from the head, as the
// walk from the head did (a review's catch).
func TestWalkBelow_AfterACursor_WalksFromIt(t *testing.T) {
	t.Parallel()
	eachFloorKind(t, func(t *testing.T, db *testdb.DB, d Dialect) {
		ctx := context.Background()
		s := floorStore(t, db, d, time.Hour)
		s.index, s.keyIndex = indexesOf(t, s)
		a, b := time.Now().Add(-3*time.Hour), time.Now().Add(-2*time.Hour)
		writeAt(t, db, "a", a)
		writeAt(t, db, "b", b)
		for _, lock := range []bool{false, true} {
			found := 0
			after := &sqldialect.Cursor{CreatedAt: b.Add(-time.Second)}
			if _, err := s.walkBelow(ctx, db.DB, s.index, s.keyIndex, after, time.Now().Add(-time.Hour), nil, lock, &found)(); err != nil {
				t.Fatal(err)
			}
			if found != 1 {
				t.Errorf("the walk (locking %v) below lag after %v found %d rows, want 1 (b): it walked from the head", lock, after.CreatedAt, found)
			}
		}
	})
}

// Dead entries older than the first pending row, which is older than lag,
// and a quick walk from it to lag before now: the measure keeps the floor
// at that row, without points, and a row made pending between it and lag
// before now is claimed at once. With the walk timed from the head, the
// floor went to lag before now with the row as a point, and such a row
// waited for the next measure.
func TestMeasureFloor_DeadEntriesBelowTheFirstOldRow_FloorKeptAtIt(t *testing.T) {
	t.Parallel()
	eachFloorKind(t, func(t *testing.T, db *testdb.DB, d Dialect) {
		ctx := context.Background()
		holdSnapshot(t, db)
		publishOld(t, db, 50000) // an hour ago
		s := floorStore(t, db, d, time.Hour)
		s.floor.pointsAbove = newHeadFloor(d == MySQL).pointsAbove // as a relay's
		mid := time.Now().Add(-30 * time.Minute)
		writeAt(t, db, "mid", mid)
		writeAt(t, db, "new", time.Now())
		conn, err := db.DB.Conn(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = conn.Close() }()
		// A measure a busy machine slowed may take the row as a point (the
		// walk timed against 2 ms, 1 ms on MariaDB): one of twenty keeps the
		// floor at it (five all failed on MariaDB in a CI run beside a
		// review's builds). Timed from the head, past 50,000 dead entries,
		// none did.
		for i := 0; ; i++ {
			s.floor.mu.Lock()
			s.floor.next = time.Time{}
			s.floor.mu.Unlock()
			if found, err := s.probe(ctx, conn); err != nil || !found { // measures
				t.Fatalf("probe: %v %v", found, err)
			}
			on, at, points := floorState(s)
			if on && len(points) == 0 && !at.After(mid) {
				break
			}
			if i == 19 {
				t.Fatalf("floor on %v at %v (mid %v), points %v, in twenty measures: the row taken as a point", on, at, mid.UTC(), points)
			}
		}
		writeAt(t, db, "late", time.Now().Add(-20*time.Minute)) // between mid and lag before now
		ids, from := claimAll(t, s)
		if !slices.Contains(ids, "late") {
			t.Errorf("the claim after the measure took %v from %v: late (between the first row and lag before now) waits for the next measure", ids, from)
		}
	})
}

// On PostgreSQL the points statement looks the points up by their ids. In
// the claim's transaction claimSetup turns enable_sort off, and, ordered
// by created_at, the planner walked the pending index in order, the id a
// filter, every entry the floor is there to skip (20,000 here; a
// review's catch).
func TestClaim_Postgres_PointsClaimReadsByTheirIDs(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, testdb.Postgres)
	if err := Migrate(context.Background(), db.DB, Postgres); err != nil {
		t.Fatal(err)
	}
	holdSnapshot(t, db)
	publishOld(t, db, 20000)
	s := pointsStore(t, db, Postgres)
	writeAt(t, db, "old", time.Now().Add(-2*time.Hour))
	writeAt(t, db, "new", time.Now())
	var at time.Time
	if err := db.QueryRow("SELECT created_at FROM acemq_outbox WHERE id = 'old'").Scan(&at); err != nil {
		t.Fatal(err)
	}
	db.MustExec("ANALYZE acemq_outbox")
	if blocks, _, plan := pointsClaimBlocks(t, db, s, []sqldialect.Cursor{{CreatedAt: at, ID: "old"}}); blocks > 20 {
		t.Errorf("the points statement of a claim of one point read %d blocks: %s", blocks, plan)
	}
}

// pointsClaimBlocks runs the points statement of a claim of 100 from the
// floor of s with pts, explained, in a transaction of db as the claim's
// (claimSetup: enable_sort off), and returns the blocks it read, its
// time and the plan.
func pointsClaimBlocks(t *testing.T, db *testdb.DB, s *Store, pts []sqldialect.Cursor) (blocks int, ms float64, plan string) {
	t.Helper()
	return explainClaim(t, db, s, sqldialect.ClaimParams{Limit: 100, MaxAttempts: s.cfg.MaxAttempts, Now: time.Now(), Points: pts})
}

// explainClaim runs PostgreSQL's EXPLAIN (ANALYZE, BUFFERS) of the claim of
// p through s, in a transaction set up as the claim's is, and rolls it
// back: the blocks it read, its time, and the plan.
func explainClaim(t *testing.T, db *testdb.DB, s *Store, params sqldialect.ClaimParams) (blocks int, ms float64, plan string) {
	t.Helper()
	q := s.q.Claim(params)
	tx, err := db.DB.Begin()
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback() }()
	if _, err := tx.Exec(s.q.ClaimSetup().SQL); err != nil {
		t.Fatal(err)
	}
	if err := tx.QueryRow("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) "+q.SQL, q.Args...).Scan(&plan); err != nil {
		t.Fatal(err)
	}
	var p []struct {
		Plan struct {
			Hit int `json:"Shared Hit Blocks"`
			Rd  int `json:"Shared Read Blocks"`
		}
		Time float64 `json:"Execution Time"`
	}
	if err := json.Unmarshal([]byte(plan), &p); err != nil {
		t.Fatal(err)
	}
	return p[0].Plan.Hit + p[0].Plan.Rd, p[0].Time, plan
}
