package outbox

import (
	"context"
	"database/sql"
	"fmt"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/acemq/watermill-outbox/internal/sqldialect"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// One key's backlog in front of the pending index (an aggregate that
// published thousands of events while the broker was away) made every
// claim walk it: each of its records but the head failed the key-head
// probe, one probe apiece, 200 ms a claim on PostgreSQL at 20,000 records,
// and the key drained at one record a claim. A claim now walks a window of
// the pending index and finds the rest key by key: what it reads grows
// with the window and the keys, not with the backlog. On PostgreSQL the
// executed plan counts the rows each step read; on SQLite the plan says
// how each part reads (it counts nothing).
func TestClaim_BehindOneKeysBacklog_ReadsAWindowNotTheBacklog(t *testing.T) {
	t.Parallel()
	const backlog = 3000
	eachWindowing(t, func(t *testing.T, db *testdb.DB, c windowing) {
		ctx := context.Background()
		want := writeBacklog(t, db, backlog)
		if c.kind == testdb.Postgres {
			db.MustExec("ANALYZE acemq_outbox")
		}
		s, err := NewStore(db.DB, StoreConfig{Dialect: c.d})
		if err != nil {
			t.Fatal(err)
		}
		tx, err := db.DB.BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = tx.Rollback() }()
		p := sqldialect.ClaimParams{Limit: 100, MaxAttempts: 10, Now: time.Now(), RelayID: "r", LeaseUntil: time.Now().Add(time.Minute)}
		if p.Window, err = s.claimWindow(ctx, tx, p); err != nil {
			t.Fatal(err)
		}
		window := defaultClaimWindow(p.Limit)
		if everyClaimWindow > 0 {
			window = everyClaimWindow // OUTBOX_TEST_CLAIM_WINDOW
		}
		if p.Window != window {
			t.Fatalf("a claim of %d rows over %d pending entries is not windowed (window %d)", p.Limit, backlog+len(want), p.Window)
		}
		q := s.q.Claim(p)
		if c.kind == testdb.SQLite {
			plan := queryLines(t, tx, "EXPLAIN QUERY PLAN "+q.SQL, q.Args...)
			for _, step := range []string{
				"SEARCH c USING INDEX acemq_outbox_pending (created_at<?)",       // near, ended at the window
				"SEARCH o USING INDEX acemq_outbox_pending_key (aggregate_id>?)", // the next key
				"SEARCH h USING INDEX acemq_outbox_pending_key (aggregate_id=?",  // its head
				"SCAN c USING INDEX acemq_outbox_pending_unkeyed",                // the unkeyed rows
			} {
				if !strings.Contains(plan, step) {
					t.Errorf("the claim's plan has no step %q:\n%s", step, plan)
				}
			}
		} else {
			if _, err := tx.ExecContext(ctx, s.q.ClaimSetup().SQL); err != nil {
				t.Fatal(err)
			}
			readsNoBacklog(t, "claim", queryLines(t, tx, "EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF) "+q.SQL, q.Args...), backlog)
		}
		if err := tx.Rollback(); err != nil {
			t.Fatal(err)
		}
		got, err := s.claimBatch(ctx, p.Limit, "r", time.Minute, nil, nil)
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = s.abandon(ctx, got) }()
		var ids []string
		for _, r := range got.rows {
			ids = append(ids, r.ID)
		}
		if !slices.Equal(ids, want) {
			t.Errorf("claimed %q, want %q", ids, want)
		}
	})
}

// windowing is a database whose claims are windowed.
type windowing struct {
	kind string
	d    Dialect
}

// eachWindowing runs fn as a parallel subtest on a migrated database of
// each kind whose claims are windowed.
func eachWindowing(t *testing.T, fn func(t *testing.T, db *testdb.DB, c windowing)) {
	t.Helper()
	for _, c := range []windowing{{testdb.Postgres, Postgres}, {testdb.SQLite, SQLite}} {
		t.Run(c.kind, func(t *testing.T) {
			t.Parallel()
			db := testdb.New(t, c.kind)
			if err := Migrate(context.Background(), db.DB, c.d); err != nil {
				t.Fatal(err)
			}
			fn(t, db, c)
		})
	}
}

// writeBacklog writes n pending records of key "hot", then twenty keys of
// one record and fifty unkeyed records, and returns the ids a claim of 100
// takes, in claim order: the key's head and every later record.
func writeBacklog(t testing.TB, db *testdb.DB, n int) []string {
	t.Helper()
	base := time.Now().Add(-time.Hour).UTC().Truncate(time.Second)
	var ids []string
	q := db.Rebind("INSERT INTO acemq_outbox (id, exchange_name, routing_key, body, created_at, aggregate_id, seq) VALUES (?, 'x', 'k', 'b', ?, ?, ?)")
	tx := db.MustBegin()
	defer func() { _ = tx.Rollback() }()
	i := 0
	insert := func(id string, key, seq any) {
		var at any = base.Add(time.Duration(i) * time.Millisecond)
		if db.Kind == testdb.SQLite {
			at = at.(time.Time).Format("2006-01-02 15:04:05.000000")
		}
		i++
		tx.MustExec(q, id, at, key, seq)
	}
	for seq := 1; seq <= n; seq++ {
		insert(fmt.Sprintf("hot#%05d", seq), "hot", seq)
	}
	ids = append(ids, "hot#00001")
	for k := range 70 {
		if k%7 < 2 {
			id := fmt.Sprintf("k%02d#1", k)
			insert(id, fmt.Sprintf("k%02d", k), 1)
			ids = append(ids, id)
			continue
		}
		id := fmt.Sprintf("u%02d", k)
		insert(id, nil, nil)
		ids = append(ids, id)
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	return ids
}

// readsNoBacklog fails t if a step of plan, PostgreSQL's EXPLAIN ANALYZE
// of a statement (what), read half of a backlog's rows or more.
func readsNoBacklog(t *testing.T, what, plan string, backlog int) {
	t.Helper()
	for _, m := range regexp.MustCompile(`rows=(\d+) loops=(\d+)`).FindAllStringSubmatch(plan, -1) {
		rows, _ := strconv.Atoi(m[1])
		loops, _ := strconv.Atoi(m[2])
		if rows*loops >= backlog/2 {
			t.Errorf("a step of the %s read %d rows %d times, a backlog's worth:\n%s", what, rows, loops, plan)
			return
		}
	}
}

// queryLines runs query on tx and returns its rows, one line each.
func queryLines(t *testing.T, tx *sql.Tx, query string, args ...any) string {
	t.Helper()
	rows, err := tx.Query(query, args...)
	if err != nil {
		t.Fatal(err)
	}
	var out strings.Builder
	if err := eachRow(rows, func(vals []any) { fmt.Fprintln(&out, vals...) }); err != nil {
		t.Fatal(err)
	}
	return out.String()
}

// eachRow hands each of rows' rows to fn, its columns as scanned into
// []any, and closes rows.
func eachRow(rows *sql.Rows, fn func(vals []any)) error {
	defer rows.Close()
	cols, err := rows.Columns()
	if err != nil {
		return err
	}
	for rows.Next() {
		vals := make([]any, len(cols))
		ptrs := make([]any, len(cols))
		for i := range vals {
			ptrs[i] = &vals[i]
		}
		if err := rows.Scan(ptrs...); err != nil {
			return err
		}
		fn(vals)
	}
	return rows.Err()
}

// An idle relay probes before it claims: behind a stuck key's backlog, the
// probe read every record of it at every poll (200 ms on PostgreSQL at
// 20,000 records). It now reads a window and the keys, and still finds a
// claimable row behind them, keyed or not.
func TestProbe_BehindAStuckKeysBacklog_ReadsAWindowNotTheBacklog(t *testing.T) {
	t.Parallel()
	const backlog = 3000
	eachWindowing(t, func(t *testing.T, db *testdb.DB, c windowing) {
		ctx := context.Background()
		writeBacklog(t, db, backlog)
		db.MustExec("DELETE FROM acemq_outbox WHERE aggregate_id IS NULL OR aggregate_id <> 'hot'")
		db.MustExec("UPDATE acemq_outbox SET attempts = 10 WHERE id = 'hot#00001'")
		if c.kind == testdb.Postgres {
			db.MustExec("ANALYZE acemq_outbox")
		}
		s, err := NewStore(db.DB, StoreConfig{Dialect: c.d})
		if err != nil {
			t.Fatal(err)
		}
		probe := func(want bool, what string) {
			t.Helper()
			got, err := s.hasClaimable(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if got != want {
				t.Errorf("%s: the probe says %v, want %v", what, got, want)
			}
		}
		probe(false, "behind the stuck key alone")
		if c.kind == testdb.Postgres {
			q := s.q.Claimable(sqldialect.ClaimParams{MaxAttempts: 10, Now: time.Now(), Window: probeWindow})
			tx, err := db.DB.BeginTx(ctx, nil)
			if err != nil {
				t.Fatal(err)
			}
			readsNoBacklog(t, "probe", queryLines(t, tx, "EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF) "+q.SQL, q.Args...), backlog)
			_ = tx.Rollback()
		}
		at := "2026-12-04 10:00:00"
		insert := db.Rebind("INSERT INTO acemq_outbox (id, exchange_name, routing_key, body, created_at, aggregate_id, seq) VALUES (?, 'x', 'k', 'b', ?, ?, ?)")
		db.MustExec(insert, "u", at, nil, nil)
		probe(true, "an unkeyed record behind it")
		db.MustExec("DELETE FROM acemq_outbox WHERE id = 'u'")
		db.MustExec(insert, "z#1", at, "z", 1)
		probe(true, "another key's record behind it")
		db.MustExec("DELETE FROM acemq_outbox WHERE id = 'z#1'")
		db.MustExec("UPDATE acemq_outbox SET attempts = 0 WHERE id = 'hot#00001'")
		probe(true, "the key's head retried")
	})
}

// A windowed claim looks at a slice of the keys beyond its window, after
// where the last one stopped, and from the first again once past the last:
// behind a key whose stuck backlog fills the window, and keys first in the
// keys' order that their stuck heads hold (a slice of them yields no row,
// and the cursor moves on all the same), every other key's records are
// claimed within a few rounds of keys ÷ slice claims (the last slice of a
// round holds the keys left, fewer), each claim only heads, none twice.
func TestClaim_NarrowedClaimsReadTheKeysInTurn_EveryHeadClaimed(t *testing.T) {
	t.Parallel()
	eachWindowing(t, func(t *testing.T, db *testdb.DB, c windowing) {
		base := time.Now().Add(-time.Hour).UTC().Truncate(time.Second)
		at := func(i int) any {
			v := base.Add(time.Duration(i) * time.Millisecond)
			if c.kind == testdb.SQLite {
				return v.Format("2006-01-02 15:04:05.000000")
			}
			return v
		}
		insert := db.Rebind("INSERT INTO acemq_outbox (id, exchange_name, routing_key, body, created_at, aggregate_id, seq, attempts) VALUES (?, 'x', 'k', 'b', ?, ?, ?, ?)")
		for seq := 1; seq <= 30; seq++ {
			attempts := 0
			if seq == 1 {
				attempts = 10 // stuck: its key holds
			}
			db.MustExec(insert, fmt.Sprintf("hot#%02d", seq), at(seq), "m-hot", seq, attempts)
		}
		// Ten keys first in the keys' order, each held by its stuck head:
		// a claim that looked at the same first keys each time would never
		// get past them.
		for k := range 10 {
			db.MustExec(insert, fmt.Sprintf("a%02d#1", k), at(50+k), fmt.Sprintf("a%02d", k), 1, 10)
		}
		const keys = 40
		for k := range keys {
			for seq := 1; seq <= 2; seq++ {
				db.MustExec(insert, fmt.Sprintf("k%02d#%d", k, seq), at(100+2*k+seq), fmt.Sprintf("k%02d", k), seq, 0)
			}
		}
		s, err := NewStore(db.DB, StoreConfig{Dialect: c.d})
		if err != nil {
			t.Fatal(err)
		}
		s.window = func(int) int { return 4 }
		s.slice = func(int) int { return 7 }
		ctx := context.Background()
		seen := map[string]int{}
		for i := 0; i < 4*(keys+10)/7+6 && len(seen) < 2*keys; i++ {
			cl, err := s.claimBatch(ctx, 5, "r", time.Minute, nil, nil)
			if err != nil {
				t.Fatal(err)
			}
			for _, r := range cl.rows {
				if strings.HasPrefix(r.ID, "hot") || strings.HasPrefix(r.ID, "a") {
					t.Fatalf("claim %d took %s, behind its key's stuck head", i, r.ID)
				}
				var k, seq int
				if _, err := fmt.Sscanf(r.ID, "k%02d#%d", &k, &seq); err != nil {
					t.Fatal(err)
				}
				if seq == 2 && seen[fmt.Sprintf("k%02d#1", k)] == 0 {
					t.Fatalf("claim %d took %s before its key's first record was published", i, r.ID)
				}
				seen[r.ID]++
				if seen[r.ID] > 1 {
					t.Fatalf("claim %d took %s again", i, r.ID)
				}
			}
			ids := make([]string, len(cl.rows))
			for j, r := range cl.rows {
				ids[j] = r.ID
			}
			if err := s.finish(ctx, cl, ids, nil); err != nil {
				t.Fatal(err)
			}
		}
		if len(seen) != 2*keys {
			t.Errorf("%d of the %d records behind the stuck key were claimed", len(seen), 2*keys)
		}
	})
}
