package outbox

import (
	"fmt"

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
