package outbox

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/acemq/watermill-outbox/internal/sqldialect"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// A keyed record waiting out its retry backoff (a lease RetryHold) is
// pending, and no claim takes it or its key's later records until the
// backoff ends. The floor passes them until then, as it passes a stuck
// key's, and is measured again when the backoff ends: then the claim
// starts below the record and takes it. Before, the floor stood at the
// record for the whole backoff, and every claim walked the entries of all
// that was published after it (beside a held snapshot, those of the
// published rows too).
func TestClaim_KeyedRecordInRetryBackoff_FloorPassesItUntilTheBackoffEnds(t *testing.T) {
	t.Parallel()
	eachFloorKind(t, func(t *testing.T, db *testdb.DB, d Dialect) {
		s := floorStore(t, db, d, time.Hour)
		held := time.Now().Add(-time.Minute)
		writeKeyed(t, db, "k#1", "k", 1, held, 1)
		writeKeyed(t, db, "k#2", "k", 2, held.Add(time.Second), 0)
		end := time.Now().Add(2 * time.Second)
		holdBack(t, db, "k#1", end)
		writeAt(t, db, "a", held.Add(2*time.Second))

		// The measure passes k#1: the claim starts above it.
		ids, from := claimAll(t, s)
		if !slices.Equal(ids, []string{"a"}) || from == nil || !from.CreatedAt.After(held) {
			t.Fatalf("the measure's claim took %v from %v; want [a], from above k#1 (%v)", ids, from, held)
		}

		// Each claim's read of the floor passes it too: one that failed
		// after the measure (here j#1, of another key).
		writeKeyed(t, db, "j#1", "j", 1, held.Add(3*time.Second), 1)
		holdBack(t, db, "j#1", end)
		writeAt(t, db, "b", held.Add(4*time.Second))
		ids, from = claimAll(t, s)
		if !slices.Equal(ids, []string{"b"}) || from == nil || !from.CreatedAt.After(held.Add(3*time.Second)) {
			t.Fatalf("the claim after j#1 failed took %v from %v; want [b], from above j#1", ids, from)
		}

		// The backoffs end: the next claim starts no higher than them,
		// without a measure (the period is an hour), and takes them.
		time.Sleep(time.Until(end.Add(10 * time.Millisecond)))
		if found, err := s.hasClaimable(context.Background()); err != nil || !found {
			t.Fatalf("an idle relay's probe after the backoffs ended: %v, %v; want them found", found, err)
		}
		checked := s.floor.checked
		ids, from = claimAll(t, s)
		if !slices.Contains(ids, "k#1") || !slices.Contains(ids, "j#1") || from == nil || from.CreatedAt.After(held) || s.floor.checked != checked {
			t.Fatalf("the claim after the backoffs ended took %v from %v (measured: %v); want k#1 and j#1, from the floor below them, no measure", ids, from, s.floor.checked != checked)
		}
	})
}

// holdBack puts the record id in a retry backoff until until, as the
// relay does after a keyed record failed.
func holdBack(t testing.TB, db *testdb.DB, id string, until time.Time) {
	t.Helper()
	var arg any = until.UTC()
	if db.Kind == testdb.MySQL {
		arg = until.UTC().Format("2006-01-02 15:04:05.000000")
	}
	db.MustExec(db.Rebind("UPDATE acemq_outbox SET locked_by = '"+sqldialect.RetryHold+"', locked_until = ? WHERE id = ?"), arg, id)
}
