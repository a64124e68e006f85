package outbox

import (
	"context"
	"database/sql"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/acemq/watermill-outbox/internal/testdb"
)

// linesLog records the store's log lines.
type linesLog struct {
	mu    sync.Mutex
	lines []string
}

func (l *linesLog) add(level, msg string, err error, f watermill.LogFields) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.lines = append(l.lines, fmt.Sprintf("%s %s %v %v", level, msg, err, f))
}
func (l *linesLog) Error(msg string, err error, f watermill.LogFields) { l.add("ERROR", msg, err, f) }
func (l *linesLog) Info(msg string, f watermill.LogFields)             { l.add("INFO", msg, nil, f) }
func (l *linesLog) Debug(msg string, f watermill.LogFields)            {}
func (l *linesLog) Trace(msg string, f watermill.LogFields)            {}
func (l *linesLog) With(watermill.LogFields) watermill.LoggerAdapter   { return l }

func (l *linesLog) fewer() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []string
	for _, s := range l.lines {
		if strings.Contains(s, "fewer rows") {
			out = append(out, s)
		}
	}
	return out
}

// pgxPoolWith opens a one-connection pgx pool on db with dsnParams, and a
// store on it logging to a linesLog.
func pgxPoolWith(t *testing.T, db *testdb.DB, dsnParams string) (*sql.DB, *Store, *linesLog) {
	t.Helper()
	pool, s := claimTxPool(t, db, func() *sql.DB {
		return stdlib.OpenDB(*mustParse(t, dsnWith(db, dsnParams)))
	})
	l := &linesLog{}
	s.log = l
	return pool, s, l
}

func pendingRows(t *testing.T, db *testdb.DB) int {
	t.Helper()
	var n int
	if err := db.QueryRow("SELECT count(*) FROM acemq_outbox WHERE published_at IS NULL").Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// claimAllByHand claims up to n rows and checks the claim is a pgClaimTx.
func claimAllByHand(t *testing.T, s *Store, n int) *claim {
	t.Helper()
	cl, err := s.claimBatch(context.Background(), n, "r", time.Minute, nil, nil)
	if err != nil {
		t.Fatalf("claim: %v", err)
	}
	if _, hand := cl.tx.(*pgClaimTx); !hand {
		t.Fatalf("claim's transaction %T, want a pgClaimTx", cl.tx)
	}
	return cl
}

func claimedIDs(cl *claim) []string {
	ids := make([]string, len(cl.rows))
	for i, r := range cl.rows {
		ids[i] = r.ID
	}
	return ids
}

// Each exec mode a DSN may set, each id column type, odd text ids and a
// batch of 1,000: every claimed row is marked by the mark sent with
// COMMIT, no 'fewer rows' is logged, the connection comes back clean, and
// a second cycle (statements cached) does the same.
func TestClaim_Postgres_Pgx_MarkWithCommit_EachQueryModeEachIDType_AllMarked(t *testing.T) {
	t.Parallel()
	modes := []string{
		"", // cache_statement
		"default_query_exec_mode=cache_describe",
		"default_query_exec_mode=exec",
		"default_query_exec_mode=simple_protocol",
		"statement_cache_capacity=1", // evicted within the batch
		"standard_conforming_strings=off&default_query_exec_mode=exec",
	}
	odd := []string{`it's`, `back\slash`, `\x41`, `''`, `$1`, `a;COMMIT`, `-- c`, `/* x`, "tab\there", `é€😀`, `"dq"`, `E'\n'`}
	type idCase struct {
		name, alter string
		ids         func(n int) []string
		n           int
	}
	cases := []idCase{
		{"text-odd", "", func(int) []string { return odd }, len(odd)},
		{"text-1000", "", func(n int) []string {
			ids := make([]string, n)
			for i := range ids {
				ids[i] = fmt.Sprintf("id-%04d-'\\", i)
			}
			return ids
		}, 1000},
		{"bigint", "ALTER TABLE acemq_outbox ALTER id TYPE bigint USING 0", func(n int) []string {
			ids := make([]string, n)
			for i := range ids {
				ids[i] = fmt.Sprint(1700000000000 + i)
			}
			return ids
		}, 5},
		{"uuid", "ALTER TABLE acemq_outbox ALTER id TYPE uuid USING NULL", func(n int) []string {
			ids := make([]string, n)
			for i := range ids {
				ids[i] = fmt.Sprintf("0b4c3b6e-5d1f-4a8e-9a51-2f0c1d3e4f%02d", i)
			}
			return ids
		}, 5},
		{"bytea", "ALTER TABLE acemq_outbox ALTER id TYPE bytea USING NULL", func(n int) []string {
			ids := make([]string, n)
			for i := range ids {
				ids[i] = fmt.Sprintf("\\x%02x00ff", i)
			}
			return ids
		}, 5},
	}
	for _, mode := range modes {
		for _, c := range cases {
			t.Run(mode+"/"+c.name, func(t *testing.T) {
				t.Parallel()
				db := testdb.New(t, testdb.Postgres)
				pool, s, log := pgxPoolWith(t, db, mode)
				if c.alter != "" {
					db.MustExec(c.alter)
				}
				ids := c.ids(c.n)
				for cycle := 0; cycle < 2; cycle++ {
					for _, id := range ids {
						if cycle == 1 && c.name != "text-odd" && c.name != "text-1000" {
							break
						}
						if cycle == 1 {
							id += "-2"
						}
						writeAt(t, db, id, time.Now())
					}
					if cycle == 1 && c.name != "text-odd" && c.name != "text-1000" {
						db.MustExec("UPDATE acemq_outbox SET published_at = NULL")
					}
					cl := claimAllByHand(t, s, 2*c.n)
					if len(cl.rows) != c.n {
						t.Fatalf("cycle %d: claimed %d rows, want %d", cycle, len(cl.rows), c.n)
					}
					if err := s.finish(context.Background(), cl, claimedIDs(cl), nil); err != nil {
						t.Fatalf("cycle %d: finish: %v", cycle, err)
					}
					if n := pendingRows(t, db); n != 0 {
						t.Errorf("cycle %d: %d rows left pending after finish, want all %d marked", cycle, n, c.n)
					}
					if f := log.fewer(); len(f) > 0 {
						t.Errorf("cycle %d: logged %q", cycle, f)
					}
					if inTransaction(t, pool) {
						t.Fatalf("cycle %d: connection came back in a transaction", cycle)
					}
				}
			})
		}
	}
}

// The 'fewer rows' log counts the UPDATE's rows, not COMMIT's: a mark
// naming an id the claim does not hold logs marked 1 of 2; a full mark
// logs nothing.
func TestClaim_Postgres_Pgx_MarkWithCommit_FewerRowsLoggedAreTheUpdates(t *testing.T) {
	t.Parallel()
	for _, mode := range []string{"", "default_query_exec_mode=simple_protocol", "default_query_exec_mode=exec"} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			db := testdb.New(t, testdb.Postgres)
			_, s, log := pgxPoolWith(t, db, mode)
			writeAt(t, db, "a", time.Now())
			writeAt(t, db, "b", time.Now())
			cl := claimAllByHand(t, s, 10)
			if err := s.finish(context.Background(), cl, []string{"a", "ghost"}, nil); err != nil {
				t.Fatal(err)
			}
			f := log.fewer()
			if len(f) != 1 || !strings.Contains(f[0], "marked:1") || !strings.Contains(f[0], "published:2") {
				t.Errorf("logged %q, want one 'fewer rows' with marked 1, published 2", f)
			}
			cl = claimAllByHand(t, s, 10)
			if err := s.finish(context.Background(), cl, claimedIDs(cl), nil); err != nil {
				t.Fatal(err)
			}
			if f2 := log.fewer(); len(f2) != 1 {
				t.Errorf("a full mark logged 'fewer rows': %q", f2[1:])
			}
		})
	}
}
