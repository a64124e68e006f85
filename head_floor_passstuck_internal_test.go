package outbox

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/acemq/watermill-outbox/internal/sqldialect"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// A keyed record this relay takes to MaxAttempts holds the later records
// of its key from the moment its mark commits. Each claim's read of the
// floor passes them at once: it stopped at the first of them (an hour
// back here) until the next measure, up to floorEveryMax, and each claim
// walked from there. A Retry of the stuck record makes the next claim
// measure; it is claimed, then the one it held.
func TestClaim_KeyStuckByThisRelaysMark_FloorPassesWhatItHoldsAtOnce(t *testing.T) {
	t.Parallel()
	eachFloorKind(t, func(t *testing.T, db *testdb.DB, d Dialect) {
		ctx := context.Background()
		hourAgo := time.Now().Add(-time.Hour).UTC()
		s := floorStore(t, db, d, time.Hour) // measured by the first claim, then not for an hour
		writeKeyed(t, db, "k#1", "k", 1, hourAgo, s.cfg.MaxAttempts-1)
		writeKeyed(t, db, "k#2", "k", 2, hourAgo.Add(time.Millisecond), 0)
		claim := func(fail string, attempts int) ([]string, *sqldialect.Cursor) {
			t.Helper()
			cl, err := s.claimBatch(ctx, 100, "r", time.Minute, nil, nil)
			if err != nil {
				t.Fatal(err)
			}
			var published []string
			var failures []failure
			for _, r := range cl.rows {
				if r.ID == fail {
					failures = append(failures, failure{id: r.ID, exchange: r.Exchange, attempts: attempts, reason: "refused"})
				} else {
					published = append(published, r.ID)
				}
			}
			if err := s.finish(ctx, cl, published, failures); err != nil {
				t.Fatal(err)
			}
			ids := append(published, fail)
			if len(failures) == 0 {
				ids = published
			}
			return ids, cl.from
		}
		// A failure under MaxAttempts holds nothing for good: k#1 stays
		// where the pending rows start, and nothing is passed.
		if ids, _ := claim("k#1", s.cfg.MaxAttempts-1); !slices.Equal(ids, []string{"k#1"}) {
			t.Fatalf("the first claim took %v, want [k#1]", ids)
		}
		if len(s.floor.skip) != 0 {
			t.Fatalf("a failure under MaxAttempts: skip %v, want none", s.floor.skip)
		}
		if ids, _ := claim("k#1", s.cfg.MaxAttempts); !slices.Equal(ids, []string{"k#1"}) {
			t.Fatalf("the second claim took %v, want [k#1]", ids)
		}
		writeAt(t, db, "new", time.Now())
		ids, from := claim("", 0)
		if !slices.Equal(ids, []string{"new"}) {
			t.Fatalf("the claim after k#1 got stuck took %v, want [new]", ids)
		}
		if from == nil || !from.CreatedAt.After(hourAgo.Add(time.Minute)) {
			t.Fatalf("the claim after k#1 got stuck started at %v; want the floor past k#2, which k#1 holds (%v)", from, hourAgo)
		}
		if n, err := s.Retry(ctx, "k#1"); err != nil || n != 1 {
			t.Fatalf("Retry: %d, %v", n, err)
		}
		if ids, _ := claim("", 0); !slices.Equal(ids, []string{"k#1"}) {
			t.Fatalf("the claim after the Retry took %v, want [k#1]", ids)
		}
		if ids, _ := claim("", 0); !slices.Equal(ids, []string{"k#2"}) {
			t.Fatalf("the claim after k#1 was published took %v, want [k#2]", ids)
		}
	})
}

// passStuck adds nothing where the floors were lowered after the mark was
// sent (a Retry through a Store over the pool may have made the record
// pending again) or the floor is off, nothing twice, and no more than
// maxStuckKeys.
func TestPassStuck_LoweredSinceOrFloorOff_PassesNothing(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, testdb.Postgres)
	if err := Migrate(context.Background(), db.DB, Postgres); err != nil {
		t.Fatal(err)
	}
	s, err := NewStore(db.DB, StoreConfig{Dialect: Postgres})
	if err != nil {
		t.Fatal(err)
	}
	k := []sqldialect.KeySeq{{Key: "k", Seq: 3}}
	s.passStuck(k, time.Now())
	if len(s.floor.skip) != 0 {
		t.Fatalf("floor off: skip %v, want none", s.floor.skip)
	}
	s.floor.on = true
	marked := time.Now()
	s.lowerFloors()
	s.passStuck(k, marked)
	if len(s.floor.skip) != 0 {
		t.Fatalf("lowered after the mark: skip %v, want none", s.floor.skip)
	}
	s.passStuck(k, time.Now())
	s.passStuck(k, time.Now())
	if !slices.Equal(s.floor.skip, k) {
		t.Fatalf("the same stuck record twice: skip %v, want %v", s.floor.skip, k)
	}
	for i := range 2 * maxStuckKeys {
		s.passStuck([]sqldialect.KeySeq{{Key: "many", Seq: int64(i + 1)}}, time.Now())
	}
	if len(s.floor.skip) != maxStuckKeys {
		t.Fatalf("skip holds %d, want at most %d", len(s.floor.skip), maxStuckKeys)
	}
}

// A Retry through the relay's pool of a record passStuck passed empties
// the floor's skip list. The measure that Retry brings may find first a
// claimable row whose created_at is NULL, and leave the floor as it was:
// its claim from the head takes the retried record, and once that is
// published its key's next record is claimable. A stale skip list passed
// it, and it waited for the next measure (10 s at most; an hour here).
func TestClaim_RetryThenMeasureFromTheHeadOnly_PassesNoStaleStuckKey(t *testing.T) {
	t.Parallel()
	eachFloorKind(t, func(t *testing.T, db *testdb.DB, d Dialect) {
		ctx := context.Background()
		hourAgo := time.Now().Add(-time.Hour).UTC()
		s := floorStore(t, db, d, time.Hour)
		writeKeyed(t, db, "k#1", "k", 1, hourAgo, 0)
		writeKeyed(t, db, "k#2", "k", 2, hourAgo.Add(time.Millisecond), 0)

		// The first claim measures (floor on, at k#1), takes k#1, and the
		// relay fails it for good: stuck, passStuck passes key k.
		cl, err := s.claimBatch(ctx, 100, "r", time.Minute, nil, nil)
		if err != nil {
			t.Fatal(err)
		}
		if len(cl.rows) != 1 || cl.rows[0].ID != "k#1" {
			t.Fatalf("first claim: %v", cl.rows)
		}
		if err := s.finish(ctx, cl, nil, []failure{{id: "k#1", exchange: "x", attempts: s.cfg.MaxAttempts, reason: "refused"}}); err != nil {
			t.Fatal(err)
		}
		t.Logf("after the stuck mark: skip %v", s.floor.skip)

		// Another library's row without a created_at, then the operator's
		// Retry of k#1 through a Store over the relay's pool.
		allowNullCreatedAt(db)
		db.MustExec("INSERT INTO acemq_outbox (id, exchange_name, routing_key, body, headers, created_at) VALUES ('nullcreated', 'x', 'k', 'b', '{}', NULL)")
		if n, err := s.Retry(ctx, "k#1"); err != nil || n != 1 {
			t.Fatalf("Retry: %d, %v", n, err)
		}

		// The measure the Retry brings finds the NULL row: this claim
		// starts at the head and takes k#1 (and the NULL row).
		ids, from := claimAll(t, s)
		if !slices.Contains(ids, "k#1") || from != nil {
			t.Fatalf("the claim after the Retry took %v from %v, want k#1 among them, from the head", ids, from)
		}
		t.Logf("after the head-only measure: skip %v, floor on %v", s.floor.skip, s.floor.on)

		// k#1 is published: k#2 is claimable now.
		ids, from = claimAll(t, s)
		if !slices.Equal(ids, []string{"k#2"}) {
			t.Fatalf("k#1 published, the next claim took %v from %v (floor skip %v); want [k#2], claimable since k#1 was published", ids, from, s.floor.skip)
		}
	})
}
