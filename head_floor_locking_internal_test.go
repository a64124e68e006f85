package outbox

import (
	"context"
	"database/sql"
	"fmt"
	"slices"
	"strings"
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
	var want, got []string
	for i := 0; i < 5 && !s.floor.on; i++ {
		id := fmt.Sprintf("new%d", i)
		writeAt(t, db, id, time.Now())
		want = append(want, id)
		s.floor.check, s.floor.missed = true, 0 // measure now
		ids, _ := claimAll(t, s)
		got = append(got, ids...)
	}
	if !s.floor.on {
		t.Fatalf("behind 10,000 dead entries, five measures left the floor off")
	}
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

// The locking reads pass rows another relay's claim holds, and wait for
// none: a measure beside a claim in flight returns, its floor below the
// rows the other holds (they are pending: its batch may fail, or be given
// up), and the claim after it takes what is free.
func TestMeasureFloor_MySQL_LockingReadsBesideAClaimInFlight_WaitForNothing(t *testing.T) {
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
	index, keyIndex := indexesOf(t, s)
	s.floor.gainAbove = time.Hour // no gain: one round of each, plain then locking
	measureCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	tx, err := db.DB.BeginTx(measureCtx, &sql.TxOptions{Isolation: sql.LevelReadCommitted})
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback()
	q := &recordingQuerier{q: tx}
	m, err := s.measureFloor(measureCtx, q, index, keyIndex, time.Now(), true)
	if err != nil {
		t.Fatalf("the measure beside a claim in flight: %v", err)
	}
	locking := 0
	for _, query := range q.sent {
		if strings.Contains(query, "FOR UPDATE SKIP LOCKED") {
			locking++
		}
	}
	if locking != 2 || m.on || m.at.After(old) {
		t.Fatalf("the measure sent %d locking reads of %d statements, floor on %v at %v; want 2, off, at or below %v", locking, len(q.sent), m.on, m.at, old)
	}
	// The locking reads locked the first row they could, "free": the claim
	// that measures takes it in the same transaction.
	if err := tx.Rollback(); err != nil {
		t.Fatal(err)
	}
	ids, _ := claimAll(t, s)
	if !slices.Equal(ids, []string{"free"}) {
		t.Fatalf("the claim after took %v, want [free]", ids)
	}
}

// On MySQL a probe does not measure: its plain read, on a connection of the
// pool, found no gain where the claims paid 15 ms behind 20,000 dead
// entries, and each such measure doubled the wait for the next. It starts
// at the head, and leaves the measure to the next claim; one that finds
// nothing there while the floor is on sets the next period.
func TestProbe_MySQL_LeavesTheMeasureToAClaim(t *testing.T) {
	t.Parallel()
	db, s := mysqlFloorStore(t)
	ctx := context.Background()
	writeAt(t, db, "first", time.Now().Add(-time.Minute))
	f := s.floor
	f.check = true
	sent := s.sent.Load()
	if found, err := s.hasClaimable(ctx); err != nil || !found {
		t.Fatalf("the probe: %v, %v", found, err)
	}
	if n := s.sent.Load() - sent; n != 1 || !f.check || !f.checked.IsZero() || f.missed != 0 {
		t.Fatalf("the probe sent %d statements, check %v, measured at %v, missed %d; want 1, the measure left to a claim", n, f.check, f.checked, f.missed)
	}
	if ids, _ := claimAll(t, s); !slices.Equal(ids, []string{"first"}) || f.checked.IsZero() {
		t.Fatalf("the claim after took %v, measured at %v; want [first], measured", ids, f.checked)
	}

	f.on, f.at, f.next = true, time.Now(), time.Time{} // the period is over
	if found, err := s.hasClaimable(ctx); err != nil || found {
		t.Fatalf("the probe of an empty outbox: %v, %v", found, err)
	}
	if !f.next.After(time.Now()) {
		t.Fatalf("a probe from the head that found nothing left the next measure at %v", f.next)
	}
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
