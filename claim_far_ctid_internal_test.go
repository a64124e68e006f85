package outbox

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/acemq/watermill-outbox/internal/sqldialect"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// A windowed claim from the head on PostgreSQL while 2,500 rows there are
// in flight (locked by another claim), on statistics taken while the table
// was empty (a quiet table before an outage's backlog): beyond its window
// it locks each candidate it chose (456 here) by a lookup of its own. The
// lookup was by id, and the planner took the pending index for it, whose
// id is its second column: each walked the whole index. A drain going
// back to the head behind 2,256 rows in flight read 385,165 blocks in
// 586 ms (the relay's bench, -scenario relay). The lookup is now by the
// row's ctid, read with the candidate (a TID scan).
func TestClaim_Postgres_FromTheHeadBehindRowsInFlight_LocksEachCandidateByItsPlace(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, testdb.Postgres)
	ctx := context.Background()
	if err := Migrate(ctx, db.DB, Postgres); err != nil {
		t.Fatal(err)
	}
	db.MustExec("ANALYZE acemq_outbox")
	at := time.Now().Add(-time.Minute).UTC()
	insertRows(t, db, 5000, func(i int) (string, time.Time, any, any, any) {
		return fmt.Sprintf("r%04d", i), at.Add(time.Duration(i) * time.Microsecond), nil, nil, nil
	})
	inFlight, err := db.DB.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = inFlight.Rollback() }()
	if _, err := inFlight.Exec("SELECT id FROM acemq_outbox WHERE id < 'r2500' FOR UPDATE"); err != nil {
		t.Fatal(err)
	}
	s, err := NewStore(db.DB, StoreConfig{Dialect: Postgres})
	if err != nil {
		t.Fatal(err)
	}
	blocks, ms, plan := explainClaim(t, db, s, sqldialect.ClaimParams{Limit: 100, Window: 64, MaxAttempts: s.cfg.MaxAttempts, Now: time.Now()})
	t.Logf("the claim read %d blocks in %.1f ms", blocks, ms)
	if blocks > 5000 {
		t.Errorf("a claim from the head behind 2,500 rows in flight read %d blocks (%.1f ms), want 5,000 at most; plan:\n%s", blocks, ms, plan)
	}
	if !strings.Contains(plan, `"Tid Scan"`) {
		t.Errorf("no TID scan in the plan:\n%s", plan)
	}
}
