package outbox

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/acemq/watermill-outbox/internal/sqldialect"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// BenchmarkClaim_BehindOneKeysBacklog times a claim of 100 rows with one
// key's backlog in front of the pending index (see
// TestClaim_BehindOneKeysBacklog_ReadsAWindowNotTheBacklog), windowed and
// as claims were before windows (a window the pending index never fills),
// at two backlogs: a windowed claim's time should not grow with the
// backlog. Each reports ms/claim; compare the rows of one run.
//
//	go test -run '^$' -bench BenchmarkClaim_BehindOneKeysBacklog -benchtime 20x .
func BenchmarkClaim_BehindOneKeysBacklog(b *testing.B) {
	for _, c := range []struct {
		kind string
		d    Dialect
	}{{testdb.Postgres, Postgres}, {testdb.SQLite, SQLite}} {
		for _, backlog := range []int{2000, 20000} {
			b.Run(fmt.Sprintf("%s/backlog=%d", c.kind, backlog), func(b *testing.B) {
				db := testdb.New(b, c.kind)
				ctx := context.Background()
				if err := Migrate(ctx, db.DB, c.d); err != nil {
					b.Fatal(err)
				}
				writeBacklog(b, db, backlog)
				if c.kind == testdb.Postgres {
					db.MustExec("ANALYZE acemq_outbox")
				}
				for _, mode := range []struct {
					name   string
					window func(int) int
				}{{"windowed", nil}, {"unwindowed", func(int) int { return 1 << 30 }}} {
					b.Run(mode.name, func(b *testing.B) {
						s, err := NewStore(db.DB, StoreConfig{Dialect: c.d})
						if err != nil {
							b.Fatal(err)
						}
						s.window = mode.window
						start := time.Now()
						for b.Loop() {
							cl, err := s.claimBatch(ctx, 100, "r", time.Minute, nil, nil)
							if err != nil {
								b.Fatal(err)
							}
							if len(cl.rows) != 71 {
								b.Fatalf("claimed %d rows, want 71", len(cl.rows))
							}
							if err := s.abandon(ctx, cl); err != nil {
								b.Fatal(err)
							}
						}
						b.ReportMetric(float64(time.Since(start).Microseconds())/1000/float64(b.N), "ms/claim")
					})
				}
			})
		}
	}
}

// BenchmarkProbe_BehindAStuckKey times an idle relay's probe behind a stuck
// key's backlog and nothing else (see
// TestProbe_BehindAStuckKeysBacklog_ReadsAWindowNotTheBacklog), windowed
// and as before. Each reports ms/probe.
//
//	go test -run '^$' -bench BenchmarkProbe_BehindAStuckKey -benchtime 20x .
func BenchmarkProbe_BehindAStuckKey(b *testing.B) {
	for _, c := range []struct {
		kind string
		d    Dialect
	}{{testdb.Postgres, Postgres}, {testdb.SQLite, SQLite}} {
		b.Run(fmt.Sprintf("%s/backlog=20000", c.kind), func(b *testing.B) {
			db := testdb.New(b, c.kind)
			ctx := context.Background()
			if err := Migrate(ctx, db.DB, c.d); err != nil {
				b.Fatal(err)
			}
			writeBacklog(b, db, 20000)
			db.MustExec("DELETE FROM acemq_outbox WHERE aggregate_id IS NULL OR aggregate_id <> 'hot'")
			db.MustExec("UPDATE acemq_outbox SET attempts = 10 WHERE id = 'hot#00001'")
			if c.kind == testdb.Postgres {
				db.MustExec("ANALYZE acemq_outbox")
			}
			for _, window := range []int{probeWindow, 0} {
				name := "windowed"
				if window == 0 {
					name = "unwindowed"
				}
				b.Run(name, func(b *testing.B) {
					s, err := NewStore(db.DB, StoreConfig{Dialect: c.d})
					if err != nil {
						b.Fatal(err)
					}
					q := s.q.Claimable(sqldialect.ClaimParams{MaxAttempts: 10, Now: time.Now(), Window: window})
					start := time.Now()
					for b.Loop() {
						var one int
						if err := db.QueryRowContext(ctx, q.SQL, q.Args...).Scan(&one); !errors.Is(err, sql.ErrNoRows) {
							b.Fatalf("the probe found a row (%v)", err)
						}
					}
					b.ReportMetric(float64(time.Since(start).Microseconds())/1000/float64(b.N), "ms/probe")
				})
			}
		})
	}
}
