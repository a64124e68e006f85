package outbox

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/acemq/watermill-outbox/internal/testdb"
)

// Three retries from another process heard within one gap; a claim
// measures between the 2nd and the 3rd. The 3rd's record must be claimed
// within max(rewindGap, rewindGapMin) of its notification: it waited for
// the floor's next measure, a period (10 s), the lowering already coming
// when it was heard having been taken by the measure.
func TestStore_RetriesHeardWithinAGap_ThirdAfterAMeasure_ClaimedWithinTheGap(t *testing.T) {
	db := testdb.New(t, testdb.Postgres)
	if err := Migrate(context.Background(), db.DB, Postgres); err != nil {
		t.Fatal(err)
	}
	s := floorStore(t, db, Postgres, 10*time.Second)
	base := time.Now().Add(-2 * time.Hour)
	writeStuckAt(t, db, "stuckA", base)
	writeStuckAt(t, db, "stuckB", base.Add(time.Second))
	writeStuckAt(t, db, "stuckC", base.Add(2*time.Second))
	for i := range 5 {
		writeAt(t, db, fmt.Sprintf("r-%d", i), time.Now().Add(-time.Hour+time.Duration(i)*time.Millisecond))
	}
	ids, _ := claimAll(t, s)
	t.Logf("first claim %v", ids)
	retry := func(id string) {
		db.MustExec("UPDATE acemq_outbox SET attempts = 0 WHERE id = $1", id)
		s.lowerFloorsHeard() // what the listener does on acemq_outbox_retry
	}
	retry("stuckA")         // lowers
	retry("stuckB")         // within the gap: next already zero, heard scheduled
	ids, _ = claimAll(t, s) // measures (next was 0): claims A and B, next = now + 10 s
	t.Logf("claim after A,B: %v; floorDue %s", ids, s.floorDue().Round(time.Millisecond))
	writeAt(t, db, "flow-1", time.Now())
	ids, _ = claimAll(t, s) // the floor's read moves it up, above stuckC
	t.Logf("a claim of the flow: %v", ids)
	retry("stuckC")
	start := time.Now()
	t.Logf("after C heard: floorDue %s", s.floorDue().Round(time.Millisecond))
	for time.Since(start) < 12*time.Second {
		if ids, _ = claimAll(t, s); len(ids) > 0 {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	waited := time.Since(start)
	t.Logf("stuckC claimed %s after its notification (%v)", waited.Round(50*time.Millisecond), ids)
	if waited > time.Second {
		t.Errorf("stuckC waited %s, want within %s", waited.Round(50*time.Millisecond), rewindGapMin)
	}
}
