package outbox

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/acemq/watermill-outbox/internal/testdb"
)

// BenchmarkClaim_BesideAHeldSnapshot times a claim of 100 rows from the
// head of the pending index, and an idle relay's probe, on PostgreSQL after
// N rows were published while another session held a snapshot (a
// pg_dump's, a report's REPEATABLE READ): their entries stay in the
// pending index, which every claim from the head walks, until the snapshot
// ends and a scan or a vacuum clears them. Side by side with the same
// claim once the snapshot ended. Each reports ms/claim or ms/probe.
//
//	go test -run '^$' -bench BenchmarkClaim_BesideAHeldSnapshot -benchtime 10x .
func BenchmarkClaim_BesideAHeldSnapshot(b *testing.B) {
	for _, published := range []int{20000, 100000} {
		b.Run(fmt.Sprintf("published=%d", published), func(b *testing.B) {
			db := testdb.New(b, testdb.Postgres)
			ctx := context.Background()
			if err := Migrate(ctx, db.DB, Postgres); err != nil {
				b.Fatal(err)
			}
			held, err := db.DB.BeginTx(ctx, nil)
			if err != nil {
				b.Fatal(err)
			}
			defer func() { _ = held.Rollback() }()
			if _, err := held.ExecContext(ctx, "SET TRANSACTION ISOLATION LEVEL REPEATABLE READ"); err != nil {
				b.Fatal(err)
			}
			var n int
			if err := held.QueryRowContext(ctx, "SELECT count(*) FROM acemq_outbox").Scan(&n); err != nil {
				b.Fatal(err) // the snapshot is taken
			}
			db.MustExec(fmt.Sprintf("INSERT INTO acemq_outbox (id, exchange_name, routing_key, body, created_at)"+
				" SELECT 'p' || g, 'x', 'k', 'b', now() - interval '1 hour' + g * interval '1 millisecond' FROM generate_series(1, %d) g", published))
			db.MustExec("UPDATE acemq_outbox SET published_at = now() WHERE published_at IS NULL")
			db.MustExec("INSERT INTO acemq_outbox (id, exchange_name, routing_key, body) SELECT 'n' || g, 'x', 'k', 'b' FROM generate_series(1, 100) g")
			db.MustExec("ANALYZE acemq_outbox")
			s, err := NewStore(db.DB, StoreConfig{Dialect: Postgres})
			if err != nil {
				b.Fatal(err)
			}
			run := func(b *testing.B) {
				b.Run("claim", func(b *testing.B) {
					timeClaims(b, s, 100, nil)
				})
				b.Run("probe", func(b *testing.B) {
					start := time.Now()
					for b.Loop() {
						if found, err := s.hasClaimable(ctx); err != nil || !found {
							b.Fatalf("the probe found nothing (%v)", err)
						}
					}
					b.ReportMetric(float64(time.Since(start).Microseconds())/1000/float64(b.N), "ms/probe")
				})
			}
			b.Run("held", run)
			if err := held.Rollback(); err != nil {
				b.Fatal(err)
			}
			// A first claim's walk marks the dead entries, as a relay's would.
			if cl, err := s.claimBatch(ctx, 100, "r", time.Minute, nil, nil); err != nil || s.abandon(ctx, cl) != nil {
				b.Fatal(err)
			}
			b.Run("ended", run)
		})
	}
}
