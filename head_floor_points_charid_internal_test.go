package outbox

import (
	"context"
	"testing"
	"time"

	"github.com/acemq/watermill-outbox/internal/testdb"
)

// PostgreSQL, an id column of type char(n) (another library's table): the
// claim reads ids as id::text, without the padding, and PendingBelow reads
// them so too. Read as the column holds them, padded, a point a mark
// published was never dropped (settled compares the two texts; a review's
// catch): every claim sent its points statement, and every probe of an
// idle relay two statements, until the next measure.
func TestClaim_PostgresCharID_PublishedPointDropped(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, testdb.Postgres)
	if err := Migrate(context.Background(), db.DB, Postgres); err != nil {
		t.Fatal(err)
	}
	db.MustExec("ALTER TABLE acemq_outbox ALTER id TYPE char(40)")
	holdSnapshot(t, db)
	publishOld(t, db, 5000)
	s := pointsStore(t, db, Postgres)
	writeAt(t, db, "old", time.Now().Add(-2*time.Hour))
	writeAt(t, db, "new", time.Now())
	ids, _ := claimAll(t, s) // measures, takes old as a point, publishes both
	on, _, points := floorState(s)
	t.Logf("claimed %q; floor on %v, points %q", ids, on, points)
	if len(points) != 0 {
		t.Errorf("points after the mark that published them: %q, want none", points)
	}
	ctx := context.Background()
	conn, err := db.DB.Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	before := s.sent.Load()
	for range 10 {
		if found, err := s.probe(ctx, conn); err != nil || found {
			t.Fatalf("probe: %v %v", found, err)
		}
	}
	if n := s.sent.Load() - before; n != 10 {
		t.Errorf("10 probes of an idle relay sent %d statements, want 10", n)
	}
}
