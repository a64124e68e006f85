package outbox

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/acemq/watermill-outbox/internal/testdb"
)

// BenchmarkClaim_BesideAHeldSnapshot times a claim of 100 rows and an idle
// relay's probe on PostgreSQL and MariaDB after N rows were published while
// another session held a snapshot (a pg_dump's, a mysqldump
// --single-transaction's, a report's): their entries stay in the pending
// index until the snapshot ends. Side by side: from the head, as before the
// floor (head); with the floor as a relay keeps it, found by its own
// timing (floor); the claim at the end of each of the floor's periods,
// which measures again (period); with the floor beside a keyed record
// stuck at MaxAttempts an hour before the dead entries, which holds ten
// records of its key (stuck-key); beside a keyed record waiting out its
// retry backoff as long before (backoff); beside an unkeyed pending row as
// long before (old-row); and from the head once the snapshot ended
// (ended). Each reports ms/claim or ms/probe.
//
//	go test -run '^$' -bench BenchmarkClaim_BesideAHeldSnapshot -benchtime 20x .
func BenchmarkClaim_BesideAHeldSnapshot(b *testing.B) {
	for _, c := range floorKinds {
		for _, published := range []int{20000, 100000} {
			b.Run(fmt.Sprintf("%s/published=%d", c.kind, published), func(b *testing.B) {
				db := testdb.New(b, c.kind)
				ctx := context.Background()
				if err := Migrate(ctx, db.DB, c.d); err != nil {
					b.Fatal(err)
				}
				ended := holdSnapshotUntil(b, db)
				publishOld(b, db, published)
				for i := range 100 {
					writeAt(b, db, fmt.Sprintf("new%03d", i), time.Now())
				}
				analyze := "ANALYZE acemq_outbox"
				if c.kind == testdb.MySQL {
					analyze = "ANALYZE TABLE acemq_outbox"
				}
				db.MustExec(analyze)
				store := func(floor bool) *Store {
					s, err := NewStore(db.DB, StoreConfig{Dialect: c.d})
					if err != nil {
						b.Fatal(err)
					}
					if !floor {
						s.floor.checkAbove = 1 << 62 // never
						return s
					}
					// As a relay finds it: claims, the first slow, the
					// second measuring from the head, on MySQL a third
					// where the second's plain reads show no gain (its
					// locking measure), until the floor is on.
					for i := 0; i < 5 && (i < 2 || !s.floor.on); i++ {
						cl, err := s.claimBatch(ctx, 100, "r", time.Minute, nil, nil)
						if err != nil || s.abandon(ctx, cl) != nil {
							b.Fatal(err)
						}
					}
					return s
				}
				run := func(b *testing.B, s *Store) {
					b.Run("claim", func(b *testing.B) {
						timeClaims(b, s, 100, nil)
						on := 0.0 // a walk from the head quicker than floorCheckAbove keeps none
						if s.floor.on {
							on = 1
						}
						b.ReportMetric(on, "floor_on")
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
				b.Run("head", func(b *testing.B) { run(b, store(false)) })
				b.Run("floor", func(b *testing.B) { run(b, store(true)) })
				// The claim that measures again, once each floor's period:
				// from the head until 2026-12-04's twenty-eighth session.
				b.Run("period/claim", func(b *testing.B) {
					s := store(true)
					var took time.Duration
					for b.Loop() {
						s.floor.mu.Lock()
						s.floor.next = time.Time{}
						s.floor.mu.Unlock()
						start := time.Now()
						cl, err := s.claimBatch(ctx, 100, "r", time.Minute, nil, nil)
						took += time.Since(start)
						if err != nil || len(cl.rows) != 100 || s.abandon(ctx, cl) != nil {
							b.Fatalf("the period's claim: %v", err)
						}
					}
					b.ReportMetric(float64(took.Microseconds())/1000/float64(b.N), "ms/claim")
				})
				// A keyed record stuck at MaxAttempts, two hours back, and ten
				// records of its key it holds: until 2026-12-04's
				// twenty-ninth session the floor stayed at the first of
				// them, below every dead entry.
				twoHoursAgo := time.Now().Add(-2 * time.Hour)
				for i := range 11 {
					attempts := 0
					if i == 0 {
						attempts = 1000
					}
					writeKeyed(b, db, fmt.Sprintf("stuck%02d", i), "stuck", int64(i+1), twoHoursAgo.Add(time.Duration(i)*time.Millisecond), attempts)
				}
				b.Run("stuck-key/floor", func(b *testing.B) { run(b, store(true)) })
				// A keyed record waiting out its retry backoff, as long
				// back: until 2026-12-04's thirty-first session the floor
				// stood at it for as long as the backoff lasted.
				writeKeyed(b, db, "backoff01", "backoff", 1, twoHoursAgo.Add(time.Second), 1)
				holdBack(b, db, "backoff01", time.Now().Add(time.Hour))
				b.Run("backoff/floor", func(b *testing.B) { run(b, store(true)) })
				// An unkeyed row as old, pending (a record committed late,
				// a publisher's clock behind, a Retry of an old record):
				// until 2026-12-05's thirty-fifth session the floor stood
				// at it, below every dead entry, until it was published.
				// Each claim takes it, as a point, and is abandoned.
				writeAt(b, db, "old-row", twoHoursAgo.Add(2*time.Second))
				b.Run("old-row/floor", func(b *testing.B) { run(b, store(true)) })
				ended()
				s := store(false)
				// A first claim's walk marks the dead entries, as a relay's would.
				if cl, err := s.claimBatch(ctx, 100, "r", time.Minute, nil, nil); err != nil || s.abandon(ctx, cl) != nil {
					b.Fatal(err)
				}
				b.Run("ended", func(b *testing.B) { run(b, s) })
			})
		}
	}
}
