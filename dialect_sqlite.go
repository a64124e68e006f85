package outbox

import (
	"context"
	"database/sql"
	"strings"
	"time"
)

// sqliteDialect holds all SQL text for SQLite (mattn/go-sqlite3).
type sqliteDialect struct{}

func (sqliteDialect) Name() string { return "sqlite" }

func (sqliteDialect) quoteIdent(part string) string { return `"` + part + `"` }

func (sqliteDialect) insertOutbox(table string, rows int) string {
	var b strings.Builder
	b.Grow(64 + rows*30)
	b.WriteString("INSERT INTO " + table + " (" + outboxColumns + ") VALUES ")
	valuesList(&b, rows, outboxColumnCount, questionMark)
	b.WriteString(" ON CONFLICT (id) DO NOTHING")
	return b.String()
}

// timeArg sends fixed-width UTC text (timeLayout), so text order is time
// order. The driver's own time.Time encoding trims trailing zeros and would
// not sort.
func (sqliteDialect) timeArg(t time.Time) any { return t.UTC().Format(timeLayout) }

func (sqliteDialect) rebind(q string) string { return q }

// leases: SQLite has no row locks, so a claim writes a lease into
// locked_by/locked_until and commits before publishing. A relay that dies
// leaves its rows until the lease expires.
func (sqliteDialect) leases() bool { return true }

func (sqliteDialect) purgePublished(table string) string {
	return "DELETE FROM " + table + " WHERE id IN (SELECT id FROM " + table +
		" WHERE published_at IS NOT NULL AND published_at < ? ORDER BY published_at LIMIT ?)"
}

func (sqliteDialect) withMigrationLock(ctx context.Context, conn *sql.Conn, fn func(execQuerier) error) error {
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

func (sqliteDialect) createMigrationsTable() string {
	return `CREATE TABLE IF NOT EXISTS acemq_schema_migrations (
    version    INTEGER  NOT NULL PRIMARY KEY,
    name       TEXT     NOT NULL,
    applied_at DATETIME NOT NULL DEFAULT (strftime('%Y-%m-%d %H:%M:%f000', 'now'))
)`
}

func (sqliteDialect) selectMigrations() string {
	return "SELECT version FROM acemq_schema_migrations"
}

func (sqliteDialect) insertMigration() string {
	return "INSERT INTO acemq_schema_migrations (version, name) VALUES (?, ?)"
}

func (sqliteDialect) insertProcessed(table string) string {
	return "INSERT INTO " + table + " (consumer_name, message_id, processed_at) VALUES (?, ?, ?) ON CONFLICT DO NOTHING"
}

func (sqliteDialect) purgeProcessed(table string) string {
	return "DELETE FROM " + table + " WHERE (consumer_name, message_id) IN (SELECT consumer_name, message_id FROM " + table + " WHERE processed_at < ? ORDER BY processed_at LIMIT ?)"
}

func (sqliteDialect) claimSetup() string { return "" }

func (sqliteDialect) pendingIndex() string { return "" }

// prepareRelay: compiling a statement in process costs no round trip.
func (sqliteDialect) prepareRelay() bool { return false }
