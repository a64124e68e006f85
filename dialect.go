package outbox

import (
	"database/sql"
	"database/sql/driver"
	"fmt"
	"reflect"

	"github.com/acemq/watermill-outbox/internal/sqldialect"
)

// Dialect is the SQL flavour of one database: [Postgres], [MySQL] (which also
// serves MariaDB) or [SQLite]. All SQL text lives in internal/sqldialect, one
// file per database; the rest of the package asks the dialect for a query.
// The interface is sealed.
type Dialect interface {
	// Name is "postgres", "mysql" or "sqlite", the folder of the dialect's
	// migrations in sqlschema.
	Name() string

	sql() sqldialect.Dialect
}

// The dialects. Compare them with ==.
var (
	Postgres Dialect = dialect{sqldialect.Postgres}
	MySQL    Dialect = dialect{sqldialect.MySQL}
	SQLite   Dialect = dialect{sqldialect.SQLite}
)

type dialect struct{ impl sqldialect.Dialect }

func (d dialect) Name() string            { return d.impl.Name() }
func (d dialect) sql() sqldialect.Dialect { return d.impl }
func (d dialect) String() string          { return d.impl.Name() }

// DefaultTable is the outbox table's name in every AceMQ library.
const DefaultTable = "acemq_outbox"

// dialectForDriver returns the dialect of a database/sql driver name, as
// *sqlx.Tx and *sqlx.DB report it.
func dialectForDriver(driverName string) (Dialect, error) {
	if d, ok := sqldialect.ForDriver(driverName); ok {
		return dialect{d}, nil
	}
	return nil, &ConfigError{Field: "Dialect", Reason: fmt.Sprintf("driver %q is not one this library knows (pgx, postgres, mysql, sqlite3); set the Dialect", driverName)}
}

// driverDialect is the dialect of drv where it is a driver this library
// knows by its package, and the package; ok is false for any other (one
// that wraps a known driver, to instrument it, say), which is not checked.
func driverDialect(drv driver.Driver) (d Dialect, pkg string, ok bool) {
	t := reflect.TypeOf(drv)
	for t != nil && t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	if t == nil {
		return nil, "", false
	}
	switch pkg = t.PkgPath(); pkg {
	case "github.com/jackc/pgx/v5/stdlib", "github.com/jackc/pgx/v4/stdlib", "github.com/lib/pq":
		return Postgres, pkg, true
	case "github.com/go-sql-driver/mysql":
		return MySQL, pkg, true
	case "github.com/mattn/go-sqlite3":
		return SQLite, pkg, true
	}
	return nil, pkg, false
}

// checkDialect refuses d for db where db's driver is another database's:
// set by mistake (a copied configuration, MySQL's Dialect over SQLite's
// pool), every statement failed later with an error of the database's
// that named nothing of the cause ("no such function:
// pg_advisory_xact_lock"), or, worse, some worked.
func checkDialect(db *sql.DB, d Dialect) error {
	if db == nil || d == nil {
		return nil
	}
	if got, pkg, ok := driverDialect(db.Driver()); ok && got != d {
		return dialectMismatch(d, got, "the database handle's driver ("+pkg+")", "*sqlx.DB")
	}
	return nil
}

// dialectMismatch is the error of d given where driver, of a handle of
// the type sqlxType would name it, is got's.
func dialectMismatch(d, got Dialect, driver, sqlxType string) error {
	return &ConfigError{Field: "Dialect", Reason: fmt.Sprintf("%s, but %s is %s's: set the driver's Dialect, or leave it nil with a %s", d.Name(), driver, got.Name(), sqlxType)}
}

// checkTxDialect is checkDialect for a *sqlx.Tx, which names its driver.
func checkTxDialect(driverName string, d Dialect) error {
	if d == nil {
		return nil
	}
	if got, ok := sqldialect.ForDriver(driverName); ok && (dialect{got}) != d {
		return dialectMismatch(d, dialect{got}, "the transaction's driver ("+driverName+")", "*sqlx.Tx")
	}
	return nil
}
