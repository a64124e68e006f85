package outbox

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/acemq/watermill-outbox/internal/testdb"
)

// claimTxPool opens a pool of one connection to db's database with the
// driver given ("pgx", lib/pq's "postgres"), and a store on it.
func claimTxPool(t *testing.T, db *testdb.DB, open func() *sql.DB) (*sql.DB, *Store) {
	t.Helper()
	if err := Migrate(context.Background(), db.DB, Postgres); err != nil {
		t.Fatal(err)
	}
	pool := open()
	t.Cleanup(func() { _ = pool.Close() })
	pool.SetMaxOpenConns(1)
	s, err := NewStore(pool, StoreConfig{Dialect: Postgres})
	if err != nil {
		t.Fatal(err)
	}
	return pool, s
}

// dsnWith is db's DSN with params (a query string's pairs) added.
func dsnWith(db *testdb.DB, params string) string {
	if params == "" {
		return db.DSN
	}
	return db.DSN + "&" + params
}

// claimSettings are the claim's settings (claimSetup) as read on q.
func claimSettings(t *testing.T, q interface {
	QueryRowContext(context.Context, string, ...any) *sql.Row
}) string {
	t.Helper()
	var sort, idle, jit string
	if err := q.QueryRowContext(context.Background(), "SELECT current_setting('enable_sort'), current_setting('idle_in_transaction_session_timeout'), current_setting('jit')").Scan(&sort, &idle, &jit); err != nil {
		t.Fatal(err)
	}
	return sort + " " + idle + " " + jit
}

// inTransaction reports whether pool's connection is in a transaction:
// SAVEPOINT is refused outside one.
func inTransaction(t *testing.T, pool *sql.DB) bool {
	t.Helper()
	_, err := pool.ExecContext(context.Background(), "SAVEPOINT probe")
	if err != nil && !strings.Contains(err.Error(), "25P01") && !strings.Contains(err.Error(), "can only be used in transaction blocks") {
		t.Fatal(err)
	}
	return err == nil
}

// A claim's transaction has its settings (enable_sort, the idle timeout,
// the JIT off) and loses them with its end, and its mark commits, whatever
// the PostgreSQL driver: through pgx's, BEGIN and the settings go as one
// statement on the connection, and the mark and COMMIT as one batch
// (pgClaimTx), in each of pgx's query modes; through another (lib/pq), as
// a *sql.Tx's.
func TestClaim_Postgres_SettingsInTheClaimsTransactionOnly_EachDriver(t *testing.T) {
	t.Parallel()
	for _, c := range []struct{ driver, mode string }{
		{"pgx", ""}, {"pgx", "simple_protocol"}, {"pgx", "exec"}, {"pgx", "describe_exec"}, {"postgres", ""},
	} {
		t.Run(c.driver+"/"+c.mode, func(t *testing.T) {
			t.Parallel()
			db := testdb.New(t, testdb.Postgres)
			params := ""
			if c.mode != "" {
				params = "default_query_exec_mode=" + c.mode
			}
			dsn := dsnWith(db, params)
			driver := c.driver
			pool, s := claimTxPool(t, db, func() *sql.DB {
				pool, err := sql.Open(driver, dsn)
				if err != nil {
					t.Fatal(err)
				}
				return pool
			})
			ctx := context.Background()
			before := claimSettings(t, pool)
			if before == "off 0 off" {
				t.Fatalf("the server's settings are already the claim's (%s): the test tells nothing", before)
			}
			writeAt(t, db, "a", time.Now())
			writeAt(t, db, "b", time.Now())
			cl, err := s.claimBatch(ctx, 10, "r", time.Minute, nil, nil)
			if err != nil {
				t.Fatal(err)
			}
			_, hand := cl.tx.(*pgClaimTx)
			if want := driver == "pgx"; hand != want {
				t.Fatalf("claim's transaction %T; begun by hand: %v, want %v", cl.tx, hand, want)
			}
			if got := claimSettings(t, cl.tx); got != "off 0 off" {
				t.Errorf("in the claim's transaction enable_sort, idle_in_transaction_session_timeout, jit = %s, want off 0 off", got)
			}
			if err := s.finish(ctx, cl, []string{"a", "b"}, nil); err != nil {
				t.Fatal(err)
			}
			if after := claimSettings(t, pool); after != before {
				t.Errorf("after the claim, the pool's connection has %s, want the session's own %s", after, before)
			}
			if inTransaction(t, pool) {
				t.Error("the pool's connection came back inside a transaction")
			}
			if n := pendingRows(t, db); n != 0 {
				t.Errorf("%d rows pending, want the 2 marked", n)
			}
		})
	}
}

// traced records the statements pgx sends.
type traced struct {
	mu  sync.Mutex
	sql []string
}

func (tr *traced) TraceQueryStart(ctx context.Context, _ *pgx.Conn, data pgx.TraceQueryStartData) context.Context {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	tr.sql = append(tr.sql, data.SQL)
	return ctx
}

func (tr *traced) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func (tr *traced) TraceBatchStart(ctx context.Context, _ *pgx.Conn, data pgx.TraceBatchStartData) context.Context {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	var sqls []string
	for _, q := range data.Batch.QueuedQueries {
		sqls = append(sqls, q.SQL)
	}
	tr.sql = append(tr.sql, "batch: "+strings.Join(sqls, " | "))
	return ctx
}

func (tr *traced) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}

func (tr *traced) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData) {}

func (tr *traced) take() []string {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	s := tr.sql
	tr.sql = nil
	return s
}

// Through pgx, the claim's BEGIN carries its settings, and its mark goes
// with COMMIT: one round trip each, where a *sql.Tx's BEGIN and the
// settings took two (a quarter of the p50 from commit to broker at 2,000
// msg/s, docs/measurements.md), and the mark and COMMIT two.
func TestClaim_Postgres_Pgx_BeginCarriesTheSettingsMarkCarriesCommit(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, testdb.Postgres)
	tr := &traced{}
	_, s := claimTxPool(t, db, func() *sql.DB {
		cfg, err := pgx.ParseConfig(db.DSN)
		if err != nil {
			t.Fatal(err)
		}
		cfg.Tracer = tr
		return stdlib.OpenDB(*cfg)
	})
	ctx := context.Background()
	writeAt(t, db, "a", time.Now())
	tr.take()
	cl, err := s.claimBatch(ctx, 10, "r", time.Minute, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.finish(ctx, cl, []string{"a"}, nil); err != nil {
		t.Fatal(err)
	}
	sent := tr.take()
	begins := slices.IndexFunc(sent, func(q string) bool { return strings.HasPrefix(strings.ToUpper(q), "BEGIN") })
	if begins < 0 {
		t.Fatalf("no BEGIN among the claim's statements %q", sent)
	}
	if begin := sent[begins]; !strings.Contains(begin, s.q.ClaimSetup().SQL) {
		t.Errorf("the claim began with %q, without its settings (%q) in the same statement", begin, s.q.ClaimSetup().SQL)
	}
	for _, q := range sent[begins+1:] {
		if strings.Contains(q, "set_config('enable_sort'") {
			t.Errorf("the settings were sent again on their own, a round trip more: %q", sent)
		}
	}
	if last := sent[len(sent)-1]; !strings.HasPrefix(last, "batch: ") || !strings.Contains(last, "published_at") || !strings.HasSuffix(last, " | COMMIT") {
		t.Errorf("the claim ended with %q, want its mark and COMMIT in one batch (all: %q)", last, sent)
	}
	for _, q := range sent {
		if strings.EqualFold(q, "commit") {
			t.Errorf("COMMIT sent on its own, a round trip more: %q", sent)
		}
	}
}

// A mark the server refuses (here a trigger's error) in the batch that
// carries COMMIT: the server skips the COMMIT, finish fails with the
// mark's error, nothing is marked, and the connection goes back to the
// pool outside a transaction, the rows claimable again.
func TestClaim_Postgres_Pgx_MarkRefusedInItsBatch_NothingMarkedConnectionClean(t *testing.T) {
	t.Parallel()
	db, pool, s, cl := claimedOnPgx(t)
	ctx := context.Background()
	db.MustExec(`CREATE FUNCTION refuse_mark() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RAISE EXCEPTION 'mark refused'; END $$`)
	db.MustExec(`CREATE TRIGGER refuse_mark BEFORE UPDATE ON acemq_outbox FOR EACH ROW EXECUTE FUNCTION refuse_mark()`)
	if _, hand := cl.tx.(*pgClaimTx); !hand {
		t.Fatalf("claim's transaction %T, want one begun by hand", cl.tx)
	}
	if err := s.finish(ctx, cl, []string{"a"}, nil); err == nil || !strings.Contains(err.Error(), "mark refused") || !strings.Contains(err.Error(), "outbox: mark published: ") {
		t.Fatalf("finish = %v, want the trigger's error, named as the mark's", err)
	}
	if inTransaction(t, pool) {
		t.Error("the pool's connection came back inside a transaction")
	}
	db.MustExec(`DROP TRIGGER refuse_mark ON acemq_outbox`)
	again, err := s.claimBatch(ctx, 10, "r", time.Minute, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(again.rows) != 1 {
		t.Fatalf("the next claim took %d rows, want the 1 whose mark was refused", len(again.rows))
	}
	if err := s.finish(ctx, again, []string{"a"}, nil); err != nil {
		t.Fatal(err)
	}
	if n := pendingRows(t, db); n != 0 {
		t.Errorf("%d rows pending, want 0 once the mark was let through", n)
	}
}

// A claim's transaction that a statement failed in cannot commit: COMMIT,
// which the server answers with ROLLBACK, is an error (as pgx's Tx.Commit
// makes it), nothing is marked, and the connection goes back to the pool
// outside any transaction.
func TestClaim_Postgres_Pgx_FailedTransaction_CommitIsAnErrorNothingMarked(t *testing.T) {
	t.Parallel()
	db, pool, s, cl := claimedOnPgx(t)
	ctx := context.Background()
	if _, err := s.execTx(ctx, cl.tx, s.q.MarkPublished(time.Now(), []any{"a"})); err != nil {
		t.Fatal(err)
	}
	if _, err := cl.tx.ExecContext(ctx, "SELECT 1/0"); err == nil {
		t.Fatal("1/0 did not fail")
	}
	if err := cl.tx.Commit(); !errors.Is(err, errCommitRolledBack) {
		t.Errorf("COMMIT of the failed transaction = %v, want errCommitRolledBack", err)
	}
	cl.ended()
	if inTransaction(t, pool) {
		t.Error("the pool's connection came back inside a transaction")
	}
	if n := pendingRows(t, db); n != 1 {
		t.Errorf("%d rows pending, want the 1 whose mark rolled back", n)
	}
}

// Once a claim's transaction is over, a statement on it fails: it never
// runs on the connection outside the transaction, autocommitted.
func TestClaim_Postgres_Pgx_StatementAfterTheEnd_RefusedNotAutocommitted(t *testing.T) {
	t.Parallel()
	for _, end := range []string{"commit", "rollback"} {
		t.Run(end, func(t *testing.T) {
			t.Parallel()
			db, _, s, cl := claimedOnPgx(t)
			ctx := context.Background()
			var err error
			tx := cl.tx
			if end == "commit" {
				err = tx.Commit()
			} else {
				err = tx.Rollback()
			}
			if err != nil {
				t.Fatal(err)
			}
			if _, err := s.execTx(ctx, tx, s.q.MarkPublished(time.Now(), []any{"a"})); err == nil {
				t.Error("a mark after the transaction's end ran")
			}
			if err := tx.Commit(); !errors.Is(err, sql.ErrTxDone) {
				t.Errorf("a second end = %v, want sql.ErrTxDone", err)
			}
			cl.ended()
			if n := pendingRows(t, db); n != 1 {
				t.Errorf("%d rows pending, want 1: the mark after the end must not have run", n)
			}
		})
	}
}

// A claim whose context ended (the relay stopping) is rolled back with a
// context that has ended too: the ROLLBACK cannot be sent, and the
// connection, still in the transaction and holding the rows' locks, is
// discarded rather than given back. The rows are claimable at once.
func TestClaim_Postgres_Pgx_RollbackCannotBeSent_ConnectionDiscardedRowsFree(t *testing.T) {
	t.Parallel()
	_, pool, s, cl := claimedOnPgx(t)
	cl.end() // the transaction's context, as fail and ended end it
	if err := s.abandon(context.Background(), cl); err == nil {
		t.Error("a ROLLBACK with an ended context reported no error")
	}
	if st := pool.Stats(); st.OpenConnections != 0 {
		t.Errorf("%d connections open after the failed ROLLBACK, want the claim's discarded", st.OpenConnections)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	again, err := s.claimBatch(ctx, 10, "r", time.Minute, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = s.abandon(context.Background(), again) }()
	if len(again.rows) != 1 {
		t.Errorf("the next claim took %d rows, want the 1 the discarded claim held", len(again.rows))
	}
}

func mustParse(t *testing.T, dsn string) *pgx.ConnConfig {
	t.Helper()
	cfg, err := pgx.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	return cfg
}

// claimedOnPgx claims the one row "a" through pgx on a pool of one
// connection.
func claimedOnPgx(t *testing.T) (*testdb.DB, *sql.DB, *Store, *claim) {
	t.Helper()
	return claimedEachWay(t, true, nil, "")
}

// hiddenPgx is pgx's driver connection under another type: the store
// cannot see pgx through it, and claims as with any other driver, in a
// *sql.Tx.
type hiddenPgx struct{ *stdlib.Conn }

type hiddenPgxConnector struct{ driver.Connector }

func (c hiddenPgxConnector) Connect(ctx context.Context) (driver.Conn, error) {
	conn, err := c.Connector.Connect(ctx)
	if err != nil {
		return nil, err
	}
	return hiddenPgx{conn.(*stdlib.Conn)}, nil
}

// BenchmarkClaim_Postgres_OneRowClaimedAndMarked times a relay's cycle for
// one row on PostgreSQL through pgx (claim, mark, commit) with the claim's
// BEGIN carrying its settings (byhand), and as a *sql.Tx sends them, one
// round trip more (sqltx), the two alternated in the same loop. It reports
// each in µs/cycle and their ratio, byhand_vs_sqltx:
//
//	go test -run '^$' -bench BenchmarkClaim_Postgres_OneRowClaimedAndMarked -benchtime 2000x .
func BenchmarkClaim_Postgres_OneRowClaimedAndMarked(b *testing.B) {
	db := testdb.New(b, testdb.Postgres)
	ctx := context.Background()
	if err := Migrate(ctx, db.DB, Postgres); err != nil {
		b.Fatal(err)
	}
	cfg, err := pgx.ParseConfig(db.DSN)
	if err != nil {
		b.Fatal(err)
	}
	store := func(pool *sql.DB) *Store {
		b.Cleanup(func() { _ = pool.Close() })
		s, err := NewStore(pool, StoreConfig{Dialect: Postgres})
		if err != nil {
			b.Fatal(err)
		}
		return s
	}
	byHand := store(stdlib.OpenDB(*cfg))
	sqlTx := store(sql.OpenDB(hiddenPgxConnector{stdlib.GetConnector(*cfg)}))
	var took [2]time.Duration
	cycle := func(s *Store, byHand bool) time.Duration {
		started := time.Now()
		cl, err := s.claimBatch(ctx, 1, "r", time.Minute, nil, nil)
		if err != nil {
			b.Fatal(err)
		}
		if _, hand := cl.tx.(*pgClaimTx); hand != byHand || len(cl.rows) != 1 {
			b.Fatalf("claimed %d rows, by hand: %v, want 1, %v", len(cl.rows), hand, byHand)
		}
		if err := s.finish(ctx, cl, []string{cl.rows[0].ID}, nil); err != nil {
			b.Fatal(err)
		}
		return time.Since(started)
	}
	b.ResetTimer()
	for i := range b.N {
		b.StopTimer()
		writeAt(b, db, fmt.Sprintf("%d-%d-a", b.N, i), time.Now())
		writeAt(b, db, fmt.Sprintf("%d-%d-b", b.N, i), time.Now())
		b.StartTimer()
		if i%2 == 0 {
			took[0] += cycle(byHand, true)
			took[1] += cycle(sqlTx, false)
		} else {
			took[1] += cycle(sqlTx, false)
			took[0] += cycle(byHand, true)
		}
	}
	b.ReportMetric(float64(took[0].Microseconds())/float64(b.N), "byhand_µs/cycle")
	b.ReportMetric(float64(took[1].Microseconds())/float64(b.N), "sqltx_µs/cycle")
	b.ReportMetric(float64(took[0])/float64(took[1]), "byhand_vs_sqltx")
}

// A COMMIT the server refuses (a deferred constraint trigger's error) ends
// the transaction, rolled back: the error is the server's, nothing is
// marked, and the connection, sound and outside a transaction, is kept,
// whether the mark went with the COMMIT (finish) or before it.
func TestClaim_Postgres_Pgx_CommitRefused_ErrorNothingMarkedConnectionKept(t *testing.T) {
	t.Parallel()
	for _, way := range []string{"finish", "commit"} {
		t.Run(way, func(t *testing.T) {
			t.Parallel()
			db, pool, s, cl := claimedOnPgx(t)
			ctx := context.Background()
			db.MustExec(`CREATE FUNCTION refuse_commit() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RAISE EXCEPTION 'commit refused'; END $$`)
			db.MustExec(`CREATE CONSTRAINT TRIGGER refuse_commit AFTER UPDATE ON acemq_outbox DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION refuse_commit()`)
			var err error
			if way == "finish" {
				err = s.finish(ctx, cl, []string{"a"}, nil)
			} else {
				if _, err := s.execTx(ctx, cl.tx, s.q.MarkPublished(time.Now(), []any{"a"})); err != nil {
					t.Fatal(err)
				}
				err = cl.tx.Commit()
				cl.ended()
			}
			names := map[string]string{"finish": "commit marks: ", "commit": "COMMIT: "}[way]
			if err == nil || !strings.Contains(err.Error(), "commit refused") || !strings.Contains(err.Error(), names) {
				t.Fatalf("the refused COMMIT gave %v, want the trigger's error, named as the COMMIT's (%q)", err, names)
			}
			if st := pool.Stats(); st.OpenConnections != 1 {
				t.Errorf("%d connections open, want the claim's kept", st.OpenConnections)
			}
			if inTransaction(t, pool) {
				t.Error("the pool's connection came back inside a transaction")
			}
			if n := publishedRows(t, db); n != 0 {
				t.Errorf("%d rows published, want none: the COMMIT was refused", n)
			}
		})
	}
}

// A Rows left open on the claim's transaction, half read, is closed by its
// end, as a *sql.Tx's end closes it, whichever way it ends: the end
// succeeds, the Rows reads no further, closing it again returns at once,
// and the connection goes back to the pool sound, outside a transaction.
// A pgClaimTx that left it open failed its end ("conn busy"), lost the
// marks, and waited to give the connection back until the Rows was
// closed: for ever, for a caller that closes it after the end. (The mark
// goes before the Rows: pgx runs one statement at a time on a connection,
// and refuses another while a Rows is open, in a *sql.Tx too; finish,
// whose mark goes with the COMMIT, only on a pgClaimTx.)
func TestClaim_Postgres_RowsLeftOpen_ClosedByTheEnd(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		end    string
		byHand bool
	}{{"commit", false}, {"commit", true}, {"rollback", false}, {"rollback", true}, {"finish", true}} {
		end, byHand := c.end, c.byHand
		t.Run(fmt.Sprintf("%s/byhand=%v", end, byHand), func(t *testing.T) {
			t.Parallel()
			db, pool, s, cl := claimedEachWay(t, byHand, nil, "")
			ctx := context.Background()
			if end == "commit" {
				if _, err := s.execTx(ctx, cl.tx, s.q.MarkPublished(time.Now(), []any{"a"})); err != nil {
					t.Fatal(err)
				}
			}
			rows, err := cl.tx.QueryContext(ctx, "SELECT g FROM generate_series(1, 100000) g")
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = rows.Close() }) // before the pool's and the database's
			if !rows.Next() {
				t.Fatalf("no first row: %v", rows.Err())
			}
			ended := make(chan error, 1)
			go func() {
				defer cl.ended()
				switch end {
				case "finish":
					ended <- s.finish(ctx, cl, []string{"a"}, nil)
				case "commit":
					ended <- cl.tx.Commit()
				default:
					ended <- cl.tx.Rollback()
				}
			}()
			select {
			case err := <-ended:
				if err != nil {
					t.Fatalf("%s with a Rows open: %v", end, err)
				}
			case <-time.After(10 * time.Second):
				t.Fatalf("%s with a Rows open did not return in 10 s", end)
			}
			if rows.Next() {
				t.Error("the Rows read on after the transaction's end")
			}
			if err := rows.Close(); err != nil {
				t.Errorf("closing the Rows after the end: %v", err)
			}
			if st := pool.Stats(); st.OpenConnections != 1 {
				t.Errorf("%d connections open, want the claim's kept", st.OpenConnections)
			}
			if inTransaction(t, pool) {
				t.Error("the pool's connection came back inside a transaction")
			}
			want := map[string]int{"commit": 1, "finish": 1, "rollback": 0}[end]
			if n := publishedRows(t, db); n != want {
				t.Errorf("%d rows published, want %d", n, want)
			}
		})
	}
}
