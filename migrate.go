package outbox

import (
	"context"
	"database/sql"
	"fmt"

	"github.com/acemq/watermill-outbox/internal/sqldialect"
	"github.com/acemq/watermill-outbox/sqlschema"
)

// Migrate creates or updates the outbox and inbox tables (acemq_outbox,
// processed_messages) in db, applying the dialect's files of the sqlschema
// package that this database has not had yet.
//
// It is safe to run on every boot, and from several processes at once: on
// PostgreSQL an advisory lock and on MySQL a named lock make the others wait,
// and the applied versions are recorded in acemq_schema_migrations. Every
// statement is also idempotent, so a database first migrated with goose or
// golang-migrate is left as it is.
func Migrate(ctx context.Context, db *sql.DB, d Dialect) error {
	if d == nil {
		return &ConfigError{Field: "dialect", Reason: "nil; pass outbox.Postgres, outbox.MySQL or outbox.SQLite"}
	}
	migrations, err := sqlschema.Migrations(d.Name())
	if err != nil {
		return err
	}
	conn, err := db.Conn(ctx)
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
			for _, stmt := range sqlschema.Statements(m.Up) {
				if _, err := q.ExecContext(ctx, stmt); err != nil {
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
