package outbox

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/acemq/watermill-outbox/internal/testdb"
)

// Tables made by other libraries: id and created_at of other types. The
// old row, below the dead entries, is taken as a point and found by the
// points statement: one that never matched would stay pending below the
// floor, found again by every measure, never claimed.
func TestClaim_PointsOfForeignColumnTypes_FindTheirRows(t *testing.T) {
	t.Parallel()
	type variant struct {
		name  string
		kind  string
		d     Dialect
		alter []string
		id    func(i int) string
		oldID string
		newID string
	}
	num := func(base int64) func(int) string {
		return func(i int) string { return fmt.Sprint(base + int64(i)) }
	}
	uuidOf := func(i int) string { return fmt.Sprintf("00000000-0000-4000-8000-%012d", i) }
	big := int64(1700000000000000000)
	variants := []variant{
		{"mysql bigint", testdb.MySQL, MySQL, []string{"ALTER TABLE acemq_outbox MODIFY id BIGINT NOT NULL"}, num(1), "900000", "900001"},
		{"mysql bigint unsigned big", testdb.MySQL, MySQL, []string{"ALTER TABLE acemq_outbox MODIFY id BIGINT UNSIGNED NOT NULL"}, num(big), fmt.Sprint(uint64(18000000000000000001)), fmt.Sprint(uint64(18000000000000000003))},
		{"mysql bigint snowflake neighbours", testdb.MySQL, MySQL, []string{"ALTER TABLE acemq_outbox MODIFY id BIGINT NOT NULL"}, num(1), fmt.Sprint(big + 123), fmt.Sprint(big + 124)},
		{"mysql datetime(0)", testdb.MySQL, MySQL, []string{"ALTER TABLE acemq_outbox MODIFY created_at DATETIME NOT NULL"}, func(i int) string { return fmt.Sprintf("old%06d", i) }, "old", "new"},
		{"mysql datetime(3)", testdb.MySQL, MySQL, []string{"ALTER TABLE acemq_outbox MODIFY created_at DATETIME(3) NOT NULL"}, func(i int) string { return fmt.Sprintf("old%06d", i) }, "old", "new"},
		{"mysql timestamp(6)", testdb.MySQL, MySQL, []string{"ALTER TABLE acemq_outbox MODIFY created_at TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6)"}, func(i int) string { return fmt.Sprintf("old%06d", i) }, "old", "new"},
		{"mysql timestamp(0)", testdb.MySQL, MySQL, []string{"ALTER TABLE acemq_outbox MODIFY created_at TIMESTAMP NOT NULL DEFAULT CURRENT_TIMESTAMP"}, func(i int) string { return fmt.Sprintf("old%06d", i) }, "old", "new"},
		{"mysql ci id", testdb.MySQL, MySQL, []string{"ALTER TABLE acemq_outbox MODIFY id VARCHAR(64) CHARACTER SET utf8mb4 COLLATE utf8mb4_general_ci NOT NULL"}, func(i int) string { return fmt.Sprintf("old%06d", i) }, "Old-X", "new"},
		{"mysql utf8mb3 id", testdb.MySQL, MySQL, []string{"ALTER TABLE acemq_outbox MODIFY id VARCHAR(64) CHARACTER SET utf8mb3 COLLATE utf8mb3_general_ci NOT NULL"}, func(i int) string { return fmt.Sprintf("old%06d", i) }, "Old-X", "new"},
		{"mysql char(36) id", testdb.MySQL, MySQL, []string{"ALTER TABLE acemq_outbox MODIFY id CHAR(36) NOT NULL"}, func(i int) string { return fmt.Sprintf("old%06d", i) }, "old", "new"},
		{"postgres uuid", testdb.Postgres, Postgres, []string{"ALTER TABLE acemq_outbox ALTER id TYPE uuid USING id::uuid"}, uuidOf, uuidOf(999999), uuidOf(999998)},
		{"postgres bigint", testdb.Postgres, Postgres, []string{"ALTER TABLE acemq_outbox ALTER id TYPE bigint USING 0"}, num(1), "900000", "900001"},
		{"postgres timestamp", testdb.Postgres, Postgres, []string{"ALTER TABLE acemq_outbox ALTER created_at TYPE timestamp USING created_at AT TIME ZONE 'UTC'"}, func(i int) string { return fmt.Sprintf("old%06d", i) }, "old", "new"},
		{"postgres char id", testdb.Postgres, Postgres, []string{"ALTER TABLE acemq_outbox ALTER id TYPE char(40)"}, func(i int) string { return fmt.Sprintf("old%06d", i) }, "old", "new"},
	}
	for _, v := range variants {
		t.Run(v.name, func(t *testing.T) {
			t.Parallel()
			db := testdb.New(t, v.kind)
			if err := Migrate(context.Background(), db.DB, v.d); err != nil {
				t.Fatal(err)
			}
			for _, a := range v.alter {
				db.MustExec(a)
			}
			holdSnapshot(t, db)
			const dead = 5000
			base := time.Now().Add(-time.Hour).UTC().Truncate(time.Second)
			insertRows(t, db, dead, func(i int) (string, time.Time, any, any, any) {
				return v.id(i), base.Add(time.Duration(i) * time.Millisecond), nil, nil, nil
			})
			db.MustExec(db.Rebind("UPDATE acemq_outbox SET published_at = ? WHERE published_at IS NULL"), time.Now().UTC())
			s := pointsStore(t, db, v.d)
			if v.kind == testdb.MySQL {
				s.index, s.keyIndex = indexesOf(t, s)
			}
			writeAt(t, db, v.oldID, time.Now().Add(-2*time.Hour).Add(123456*time.Microsecond))
			writeAt(t, db, v.newID, time.Now())
			ctx := context.Background()
			cl, err := s.claimBatch(ctx, 100, "r", time.Minute, nil, nil)
			if err != nil {
				t.Fatal(err)
			}
			ids := rowIDs(cl.rows)
			on, at, points := floorState(s)
			t.Logf("claimed %v (%d points), floor on %v at %v, points %v", ids, cl.points, on, at, points)
			if err := s.finish(ctx, cl, ids, nil); err != nil {
				t.Fatal(err)
			}
			if len(points) != 0 && cl.points == 0 {
				t.Errorf("the floor's points %v matched no row: claimed %v", points, ids)
			}
			// Again, a measure: the old row, if left, is found again.
			s.floor.mu.Lock()
			s.floor.next = time.Time{}
			s.floor.mu.Unlock()
			ids2, _ := claimAll(t, s)
			all := append(ids, ids2...)
			if !slices.Contains(all, v.oldID) {
				var left int
				_ = db.QueryRow("SELECT COUNT(*) FROM acemq_outbox WHERE published_at IS NULL").Scan(&left)
				t.Errorf("the old row %s was never claimed (claims %v then %v; %d pending): a point that never matches its row", v.oldID, ids, ids2, left)
			}
		})
	}
}
