package outbox

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/acemq/watermill-outbox/internal/testdb"
)

// Another process retries two stuck records 130 ms apart (PostgreSQL: its
// Retry notifies acemq_outbox_retry). The relay's listener hears both. A
// floor lowered for the first was not lowered again for the second, within
// rewindGap, and a claim between them had moved it above the second: it
// waited for the floor's next measure, 10 s. It is lowered again once the
// gap is over.
func TestForwarder_RetryNotificationsInABurst_SecondRecordClaimedWithinTheGap(t *testing.T) {
	db := testdb.New(t, testdb.Postgres)
	if err := Migrate(context.Background(), db.DB, Postgres); err != nil {
		t.Fatal(err)
	}
	s := floorStore(t, db, Postgres, 10*time.Second) // floorEveryMax, the longest period
	listenBeside(t, db)
	base := time.Now().Add(-2 * time.Hour)
	writeStuckAt(t, db, "stuckA", base)
	writeStuckAt(t, db, "stuckB", base.Add(time.Second))
	for i := range 5 {
		writeAt(t, db, fmt.Sprintf("r-%d", i), time.Now().Add(-time.Hour+time.Duration(i)*time.Millisecond))
	}
	ids, _ := claimAll(t, s) // measures: floor on, above the stuck ones
	t.Logf("first claim %v", ids)
	// "Another process" (raw SQL, as its Retry writes and notifies).
	heard := func() time.Time {
		s.floor.mu.Lock()
		defer s.floor.mu.Unlock()
		return s.floor.heard
	}
	retry := func(id string) {
		before := heard()
		db.MustExec("UPDATE acemq_outbox SET attempts = 0 WHERE id = $1", id)
		db.MustExec("SELECT pg_notify('acemq_outbox_retry', current_schema() || '.acemq_outbox')")
		// The listener hears it: a sleep of 30 ms was too short in a
		// loaded CI run, and the first retry went unheard until the second.
		for deadline := time.Now().Add(5 * time.Second); heard().Equal(before) && time.Now().Before(deadline); {
			time.Sleep(5 * time.Millisecond)
		}
	}
	retry("stuckA")
	ids, _ = claimAll(t, s)
	t.Logf("after the 1st retry notification: claimed %v", ids)
	if len(ids) != 1 || ids[0] != "stuckA" {
		t.Errorf("single notification: stuckA not claimed at once: %v", ids)
	}
	// The flow goes on: the relay's next claim reads its floor up from where it stood.
	writeAt(t, db, "flow-1", time.Now())
	ids, _ = claimAll(t, s)
	t.Logf("a claim of the flow: %v", ids)
	retry("stuckB")
	start := time.Now()
	ids, _ = claimAll(t, s)
	t.Logf("after the 2nd retry notification (%s after the 1st): claimed %v; floorDue %s", 130*time.Millisecond, ids, s.floorDue().Round(time.Millisecond))
	if len(ids) == 1 && ids[0] == "stuckB" {
		return
	}
	for time.Since(start) < 12*time.Second {
		time.Sleep(50 * time.Millisecond)
		if ids, _ = claimAll(t, s); len(ids) > 0 {
			break
		}
	}
	waited := time.Since(start)
	t.Logf("second retried record claimed %s after its notification (%v)", waited.Round(50*time.Millisecond), ids)
	if len(ids) != 1 || ids[0] != "stuckB" || waited > 2*time.Second {
		t.Errorf("second retried record claimed %s after its notification (%v), want within rewindGap (%s at the least)", waited.Round(50*time.Millisecond), ids, rewindGapMin)
	}
}
