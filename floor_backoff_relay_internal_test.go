package outbox

import (
	"context"
	"database/sql"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/acemq/watermill-outbox/internal/testdb"
)

// backoffRelays: relays beside a held snapshot; keyed records that
// fail (transiently) several times in a row, each failure a retry backoff
// the floor passes; unkeyed traffic meanwhile. Every record must reach the
// destination once, keys in order, each within the period, a poll, its
// own backoffs and slack.
func backoffRelays(t *testing.T, db *testdb.DB, d Dialect, relaysN int, period time.Duration, dead int, run time.Duration, maxFails int) {
	holdSnapshot(t, db)
	publishOld(t, db, dead)
	dest := newStressDest()
	pools := []*sql.DB{db.DB.DB}
	for len(pools) < relaysN {
		pools = append(pools, stressPool(t, db))
	}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	defer func() { cancel(); wg.Wait() }()
	var relays []*Forwarder
	for i, p := range pools {
		f, err := NewForwarder(p, dest, ForwarderConfig{Dialect: d, MaxAttempts: 50, BatchSize: 20, RetryMin: 50 * time.Millisecond, RetryMax: 400 * time.Millisecond, RelayID: fmt.Sprintf("relay%d", i)})
		if err != nil {
			t.Fatal(err)
		}
		if period > 0 {
			floorAlwaysOn(f.store, period)
		}
		relays = append(relays, f)
		wg.Add(1)
		go func() { defer wg.Done(); _ = f.Run(ctx) }()
		<-f.Running()
	}
	w := newStressWriter(t, db)
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 7))
	keys := []string{"ka", "kb", "kc", "kd"}
	start := time.Now()
	anyOn := false
	for i := 0; time.Since(start) < run; i++ {
		if i%50 == 0 {
			for _, f := range relays {
				anyOn = anyOn || FloorOn(f)
			}
		}
		id := fmt.Sprintf("r%05d", i)
		kind := "fresh"
		var created any = time.Now()
		if rng.IntN(6) == 0 {
			created, kind = time.Now().Add(-time.Duration(1+rng.IntN(60))*time.Minute), "late"
		}
		key := ""
		if rng.IntN(2) == 0 {
			key = keys[rng.IntN(len(keys))]
			id = w.nextKeyedID(key)
			kind += "-keyed"
			if n := rng.IntN(maxFails + 1); n > 0 && rng.IntN(3) == 0 {
				dest.mu.Lock()
				dest.flaky[id] = n
				dest.mu.Unlock()
				kind += fmt.Sprintf("-fails%d", n)
			}
		}
		w.insert(id, kind, created, key)
		time.Sleep(time.Duration(5+rng.IntN(30)) * time.Millisecond)
	}
	if period == 0 {
		period = floorEveryMax
	}
	// period + poll + the record's own backoffs (maxFails × RetryMax) + slack.
	w.check(t, dest, period+250*time.Millisecond+time.Duration(maxFails)*400*time.Millisecond+2*time.Second, 40*time.Second)
	t.Logf("a floor was on during the run: %v", anyOn)
}

func TestForwarder_TwoRelaysBesideASnapshot_KeyedFailuresInARow_NothingLostNothingLate(t *testing.T) {
	eachFloorKind(t, func(t *testing.T, db *testdb.DB, d Dialect) {
		backoffRelays(t, db, d, 2, time.Second, 20000, 10*time.Second, 4)
	})
}
