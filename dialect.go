package outbox

import (
	"context"
	"database/sql"
	"fmt"
	"strings"
	"time"
)

// Dialect is the SQL flavour of one database: [Postgres], [MySQL] (which also
// serves MariaDB) or [SQLite]. All SQL text of a dialect lives in its own file
// (dialect_postgres.go, dialect_mysql.go, dialect_sqlite.go); the rest of the
// package asks the dialect for a query. The interface is sealed.
type Dialect interface {
	// Name is "postgres", "mysql" or "sqlite", the folder of the dialect's
	// migrations in sqlschema.
	Name() string

	quoteIdent(part string) string
	// insertOutbox inserts rows messages, skipping ids already present,
	// with the columns of outboxColumns in that order.
	insertOutbox(table string, rows int) string
	// timeArg turns a UTC time into the argument the driver stores with
	// microsecond precision and in time order.
	timeArg(t time.Time) any
	// withMigrationLock runs fn while no other process migrates the same
	// database, on one connection.
	withMigrationLock(ctx context.Context, conn *sql.Conn, fn func(execQuerier) error) error
	// rebind turns the "?" placeholders of portable SQL into the dialect's.
	rebind(query string) string
	// claimSetup, if not empty, runs first in a locking claim's transaction.
	claimSetup() string
	// pendingIndex, if not empty, is a query for the name of the table's
	// index of pending rows (the one whose first column is published_at);
	// arguments: the table's schema (or NULL for the current one), its name.
	// The claims then name it, and may overlap only if it is found.
	pendingIndex() string
	// leases: claims are leases in locked_by/locked_until, committed before
	// publishing, rather than row locks held by an open transaction.
	leases() bool
	// prepareRelay: Run prepares the claims and the mark of a full batch
	// once rather than have the driver prepare them for every batch.
	prepareRelay() bool
	// purgePublished deletes at most ? rows published before ?.
	purgePublished(table string) string
	// insertProcessed records (consumer_name, message_id, processed_at) and
	// affects no row when the key is there already.
	insertProcessed(table string) string
	// purgeProcessed deletes at most ? inbox rows processed before ?.
	purgeProcessed(table string) string
	createMigrationsTable() string
	selectMigrations() string
	insertMigration() string
}

// The dialects. Compare them with ==.
var (
	Postgres Dialect = postgresDialect{}
	MySQL    Dialect = mysqlDialect{}
	SQLite   Dialect = sqliteDialect{}
)

// DialectForDriver returns the dialect of a database/sql driver name, as
// *sqlx.Tx and *sqlx.DB report it: "pgx", "pgx/v5", "postgres" (lib/pq),
// "mysql", "sqlite3".
func DialectForDriver(driverName string) (Dialect, error) {
	switch driverName {
	case "pgx", "pgx/v5", "postgres":
		return Postgres, nil
	case "mysql":
		return MySQL, nil
	case "sqlite3":
		return SQLite, nil
	}
	return nil, &ConfigError{Field: "dialect", Reason: fmt.Sprintf("driver %q is not one this library knows (pgx, postgres, mysql, sqlite3); pass outbox.WithDialect", driverName)}
}

// outboxColumns are the columns TxPublisher writes, in argument order.
const outboxColumns = "id, exchange_name, routing_key, body, body_encoding, content_type, headers, created_at"

const outboxColumnCount = 8

// timeLayout is the UTC text form of a timestamp for MySQL and SQLite:
// microseconds, fixed width.
const timeLayout = "2006-01-02 15:04:05.000000"

// DefaultTable is the outbox table's name in every AceMQ library.
const DefaultTable = "acemq_outbox"

// execQuerier is the part of *sql.Conn and *sql.Tx the migrator uses.
type execQuerier interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
	QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error)
}

// quoteTable validates a table name, "name" or "schema.name", each part an
// SQL identifier of letters, digits and underscores, and returns it quoted
// for the dialect. It is the only way a configurable name reaches SQL text.
func quoteTable(d Dialect, name string) (string, error) {
	parts := strings.Split(name, ".")
	if len(parts) > 2 {
		return "", fmt.Errorf("%q has more than one dot; want table or schema.table", name)
	}
	quoted := make([]string, len(parts))
	for i, p := range parts {
		if err := validIdent(p); err != nil {
			return "", fmt.Errorf("%q: %w", name, err)
		}
		quoted[i] = d.quoteIdent(p)
	}
	return strings.Join(quoted, "."), nil
}

func validIdent(s string) error {
	if s == "" {
		return fmt.Errorf("empty identifier")
	}
	if len(s) > 63 {
		return fmt.Errorf("identifier longer than 63 characters")
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case c == '_', 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z':
		case '0' <= c && c <= '9' && i > 0:
		default:
			return fmt.Errorf("identifier may hold only letters, digits and underscores, not starting with a digit")
		}
	}
	return nil
}

// valuesList writes "(p1, p2, …), (…)" for rows rows of cols columns, with
// placeholder(n) giving the n-th (1-based) placeholder.
func valuesList(b *strings.Builder, rows, cols int, placeholder func(n int) string) {
	n := 1
	for r := 0; r < rows; r++ {
		if r > 0 {
			b.WriteString(", ")
		}
		b.WriteByte('(')
		for c := 0; c < cols; c++ {
			if c > 0 {
				b.WriteString(", ")
			}
			b.WriteString(placeholder(n))
			n++
		}
		b.WriteByte(')')
	}
}

func questionMark(int) string { return "?" }
