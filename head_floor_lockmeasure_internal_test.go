package outbox

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/acemq/watermill-outbox/internal/testdb"
)

// An idle MySQL relay whose every probe from the head takes checkAbove (a
// database 5 ms away) and whose measures find no gain measures less and
// less often (headWalked's doubling). A form that counted no measure on
// MySQL as missed until a claim's locking measure, which an idle relay
// never makes, measured every checkEvery for good.
func TestProbe_MySQL_IdleNoGain_MeasuresLessOften(t *testing.T) {
	t.Parallel()
	db, s := mysqlFloorStore(t)
	_ = db
	ctx := context.Background()
	s.index, s.keyIndex = indexesOf(t, s)
	f := s.floor
	const every = 50 * time.Millisecond
	f.mu.Lock()
	f.checkAbove, f.checkEvery, f.gainAbove, f.check = 0, every, time.Hour, true
	f.mu.Unlock()
	measures, last := 0, time.Time{}
	end := time.Now().Add(30 * every)
	for time.Now().Before(end) {
		if found, err := s.hasClaimable(ctx); err != nil || found {
			t.Fatalf("the probe of an empty outbox: %v, %v", found, err)
		}
		f.mu.Lock()
		if f.checked != last {
			measures, last = measures+1, f.checked
		}
		f.mu.Unlock()
		time.Sleep(every / 10)
	}
	// Doubling: at 0, 1, 3, 7, 15, 31 checkEvery: 5 in 30 checkEvery.
	if measures > 8 {
		f.mu.Lock()
		defer f.mu.Unlock()
		t.Fatalf("an idle relay's probes measured %d times in %v without gain (checkEvery %v): missed %d, lockDue %v; want the wait doubled after each", measures, 30*every, every, f.missed, f.lockDue)
	}
}

// Once the snapshot ends (no gain), an idle MySQL relay's floor turns off
// within two measures: the first leaves it to a claim's locking measure,
// which an idle relay never makes; a form that left every one to it kept
// the floor on for good.
func TestProbe_MySQL_IdleFloorOnNoGain_TurnsOff(t *testing.T) {
	t.Parallel()
	_, s := mysqlFloorStore(t)
	ctx := context.Background()
	s.index, s.keyIndex = indexesOf(t, s)
	f := s.floor
	const every = 50 * time.Millisecond
	f.mu.Lock()
	f.gainAbove, f.everyMin, f.everyMax = time.Hour, every, every // no gain: no snapshot held
	f.on, f.at, f.next = true, time.Now().Add(-f.lag), time.Time{}
	f.mu.Unlock()
	for range 20 {
		if found, err := s.hasClaimable(ctx); err != nil || found {
			t.Fatalf("the probe of an empty outbox: %v, %v", found, err)
		}
		time.Sleep(every / 2)
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.on {
		t.Fatalf("20 idle probes over %d periods, each measure without gain, left the floor on (lockDue %v)", 10, f.lockDue)
	}
}

// A row made pending below a floor that is on (another process's Retry)
// waits at most the floor's period. A claim's locking measure sets the
// next period from itself: it reads where the pending rows start from the
// head first, so the row is below its floor. A form that kept the floor
// its plain measure found left the row above it for up to two periods.
func TestClaim_MySQL_LockMeasure_RowRetriedBelowTheFloorWaitsAPeriodAtMost(t *testing.T) {
	t.Parallel()
	db, s := stuckBehindDeadEntries(t)
	ctx := context.Background()
	f := s.floor
	const period = 3 * time.Second
	f.mu.Lock()
	f.everyMin, f.everyMax, f.gainAbove = period, period, 2500*time.Microsecond // the plain reads miss it, the locking ones (about 15 ms) not
	f.on, f.at, f.next = true, time.Now().Add(-f.lag), time.Time{}              // on, its period over
	f.mu.Unlock()
	// The period's measure, by an idle relay's probe.
	if _, err := s.hasClaimable(ctx); err != nil {
		t.Fatal(err)
	}
	f.mu.Lock()
	if !f.lockDue { // the plain reads gained by chance: as where they did not
		t.Log("the probe's plain reads gained: as where they missed")
		f.lockDue = true
	}
	on, periodEnd := f.on, f.next
	f.mu.Unlock()
	if !on {
		t.Fatal("the floor went off at the probe's measure")
	}
	// Another process retries r, below the floor: it waits for the next
	// measure, at periodEnd at the latest.
	db.MustExec("UPDATE acemq_outbox SET attempts = 0 WHERE id = 'r'")
	pending := time.Now()
	time.Sleep(time.Until(periodEnd.Add(-500 * time.Millisecond)))
	writeAt(t, db, "new", time.Now())
	ids, from := claimAll(t, s)
	f.mu.Lock()
	next, on := f.next, f.on
	f.mu.Unlock()
	t.Logf("the claim %v before the period's end took %v from %v; floor on %v, next %v after the period's end", time.Until(periodEnd).Round(time.Millisecond), ids, from, on, next.Sub(periodEnd).Round(time.Millisecond))
	if slices.Contains(ids, "r") {
		return
	}
	for {
		ids, _ := claimAll(t, s)
		if slices.Contains(ids, "r") {
			return
		}
		if time.Now().After(periodEnd.Add(time.Second)) {
			t.Fatalf("r, pending below the floor since %v before the period's end, not claimed %v after it (the claim's locking measure set next %v after the period's end)", periodEnd.Sub(pending).Round(time.Millisecond), time.Second, next.Sub(periodEnd).Round(time.Millisecond))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// With the floor off, a row made pending after a probe's measure (another
// process's Retry, a transaction committed late) is taken by the next
// claim. A form whose locking measure turned the floor on where the plain
// measure had found it, above that row, had the claims pass it for a
// period.
func TestClaim_MySQL_LockMeasure_RowMadePendingSinceThePlainMeasureIsClaimed(t *testing.T) {
	t.Parallel()
	db, s := stuckBehindDeadEntries(t)
	ctx := context.Background()
	f := s.floor
	f.mu.Lock()
	f.everyMin, f.everyMax, f.check, f.gainAbove = 10*time.Second, 10*time.Second, true, 2500*time.Microsecond // the plain reads miss it, the locking ones (about 15 ms) not
	f.mu.Unlock()
	if _, err := s.hasClaimable(ctx); err != nil { // a slow probe's measure
		t.Fatal(err)
	}
	f.mu.Lock()
	if f.on || !f.lockDue {
		// The plain reads gained by chance: as where they did not.
		t.Logf("the probe's plain reads turned the floor on (%v) or left no locking measure due (%v): as where they missed", f.on, f.lockDue)
		f.on, f.lockDue = false, true
	}
	f.mu.Unlock()
	db.MustExec("UPDATE acemq_outbox SET attempts = 0 WHERE id = 'r'") // another process's Retry
	for i := range 3 {
		writeAt(t, db, fmt.Sprintf("new%d", i), time.Now())
		ids, from := claimAll(t, s)
		if slices.Contains(ids, "r") {
			return
		}
		f.mu.Lock()
		on, at := f.on, f.at
		f.mu.Unlock()
		t.Errorf("claim %d after r was made pending with the floor off took %v from %v (floor on %v at %v); want r", i, ids, from, on, at.Format(time.RFC3339Nano))
	}
}

// A MySQL relay whose pending index was renamed (or dropped and made
// again under another name) fails one claim at most: that claim's error
// makes it forget the name (forgetIndex), and the next looks the index up
// again. A locking measure due, whose reads name the index, fails no
// claim: the claim goes on from the head. As first written, it failed the
// claim without forgetting the name, and the claim after failed too.
func TestClaim_MySQL_PendingIndexRenamed_LockMeasureDue_NoClaimFails(t *testing.T) {
	t.Parallel()
	for _, due := range []bool{false, true} {
		t.Run(fmt.Sprintf("lockDue=%v", due), func(t *testing.T) {
			db, s := mysqlFloorStore(t)
			ctx := context.Background()
			s.index, s.keyIndex = indexesOf(t, s)
			writeAt(t, db, "a", time.Now().Add(-time.Minute))
			db.MustExec("ALTER TABLE acemq_outbox RENAME INDEX `" + s.index + "` TO acemq_outbox_pending_renamed")
			s.floor.mu.Lock()
			s.floor.lockDue = due // a measure whose plain reads found no gain
			s.floor.mu.Unlock()
			var errs []error
			var got []string
			for range 3 {
				cl, err := s.claimBatch(ctx, 100, "r", time.Minute, nil, nil)
				if err != nil {
					errs = append(errs, err)
					continue
				}
				for _, r := range cl.rows {
					got = append(got, r.ID)
				}
				if err := s.finish(ctx, cl, got, nil); err != nil {
					t.Fatal(err)
				}
				break
			}
			wantErrs := 1
			if due {
				wantErrs = 0 // the measure's failure is the claim's first statement's
			}
			if !slices.Equal(got, []string{"a"}) || len(errs) > wantErrs {
				t.Fatalf("after the pending index was renamed, the claims took %v after %d failed: %v; want [a] after one failure at most", got, len(errs), errs)
			}
		})
	}
}

// A locking measure that finds no gain sends what floorCheckAbove's
// comment counts: BEGIN, where the pending rows start (one read where no
// key is stuck), two locking reads, ROLLBACK; two reads more where the
// first pending row is older than lag (the rows below lag before now, and
// the locking walk to them from the first, too quick for points here).
func TestLockMeasure_MySQL_NoGain_SendsTheStatementsDocumented(t *testing.T) {
	t.Parallel()
	db, s := mysqlFloorStore(t)
	ctx := context.Background()
	s.index, s.keyIndex = indexesOf(t, s)
	conn, err := db.DB.Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	for _, c := range []struct {
		age  time.Duration
		want int64
	}{{0, 5}, {time.Minute, 7}} {
		db.MustExec("DELETE FROM acemq_outbox")
		writeAt(t, db, "a", time.Now().Add(-c.age))
		f := s.floor
		f.mu.Lock()
		f.lockDue, f.gainAbove, f.pointsAbove = true, time.Hour, time.Hour // no gain
		f.mu.Unlock()
		sent := s.sent.Load()
		if err := s.lockMeasure(ctx, conn); err != nil {
			t.Fatal(err)
		}
		if n := s.sent.Load() - sent; n != c.want {
			t.Errorf("a locking measure without gain, the first pending row %v old, sent %d statements; want %d", c.age, n, c.want)
		}
	}
}

// stuckBehindDeadEntries is a MySQL Store beside a held snapshot of 20,000
// published rows (an hour old) and a row "r" stuck at 1,000 attempts, ten
// minutes old: after the dead entries, below any floor once retried. Its
// indexes are looked up, as a relay's are when it starts.
func stuckBehindDeadEntries(t *testing.T) (*testdb.DB, *Store) {
	t.Helper()
	db, s := mysqlFloorStore(t)
	holdSnapshot(t, db)
	publishOld(t, db, 20_000)
	writeStuckAt(t, db, "r", time.Now().Add(-10*time.Minute))
	s.index, s.keyIndex = indexesOf(t, s)
	return db, s
}
