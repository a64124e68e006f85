package outbox

import (
	"context"
	"database/sql"
	"errors"
	"fmt"

	"github.com/jmoiron/sqlx"

	"github.com/acemq/watermill-outbox/internal/sqldialect"
	"github.com/acemq/watermill-outbox/sqlschema"
)

// Migrate creates or updates the outbox and inbox tables in db, applying
// the dialect's files of the sqlschema package that this database has not
// had yet: acemq_outbox, processed_messages, and for per-aggregate order
// acemq_outbox_sequences (the publisher's numbers), acemq_inbox_held and
// acemq_inbox_sequences (the ordered inbox's), with the applied versions
// in acemq_schema_migrations.
//
// It is safe to run on every boot, and from several processes at once: on
// PostgreSQL an advisory lock, on MySQL a named lock and on SQLite the
// file's write lock (a transaction begun IMMEDIATE, waiting up to the busy
// timeout) make the others wait. On PostgreSQL the pending steps run in one
// transaction, and the writes to a table a step indexes or alters wait
// until it commits (see the README's Upgrading). Every
// statement is also idempotent, so a database first migrated with goose or
// golang-migrate is left as it is.
//
// An acemq_outbox that another AceMQ library created (Rails' migration, say)
// is brought up to date in place: what this library needs and the table
// lacks (processed_at, the index of pending rows the relay's claim walks, on
// PostgreSQL the trigger that wakes the relay) is added, and no row is
// dropped or changed. The columns keep their types but for one change:
// times (created_at, published_at, locked_until, processed_at) that keep
// less than microseconds, as Rails before 7.0 made them, are raised to
// microseconds, their type family, nullability and default kept
// (sqlschema's 0011), for the publisher tells its own rows by created_at
// to the microsecond. On PostgreSQL that rewrites no row but builds the
// partial indexes over those columns again; on MySQL it rebuilds the
// table; either once, and writes to the table wait meanwhile. The table is,
// on PostgreSQL, the one the unqualified name acemq_outbox resolves to on
// db's search_path: with search_path=svc,public and the estate's table in
// public, Migrate works in public, and creates nothing in svc.
//
// db is a *sql.DB or a *sqlx.DB; with a *sqlx.DB, d may be nil (its driver
// names the dialect), as for the other constructors.
func Migrate(ctx context.Context, db any, d Dialect) error {
	var sdb *sql.DB
	switch h := db.(type) {
	case *sql.DB:
		sdb = h
	case *sqlx.DB:
		if h != nil {
			sdb = h.DB
			if d == nil {
				var err error
				if d, err = dialectForDriver(h.DriverName()); err != nil {
					return err
				}
			}
		}
	default:
		return &ConfigError{Field: "db", Reason: fmt.Sprintf("%T; want a *sql.DB or *sqlx.DB", db)}
	}
	if sdb == nil {
		return &ConfigError{Field: "db", Reason: "nil"}
	}
	if d == nil {
		return &ConfigError{Field: "dialect", Reason: "nil; pass outbox.Postgres, outbox.MySQL or outbox.SQLite"}
	}
	if err := checkDialect(sdb, d); err != nil {
		return err
	}
	migrations, err := sqlschema.Migrations(d.Name())
	if err != nil {
		return err
	}
	conn, err := sdb.Conn(ctx)
	if err != nil {
		return fmt.Errorf("outbox: migrate: %w", err)
	}
	defer conn.Close()

	sd := d.sql()
	err = sd.WithMigrationLock(ctx, conn, func(q sqldialect.Execer) error {
		if err := execQuery(ctx, q, sqldialect.CreateMigrationsTable(sd)); err != nil {
			return err
		}
		applied, err := appliedVersions(ctx, q)
		if err != nil {
			return err
		}
		for _, m := range migrations {
			if applied[m.Version] {
				continue
			}
			for _, step := range m.UpSteps {
				if err := runStep(ctx, q, step); err != nil {
					return fmt.Errorf("%s: %w", m.Name, err)
				}
			}
			if err := execQuery(ctx, q, sqldialect.InsertMigration(sd, m.Version, m.Name)); err != nil {
				return fmt.Errorf("%s: recording it: %w", m.Name, err)
			}
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("outbox: migrate %s: %w", d.Name(), err)
	}
	return nil
}

// runStep runs a step of a migration: its statement, unless its guard's
// query returns a row (see sqlschema.Steps).
func runStep(ctx context.Context, q sqldialect.Execer, step sqlschema.Step) error {
	if step.Unless != "" {
		rows, err := q.QueryContext(ctx, step.Unless)
		if err != nil {
			return err
		}
		found := rows.Next()
		if err := errors.Join(rows.Err(), rows.Close()); err != nil {
			return err
		}
		if found {
			return nil
		}
	}
	_, err := q.ExecContext(ctx, step.Run)
	return err
}

func execQuery(ctx context.Context, q sqldialect.Execer, query sqldialect.Query) error {
	_, err := q.ExecContext(ctx, query.SQL, query.Args...)
	return err
}

func appliedVersions(ctx context.Context, q sqldialect.Execer) (map[int]bool, error) {
	sel := sqldialect.SelectMigrations()
	rows, err := q.QueryContext(ctx, sel.SQL, sel.Args...)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	applied := map[int]bool{}
	for rows.Next() {
		var v int
		if err := rows.Scan(&v); err != nil {
			return nil, err
		}
		applied[v] = true
	}
	return applied, rows.Err()
}
