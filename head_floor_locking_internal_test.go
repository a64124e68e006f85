package outbox

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/acemq/watermill-outbox/internal/testdb"
)

// MySQL's claim walks the entries of rows published under a held snapshot
// with a locking read, under READ COMMITTED: some 20 times slower than a
// plain read. Behind 10,000 of them a claim from the head took 8 ms on
// MariaDB, its measure's plain reads gained 0.3 ms, under the 1 ms it
// asks, and the floor stayed off: every claim paid the walk. The measure
// times locking reads where the plain ones show no gain, and keeps the
// floor; the claims start at it and take every pending row.
func TestClaim_MySQL_BehindTenThousandDeadEntries_LockingMeasureKeepsTheFloor(t *testing.T) {
	t.Parallel()
	db, s := mysqlFloorStore(t)
	holdSnapshot(t, db)
	publishOld(t, db, 10_000)
	want, got := turnFloorOn(t, db, s)
	writeAt(t, db, "last", time.Now())
	ids, from := claimAll(t, s)
	got = append(got, ids...)
	if from == nil || !slices.Equal(ids, []string{"last"}) {
		t.Fatalf("the claim after the measure took %v from %v; want [last], from the floor", ids, from)
	}
	if want = append(want, "last"); !slices.Equal(got, want) {
		t.Fatalf("the claims took %v, want %v", got, want)
	}
}

// The locking measure passes rows another relay's claim holds, waits for
// none, and runs in a transaction of its own, rolled back at once: the
// rows its reads passed are free when the claim begins.
func TestLockMeasure_MySQL_BesideAClaimInFlight_WaitsForNothingHoldsNothing(t *testing.T) {
	t.Parallel()
	db, s := mysqlFloorStore(t)
	ctx := context.Background()
	old := time.Now().Add(-time.Minute).UTC().Truncate(time.Millisecond)
	for i := range 10 {
		writeAt(t, db, fmt.Sprintf("held%d", i), old.Add(time.Duration(i)*time.Millisecond))
	}
	writeAt(t, db, "free", time.Now())
	other, err := NewStore(db.DB, StoreConfig{Dialect: MySQL})
	if err != nil {
		t.Fatal(err)
	}
	inFlight, err := other.claimBatch(ctx, 10, "other", time.Minute, atHead, nil)
	if err != nil || len(inFlight.rows) != 10 {
		t.Fatalf("the other relay's claim: %v", err)
	}
	defer other.abandon(ctx, inFlight)
	s.index, s.keyIndex = indexesOf(t, s)
	s.floor.lockDue = true
	measureCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	conn, err := db.DB.Conn(measureCtx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	sent := s.sent.Load()
	if err := s.lockMeasure(measureCtx, conn); err != nil {
		t.Fatalf("the locking measure beside a claim in flight: %v", err)
	}
	if n := s.sent.Load() - sent; n < 4 || s.floor.lockDue {
		t.Fatalf("the locking measure sent %d statements, due after %v; want BEGIN, two reads or more, ROLLBACK, and done", n, s.floor.lockDue)
	}
	// The reads passed "free", the first row no other claim holds, locked
	// it, and let it go.
	ids, _ := claimAll(t, s)
	if !slices.Equal(ids, []string{"free"}) {
		t.Fatalf("the claim after took %v, want [free]", ids)
	}
}

// A record stuck below the floor can be retried while a claim's batch is
// in flight, each period: the locking reads, which pass it, lock it only
// for their own transaction. In the claim's, as first written, an
// operator's Retry waited for the batch's marks (up to PublishTimeout, or
// innodb_lock_wait_timeout and an error).
func TestClaim_MySQL_BesideASnapshot_RetryOfAStuckRecordBelowTheFloorBesideABatchInFlight(t *testing.T) {
	t.Parallel()
	db, s := mysqlFloorStore(t)
	ctx := context.Background()
	holdSnapshot(t, db)
	publishOld(t, db, 10_000)
	writeStuckAt(t, db, "stuck", time.Now().Add(-2*time.Hour))
	turnFloorOn(t, db, s)
	op, err := NewStore(db.DB, StoreConfig{Dialect: MySQL})
	if err != nil {
		t.Fatal(err)
	}
	for i := range 5 {
		writeAt(t, db, fmt.Sprintf("period%d", i), time.Now())
		s.floor.next = time.Time{} // the period is over
		cl, err := s.claimBatch(ctx, 100, "r", time.Minute, nil, nil)
		if err != nil {
			t.Fatal(err)
		}
		rctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		start := time.Now()
		n, err := op.Retry(rctx, "stuck")
		took := time.Since(start)
		cancel()
		_ = s.abandon(ctx, cl)
		if err != nil || n != 1 {
			t.Fatalf("period %d: the period's claim started at the floor (%v) and took %d rows; while its batch is in flight, an operator's Retry of a record stuck below the floor: %d rows after %v, %v; want 1 at once", i, cl.from != nil, len(cl.rows), n, took.Round(time.Millisecond), err)
		}
		db.MustExec("UPDATE acemq_outbox SET attempts = 1000 WHERE id = 'stuck'")
	}
}

// An idle relay's probes measure, and keep the floor beside a held
// snapshot where their plain reads gain (100,000 dead entries on
// MariaDB). A form that left every measure on MySQL to a claim, which an
// idle relay never makes, had each probe walk from the head.
func TestProbe_MySQL_IdleBesideAHeldSnapshot_KeepsTheFloor(t *testing.T) {
	t.Parallel()
	db, s := mysqlFloorStore(t)
	ctx := context.Background()
	holdSnapshot(t, db)
	publishOld(t, db, 100_000)
	indexesOf(t, s)
	for i := 0; i < 5 && !s.floor.on; i++ {
		s.floor.check, s.floor.missed = true, 0 // what a slow probe from the head does
		if found, err := s.hasClaimable(ctx); err != nil || found {
			t.Fatalf("the probe of an outbox with nothing pending: %v, %v", found, err)
		}
	}
	if !s.floor.on {
		t.Fatalf("five idle probes beside 100,000 dead entries, each measuring, left the floor off")
	}
}

// Where a measure's plain reads show no gain on MySQL, the next claim
// measures with locking reads, before its transaction; no measure counts
// as missed until that one has.
func TestMeasure_MySQL_NoPlainGain_TheNextClaimMeasuresLocking(t *testing.T) {
	t.Parallel()
	db, s := mysqlFloorStore(t)
	ctx := context.Background()
	s.index, s.keyIndex = indexesOf(t, s) // as a relay looks them up when it starts
	writeAt(t, db, "first", time.Now().Add(-time.Minute))
	f := s.floor
	f.check, f.gainAbove = true, time.Hour // no gain, plain or locking
	if found, err := s.hasClaimable(ctx); err != nil || !found {
		t.Fatalf("the probe: %v, %v", found, err)
	}
	if f.on || !f.lockDue || f.missed != 0 {
		t.Fatalf("after a probe's measure without gain: floor on %v, locking measure due %v, missed %d; want off, due, 0", f.on, f.lockDue, f.missed)
	}
	if ids, _ := claimAll(t, s); !slices.Equal(ids, []string{"first"}) {
		t.Fatalf("the claim after took %v, want [first]", ids)
	}
	if f.on || f.lockDue || f.missed != 1 {
		t.Fatalf("after the claim's locking measure without gain: floor on %v, due %v, missed %d; want off, done, 1", f.on, f.lockDue, f.missed)
	}
}

// turnFloorOn writes a row and claims, measuring each time, until s keeps
// its floor, five times at most: the ids it wrote and those it claimed.
func turnFloorOn(t *testing.T, db *testdb.DB, s *Store) (written, claimed []string) {
	t.Helper()
	for i := 0; i < 5 && !s.floor.on; i++ {
		id := fmt.Sprintf("new%d", i)
		writeAt(t, db, id, time.Now())
		written = append(written, id)
		s.floor.check, s.floor.missed = true, 0 // measure now
		ids, _ := claimAll(t, s)
		claimed = append(claimed, ids...)
	}
	if !s.floor.on {
		t.Fatalf("behind the dead entries, five measures left the floor off")
	}
	return written, claimed
}

// mysqlFloorStore is a Store over a migrated MySQL database of its own.
func mysqlFloorStore(t *testing.T) (*testdb.DB, *Store) {
	t.Helper()
	db := testdb.New(t, testdb.MySQL)
	if err := Migrate(context.Background(), db.DB, MySQL); err != nil {
		t.Fatal(err)
	}
	s, err := NewStore(db.DB, StoreConfig{Dialect: MySQL})
	if err != nil {
		t.Fatal(err)
	}
	return db, s
}
