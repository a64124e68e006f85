package outbox

import (
	"context"
	"database/sql"
	"fmt"
	"testing"
	"time"

	"github.com/acemq/watermill-outbox/internal/sqldialect"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// handlerReads is the sum of the Handler_read_% counters of conn's session.
func handlerReads(t testing.TB, q interface {
	QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error)
}) int64 {
	t.Helper()
	rows, err := q.QueryContext(context.Background(), "SHOW SESSION STATUS LIKE 'Handler_read%'")
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var sum int64
	for rows.Next() {
		var name string
		var v int64
		if err := rows.Scan(&name, &v); err != nil {
			t.Fatal(err)
		}
		if name != "Handler_read_key" { // lookups, not steps
			sum += v
		}
	}
	return sum
}

// On MySQL a claim's points are exact keys of the pending index
// (atPoints). The id is bound as a utf8mb4 string literal: for an id
// column of another character set (utf8mb3, latin1: another library's
// table) or a number (BIGINT), it is still part of the key: the points
// statement and the probe's step over no other entry (handler steps,
// beside 5,000 dead entries after the point). Those steps do not count
// the dead entries InnoDB passes itself: sqldialect's
// TestClaimOfPoints_MySQLExactKeys_PostgresIDs keeps the key exact.
func TestClaim_MySQLPointsStatement_ExactKeyWhateverTheIDColumn(t *testing.T) {
	t.Parallel()
	for _, v := range []struct {
		name  string
		alter string
		id    func(int) string
		old   string
	}{
		{"utf8mb4_bin id (this library's)", "", func(i int) string { return fmt.Sprintf("d%06d", i) }, "old"},
		{"utf8mb3 id", "ALTER TABLE acemq_outbox MODIFY id VARCHAR(64) CHARACTER SET utf8mb3 COLLATE utf8mb3_general_ci NOT NULL", func(i int) string { return fmt.Sprintf("d%06d", i) }, "old"},
		{"latin1 id", "ALTER TABLE acemq_outbox MODIFY id VARCHAR(64) CHARACTER SET latin1 NOT NULL", func(i int) string { return fmt.Sprintf("d%06d", i) }, "old"},
		{"bigint id", "ALTER TABLE acemq_outbox MODIFY id BIGINT NOT NULL", func(i int) string { return fmt.Sprint(100 + i) }, "7"},
	} {
		t.Run(v.name, func(t *testing.T) {
			t.Parallel()
			db := testdb.New(t, testdb.MySQL)
			if err := Migrate(context.Background(), db.DB, MySQL); err != nil {
				t.Fatal(err)
			}
			if v.alter != "" {
				db.MustExec(v.alter)
			}
			holdSnapshot(t, db)
			// The point, then 5,000 rows published after it, one
			// created_at later each (handler steps count entries, not
			// time: 5,000 show a walk as 20,000 do, for a quarter of the
			// suite's time).
			oldAt := time.Now().Add(-2 * time.Hour).UTC().Truncate(time.Second)
			writeAt(t, db, v.old, oldAt)
			insertRows(t, db, 5000, func(i int) (string, time.Time, any, any, any) {
				return v.id(i), oldAt.Add(time.Duration(i+1) * time.Millisecond), nil, nil, nil
			})
			db.MustExec(db.Rebind("UPDATE acemq_outbox SET published_at = ? WHERE published_at IS NULL AND id <> ?"), time.Now().UTC(), v.old)
			s := pointsStore(t, db, MySQL)
			s.index, s.keyIndex = indexesOf(t, s)
			writeAt(t, db, "9999999", time.Now())
			ctx := context.Background()
			conn, err := db.DB.Conn(ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close()
			if found, err := s.probe(ctx, conn); err != nil || !found {
				t.Fatalf("probe: %v %v", found, err)
			}
			s.floor.mu.Lock()
			pts := s.floor.pointsBelow()
			s.floor.mu.Unlock()
			if len(pts) != 1 {
				t.Fatalf("points %v, want the old row", pts)
			}
			// The probe's statement of the points.
			before := handlerReads(t, conn)
			started := time.Now()
			if found, err := s.probe(ctx, conn); err != nil || !found {
				t.Fatalf("probe: %v %v", found, err)
			}
			probeSteps, probeTook := handlerReads(t, conn)-before, time.Since(started)
			// The claim's statement of the points, in a claim's transaction.
			tx, err := conn.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelReadCommitted})
			if err != nil {
				t.Fatal(err)
			}
			defer tx.Rollback()
			q := s.inline(s.q.Claim(sqldialect.ClaimParams{Limit: 100, MaxAttempts: s.cfg.MaxAttempts, Now: time.Now(), Index: s.index, KeyIndex: s.keyIndex, Points: pts}))
			before = handlerReads(t, tx)
			started = time.Now()
			rows, err := tx.QueryContext(ctx, q.SQL, q.Args...)
			if err != nil {
				t.Fatal(err)
			}
			got, err := s.q.ScanClaimed(rows)
			if err != nil {
				t.Fatal(err)
			}
			claimSteps, claimTook := handlerReads(t, tx)-before, time.Since(started)
			t.Logf("points statement: %d rows, %d handler steps, %v; probe (at the floor, its points first): %d steps, %v", len(got), claimSteps, claimTook, probeSteps, probeTook)
			if len(got) != 1 {
				t.Errorf("the points statement took %d rows, want the old row", len(got))
			}
			if claimSteps > 1000 {
				t.Errorf("the points statement of one point stepped over %d index entries (%v): the id is not part of the key; every claim from the floor walks the dead entries after the point", claimSteps, claimTook)
			}
			if probeSteps > 1000 {
				t.Errorf("the probe at the floor stepped over %d entries (%v)", probeSteps, probeTook)
			}
		})
	}
}
