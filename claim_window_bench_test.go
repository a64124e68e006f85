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
						timeClaims(b, s, 71, nil)
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

// BenchmarkClaim_BehindAStuckKey_ManyKeys times the first claim of 100 rows
// from the head of the pending index when a stuck key's 2,000 records fill
// the window and one pending record of each of many other keys comes after
// them: the claim's far part finds those keys' heads. Windowed as a relay's
// first claim is (not narrowed), reading a slice of the keys, and every
// key as before (windowed_every_key); and as claims were before windows. Each reports ms/claim; compare the rows of one run.
//
//	go test -run '^$' -bench BenchmarkClaim_BehindAStuckKey_ManyKeys -benchtime 10x .
func BenchmarkClaim_BehindAStuckKey_ManyKeys(b *testing.B) {
	for _, c := range []struct {
		kind string
		d    Dialect
	}{{testdb.Postgres, Postgres}, {testdb.SQLite, SQLite}} {
		for _, keys := range []int{10000, 50000} {
			b.Run(fmt.Sprintf("%s/keys=%d", c.kind, keys), func(b *testing.B) {
				db := testdb.New(b, c.kind)
				ctx := context.Background()
				if err := Migrate(ctx, db.DB, c.d); err != nil {
					b.Fatal(err)
				}
				writeManyKeysBehindStuck(b, db, 2000, keys)
				for _, mode := range []struct {
					name   string
					window func(int) int
					slice  func(int) int
				}{
					{"windowed", nil, nil},
					{"windowed_every_key", nil, func(int) int { return 0 }},
					{"unwindowed", func(int) int { return 1 << 30 }, nil},
				} {
					b.Run(mode.name, func(b *testing.B) {
						s, err := NewStore(db.DB, StoreConfig{Dialect: c.d})
						if err != nil {
							b.Fatal(err)
						}
						s.window, s.slice = mode.window, mode.slice
						// Each claim the relay's first from the head.
						timeClaims(b, s, 100, func() { s.narrowed.Store(0) })
					})
				}
			})
		}
	}
}

// writeManyKeysBehindStuck writes a stuck key's backlog records (its head
// at MaxAttempts) and, after them, one pending record for each of keys
// other keys.
func writeManyKeysBehindStuck(t testing.TB, db *testdb.DB, backlog, keys int) {
	t.Helper()
	// at is the created_at of the gth row written, a millisecond apart.
	at := func(g string) string {
		if db.Kind == testdb.SQLite {
			return "strftime('%Y-%m-%d %H:%M:%f000', 'now', '-1 hour', '+' || ((" + g + ") / 1000.0) || ' seconds')"
		}
		return "now() - interval '1 hour' + (" + g + ") * interval '1 millisecond'"
	}
	series := func(n int) string {
		if db.Kind == testdb.SQLite {
			return fmt.Sprintf("(WITH RECURSIVE s(g) AS (SELECT 1 UNION ALL SELECT g + 1 FROM s WHERE g < %d) SELECT g FROM s)", n)
		}
		return fmt.Sprintf("generate_series(1, %d) g", n)
	}
	db.MustExec("INSERT INTO acemq_outbox (id, exchange_name, routing_key, body, created_at, aggregate_id, seq, attempts)" +
		" SELECT 'hot#' || g, 'x', 'k', 'b', " + at("g") + ", 'hot', g, CASE WHEN g = 1 THEN 10 ELSE 0 END FROM " + series(backlog))
	db.MustExec("INSERT INTO acemq_outbox (id, exchange_name, routing_key, body, created_at, aggregate_id, seq)" +
		" SELECT 'k' || g || '#1', 'x', 'k', 'b', " + at(fmt.Sprintf("g + %d", backlog)) + ", 'k' || g, 1 FROM " + series(keys))
	if db.Kind == testdb.Postgres {
		db.MustExec("ANALYZE acemq_outbox")
	}
}

// timeClaims claims 100 rows of s and abandons them, b.N times, failing b
// unless each claim takes want rows, and reports ms/claim. before, if set,
// runs before each claim.
func timeClaims(b *testing.B, s *Store, want int, before func()) {
	b.Helper()
	ctx := context.Background()
	start := time.Now()
	for b.Loop() {
		if before != nil {
			before()
		}
		cl, err := s.claimBatch(ctx, 100, "r", time.Minute, nil, nil)
		if err != nil {
			b.Fatal(err)
		}
		if len(cl.rows) != want {
			b.Fatalf("claimed %d rows, want %d", len(cl.rows), want)
		}
		if err := s.abandon(ctx, cl); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(time.Since(start).Microseconds())/1000/float64(b.N), "ms/claim")
}
