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

// floorState is the floor of s: on, where, and its points' ids.
func floorState(s *Store) (on bool, at time.Time, points []string) {
	f := s.floor
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, c := range f.points {
		points = append(points, c.ID)
	}
	return f.on, f.at, points
}

// pointsStore is a floorStore that takes the rows older than lag as
// points wherever a measure finds them, however quick the walk between.
func pointsStore(t testing.TB, db *testdb.DB, d Dialect) *Store {
	s := floorStore(t, db, d, time.Hour)
	s.floor.pointsAbove = 0
	return s
}

// pointsBesideASnapshot is a pointsStore beside a held snapshot of dead
// rows published an hour ago (publishOld).
func pointsBesideASnapshot(t testing.TB, db *testdb.DB, d Dialect, dead int) *Store {
	holdSnapshot(t, db)
	publishOld(t, db, dead)
	return pointsStore(t, db, d)
}

// rowIDs are the ids of a claim's rows, in its order.
func rowIDs(rows []sqldialect.ClaimedRow) []string {
	var ids []string
	for _, r := range rows {
		ids = append(ids, r.ID)
	}
	return ids
}

// deadRangeEnd is where publishOld's n rows end in created_at.
func deadRangeEnd(n int) time.Time {
	return time.Now().Add(-time.Hour).Add(time.Duration(n) * time.Millisecond)
}

// Rows older than the floor's lag (a record committed late, a publisher's
// clock behind, a Retry of old records), below the entries a held snapshot
// keeps: a measure keeps the floor lag before now, above those entries,
// and the claim takes the old rows as points, first, in claim order. Once
// published, they are no longer looked for.
func TestClaim_OldRowsBelowDeadEntries_FloorStaysNearNow_OldRowsClaimedAsPoints(t *testing.T) {
	t.Parallel()
	eachFloorKind(t, func(t *testing.T, db *testdb.DB, d Dialect) {
		const dead = 20000
		s := pointsBesideASnapshot(t, db, d, dead)
		writeAt(t, db, "old1", time.Now().Add(-2*time.Hour))    // below the dead entries
		writeAt(t, db, "old2", time.Now().Add(-90*time.Minute)) // below them too
		writeAt(t, db, "mid", time.Now().Add(-30*time.Minute))  // above them, older than lag
		for i := range 3 {
			writeAt(t, db, fmt.Sprintf("new%d", i), time.Now())
		}
		measured := time.Now()
		ids, from := claimAll(t, s) // measures: the floor is read from the head
		want := []string{"old1", "old2", "mid", "new0", "new1", "new2"}
		if !slices.Equal(ids, want) {
			t.Fatalf("the claim that measured took %v, want %v", ids, want)
		}
		on, at, points := floorState(s)
		if !on || from == nil || at.Before(measured.Add(-floorLag-time.Second)) {
			t.Fatalf("floor on %v at %v (claim from %v), want on, lag before now: it stands below the dead entries", on, at, from)
		}
		if len(points) != 0 {
			t.Errorf("points after their marks: %v, want none", points)
		}

		// One more, older than lag again, found by the next measure.
		writeAt(t, db, "old3", time.Now().Add(-3*time.Hour))
		writeAt(t, db, "new3", time.Now())
		s.floor.mu.Lock()
		s.floor.next = time.Time{}
		s.floor.mu.Unlock()
		if ids, from := claimAll(t, s); !slices.Equal(ids, []string{"old3", "new3"}) || from == nil || from.CreatedAt.Before(deadRangeEnd(dead)) {
			t.Fatalf("the next measure's claim took %v from %v, want [old3 new3] from above the dead entries", ids, from)
		}
	})
}

// A probe at the floor finds a row below it that the last measure found,
// and an idle relay claims it: the only pending row is one older than lag.
func TestProbe_OnlyARowBelowTheFloor_FoundAndClaimed(t *testing.T) {
	t.Parallel()
	eachFloorKind(t, func(t *testing.T, db *testdb.DB, d Dialect) {
		ctx := context.Background()
		s := pointsBesideASnapshot(t, db, d, 5000)
		writeAt(t, db, "old", time.Now().Add(-2*time.Hour))
		conn, err := db.DB.Conn(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = conn.Close() }()
		found, err := s.probe(ctx, conn) // measures
		if err != nil || !found {
			t.Fatalf("the probe that measured found %v (%v), want the old row", found, err)
		}
		if on, _, points := floorState(s); !on || !slices.Equal(points, []string{"old"}) {
			t.Fatalf("floor on %v, points %v; want on, [old]", on, points)
		}
		if found, err = s.probe(ctx, conn); err != nil || !found { // at the floor
			t.Fatalf("the probe at the floor found %v (%v), want the old row, its point", found, err)
		}
		if ids, _ := claimAll(t, s); !slices.Equal(ids, []string{"old"}) {
			t.Fatalf("claimed %v, want [old]", ids)
		}
		if found, err = s.probe(ctx, conn); err != nil || found {
			t.Fatalf("the probe after the old row was published found %v (%v), want nothing", found, err)
		}
	})
}

// A key's first record older than lag, taken as a point, and its next one
// above the floor: the next one waits for it, as in any claim.
func TestClaim_KeyedRecordBelowTheFloor_ItsKeysNextWaitsForIt(t *testing.T) {
	t.Parallel()
	eachFloorKind(t, func(t *testing.T, db *testdb.DB, d Dialect) {
		s := pointsBesideASnapshot(t, db, d, 5000)
		writeKeyed(t, db, "k#1", "k", 1, time.Now().Add(-2*time.Hour), 0)
		writeKeyed(t, db, "k#2", "k", 2, time.Now(), 0)
		writeAt(t, db, "new", time.Now())
		if ids, _ := claimAll(t, s); !slices.Equal(ids, []string{"k#1", "new"}) {
			t.Fatalf("claimed %v, want [k#1 new]: k#2 waits for k#1", ids)
		}
		if ids, _ := claimAll(t, s); !slices.Equal(ids, []string{"k#2"}) {
			t.Fatalf("claimed %v, want [k#2]", ids)
		}
	})
}

// A claim that its points fill (a batch of one, say) resumes a drain at
// the floor, not after its last point, below the dead entries.
func TestClaim_BatchOfPointsAlone_DrainResumesAtTheFloor(t *testing.T) {
	t.Parallel()
	eachFloorKind(t, func(t *testing.T, db *testdb.DB, d Dialect) {
		ctx := context.Background()
		s := pointsBesideASnapshot(t, db, d, 5000)
		writeAt(t, db, "old", time.Now().Add(-2*time.Hour))
		writeAt(t, db, "new", time.Now())
		cl, err := s.claimBatch(ctx, 1, "r", time.Minute, nil, nil)
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = s.abandon(ctx, cl) }()
		if len(cl.rows) != 1 || cl.rows[0].ID != "old" || cl.points != 1 {
			t.Fatalf("claimed %v (%d points), want [old], a point", cl.rows, cl.points)
		}
		last := (&batch{claim: cl}).last()
		if last == nil || last.ID != "" || last.CreatedAt.Before(deadRangeEnd(5000)) {
			t.Fatalf("the drain resumes after %+v, want the floor, above the dead entries", last)
		}
	})
}

// On MySQL a locking measure, with a row older than lag pending below
// 20,000 dead entries, keeps the floor on above them with the row as a
// point: it timed the floor against a head no lower than the row, found no
// gain and turned the floor off, and every claim walked the entries with
// locking reads.
func TestLockMeasure_MySQL_OldRowBelowDeadEntries_FloorOnAboveThem(t *testing.T) {
	t.Parallel()
	db, s := mysqlFloorStore(t)
	holdSnapshot(t, db)
	const dead = 20000
	publishOld(t, db, dead)
	s.index, s.keyIndex = indexesOf(t, s)
	writeAt(t, db, "old", time.Now().Add(-2*time.Hour))
	writeAt(t, db, "new", time.Now())
	s.floor.mu.Lock()
	s.floor.on, s.floor.at, s.floor.next, s.floor.lockDue = true, time.Now().Add(-floorLag), time.Now().Add(time.Hour), true
	s.floor.mu.Unlock()
	ids, from := claimAll(t, s)
	if !slices.Equal(ids, []string{"old", "new"}) {
		t.Fatalf("claimed %v, want [old new]", ids)
	}
	on, at, _ := floorState(s)
	if !on || from == nil || at.Before(deadRangeEnd(dead)) {
		t.Fatalf("after the locking measure the floor is on %v at %v (the claim from %v), want on above the dead entries", on, at, from)
	}
}

// A drain that goes back for a key's next record (behindNextOfKeys), an
// old one below the dead entries, starts at the floor, which takes it as a
// point: from a cursor just before it, the claim walked every dead entry
// between it and the floor, once for each of the key's old records.
func TestClaim_DrainBackForAKeysOldNextRecord_StartsAtTheFloor(t *testing.T) {
	t.Parallel()
	eachFloorKind(t, func(t *testing.T, db *testdb.DB, d Dialect) {
		ctx := context.Background()
		s := pointsBesideASnapshot(t, db, d, 5000)
		old := time.Now().Add(-2 * time.Hour)
		writeKeyed(t, db, "k#1", "k", 1, old, 0)
		writeKeyed(t, db, "k#2", "k", 2, old.Add(time.Millisecond), 0)
		writeAt(t, db, "new", time.Now())
		if ids, _ := claimAll(t, s); !slices.Equal(ids, []string{"k#1", "new"}) {
			t.Fatalf("claimed %v, want [k#1 new]", ids)
		}
		next, err := s.firstNext(ctx, []sqldialect.KeySeq{{Key: "k", Seq: 1}})
		if err != nil || next == nil {
			t.Fatalf("k#1's next: %v, %v", next, err)
		}
		cl, err := s.claimBatch(ctx, 100, "r", time.Minute, next, nil)
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = s.abandon(ctx, cl) }()
		if len(cl.rows) != 1 || cl.rows[0].ID != "k#2" || cl.points != 1 || cl.from == nil || cl.from.CreatedAt.Before(deadRangeEnd(5000)) {
			t.Fatalf("the drain's claim from before k#2 took %v (%d points) from %v, want k#2, a point, from the floor above the dead entries", cl.rows, cl.points, cl.from)
		}
	})
}
