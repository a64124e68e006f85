package outbox

import (
	"context"
	"database/sql"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/acemq/watermill-outbox/internal/testdb"
)

// heldStatement is a pgx tracer that holds the first statement whose SQL is
// stmt, inside pgx (database/sql's driver-connection lock held, for a
// pgClaimTx inside Conn.Raw), until release is closed.
type heldStatement struct {
	stmt    string
	once    sync.Once
	entered chan struct{}
	release chan struct{}
}

func newHeldStatement(stmt string) *heldStatement {
	return &heldStatement{stmt: stmt, entered: make(chan struct{}), release: make(chan struct{})}
}

func (g *heldStatement) TraceQueryStart(ctx context.Context, _ *pgx.Conn, data pgx.TraceQueryStartData) context.Context {
	if strings.EqualFold(strings.TrimSpace(data.SQL), g.stmt) {
		hit := false
		g.once.Do(func() { hit = true })
		if hit {
			close(g.entered)
			<-g.release
		}
	}
	return ctx
}

func (g *heldStatement) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// claimedEachWay claims the one row "a" through pgx, on a pool of one
// connection, with tracer on pgx's connections; byHand false hides pgx
// from the store, which then claims in a *sql.Tx, as before the change.
func claimedEachWay(t *testing.T, byHand bool, tracer pgx.QueryTracer, dsnParams string) (*testdb.DB, *sql.DB, *Store, *claim) {
	t.Helper()
	db := testdb.New(t, testdb.Postgres)
	pool, s := claimTxPool(t, db, func() *sql.DB {
		cfg := mustParse(t, dsnWith(db, dsnParams))
		if tracer != nil {
			cfg.Tracer = tracer
		}
		if byHand {
			return stdlib.OpenDB(*cfg)
		}
		return sql.OpenDB(hiddenPgxConnector{stdlib.GetConnector(*cfg)})
	})
	writeAt(t, db, "a", time.Now())
	cl, err := s.claimBatch(context.Background(), 10, "r", time.Minute, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, hand := cl.tx.(*pgClaimTx); hand != byHand || len(cl.rows) != 1 {
		t.Fatalf("claim %T of %d rows, want by hand %v, 1 row", cl.tx, len(cl.rows), byHand)
	}
	return db, pool, s, cl
}

func publishedRows(t *testing.T, db *testdb.DB) int {
	t.Helper()
	var n int
	if err := db.QueryRow("SELECT count(*) FROM acemq_outbox WHERE published_at IS NOT NULL").Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

func eachClaimTx(t *testing.T, fn func(t *testing.T, byHand bool)) {
	for _, way := range []struct {
		name   string
		byHand bool
	}{{"sqltx", false}, {"byhand", true}} {
		t.Run(way.name, func(t *testing.T) {
			t.Parallel()
			fn(t, way.byHand)
		})
	}
}

// A statement on the claim's transaction that comes while its ROLLBACK is
// on the wire (another goroutine's) fails or is rolled back with it, in a
// *sql.Tx and in a pgClaimTx alike. A pgClaimTx whose end did not hold
// its statements off sent ROLLBACK inside Conn.Raw and closed the
// *sql.Conn only after: a statement that grabbed the Conn meanwhile ran
// next on the connection, outside any transaction, autocommitted.
func TestClaim_Postgres_StatementRacingRollback_FailsNotAutocommitted(t *testing.T) {
	t.Parallel()
	eachClaimTx(t, func(t *testing.T, byHand bool) {
		gate := newHeldStatement("ROLLBACK")
		db, _, s, cl := claimedEachWay(t, byHand, gate, "")
		rolledBack := make(chan error, 1)
		go func() { rolledBack <- cl.tx.Rollback() }()
		<-gate.entered // ROLLBACK is about to be sent
		marked := make(chan error, 1)
		go func() {
			_, err := s.execTx(context.Background(), cl.tx, s.q.MarkPublished(time.Now(), []any{"a"}))
			marked <- err
		}()
		time.Sleep(300 * time.Millisecond) // the mark waits for the connection
		close(gate.release)
		if err := <-rolledBack; err != nil {
			t.Fatalf("rollback: %v", err)
		}
		err := <-marked
		cl.ended()
		if n := publishedRows(t, db); n != 0 {
			t.Errorf("the mark racing the ROLLBACK returned %v and %d row is published: it ran after the ROLLBACK, autocommitted", err, n)
		}
	})
}

// Two ends of the claim's transaction, one racing the other: the second
// fails (sql.ErrTxDone), as a *sql.Tx's does. A pgClaimTx that sent the
// second too sent it on the connection outside the transaction, and
// PostgreSQL answers a COMMIT with no transaction with a warning: both
// reported success, the COMMIT's although the ROLLBACK undid the marks.
func TestClaim_Postgres_CommitRacingRollback_OneEndOnly(t *testing.T) {
	t.Parallel()
	eachClaimTx(t, func(t *testing.T, byHand bool) {
		gate := newHeldStatement("ROLLBACK")
		db, _, s, cl := claimedEachWay(t, byHand, gate, "")
		if _, err := s.execTx(context.Background(), cl.tx, s.q.MarkPublished(time.Now(), []any{"a"})); err != nil {
			t.Fatal(err)
		}
		rolledBack := make(chan error, 1)
		go func() { rolledBack <- cl.tx.Rollback() }()
		<-gate.entered
		committed := make(chan error, 1)
		go func() { committed <- cl.tx.Commit() }()
		time.Sleep(300 * time.Millisecond)
		close(gate.release)
		rbErr, cErr := <-rolledBack, <-committed
		cl.ended()
		n := publishedRows(t, db)
		if cErr == nil && n == 0 {
			t.Errorf("Commit reported success (rollback: %v) but nothing was committed: %d rows published", rbErr, n)
		}
		if rbErr == nil && cErr == nil {
			t.Errorf("both ends of one transaction succeeded; the second should be sql.ErrTxDone")
		}
	})
}

// a relay's claim cancelled while its statement waits (a table
// lock) leaves no transaction on the pool, nothing marked, the settings
// not leaked, and the row claimable.
func TestClaim_Postgres_Pgx_CancelledMidClaim_PoolClean(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, testdb.Postgres)
	pool, s := claimTxPool(t, db, func() *sql.DB { return stdlib.OpenDB(*mustParse(t, db.DSN)) })
	before := claimSettings(t, pool)
	writeAt(t, db, "a", time.Now())
	locker, err := db.DB.Begin()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := locker.Exec("LOCK TABLE acemq_outbox IN ACCESS EXCLUSIVE MODE"); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel()
	if cl, err := s.claimBatch(ctx, 10, "r", time.Minute, nil, nil); err == nil {
		_ = s.abandon(context.Background(), cl)
		t.Fatal("the claim behind the lock did not fail")
	}
	_ = locker.Rollback()
	if inTransaction(t, pool) {
		t.Error("the pool's connection is inside a transaction")
	}
	if after := claimSettings(t, pool); after != before {
		t.Errorf("settings %s after the cancelled claim, want %s", after, before)
	}
	cl, err := s.claimBatch(context.Background(), 10, "r", time.Minute, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.finish(context.Background(), cl, []string{"a"}, nil); err != nil || len(cl.rows) != 1 {
		t.Errorf("the next claim took %d rows, finish: %v", len(cl.rows), err)
	}
}

// the claim's connection killed mid-batch: the marks fail,
// nothing is marked, the pool recovers, and the row is claimed again.
func TestClaim_Postgres_Pgx_BackendTerminatedMidBatch_NothingMarkedClaimedAgain(t *testing.T) {
	t.Parallel()
	for _, when := range []string{"before-mark", "before-commit"} {
		t.Run(when, func(t *testing.T) {
			t.Parallel()
			db, pool, s, cl := claimedEachWay(t, true, nil, "")
			ctx := context.Background()
			var pid int
			if err := cl.tx.QueryRowContext(ctx, "SELECT pg_backend_pid()").Scan(&pid); err != nil {
				t.Fatal(err)
			}
			kill := func() {
				if _, err := db.Exec("SELECT pg_terminate_backend($1)", pid); err != nil {
					t.Fatal(err)
				}
				time.Sleep(200 * time.Millisecond)
			}
			var err error
			if when == "before-mark" {
				kill()
				err = s.finish(ctx, cl, []string{"a"}, nil)
			} else {
				if _, err := s.execTx(ctx, cl.tx, s.q.MarkPublished(time.Now(), []any{"a"})); err != nil {
					t.Fatal(err)
				}
				kill()
				err = cl.tx.Commit()
				cl.ended()
			}
			if err == nil {
				t.Error("the marks on a killed connection reported success")
			}
			if n := publishedRows(t, db); n != 0 {
				t.Errorf("%d rows published", n)
			}
			if inTransaction(t, pool) {
				t.Error("pool connection inside a transaction")
			}
			again, err := s.claimBatch(ctx, 10, "r", time.Minute, nil, nil)
			if err != nil {
				t.Fatal(err)
			}
			if err := s.finish(ctx, again, []string{"a"}, nil); err != nil || len(again.rows) != 1 {
				t.Errorf("claimed again %d rows, finish %v", len(again.rows), err)
			}
		})
	}
}

// session settings a role or the DSN sets (here through pgx's
// run-time parameters): the claim is READ COMMITTED whatever the default,
// outlives a short idle_in_transaction_session_timeout, and the session's
// values are back after it.
func TestClaim_Postgres_Pgx_SessionSettings_ClaimKeepsItsOwnSessionKeepsIts(t *testing.T) {
	t.Parallel()
	db, pool, s, cl := claimedEachWay(t, true, nil, "default_transaction_isolation=serializable&idle_in_transaction_session_timeout=300&standard_conforming_strings=off")
	ctx := context.Background()
	var iso string
	if err := cl.tx.QueryRowContext(ctx, "SELECT current_setting('transaction_isolation')").Scan(&iso); err != nil {
		t.Fatal(err)
	}
	if iso != "read committed" {
		t.Errorf("claim's isolation %q", iso)
	}
	time.Sleep(700 * time.Millisecond) // past the session's idle timeout
	if err := s.finish(ctx, cl, []string{"a"}, nil); err != nil {
		t.Fatalf("finish after an idle wait: %v", err)
	}
	if n := publishedRows(t, db); n != 1 {
		t.Errorf("%d published", n)
	}
	var idle, scs string
	if err := pool.QueryRowContext(ctx, "SELECT current_setting('idle_in_transaction_session_timeout'), current_setting('standard_conforming_strings')").Scan(&idle, &scs); err != nil {
		t.Fatal(err)
	}
	if idle != "300ms" || scs != "off" {
		t.Errorf("session settings after the claim: %s %s", idle, scs)
	}
}
