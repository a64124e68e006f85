package outbox

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/acemq/watermill-outbox/internal/testdb"
)

// A claim abandoned (by a relay closed or a panic mid-sweep) puts the keys'
// cursor back where it found it: the heads it took are taken by the next
// claim, not left for the cursor to come round to (keys ÷ KeysRead claims),
// as a review found them when the cursor moved in the claim itself.
func TestClaim_Abandoned_NextClaimTakesTheSameHeads(t *testing.T) {
	db := testdb.New(t, testdb.Postgres)
	ctx := context.Background()
	if err := Migrate(ctx, db.DB, Postgres); err != nil {
		t.Fatal(err)
	}
	base := time.Now().Add(-time.Hour).UTC()
	writeStuckBacklog(t, db, testdb.Postgres, base, 30)
	q := db.Rebind(keyedRowInsert)
	for k := 1; k <= 40; k++ {
		db.MustExec(q, fmt.Sprintf("k%02d#1", k), base.Add(time.Second+time.Duration(k)*time.Millisecond), fmt.Sprintf("k%02d", k), 1, 0)
	}
	s, err := NewStore(db.DB, StoreConfig{Dialect: Postgres})
	if err != nil {
		t.Fatal(err)
	}
	s.window = func(int) int { return 4 }
	s.slice = func(int) int { return 7 }
	ids := func() []string {
		cl, err := s.claimBatch(ctx, 5, "r", time.Minute, nil, nil)
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = s.abandon(ctx, cl) }()
		var out []string
		for _, r := range cl.rows {
			out = append(out, r.ID)
		}
		return out
	}
	first := ids() // abandoned: nothing claimed
	second := ids()
	if !slices.Equal(first, second) {
		t.Errorf("after an abandoned claim of %v the next claim took %v: the oldest claimable heads wait for the keys' cursor to come round", first, second)
	}
}
