package outbox

import (
	"fmt"
	"slices"
	"testing"
	"time"
)

// A floor a locking measure kept on MySQL is not timed with locking reads
// again each period: behind 20,000 dead entries, where the plain reads show
// no gain, each period's plain miss sent the next claim to a locking walk
// from the head (15 ms), and the records that came meanwhile waited for
// it. Until lockNext the periods read where the pending rows start, from
// the head with one plain read, and their claims take the rows below the
// floor; after it, a locking measure decides again, and turns a floor that
// saves nothing off.
func TestClaim_MySQL_FloorKeptByALockingMeasure_PeriodsMeasureNoMoreUntilLockNext(t *testing.T) {
	t.Parallel()
	db, s := mysqlFloorStore(t)
	holdSnapshot(t, db)
	publishOld(t, db, 10_000)
	turnFloorOn(t, db, s)
	f := s.floor
	if f.lockNext.IsZero() {
		// The plain reads gained (other transactions on the server slow
		// them too): a locking measure keeps the floor as it does.
		f.lockDue = true
		writeAt(t, db, "locked", time.Now())
		claimAll(t, s)
	}
	if !f.on || f.lockNext.IsZero() {
		t.Fatalf("after a locking measure behind 10,000 dead entries: floor on %v, next locking measure %v; want on, due later", f.on, f.lockNext)
	}
	f.lockNext = time.Now().Add(time.Hour)
	f.gainAbove = time.Hour // neither plain nor locking reads gain now
	for i := range 5 {
		below := fmt.Sprintf("below%d", i)
		writeAt(t, db, below, f.at.Add(-time.Millisecond))
		f.next = time.Time{} // the period is over
		sent := s.sent.Load()
		ids, from := claimAll(t, s)
		n := s.sent.Load() - sent
		if !f.on || f.lockDue || from == nil || !slices.Equal(ids, []string{below}) {
			t.Fatalf("period %d: the claim took %v from %v (%d statements, the mark's among them); floor on %v, locking measure due %v; want [%s] from the floor, on, none due", i, ids, from, n, f.on, f.lockDue, below)
		}
	}
	f.lockNext = time.Now().Add(-time.Millisecond)
	f.next = time.Time{}
	claimAll(t, s)
	if !f.lockDue {
		t.Fatalf("past lockNext, the period's plain reads missed and sent no claim to a locking measure (floor on %v)", f.on)
	}
	claimAll(t, s)
	if f.on || !f.lockNext.IsZero() {
		t.Fatalf("a locking measure without gain left the floor on %v, next locking measure %v; want off, none", f.on, f.lockNext)
	}
}

// Each locking measure that keeps a floor doubles the wait for the next,
// from two periods after the one that turned it on, to floorLockMax; a
// floor turned off starts over.
func TestLockedOn_WaitsDoubleUpToFloorLockMax(t *testing.T) {
	t.Parallel()
	f := newHeadFloor(true)
	now := time.Now()
	head := 15 * time.Millisecond // period: floorEveryMin
	var waits []time.Duration
	for range 7 {
		f.lockedOn(now, head)
		f.on = true
		waits = append(waits, f.lockNext.Sub(now))
	}
	want := []time.Duration{4 * time.Second, 8 * time.Second, 16 * time.Second, 32 * time.Second, time.Minute, time.Minute, time.Minute}
	if !slices.Equal(waits, want) {
		t.Fatalf("waits after locking measures that kept the floor: %v, want %v", waits, want)
	}
	f.off()
	f.lockedOn(now, head)
	if got := f.lockNext.Sub(now); got != 4*time.Second {
		t.Fatalf("after the floor went off, the first wait is %v, want 4s", got)
	}
}
