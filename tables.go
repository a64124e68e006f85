package outbox

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

	"github.com/acemq/watermill-outbox/internal/sqldialect"
)

// This file holds what the Store and the Inbox both ask of a table: a
// purge in bounded batches, a count, a probe.

// dbConn is the part of *sql.DB and *sqlx.DB these helpers use.
type dbConn interface {
	sqldialect.Execer
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
	BeginTx(ctx context.Context, opts *sql.TxOptions) (*sql.Tx, error)
}

// inBatches deletes the rows older than olderThan in batches of at most
// batch rows (del), until one deletes fewer, and returns how many it
// deleted, also on an error: the batches before it are committed. Bounded
// batches keep a purge over millions of rows from holding long locks.
// Each batch starts where the last ended (from: the batch-th row's time,
// which bound reads first, as stored), not at the head of the index, whose
// entries of the rows deleted before stay while any transaction older than
// them is open (see sqldialect's PurgePublishedBound). what names the
// purge in its errors.
func inBatches(ctx context.Context, db dbConn, d sqldialect.Dialect, what string, olderThan time.Duration, batch int,
	bound func(cutoff time.Time, from any, n int) sqldialect.Query,
	del func(cutoff time.Time, limit int, from, upTo any) sqldialect.Query) (int64, error) {
	if olderThan < 0 {
		return 0, &ConfigError{Field: "olderThan", Reason: "negative duration"}
	}
	cutoff := time.Now().Add(-olderThan)
	var (
		total int64
		from  any
	)
	for {
		var upTo any
		b := bound(cutoff, from, batch-1)
		switch err := db.QueryRowContext(ctx, b.SQL, b.Args...).Scan(&upTo); {
		case errors.Is(err, sql.ErrNoRows):
			upTo = nil // fewer than batch left: the last batch
		case err != nil:
			return total, fmt.Errorf("outbox: %s: %w", what, err)
		}
		n, err := execRange(ctx, db, d, del(cutoff, batch, from, upTo))
		if err != nil {
			return total, fmt.Errorf("outbox: %s: %w", what, err)
		}
		total += n
		if upTo == nil || n < int64(batch) {
			// The last, or a batch short of rows another transaction took
			// or changed meanwhile (locked, made pending again): those left
			// wait for the next purge, as before.
			return total, nil
		}
		from = upTo
	}
}

// execAffected runs q and returns the rows it affected.
func execAffected(ctx context.Context, db sqldialect.Execer, q sqldialect.Query) (int64, error) {
	res, err := db.ExecContext(ctx, q.SQL, q.Args...)
	if err != nil {
		return 0, err
	}
	return res.RowsAffected()
}

// execRange runs q, a write over a range of rows (a purge, a retry of
// every stuck row, a republish), and returns the rows it affected: where the database
// takes gap locks (MySQL), in a READ COMMITTED transaction of its own.
// Under REPEATABLE READ an operator's retry --all-stuck beside running
// services failed some of their transactions with deadlocks, and a purge
// held their inserts back while it ran.
func execRange(ctx context.Context, db dbConn, d sqldialect.Dialect, q sqldialect.Query) (int64, error) {
	if !d.GapLocks() {
		return execAffected(ctx, db, q)
	}
	tx, err := db.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelReadCommitted})
	if err != nil {
		return 0, err
	}
	defer func() { _ = tx.Rollback() }() // a no-op after the commit
	n, err := execAffected(ctx, tx, q)
	if err != nil {
		return 0, err
	}
	return n, tx.Commit()
}

// count runs a COUNT query of table.
func count(ctx context.Context, db dbConn, q sqldialect.Query, table string) (int64, error) {
	var n int64
	if err := db.QueryRowContext(ctx, q.SQL, q.Args...).Scan(&n); err != nil {
		return 0, fmt.Errorf("outbox: count %s: %w", table, err)
	}
	return n, nil
}

// probe asks whether table is there and readable, reading no row.
func probe(ctx context.Context, db dbConn, q sqldialect.Query, table string) error {
	rows, err := db.QueryContext(ctx, q.SQL, q.Args...)
	if err != nil {
		return fmt.Errorf("outbox: %s: %w", table, err)
	}
	return rows.Close()
}
