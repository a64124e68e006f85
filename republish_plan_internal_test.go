package outbox

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/acemq/watermill-outbox/internal/sqldialect"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// A Republish walks the published rows in batches, each from the cursor
// the last one ended at; the index bounds each batch's walk at the cursor.
// With the cursor's OR alone, PostgreSQL used it as a filter and walked
// every published row before the cursor at each batch (569 ms a batch at
// row 900,000 of 950,000, measured; a Republish of 190,000 records overran
// the Republisher plugin's 30 s), and SQLite read every row after it and
// sorted them. The plans say which; the figures come from tables too large
// for a test.
func TestRepublishPick_AfterACursor_TheIndexStartsAtTheCursor(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		kind    string
		d       Dialect
		explain string
		prepare string
		want    func(plan string) bool
	}{
		{testdb.Postgres, Postgres, "EXPLAIN ", "SET LOCAL enable_seqscan = off",
			func(plan string) bool {
				return strings.Contains(plan, "Index Cond") && strings.Contains(plan, "(published_at >= ")
			}},
		{testdb.SQLite, SQLite, "EXPLAIN QUERY PLAN ", "",
			func(plan string) bool {
				return strings.Contains(plan, "published_at>?") && !strings.Contains(plan, "MULTI-INDEX OR")
			}},
	} {
		t.Run(c.kind, func(t *testing.T) {
			t.Parallel()
			db := testdb.New(t, c.kind)
			ctx := context.Background()
			if err := Migrate(ctx, db.DB, c.d); err != nil {
				t.Fatal(err)
			}
			s, err := NewStore(db.DB, StoreConfig{Dialect: c.d})
			if err != nil {
				t.Fatal(err)
			}
			q := s.q.RepublishPick(time.Now(), time.Time{}, []string{"order.placed"}, nil,
				&sqldialect.RepublishCursor{PublishedAt: s.dialect.sql().TimeArg(time.Now().Add(-time.Hour)), ID: "m-1"}, 1000, true)
			tx, err := db.DB.BeginTx(ctx, nil)
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = tx.Rollback() }()
			if c.prepare != "" {
				if _, err := tx.ExecContext(ctx, c.prepare); err != nil {
					t.Fatal(err)
				}
			}
			if plan := queryLines(t, tx, c.explain+q.SQL, q.Args...); !c.want(plan) {
				t.Errorf("the walk after a cursor is not bounded by it in the index:\n%s", plan)
			}
		})
	}
}
