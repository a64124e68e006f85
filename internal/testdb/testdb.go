// Package testdb gives tests and benchmarks an isolated, real database: a
// schema of its own on PostgreSQL, a database of its own on MySQL/MariaDB, a
// file of its own on SQLite, each dropped afterwards.
//
// The servers are the local ones the README names, or those of the
// OUTBOX_TEST_POSTGRES_DSN, OUTBOX_TEST_MYSQL_DSN and OUTBOX_TEST_AMQP_URL
// environment variables. A test whose server does not answer is skipped with
// the reason printed, except under CI=true, where it fails: CI must never
// pass by skipping.
package testdb

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-sql-driver/mysql"
	_ "github.com/jackc/pgx/v5/stdlib" // registers "pgx"
	"github.com/jmoiron/sqlx"
	_ "github.com/mattn/go-sqlite3" // registers "sqlite3"
)

// Kinds of database, named as the dialects are.
const (
	Postgres = "postgres"
	MySQL    = "mysql"
	SQLite   = "sqlite"
)

// Kinds lists every kind, in the order tests run them.
var Kinds = []string{Postgres, MySQL, SQLite}

// Defaults for the local services (docker-compose.yml and CI).
const (
	DefaultPostgresDSN = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"
	DefaultMySQLDSN    = "root@tcp(127.0.0.1:3306)/test"
	DefaultAMQPURL     = "amqp://guest:guest@127.0.0.1:5672/"
)

// PostgresDSN is the server tests use, from OUTBOX_TEST_POSTGRES_DSN.
func PostgresDSN() string { return env("OUTBOX_TEST_POSTGRES_DSN", DefaultPostgresDSN) }

// MySQLDSN is the server tests use, from OUTBOX_TEST_MYSQL_DSN.
func MySQLDSN() string { return env("OUTBOX_TEST_MYSQL_DSN", DefaultMySQLDSN) }

// AMQPURL is the broker tests use, from OUTBOX_TEST_AMQP_URL.
func AMQPURL() string { return env("OUTBOX_TEST_AMQP_URL", DefaultAMQPURL) }

func env(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}

// DB is one isolated database.
type DB struct {
	*sqlx.DB
	Kind string
	// DSN opens more connections to the same isolated database, as another
	// process of the same service would.
	DSN  string
	Name string // schema (postgres), database (mysql) or file (sqlite)
	drop func() error
}

// Close closes the pool and drops the isolated database.
func (d *DB) Close() error {
	err := d.DB.Close()
	if d.drop != nil {
		if dropErr := d.drop(); err == nil {
			err = dropErr
		}
	}
	return err
}

// Open creates an isolated database of the given kind. dir holds the file of
// an SQLite database.
func Open(ctx context.Context, kind, dir string) (*DB, error) {
	name := "t_" + randomHex(6)
	switch kind {
	case Postgres:
		return openPostgres(ctx, name)
	case MySQL:
		return openMySQL(ctx, name)
	case SQLite:
		return openSQLite(filepath.Join(dir, name+".db"))
	}
	return nil, fmt.Errorf("testdb: unknown kind %q", kind)
}

func openPostgres(ctx context.Context, schema string) (*DB, error) {
	admin, err := sqlx.Open("pgx", PostgresDSN())
	if err != nil {
		return nil, err
	}
	defer admin.Close()
	if _, err := admin.ExecContext(ctx, "CREATE SCHEMA "+schema); err != nil {
		return nil, fmt.Errorf("testdb: postgres at %s: %w", redact(PostgresDSN()), err)
	}
	u, err := url.Parse(PostgresDSN())
	if err != nil {
		return nil, err
	}
	q := u.Query()
	q.Set("search_path", schema) // pgx sends unknown parameters as run-time settings
	u.RawQuery = q.Encode()
	dsn := u.String()
	db, err := sqlx.Open("pgx", dsn)
	if err != nil {
		return nil, err
	}
	return &DB{DB: db, Kind: Postgres, DSN: dsn, Name: schema, drop: func() error {
		admin, err := sqlx.Open("pgx", PostgresDSN())
		if err != nil {
			return err
		}
		defer admin.Close()
		_, err = admin.Exec("DROP SCHEMA " + schema + " CASCADE")
		return err
	}}, nil
}

func openMySQL(ctx context.Context, database string) (*DB, error) {
	admin, err := sqlx.Open("mysql", MySQLDSN())
	if err != nil {
		return nil, err
	}
	defer admin.Close()
	if _, err := admin.ExecContext(ctx, "CREATE DATABASE "+database); err != nil {
		return nil, fmt.Errorf("testdb: mysql at %s: %w", redact(MySQLDSN()), err)
	}
	cfg, err := mysql.ParseDSN(MySQLDSN())
	if err != nil {
		return nil, err
	}
	cfg.DBName = database
	cfg.ParseTime = true
	cfg.Loc = time.UTC
	dsn := cfg.FormatDSN()
	db, err := sqlx.Open("mysql", dsn)
	if err != nil {
		return nil, err
	}
	return &DB{DB: db, Kind: MySQL, DSN: dsn, Name: database, drop: func() error {
		admin, err := sqlx.Open("mysql", MySQLDSN())
		if err != nil {
			return err
		}
		defer admin.Close()
		_, err = admin.Exec("DROP DATABASE IF EXISTS " + database)
		return err
	}}, nil
}

// SQLiteDSN is how the library's own tests and examples open SQLite: WAL, so
// readers do not block the writer; a busy timeout, so a second writer waits
// rather than failing; and BEGIN IMMEDIATE, so a transaction takes the write
// lock when it starts and two writers never deadlock on the upgrade.
func SQLiteDSN(path string) string {
	return "file:" + path + "?_journal_mode=WAL&_busy_timeout=10000&_txlock=immediate&_foreign_keys=on&_stmt_cache_size=32"
}

func openSQLite(path string) (*DB, error) {
	dsn := SQLiteDSN(path)
	db, err := sqlx.Open("sqlite3", dsn)
	if err != nil {
		return nil, err
	}
	return &DB{DB: db, Kind: SQLite, DSN: dsn, Name: path, drop: func() error {
		for _, suffix := range []string{"", "-wal", "-shm"} {
			if err := os.Remove(path + suffix); err != nil && !os.IsNotExist(err) {
				return err
			}
		}
		return nil
	}}, nil
}

var (
	reachMu sync.Mutex
	reached = map[string]error{}
)

// Reachable says whether the server of a kind (or "amqp") answered, asking
// it once per process.
func Reachable(kind string) error {
	reachMu.Lock()
	defer reachMu.Unlock()
	if err, ok := reached[kind]; ok {
		return err
	}
	err := ping(kind)
	reached[kind] = err
	return err
}

func ping(kind string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	var driver, dsn string
	switch kind {
	case Postgres:
		driver, dsn = "pgx", PostgresDSN()
	case MySQL:
		driver, dsn = "mysql", MySQLDSN()
	case SQLite:
		return nil
	case "amqp":
		return pingAMQP(ctx)
	default:
		return fmt.Errorf("unknown kind %q", kind)
	}
	db, err := sql.Open(driver, dsn)
	if err != nil {
		return err
	}
	defer db.Close()
	if err := db.PingContext(ctx); err != nil {
		return fmt.Errorf("%s at %s does not answer: %w", kind, redact(dsn), err)
	}
	return nil
}

// Require skips the test when the server of kind is unreachable, or fails it
// under CI=true.
func Require(t testing.TB, kind string) {
	t.Helper()
	if err := Reachable(kind); err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("%v (required under CI=true; start it, see README)", err)
		}
		t.Skipf("skipping: %v (start the services with `docker compose up -d`, or set CI=true to make this a failure)", err)
	}
}

// New returns an isolated database of kind for the test, dropped when the
// test ends.
func New(t testing.TB, kind string) *DB {
	t.Helper()
	Require(t, kind)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	db, err := Open(ctx, kind, t.TempDir())
	if err != nil {
		t.Fatalf("testdb: %v", err)
	}
	t.Cleanup(func() {
		if err := db.Close(); err != nil {
			t.Errorf("testdb: dropping %s: %v", db.Name, err)
		}
	})
	return db
}

// Each runs fn as a subtest on an isolated database of every kind.
func Each(t *testing.T, fn func(t *testing.T, db *DB)) {
	t.Helper()
	for _, kind := range Kinds {
		t.Run(kind, func(t *testing.T) { fn(t, New(t, kind)) })
	}
}

// RandomName is a fresh name part for a test's own schema, queue or table.
func RandomName() string { return randomHex(6) }

func randomHex(n int) string {
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		panic(err)
	}
	return hex.EncodeToString(b)
}

// redact hides the password of a URL DSN (PostgreSQL, AMQP) or of a
// go-sql-driver/mysql DSN (user:pass@tcp(host)/db).
func redact(dsn string) string {
	if cfg, err := mysql.ParseDSN(dsn); err == nil && !strings.Contains(dsn, "://") {
		if cfg.Passwd == "" {
			return dsn
		}
		cfg.Passwd = "***"
		return cfg.FormatDSN()
	}
	u, err := url.Parse(dsn)
	if err != nil || u.User == nil {
		return dsn
	}
	if _, ok := u.User.Password(); !ok {
		return dsn
	}
	return strings.Replace(dsn, u.User.String()+"@", u.User.Username()+":***@", 1)
}
