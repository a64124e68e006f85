package sqldialect

import (
	"context"
	"database/sql"
	"time"
)

// sqlite holds all SQL text for SQLite (mattn/go-sqlite3).
type sqlite struct{}

func (sqlite) Name() string       { return "sqlite" }
func (sqlite) DriverName() string { return "sqlite3" }

func (sqlite) quoteIdent(part string) string { return `"` + part + `"` }

// TimeArg sends fixed-width UTC text (timeLayout), so text order is time
// order. The driver's own time.Time encoding trims trailing zeros and would
// not sort.
func (sqlite) TimeArg(t time.Time) any { return t.UTC().Format(timeLayout) }

// fromDriver: mattn/go-sqlite3 parses zoneless text as UTC, text with an
// offset at its offset, and then moves the time to the DSN's _loc, keeping
// the instant.
func (sqlite) fromDriver(t time.Time) time.Time { return instant(t) }

func (sqlite) rebind(q string) string { return q }

func (sqlite) Listens() bool { return false }

// Leases: SQLite has no row locks, so a claim writes a lease into
// locked_by/locked_until and commits before publishing. A relay that dies
// leaves its rows until the lease expires.
func (sqlite) Leases() bool { return true }

// PreparesRelay: compiling a statement in process costs no round trip.
func (sqlite) PreparesRelay() bool { return false }

func (sqlite) insertOutbox(table, cols string, n, rows int) string {
	return insertOutboxOnConflict(table, cols, n, rows, questionMark)
}

func (d sqlite) allocateSeq(sequences, key string, n int) (Query, bool) {
	return Query{SQL: d.rebind(allocateSeqReturning(sequences)), Args: []any{key, n}}, true
}

// claim leases the rows: the update is conditional on the rows still being
// free, so of two relays the second claims other rows, or none. RETURNING
// promises no order: the caller sorts.
func (sqlite) claim(table string, p ClaimParams, where string, args []any) Query {
	lease := []any{p.RelayID, sqlite{}.TimeArg(p.LeaseUntil)}
	return Query{
		SQL: "UPDATE " + table + " SET locked_by = ?, locked_until = ? WHERE id IN (SELECT id FROM " + table + " " + claimAlias +
			" WHERE " + where + " ORDER BY created_at, id LIMIT ?) RETURNING " + claimColumns,
		Args: append(append(lease, args...), p.Limit),
	}
}

func (sqlite) keyHead(table, alias string, _ ClaimParams) string {
	return keyHeadNotExists(table, alias)
}

func (sqlite) claimSetup() string { return "" }

func (sqlite) pendingIndex() string { return "" }

func (sqlite) keyIndex() string { return "" }

func (sqlite) purgePublished(table string) string { return purgePublishedByKey(table) }

func (sqlite) insertProcessed(table string) string { return insertProcessedOnConflict(table) }

func (sqlite) purgeProcessed(table string) string { return purgeProcessedByKey(table) }

func (sqlite) insertInboxSequence() string { return insertInboxSequenceOnConflict }

func (sqlite) insertInboxHeld() string { return insertInboxHeldOnConflict }

func (d sqlite) advanceInboxSequence(ctx context.Context, tx Execer, consumer, key string, seq int64) (bool, error) {
	q := Query{SQL: d.rebind(advanceInboxSequenceOnConflict), Args: []any{consumer, key, firstSeq(seq), seq, seq - 1}}
	return advanceOnConflict(ctx, tx, q, seq)
}

// lockInboxSequence: SQLite has no row locks. The insert-if-absent before it
// is a write, which takes the database's write lock for the rest of the
// transaction (at BEGIN already under _txlock=immediate), so the read is as
// good as a lock.
func (sqlite) lockInboxSequence() string { return selectInboxSequence }

func (sqlite) WithMigrationLock(ctx context.Context, conn *sql.Conn, fn func(Execer) error) error {
	// The first DDL statement takes SQLite's write lock for the rest of the
	// transaction; a second process waits on its busy timeout.
	tx, err := conn.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback() }()
	if err := fn(tx); err != nil {
		return err
	}
	return tx.Commit()
}

func (sqlite) createMigrationsTable() string {
	return `CREATE TABLE IF NOT EXISTS acemq_schema_migrations (
    version    INTEGER  NOT NULL PRIMARY KEY,
    name       TEXT     NOT NULL,
    applied_at DATETIME NOT NULL DEFAULT (strftime('%Y-%m-%d %H:%M:%f000', 'now'))
)`
}

func (sqlite) insertMigration() string {
	return "INSERT INTO acemq_schema_migrations (version, name) VALUES (?, ?)"
}
