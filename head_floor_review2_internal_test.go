package outbox

import (
	"context"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/acemq/watermill-outbox/internal/testdb"
)

// Store.Retry (and Republish) through a Store over the relay's pool are
// said to make the relay's next claim measure (lowerFloors sets next to
// zero), and so take the retried row. When the relay's own claim of the
// period is under way as the Retry commits, that claim's statement did not
// see the retried row; when that claim ended by setting next a whole
// period ahead again (headWalked, when the period's claim started at the
// head), the next claim started at the floor, and the row waited a period
// (up to floorEveryMax, 10 s) instead.
//
// The interleaving is made by calling the steps of claimBatch in order:
// headBound (the period's measure), the Retry, headWalked where the claim
// started at the head (the claim ends).
func TestClaim_RetryDuringAWalkFromTheHead_NextClaimStartsAtTheHead(t *testing.T) {
	eachFloorKind(t, func(t *testing.T, db *testdb.DB, d Dialect) {
		ctx := context.Background()
		s := floorStore(t, db, d, time.Hour)
		op, err := NewStore(db.DB, StoreConfig{Dialect: d}) // the operator's, over the same pool
		if err != nil {
			t.Fatal(err)
		}
		writeFreshAndStuck(t, db)

		// The relay's claim: its period is over, it measures...
		from, _, err := s.headBound(ctx, db.DB, "", "", false)
		if err != nil {
			t.Fatalf("headBound: %v", err)
		}
		// ...its statement runs (and does not see 'stuck', not pending yet)...
		// ...the operator's Retry commits, and lowers the relay's floor...
		if n, err := op.Retry(ctx, "stuck"); err != nil || n != 1 {
			t.Fatalf("Retry: %d, %v", n, err)
		}
		// ...and the claim ends, 10 ms after it started.
		if from == nil {
			s.headWalked(10 * time.Millisecond)
		}

		cl, err := s.claimBatch(ctx, 100, "r", time.Minute, nil, nil)
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = s.abandon(ctx, cl) }()
		for _, r := range cl.rows {
			if r.ID == "stuck" {
				return
			}
		}
		t.Fatalf("the claim after the Retry took %d rows, not the retried one: it started at the floor, and the row waits %v (floorDue)", len(cl.rows), s.floorDue().Round(time.Second))
	})
}

// An idle relay that keeps its floor (period floorEveryMin, 250 ms) stays
// within 10 statements a second. The relay's start (its adaptive poll from
// MinPollInterval up, a retry's backoff after a statement the loaded machine
// timed out) is not idle: the rate is measured once a one-second window has
// settled under the bound, and over up to three 3 s windows, the first within
// it passing; a relay whose idle rate is above it fails all three.
func TestForwarder_FloorOn_IdleUnderTenStatementsASecond(t *testing.T) {
	eachFloorKind(t, func(t *testing.T, db *testdb.DB, d Dialect) {
		dest := &confirmingDest{}
		f, err := NewForwarder(db.DB, dest, ForwarderConfig{Dialect: d})
		if err != nil {
			t.Fatal(err)
		}
		floorAlwaysOn(f.store, floorEveryMin)
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- f.Run(ctx) }()
		defer func() { cancel(); <-done }()
		<-f.Running()
		window := func(d time.Duration) float64 {
			before := f.store.sent.Load()
			time.Sleep(d)
			return float64(f.store.sent.Load()-before) / d.Seconds()
		}
		for deadline := time.Now().Add(15 * time.Second); window(time.Second) > 10; {
			if time.Now().After(deadline) {
				t.Fatalf("idle with the floor on: not settled under 10 statements/s in 15 s")
			}
		}
		var rates []float64
		for i := 0; i < 3; i++ {
			rate := window(3 * time.Second)
			rates = append(rates, rate)
			if rate <= 10 {
				t.Logf("%s: %.1f statements/s idle (windows %.1f), floor on: %v", db.Kind, rate, rates, f.store.floor.on)
				return
			}
		}
		t.Errorf("idle with the floor on: %.1f statements/s in each of three 3 s windows", rates)
	})
}

// The registry of floors: Stores made and dropped concurrently with
// lowerFloors, under -race; every entry gone once they are collected.
func TestStore_Floors_RegistryRaceAndCleanup(t *testing.T) {
	db := testdb.New(t, testdb.Postgres)
	table := "floors_" + testdb.RandomName()
	count := func() int {
		floors.mu.Lock()
		defer floors.mu.Unlock()
		n := 0
		for k, g := range floors.m {
			if k.table == `"`+table+`"` || k.table == table {
				n += len(g)
			}
		}
		return n
	}
	var wg sync.WaitGroup
	for g := 0; g < 8; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < 200; i++ {
				s, err := NewStore(db.DB, StoreConfig{Dialect: Postgres, Table: table})
				if err != nil {
					t.Error(err)
					return
				}
				s.lowerFloors()
				s.headWalked(time.Hour)
				_ = s.floorDue()
				if i%50 == 0 {
					runtime.GC()
				}
			}
		}()
	}
	wg.Wait()
	t.Logf("registered after the loops: %d", count())
	deadline := time.Now().Add(5 * time.Second)
	for count() > 0 && time.Now().Before(deadline) {
		runtime.GC()
		time.Sleep(10 * time.Millisecond)
	}
	if n := count(); n > 0 {
		t.Fatalf("%d floors of collected Stores still registered", n)
	}
}
