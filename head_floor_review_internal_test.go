package outbox

import (
	"context"
	"testing"
	"time"

	"github.com/acemq/watermill-outbox/internal/testdb"
)

// On MySQL, a claim whose statement fails (the pending index it names was
// renamed or dropped) forgets the index, and the next claim looks it up
// again. With the floor on, the floor's read (PendingFirst, which names the
// same index) fails first, before the claim's statement, and does not
// forget it: every claim and probe after fails, for good.
func TestClaim_FloorOn_PendingIndexRenamed_ClaimsRecover(t *testing.T) {
	t.Parallel()
	for _, floor := range []bool{false, true} {
		name := "floor off"
		if floor {
			name = "floor on"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			db := testdb.New(t, testdb.MySQL)
			ctx := context.Background()
			if err := Migrate(ctx, db.DB, MySQL); err != nil {
				t.Fatal(err)
			}
			s, err := NewStore(db.DB, StoreConfig{Dialect: MySQL})
			if err != nil {
				t.Fatal(err)
			}
			if floor {
				floorAlwaysOn(s, time.Hour)
			}
			writeAt(t, db, "a", time.Now())
			cl, err := s.claimBatch(ctx, 100, "r", time.Minute, nil, nil) // looks the index up
			if err != nil {
				t.Fatal(err)
			}
			if err := s.finish(ctx, cl, []string{"a"}, nil); err != nil {
				t.Fatal(err)
			}
			db.MustExec("ALTER TABLE acemq_outbox RENAME INDEX acemq_outbox_pending TO acemq_outbox_pending_renamed")
			writeAt(t, db, "b", time.Now())
			var errs []error
			for range 3 {
				cl, err := s.claimBatch(ctx, 100, "r", time.Minute, nil, nil)
				if err != nil {
					errs = append(errs, err)
					continue
				}
				_ = s.abandon(ctx, cl)
				if len(cl.rows) != 1 || cl.rows[0].ID != "b" {
					t.Fatalf("claimed %v, want [b]", cl.rows)
				}
				return
			}
			t.Fatalf("3 claims after the pending index was renamed failed: %v", errs)
		})
	}
}
