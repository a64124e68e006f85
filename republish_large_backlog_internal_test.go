package outbox

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/acemq/watermill-outbox/internal/testdb"
)

// The figures of a Republish of a large keyed backlog, whose records the
// walk finds in another order than their keys' (published_at shuffled
// across seq), on each database: the time of the first boot, which makes
// them all pending, and of a second, which finds none. Behind
// OUTBOX_TEST_REPUBLISH_ROWS (200000 for the README's figures): the
// table takes seconds to fill, and the figures are this machine's, not
// asserted.
func TestRepublish_LargeKeyedBacklog_Figures(t *testing.T) {
	rows, _ := strconv.Atoi(os.Getenv("OUTBOX_TEST_REPUBLISH_ROWS"))
	if rows <= 0 {
		t.Skip("OUTBOX_TEST_REPUBLISH_ROWS unset")
	}
	for _, c := range []struct {
		kind, fill string
		d          Dialect
	}{
		{testdb.MySQL, `INSERT INTO acemq_outbox (id, exchange_name, routing_key, body, headers, created_at, published_at, aggregate_id, seq)
WITH RECURSIVE n(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM n WHERE i < {last})
SELECT CONCAT('id-', i), '', 'rk', 'x', '{}', NOW(6) - INTERVAL 3 HOUR, NOW(6) - INTERVAL 2 HOUR - INTERVAL ((i * 7919) % {rows}) SECOND,
CONCAT('key-', i % 1000), FLOOR(i / 1000) + 1 FROM n`, MySQL},
		{testdb.Postgres, `INSERT INTO acemq_outbox (id, exchange_name, routing_key, body, headers, created_at, published_at, aggregate_id, seq)
SELECT 'id-' || i, '', 'rk', 'x', '{}', now() - interval '3 hours', now() - interval '2 hours' - ((i * 7919) % {rows}) * interval '1 second',
'key-' || (i % 1000), i / 1000 + 1 FROM generate_series(0, {last}) i`, Postgres},
		{testdb.SQLite, `INSERT INTO acemq_outbox (id, exchange_name, routing_key, body, headers, created_at, published_at, aggregate_id, seq)
WITH RECURSIVE n(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM n WHERE i < {last})
SELECT 'id-' || i, '', 'rk', 'x', '{}', strftime('%Y-%m-%d %H:%M:%f', 'now', '-3 hours'), strftime('%Y-%m-%d %H:%M:%f', 'now', '-2 hours', '-' || ((i * 7919) % {rows}) || ' seconds'),
'key-' || (i % 1000), i / 1000 + 1 FROM n`, SQLite},
	} {
		t.Run(c.kind, func(t *testing.T) {
			db := testdb.New(t, c.kind)
			ctx := context.Background()
			if err := Migrate(ctx, db.DB.DB, c.d); err != nil {
				t.Fatal(err)
			}
			conn, err := db.DB.DB.Conn(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if c.kind == testdb.MySQL {
				if _, err := conn.ExecContext(ctx, fmt.Sprintf("SET SESSION max_recursive_iterations = %d", rows+1)); err != nil {
					t.Fatal(err)
				}
			}
			start := time.Now()
			fill := strings.NewReplacer("{last}", strconv.Itoa(rows-1), "{rows}", strconv.Itoa(rows)).Replace(c.fill)
			if _, err := conn.ExecContext(ctx, fill); err != nil {
				t.Fatal(err)
			}
			_ = conn.Close()
			t.Logf("filled in %s", time.Since(start).Round(time.Millisecond))
			r, err := NewRepublisher(db.DB, RepublisherConfig{Dialect: c.d, TrackedTopics: NewTrackedTopics("rk"), Grace: time.Minute})
			if err != nil {
				t.Fatal(err)
			}
			start = time.Now()
			n, err := r.Republish(ctx)
			took := time.Since(start)
			if err != nil || n != int64(rows) {
				t.Fatalf("Republish made %d of %d pending: %v", n, rows, err)
			}
			start = time.Now()
			again, err := r.Republish(ctx)
			if err != nil || again != 0 {
				t.Fatalf("a second Republish made %d pending: %v", again, err)
			}
			t.Logf("%s: %d keyed records over 1,000 keys made pending in %s; a second boot %s", c.kind, rows, took.Round(time.Millisecond), time.Since(start).Round(time.Microsecond))
		})
	}
}
