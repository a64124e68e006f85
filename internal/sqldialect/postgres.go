package sqldialect

import (
	"context"
	"database/sql"
	"time"
)

// postgres holds all SQL text for PostgreSQL.
type postgres struct{}

func (postgres) Name() string       { return "postgres" }
func (postgres) DriverName() string { return "pgx" }

func (postgres) quoteIdent(part string) string { return `"` + part + `"` }

// TimeArg sends the time in UTC. For a timestamptz column the zone makes no
// difference; a timestamp column (without time zone, as Rails and the other
// AceMQ libraries create acemq_outbox) gets the time's wall clock from pgx,
// which under a TZ other than UTC would store local time in a table every
// other service reads as UTC, and compare leases and cutoffs off by hours.
func (postgres) TimeArg(t time.Time) any { return t.UTC() }

// fromDriver: pgx returns a timestamptz as its instant (in time.Local) and a
// timestamp as its stored wall clock in UTC, which is the UTC time written.
func (postgres) fromDriver(t time.Time) time.Time { return instant(t) }

func (postgres) rebind(q string) string { return rebindDollar(q) }

// Listens: a trigger notifies NotifyChannel at commit
// (sqlschema/postgres/0003_notify_acemq_outbox.up.sql).
func (postgres) Listens() bool { return true }

// NotifyChannel is the channel the acemq_outbox trigger notifies on commit.
const NotifyChannel = "acemq_outbox"

// Listen subscribes a connection to NotifyChannel.
func Listen() Query { return Query{SQL: "LISTEN " + NotifyChannel} }

// Leases: PostgreSQL has FOR UPDATE SKIP LOCKED, so a claim is a row lock
// held by the relay's transaction. A relay that dies releases it with its
// connection, at once; a second relay skips the locked rows.
func (postgres) Leases() bool { return false }

// PreparesRelay: pgx caches the statements it prepares on each connection
// already, and a DSN set up for a pooler that cannot keep them (pgbouncer in
// transaction mode) must have its way.
func (postgres) PreparesRelay() bool { return false }

func (postgres) insertOutbox(table, cols string, n, rows int) string {
	return insertOutboxOnConflict(table, cols, n, rows, dollar)
}

func (d postgres) allocateSeq(sequences, key string, n int) (Query, bool) {
	return Query{SQL: d.rebind(allocateSeqReturning(sequences)), Args: []any{key, n}}, true
}

func (postgres) claim(table string, p ClaimParams, where string, args []any) Query {
	return Query{SQL: rebindDollar(lockingClaim(table+" "+claimAlias, where)), Args: append(args, p.Limit)}
}

func (postgres) keyHead(table, alias string, _ ClaimParams) string {
	return keyHeadNotExists(table, alias)
}

// claimSetup makes the planner walk the pending index in order, which is the
// only good plan for the claim. Statistics gathered while the table was
// small (a new table, or a quiet one before an outage's backlog) make it
// believe a handful of rows are pending, and it then fetches all of them
// and sorts them: 9 ms per claim over 20,000 pending rows, 165 ms over
// 200,000, against a fraction of a millisecond. SET LOCAL ends with the
// claim's transaction.
func (postgres) claimSetup() string { return "SET LOCAL enable_sort = off" }

// pendingIndex: the partial index is found by the planner; nothing to name.
func (postgres) pendingIndex() string { return "" }

func (postgres) keyIndex() string { return "" }

func (postgres) purgePublished(table string) string { return purgePublishedByKey(table) }

func (postgres) insertProcessed(table string) string { return insertProcessedOnConflict(table) }

func (postgres) purgeProcessed(table string) string { return purgeProcessedByKey(table) }

func (postgres) insertInboxSequence() string { return insertInboxSequenceOnConflict }

func (postgres) insertInboxHeld() string { return insertInboxHeldOnConflict }

func (d postgres) advanceInboxSequence(ctx context.Context, tx Execer, consumer, key string, seq int64) (bool, error) {
	q := Query{SQL: d.rebind(advanceInboxSequenceOnConflict), Args: []any{consumer, key, firstSeq(seq), seq, seq - 1}}
	return advanceOnConflict(ctx, tx, q, seq)
}

func (postgres) lockInboxSequence() string { return selectInboxSequence + " FOR UPDATE" }

// migrationLockKey is an arbitrary constant shared by every process that
// migrates: pg_advisory_xact_lock makes the second one wait for the first.
const migrationLockKey = 0x6163656d71 // "acemq"

func (postgres) WithMigrationLock(ctx context.Context, conn *sql.Conn, fn func(Execer) error) error {
	// DDL is transactional on PostgreSQL: the lock, the schema and the record
	// of it commit together, and a failure leaves nothing half-made.
	tx, err := conn.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback() }()
	if _, err := tx.ExecContext(ctx, "SELECT pg_advisory_xact_lock($1)", migrationLockKey); err != nil {
		return err
	}
	if err := fn(tx); err != nil {
		return err
	}
	return tx.Commit()
}

func (postgres) createMigrationsTable() string {
	return `CREATE TABLE IF NOT EXISTS acemq_schema_migrations (
    version    integer        PRIMARY KEY,
    name       varchar(255)   NOT NULL,
    applied_at timestamptz(6) NOT NULL DEFAULT now()
)`
}

func (postgres) insertMigration() string {
	return "INSERT INTO acemq_schema_migrations (version, name) VALUES ($1, $2)"
}
