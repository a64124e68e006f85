package outbox

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/acemq/watermill-outbox/internal/testdb"
)

// The keys' cursor under claims, abandons and finishes from
// four goroutines, as Run's overlapping claims and a Sweep make them; run
// under -race. Every record must be published in the end.
func TestClaim_KeysCursor_ConcurrentClaimsAndAbandons(t *testing.T) {
	eachWindowing(t, func(t *testing.T, db *testdb.DB, c windowing) {
		kind, d := c.kind, c.d
		ctx := context.Background()
		base := time.Now().Add(-time.Hour).UTC().Truncate(time.Second)
		tx := db.MustBegin()
		n := 0
		for k := 0; k < 60; k++ {
			for seq := 1; seq <= 5; seq++ {
				n++
				tx.MustExec(tx.Rebind(keyedRowInsert), fmt.Sprintf("k%02d#%d", k, seq), keyedAt(kind, base, k*10+seq), fmt.Sprintf("k%02d", k), seq, 0)
			}
		}
		if err := tx.Commit(); err != nil {
			t.Fatal(err)
		}
		s, err := NewStore(db.DB, StoreConfig{Dialect: d})
		if err != nil {
			t.Fatal(err)
		}
		s.window = func(int) int { return 4 }
		s.slice = func(int) int { return 7 }
		var wg sync.WaitGroup
		deadline := time.Now().Add(20 * time.Second)
		for g := 0; g < 4; g++ {
			wg.Add(1)
			go func(g int) {
				defer wg.Done()
				for time.Now().Before(deadline) {
					cl, err := s.claimBatch(ctx, 5, fmt.Sprintf("r%d", g), time.Minute, nil, nil)
					if err != nil {
						continue // busy, serialization: try again
					}
					switch r := rand.IntN(4); {
					case len(cl.rows) == 0:
						_ = s.abandon(ctx, cl)
						var left int
						if err := db.Get(&left, "SELECT COUNT(*) FROM acemq_outbox WHERE published_at IS NULL"); err == nil && left == 0 {
							return
						}
					case r == 0:
						_ = s.abandon(ctx, cl)
						_ = s.abandon(ctx, cl) // twice
					default:
						ids := make([]string, len(cl.rows))
						for i, row := range cl.rows {
							ids[i] = row.ID
						}
						_ = s.finish(ctx, cl, ids, nil)
					}
				}
			}(g)
		}
		wg.Wait()
		var left int
		if err := db.Get(&left, "SELECT COUNT(*) FROM acemq_outbox WHERE published_at IS NULL"); err != nil {
			t.Fatal(err)
		}
		if left != 0 {
			t.Errorf("%d of %d records unpublished after 20 s of claims", left, n)
		}
	})
}
