package outbox

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"sync"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/acemq/watermill-outbox/internal/sqldialect"
)

// claimTx is the transaction a locking claim holds its rows under, and
// marks them in: a *sql.Tx, or on PostgreSQL through pgx's database/sql
// driver a pgClaimTx.
type claimTx interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
	QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error)
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
	Commit() error
	Rollback() error
}

// beginClaim begins a locking claim's transaction on conn, READ COMMITTED,
// with the dialect's settings for the claim (ClaimSetup) made in it. txCtx
// is what the transaction begins with: its end rolls it back.
func (s *Store) beginClaim(ctx, txCtx context.Context, conn *sql.Conn) (claimTx, error) {
	setup := s.q.ClaimSetup()
	if s.dialect == Postgres && setup.SQL != "" && len(setup.Args) == 0 {
		if tx, err := beginPgxClaim(ctx, txCtx, conn, setup.SQL); tx != nil || err != nil {
			return tx, err
		}
	}
	tx, err := conn.BeginTx(txCtx, &sql.TxOptions{Isolation: sql.LevelReadCommitted})
	if err != nil {
		return nil, err
	}
	if setup.SQL != "" {
		if _, err := tx.ExecContext(ctx, setup.SQL, setup.Args...); err != nil {
			_ = tx.Rollback()
			return nil, err
		}
	}
	return tx, nil
}

// pgClaimTx is a claim's transaction on PostgreSQL through pgx, begun by
// hand on its connection: BEGIN and the claim's settings go to the server
// as one simple-protocol statement, where a *sql.Tx sends BEGIN, waits,
// and then the settings, and waits again; and the mark of a batch goes
// with COMMIT (markAndCommit). The settings' round trip was a quarter of
// the time from commit to broker at 2,000 messages a second on a 2-core
// machine (p50 11.0–11.9 ms against 8.1–8.9 without it; see
// docs/measurements.md, 2026-12-05).
//
// database/sql does not know of the transaction, so pgClaimTx keeps what a
// *sql.Tx promises: it ends once, by COMMIT or ROLLBACK (a second end, or
// one racing it, is sql.ErrTxDone and sends nothing), and its connection
// goes back to the pool at that end; a statement after the end, or one
// that comes while the end is on the wire, waits for it and fails
// (sql.ErrTxDone, sql.ErrConnDone from QueryRowContext's Scan) rather than
// run outside the transaction; a COMMIT the server answers with ROLLBACK
// (the transaction had failed) is an error, as pgx's own Tx.Commit makes
// it; and a connection whose transaction could not be ended is discarded,
// never handed to the pool's next user inside it (pgx's driver discards
// one anyway, should it come back in a transaction).
//
// As a *sql.Tx's, its end closes the *sql.Rows its QueryContext returned
// and left open before it sends COMMIT or ROLLBACK (should reading a
// Rows to its end fail, the connection is lost, and so is the end: the
// connection is discarded). A
// *sql.Row never scanned keeps its statement open, and the end fails, its
// connection busy: scan every QueryRowContext's row.
type pgClaimTx struct {
	conn *sql.Conn
	ctx  context.Context // txCtx: COMMIT and ROLLBACK run with it, as a *sql.Tx's do
	// mu is held for reading by each statement while it is sent, and for
	// writing by the end, which sets done.
	mu   sync.RWMutex
	done bool
	// rows are what QueryContext returned, closed at the end; rowsMu
	// guards the slice, appended to under mu's read lock.
	rowsMu sync.Mutex
	rows   []*sql.Rows
}

// ending takes the transaction's end for the caller, and closes the Rows
// left open on it: false if it has ended already. The caller unlocks mu
// when the end is over.
func (t *pgClaimTx) ending() bool {
	t.mu.Lock()
	if t.done {
		t.mu.Unlock()
		return false
	}
	t.done = true
	for _, r := range t.rows {
		_ = r.Close() // its error is the end's: a connection still busy fails it
	}
	t.rows = nil
	return true
}

// errCommitRolledBack: the claim's transaction had failed, and COMMIT
// rolled it back.
var errCommitRolledBack = errors.New("the transaction had failed: COMMIT rolled it back")

// beginPgxClaim begins a pgClaimTx on conn with setup in it; nil and no
// error when conn is not pgx's.
func beginPgxClaim(ctx, txCtx context.Context, conn *sql.Conn, setup string) (claimTx, error) {
	var (
		pgx   bool
		began error
	)
	err := conn.Raw(func(driverConn any) error {
		sc, ok := driverConn.(*stdlib.Conn)
		if !ok {
			return nil
		}
		pgx = true
		if err := txCtx.Err(); err != nil {
			began = err
			return nil
		}
		// No arguments: pgx sends it by the simple protocol, which takes
		// several statements.
		if _, began = sc.Conn().Exec(ctx, "BEGIN ISOLATION LEVEL READ COMMITTED; "+setup); began != nil {
			// BEGIN may have run and the settings failed: the connection is
			// in a failed transaction. Not worth a ROLLBACK's round trip.
			return driver.ErrBadConn
		}
		return nil
	})
	switch {
	case !pgx:
		return nil, nil
	case began != nil:
		return nil, began
	case err != nil:
		return nil, err
	}
	return &pgClaimTx{conn: conn, ctx: txCtx}, nil
}

// markAndCommit runs mark, the mark of the batch's published rows, and
// COMMIT in one round trip (a pgx batch: both statements, then one Sync),
// where ExecContext and Commit take two, and gives the connection back. It
// returns the rows mark changed. Should mark fail, the server skips the
// COMMIT: the transaction is rolled back, its connection discarded if even
// that fails, and the error is mark's. Its errors say which statement
// failed as the *sql.Tx path's do ("mark published: …", "commit marks:
// …"), and a connection lost once the mark had run, that the COMMIT's
// outcome is unknown.
func (t *pgClaimTx) markAndCommit(ctx context.Context, mark sqldialect.Query) (int64, error) {
	if !t.ending() {
		return 0, sql.ErrTxDone
	}
	defer t.mu.Unlock()
	var (
		marked int64
		ended  error
	)
	err := t.conn.Raw(func(driverConn any) error {
		conn := driverConn.(*stdlib.Conn).Conn()
		batch := &pgx.Batch{}
		batch.Queue(mark.SQL, mark.Args...)
		batch.Queue("COMMIT")
		results := conn.SendBatch(ctx, batch)
		tag, err := results.Exec()
		if err != nil {
			err = fmt.Errorf("mark published: %w", err)
		} else {
			marked = tag.RowsAffected()
			tag, err = results.Exec()
			switch {
			case err != nil && conn.IsClosed():
				err = fmt.Errorf("commit marks (the connection lost: committed or not, unknown): %w", err)
			case err != nil:
				err = fmt.Errorf("commit marks: %w", err)
			case tag.String() == "ROLLBACK":
				ended = fmt.Errorf("commit marks: %w", errCommitRolledBack)
			}
		}
		if cerr := results.Close(); err == nil && cerr != nil {
			err = fmt.Errorf("mark published and commit: %w", cerr)
		}
		if err == nil {
			return nil
		}
		ended = err
		if !conn.IsClosed() && conn.PgConn().TxStatus() == 'I' {
			return nil // over: COMMIT's own failure (a deferred constraint) rolled it back
		}
		if _, rerr := conn.Exec(ctx, "ROLLBACK"); rerr != nil || conn.PgConn().TxStatus() != 'I' {
			return driver.ErrBadConn
		}
		return nil
	})
	if errors.Is(err, sql.ErrConnDone) {
		return 0, sql.ErrTxDone
	}
	_ = t.conn.Close()
	if ended != nil {
		return marked, ended
	}
	return marked, err
}

func (t *pgClaimTx) ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error) {
	t.mu.RLock()
	defer t.mu.RUnlock()
	if t.done {
		return nil, sql.ErrTxDone
	}
	return t.conn.ExecContext(ctx, query, args...)
}

func (t *pgClaimTx) QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error) {
	t.mu.RLock()
	defer t.mu.RUnlock()
	if t.done {
		return nil, sql.ErrTxDone
	}
	rows, err := t.conn.QueryContext(ctx, query, args...)
	if err == nil {
		t.rowsMu.Lock()
		t.rows = append(t.rows, rows)
		t.rowsMu.Unlock()
	}
	return rows, err
}

// QueryRowContext: after the end, the connection is closed, and the row's
// Scan fails with sql.ErrConnDone.
func (t *pgClaimTx) QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row {
	t.mu.RLock()
	defer t.mu.RUnlock()
	return t.conn.QueryRowContext(ctx, query, args...)
}

// Commit commits the transaction and gives its connection back.
func (t *pgClaimTx) Commit() error { return t.end("COMMIT") }

// Rollback rolls the transaction back and gives its connection back.
func (t *pgClaimTx) Rollback() error { return t.end("ROLLBACK") }

// end sends stmt, COMMIT or ROLLBACK, and closes the transaction's
// connection, discarding it unless the transaction is known to be over.
func (t *pgClaimTx) end(stmt string) error {
	if !t.ending() {
		return sql.ErrTxDone
	}
	defer t.mu.Unlock()
	var ended error
	err := t.conn.Raw(func(driverConn any) error {
		conn := driverConn.(*stdlib.Conn).Conn()
		tag, err := conn.Exec(t.ctx, stmt)
		switch {
		case err != nil && !conn.IsClosed() && conn.PgConn().TxStatus() == 'I':
			ended = err // the server's refusal (a deferred constraint's): over, and the connection sound
		case err != nil:
			ended = err
			return driver.ErrBadConn
		case stmt == "COMMIT" && tag.String() == "ROLLBACK":
			ended = errCommitRolledBack
		}
		return nil
	})
	if errors.Is(err, sql.ErrConnDone) {
		return sql.ErrTxDone
	}
	_ = t.conn.Close()
	if ended != nil {
		return fmt.Errorf("%s: %w", stmt, ended)
	}
	return err
}
