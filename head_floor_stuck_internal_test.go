package outbox

import (
	"context"
	"database/sql"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/acemq/watermill-outbox/internal/testdb"
)

// A keyed record stuck at MaxAttempts holds the records after it in its
// key until it is retried: pending, under MaxAttempts, and no claim takes
// them. Read as where the pending rows start, the first of them kept the
// floor an hour back beside a held snapshot, every claim walked the dead
// entries since, and the measure found no gain: one stuck key, an
// ordinary state, turned the floor off. The floor passes them; a Retry of
// the stuck record makes the next claim measure, and it is claimed, then
// the one it held.
func TestClaim_StuckKeyBesideAHeldSnapshot_FloorPassesWhatItHolds(t *testing.T) {
	t.Parallel()
	eachFloorKind(t, func(t *testing.T, db *testdb.DB, d Dialect) {
		ctx := context.Background()
		holdSnapshot(t, db)
		publishOld(t, db, 100_000)
		hourAgo := time.Now().Add(-time.Hour).UTC()
		writeKeyed(t, db, "k#1", "k", 1, hourAgo, 1000)
		writeKeyed(t, db, "k#2", "k", 2, hourAgo.Add(time.Millisecond), 0)
		s, err := NewStore(db.DB, StoreConfig{Dialect: d})
		if err != nil {
			t.Fatal(err)
		}
		claim := func() []string { ids, _ := claimAll(t, s); return ids }
		for i := 0; i < 5 && !s.floor.on; i++ {
			writeAt(t, db, fmt.Sprintf("new%d", i), time.Now())
			s.floor.check, s.floor.missed = true, 0 // measure now
			claim()
		}
		if !s.floor.on || !s.floor.at.After(hourAgo.Add(time.Minute)) {
			t.Fatalf("beside 100,000 dead entries and a stuck key: floor on %v at %v; want on, past the records the stuck one holds (%v)", s.floor.on, s.floor.at, hourAgo)
		}
		if n, err := s.Retry(ctx, "k#1"); err != nil || n != 1 {
			t.Fatalf("Retry: %d, %v", n, err)
		}
		if ids := claim(); !slices.Equal(ids, []string{"k#1"}) {
			t.Fatalf("the claim after the Retry took %v, want [k#1]", ids)
		}
		if ids := claim(); !slices.Equal(ids, []string{"k#2"}) {
			t.Fatalf("the claim after k#1 was published took %v, want [k#2]", ids)
		}
	})
}

// The floor's read passes the records a stuck one holds by looking at
// their key's head only. A first form asked whether any earlier record of
// the key was stuck, and MariaDB answered through the unique (aggregate_id,
// seq) index, one lookup per earlier record, published ones included:
// 107 ms a read for a key with 100,000 published records kept, against
// 0.15 ms. Here such a key has its head stuck and a record held behind it,
// and a second key of the same history is not stuck: the read from the
// head finds the right row and reads a few index entries, not the
// keys' histories; a Retry of the stuck record makes it the first again.
func TestPendingFirst_KeyWithLongHistory_ReadsOnlyItsHead(t *testing.T) {
	t.Parallel()
	eachFloorKind(t, func(t *testing.T, db *testdb.DB, d Dialect) {
		ctx := context.Background()
		const history = 100_000
		hourAgo := time.Now().Add(-time.Hour).UTC().Truncate(time.Second)
		publishKeyHistory(t, db, "k", history, hourAgo)
		publishKeyHistory(t, db, "j", history, hourAgo)
		writeKeyed(t, db, "k#stuck", "k", history+1, hourAgo.Add(2*time.Minute), 1000)
		writeKeyed(t, db, "k#held", "k", history+2, hourAgo.Add(3*time.Minute), 0)
		writeKeyed(t, db, "j#next", "j", history+1, hourAgo.Add(4*time.Minute), 0)
		writeAt(t, db, "unkeyed", hourAgo.Add(5*time.Minute))
		vacuum(t, db)
		s, err := NewStore(db.DB, StoreConfig{Dialect: d})
		if err != nil {
			t.Fatal(err)
		}
		index, keyIndex := "", ""
		if d == MySQL {
			if index, keyIndex, err = s.findIndexes(ctx, db.DB); err != nil || index == "" || keyIndex == "" {
				t.Fatalf("MySQL's indexes: %q, %q, %v", index, keyIndex, err)
			}
		}
		first := func() (string, int) {
			t.Helper()
			tx, err := db.DB.BeginTx(ctx, nil)
			if err != nil {
				t.Fatal(err)
			}
			defer tx.Rollback()
			before := entriesRead(t, db, tx)
			c, err := s.pendingFirst(ctx, tx, index, keyIndex, nil)
			if err != nil {
				t.Fatal(err)
			}
			read := entriesRead(t, db, tx) - before
			if c == nil {
				return "", read
			}
			return c.ID, read
		}
		if id, read := first(); id != "j#next" || read > 100 {
			t.Fatalf("where the pending rows start beside a stuck key of %d published records: %q, %d index entries read; want j#next, at most 100", history, id, read)
		}
		if n, err := s.Retry(ctx, "k#stuck"); err != nil || n != 1 {
			t.Fatalf("Retry: %d, %v", n, err)
		}
		if id, read := first(); id != "k#stuck" || read > 100 {
			t.Fatalf("after the Retry: %q, %d index entries read; want k#stuck, at most 100", id, read)
		}
	})
}

// writeKeyed writes a pending record of key at seq, created at at, after
// attempts attempts.
func writeKeyed(t testing.TB, db *testdb.DB, id, key string, seq int64, at time.Time, attempts int) {
	t.Helper()
	db.MustExec(db.Rebind("INSERT INTO acemq_outbox (id, exchange_name, routing_key, body, headers, created_at, aggregate_id, seq, attempts) VALUES (?, 'x', 'k', 'b', '{}', ?, ?, ?, ?)"),
		id, at.UTC(), key, seq, attempts)
}

// publishKeyHistory writes n records of key, seq 1 to n, created a
// millisecond apart from from on, and publishes them, as a relay does.
func publishKeyHistory(t testing.TB, db *testdb.DB, key string, n int, from time.Time) {
	t.Helper()
	now := time.Now().UTC()
	for start := 0; start < n; start += 500 {
		var (
			values []string
			args   []any
		)
		for i := start; i < min(start+500, n); i++ {
			values = append(values, "(?, 'x', 'k', 'b', '{}', ?, ?, ?)")
			args = append(args, fmt.Sprintf("%s#%06d", key, i+1), from.Add(time.Duration(i)*time.Millisecond), key, i+1)
		}
		db.MustExec(db.Rebind("INSERT INTO acemq_outbox (id, exchange_name, routing_key, body, headers, created_at, aggregate_id, seq) VALUES "+strings.Join(values, ", ")), args...)
	}
	db.MustExec(db.Rebind("UPDATE acemq_outbox SET published_at = ? WHERE aggregate_id = ? AND published_at IS NULL"), now, key)
}

// vacuum removes, on PostgreSQL, the index entries of the outbox's rows
// since published, and brings the planner's statistics up to date, as
// autovacuum does some while after a bulk write. MySQL's purge removes
// them by itself, with no snapshot held; its statistics are left as InnoDB
// keeps them after the write, which is when MariaDB chose the wrong index.
func vacuum(t testing.TB, db *testdb.DB) {
	t.Helper()
	if db.Kind == testdb.Postgres {
		db.MustExec("VACUUM ANALYZE acemq_outbox")
	}
}

// entriesRead is how many rows and index entries the statements of tx
// have read so far: on PostgreSQL those its scans of the outbox and its
// indexes returned, on MySQL its handler reads (the session's; a few
// hundred come with each status read itself).
func entriesRead(t testing.TB, db *testdb.DB, tx *sql.Tx) int {
	t.Helper()
	var n int
	if db.Kind == testdb.Postgres {
		if err := tx.QueryRow(`SELECT pg_stat_get_xact_tuples_returned('acemq_outbox'::regclass) +
			(SELECT COALESCE(SUM(pg_stat_get_xact_tuples_returned(indexrelid)), 0) FROM pg_index WHERE indrelid = 'acemq_outbox'::regclass)`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	rows, err := tx.Query("SHOW SESSION STATUS WHERE Variable_name IN ('Handler_read_key', 'Handler_read_next', 'Handler_read_prev', 'Handler_read_rnd_next', 'Handler_read_first', 'Handler_read_last')")
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	for rows.Next() {
		var name string
		var v int
		if err := rows.Scan(&name, &v); err != nil {
			t.Fatal(err)
		}
		n += v
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return n
}
