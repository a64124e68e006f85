package outboxctl

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"time"

	"github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5/pgconn"
	_ "github.com/jackc/pgx/v5/stdlib" // registers "pgx"
	_ "github.com/mattn/go-sqlite3"    // registers "sqlite3"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/sqldialect"
)

// connectTimeout bounds the first contact with the database and the broker:
// an address that drops packets fails the command after this long rather
// than after the operating system's TCP timeout of minutes.
const connectTimeout = 10 * time.Second

// Kinds of database, named as the dialects are.
const (
	kindPostgres = "postgres"
	kindMySQL    = "mysql"
	kindSQLite   = "sqlite"
)

// target is the database a command works on, as the operator named it.
type target struct {
	kind   string
	driver string
	dsn    string // what the driver opens
	shown  string // the DSN as given, password hidden: for messages
	path   string // sqlite: the file; "" for an in-memory database
	// readOnly: an SQLite file opened read-only (mode=ro), where only the
	// commands that read work.
	readOnly bool
	dialect  outbox.Dialect
}

// sqliteParams make concurrent writers (the relay, the services, this tool)
// wait for each other rather than fail with SQLITE_BUSY, and take the write
// lock at BEGIN so that two of them never deadlock on the upgrade. Each is
// added only where the DSN does not set it.
var sqliteParams = [][2]string{{"_txlock", "immediate"}, {"_busy_timeout", "5000"}}

// sqliteSync is the synchronous setting this tool's connections take where
// the DSN sets none (mattn/go-sqlite3 reads _synchronous or _sync). Its own
// default, NORMAL, does not sync a WAL commit: a power cut could roll back a
// relay's mark (its batch sent again) or an operator's retry, skip-gap or
// skip-held that the command reported done. FULL is what the README asks of
// the services; a write here costs a fraction of a millisecond more.
const sqliteSync = "FULL"

// switchesToWAL are the commands that put an SQLite database in WAL mode,
// which stays in the file: those that set the database up for the services
// or write beside them as a service does. migrate makes the database the
// relay and the services share; relay writes (claims, marks) at every poll
// for as long as it runs, and in rollback-journal mode every one of those
// commits would keep the services' readers out. The other commands leave
// the journal mode as they find it. status, stuck and held only read: an
// operator's look must change nothing, and must work on a file opened
// read-only (mode=ro), where switching fails. retry, purge, skip-gap and
// skip-held write once, at an operator's hand, and work in either mode,
// waiting their turn (_busy_timeout); the journal mode is a choice of the
// database's owner, not something a repair should make for them.
var switchesToWAL = map[string]bool{"migrate": true, "relay": true}

// parseTarget tells the database from the form of --db. wal asks for an
// SQLite database to be put in WAL mode (see switchesToWAL).
func parseTarget(raw string, wal bool) (target, error) {
	switch {
	case raw == "":
		return target{}, usagef("no database: pass --db or set OUTBOX_DB (a postgres:// URL, a MySQL DSN user:pass@tcp(host:port)/db, or an SQLite path)")
	case strings.HasPrefix(raw, "postgres://"), strings.HasPrefix(raw, "postgresql://"):
		return postgresTarget(raw)
	case strings.HasPrefix(raw, "mysql://"):
		return mysqlURLTarget(raw)
	case strings.Contains(raw, "@tcp("), strings.Contains(raw, "@unix("),
		strings.HasPrefix(raw, "tcp("), strings.HasPrefix(raw, "unix("):
		return mysqlTarget(raw)
	case strings.HasPrefix(raw, "file:"):
		return sqliteTarget(raw, wal)
	case strings.Contains(raw, "@/"):
		return mysqlTarget(raw) // user:pass@/db: the driver's default address
	case strings.Contains(raw, "://"):
		scheme, _, _ := strings.Cut(raw, "://")
		return target{}, usagef("--db: %s:// is not a database outboxctl knows; want a postgres:// URL, a MySQL DSN user:pass@tcp(host:port)/db, or an SQLite path", scheme)
	case keywordDSN.MatchString(raw):
		// libpq's host=… dbname=…: read as a path it became an SQLite file
		// of that name, which migrate created and the relay drained of
		// nothing, while the real outbox filled up.
		return target{}, usagef("--db: a key=value DSN; write PostgreSQL's as a URL, postgres://user:pass@host:5432/db?sslmode=disable (an SQLite file of such a name: file:NAME)")
	case schemeTypo.MatchString(raw):
		// Not the URL itself: its password would go into the log too.
		scheme, _, _ := strings.Cut(raw, ":")
		return target{}, usagef("--db %s:…: want scheme://, as postgres://user@host/db or mysql://user@host/db (an SQLite file of such a name: file:NAME)", scheme)
	}
	return sqliteTarget(raw, wal)
}

var (
	// keywordDSN is the start of a key=value DSN (libpq's "host=… dbname=…").
	keywordDSN = regexp.MustCompile(`^\s*[A-Za-z_]+\s*=`)
	// schemeTypo is a database URL missing a slash or two ("postgres:/h/db").
	schemeTypo = regexp.MustCompile(`(?i)^(postgres|postgresql|mysql):`)
)

// unparsableURL is the usage error of a --db URL that url.Parse refused,
// without url.Parse's words: they quote the URL, or the part of it they
// stopped at ("invalid URL escape "%wo"", "invalid port ":Pa55%word@…""),
// password and all (a bare % in a password is the common case), into a
// terminal's scrollback or a pod's log.
func unparsableURL() error {
	return usagef("--db: the URL does not parse; in a URL a password's %%, @, / and : are written %%25, %%40, %%2F and %%3A")
}

func postgresTarget(raw string) (target, error) {
	u, err := url.Parse(raw)
	if err != nil {
		return target{}, unparsableURL()
	}
	q := u.Query()
	if q.Get("application_name") == "" {
		// Names the sessions in pg_stat_activity.
		q.Set("application_name", "outboxctl")
		u.RawQuery = q.Encode()
	}
	return target{kind: kindPostgres, driver: "pgx", dsn: u.String(), shown: redactURL(raw), dialect: outbox.Postgres}, nil
}

// mysqlURLTarget turns mysql://user:pass@host:port/db?params into the
// driver's DSN.
func mysqlURLTarget(raw string) (target, error) {
	u, err := url.Parse(raw)
	if err != nil {
		return target{}, unparsableURL()
	}
	host := u.Host
	if u.Port() == "" {
		host += ":3306"
	}
	cfg, err := mysql.ParseDSN("tcp(" + host + ")" + u.EscapedPath() + "?" + u.RawQuery)
	if err != nil {
		return target{}, usagef("--db %s: %v", redactURL(raw), err)
	}
	if u.User != nil {
		cfg.User = u.User.Username()
		cfg.Passwd, _ = u.User.Password()
	}
	return mysqlConfigTarget(cfg, redactURL(raw))
}

func mysqlTarget(raw string) (target, error) {
	cfg, err := mysql.ParseDSN(raw)
	if err != nil {
		return target{}, usagef("--db %s: %v", redactMySQL(raw), err)
	}
	return mysqlConfigTarget(cfg, redactMySQL(raw))
}

func mysqlConfigTarget(cfg *mysql.Config, shown string) (target, error) {
	if cfg.DBName == "" {
		return target{}, usagef("--db %s: no database name; want user:pass@tcp(host:port)/db", shown)
	}
	// Timestamps come back as time.Time rather than text.
	cfg.ParseTime = true
	return target{kind: kindMySQL, driver: "mysql", dsn: cfg.FormatDSN(), shown: shown, dialect: outbox.MySQL}, nil
}

func sqliteTarget(raw string, wal bool) (target, error) {
	path, query, _ := strings.Cut(raw, "?")
	dsn := raw
	if !strings.HasPrefix(raw, "file:") {
		// mattn/go-sqlite3 cuts the parameters off a plain path and opens
		// the rest as a file name, so a path needs no URI escaping.
		if strings.Contains(raw, "?") {
			return target{}, usagef("--db %q: an SQLite path with parameters must be a file: URI", raw)
		}
		query = ""
	} else {
		path = strings.TrimPrefix(path, "file:")
		if strings.HasPrefix(path, "//") { // file:///abs/path or file://host/path
			if u, err := url.Parse(raw); err == nil {
				path = u.Path
			}
		}
		if p, err := url.PathUnescape(path); err == nil {
			path = p
		}
	}
	values, err := url.ParseQuery(query)
	if err != nil {
		return target{}, usagef("--db %q: %v", raw, err)
	}
	var add []string
	for _, p := range sqliteParams {
		if !values.Has(p[0]) {
			add = append(add, p[0]+"="+p[1])
		}
	}
	if !values.Has("_synchronous") && !values.Has("_sync") {
		add = append(add, "_synchronous="+sqliteSync)
	}
	// Not on a file opened read-only, where the switch fails the open
	// ("attempt to write a readonly database"), nor over a journal mode
	// the DSN chose (mattn/go-sqlite3 takes _journal as _journal_mode).
	if wal && values.Get("mode") != "ro" && !values.Has("_journal_mode") && !values.Has("_journal") {
		add = append(add, "_journal_mode=WAL")
	}
	if len(add) > 0 {
		sep := "?"
		if strings.Contains(dsn, "?") {
			sep = "&"
		}
		dsn += sep + strings.Join(add, "&")
	}
	if path == ":memory:" || values.Get("mode") == "memory" {
		path = ""
	}
	return target{kind: kindSQLite, driver: "sqlite3", dsn: dsn, shown: redactQuery(raw), path: path, readOnly: values.Get("mode") == "ro", dialect: outbox.SQLite}, nil
}

// redactURL hides a URL's password, in the user part or in a parameter.
func redactURL(raw string) string {
	u, err := url.Parse(raw)
	if err != nil {
		return "(an unparsable URL)"
	}
	if _, ok := u.User.Password(); ok {
		u.User = url.UserPassword(u.User.Username(), "xxxxx")
	}
	q := u.Query()
	changed := false
	for k := range q {
		if isSecretParam(k) {
			q.Set(k, "xxxxx")
			changed = true
		}
	}
	if changed {
		u.RawQuery = q.Encode()
	}
	return u.String()
}

// redactMySQL hides the password of user:pass@tcp(host)/db. The driver
// takes the password verbatim, up to the last @ before the database.
func redactMySQL(raw string) string {
	slash := strings.LastIndex(raw, "/")
	if slash < 0 {
		slash = len(raw)
	}
	at := strings.LastIndex(raw[:slash], "@")
	if at < 0 {
		return redactQuery(raw)
	}
	creds := raw[:at]
	if colon := strings.IndexByte(creds, ':'); colon >= 0 {
		raw = creds[:colon+1] + "xxxxx" + raw[at:]
	}
	return redactQuery(raw)
}

// redactQuery hides password parameters of a DSN's query string.
func redactQuery(raw string) string {
	base, query, ok := strings.Cut(raw, "?")
	if !ok {
		return raw
	}
	parts := strings.Split(query, "&")
	for i, p := range parts {
		if k, _, ok := strings.Cut(p, "="); ok && isSecretParam(k) {
			parts[i] = k + "=xxxxx"
		}
	}
	return base + "?" + strings.Join(parts, "&")
}

func isSecretParam(k string) bool {
	k = strings.ToLower(k)
	return strings.Contains(k, "pass") || strings.Contains(k, "secret")
}

// database is an open, answering database.
type database struct {
	*target
	db  *sql.DB
	cli *cli
}

// open opens --db and makes sure it answers. An SQLite file must exist
// unless create is set (migrate): opening a mistyped path would otherwise
// create an empty database and report its outbox as missing.
func (c *cli) open(create bool) (*database, error) {
	t, err := parseTarget(c.g.db, switchesToWAL[c.command])
	if err != nil {
		return nil, err
	}
	if t.kind == kindSQLite && t.path != "" {
		// A missing directory first: the file's absence was put to migrate,
		// which then failed with "unable to open database file" (a review:
		// a volume not mounted).
		if _, err := os.Stat(filepath.Dir(t.path)); errors.Is(err, os.ErrNotExist) {
			return nil, fmt.Errorf("the directory %s of the sqlite database %s does not exist (a volume not mounted? a mistyped path?)", filepath.Dir(t.path), t.shown)
		}
	}
	if t.kind == kindSQLite && t.path != "" && !create {
		if _, err := os.Stat(t.path); err != nil {
			if errors.Is(err, os.ErrNotExist) {
				return nil, fmt.Errorf("the sqlite database %s does not exist (outboxctl migrate creates it)", t.shown)
			}
			return nil, fmt.Errorf("cannot open the sqlite database %s: %v", t.shown, err)
		}
	}
	db, err := sql.Open(t.driver, t.dsn)
	if err != nil {
		return nil, fmt.Errorf("cannot open the %s database at %s: %v", t.kind, t.shown, err)
	}
	ctx, cancel := context.WithTimeout(c.ctx, connectTimeout)
	defer cancel()
	if err := db.PingContext(ctx); err != nil {
		_ = db.Close()
		if t.kind == kindSQLite {
			return nil, fmt.Errorf("cannot open the sqlite database %s: %v", t.shown, err)
		}
		return nil, fmt.Errorf("cannot connect to the %s database at %s: %v", t.kind, t.shown, connectError(err))
	}
	return &database{target: &t, db: db, cli: c}, nil
}

func (d *database) Close() error { return d.db.Close() }

// connectError is the part of a failed connection a person acts on: the
// network's refusal rather than pgx's account of every address and TLS mode
// it tried, and the server's answer otherwise.
func connectError(err error) error {
	var netErr *net.OpError
	if errors.As(err, &netErr) {
		return netErr
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr
	}
	return err
}

// requireTable fails with the migrate hint unless table exists.
func (d *database) requireTable(ctx context.Context, table string) error {
	var check func(context.Context) error
	switch table {
	case sqldialect.InboxHeldTable, sqldialect.InboxSequencesTable:
		// The ordered inbox's: neither the outbox's nor the inbox's check
		// looks at them (status, show and resend failed on a database
		// without them, reading the outbox's check as theirs).
		check = func(ctx context.Context) error {
			for _, t := range []string{sqldialect.InboxHeldTable, sqldialect.InboxSequencesTable} {
				if _, err := d.db.ExecContext(ctx, "SELECT 1 FROM "+t+" WHERE 1 = 0"); err != nil {
					return err
				}
			}
			return nil
		}
	case d.cli.g.inboxTable:
		in, err := d.cli.inbox(d, 0)
		if err != nil {
			return err
		}
		check = in.Check
	default:
		s, err := d.cli.store(d, 0)
		if err != nil {
			return err
		}
		check = s.Check
	}
	return d.explain(check(ctx), table)
}

// hasTable says whether table exists; other failures are errors.
func (d *database) hasTable(ctx context.Context, table string) (bool, error) {
	err := d.requireTable(ctx, table)
	var missing *missingTableError
	if errors.As(err, &missing) {
		return false, nil
	}
	return err == nil, err
}

// notifyTrigger reads whether table's NOTIFY trigger fires (PostgreSQL).
func (d *database) notifyTrigger(ctx context.Context, table string) (bool, error) {
	o, err := sqldialect.NewOutbox(sqldialect.Postgres, table)
	if err != nil {
		return false, err
	}
	q := o.NotifyTrigger()
	var payload, quiet *string
	var fires bool
	err = d.db.QueryRowContext(ctx, q.SQL, q.Args...).Scan(&payload, &fires, &quiet)
	return fires, err
}

// quietLeft reads how many more milliseconds table's NOTIFY trigger stays
// quiet for a relay in a flow (PostgreSQL, migration 0010); nil when the
// table has no quiet sequence this role may read.
func (d *database) quietLeft(ctx context.Context, table string) (*int64, error) {
	o, err := sqldialect.NewOutbox(sqldialect.Postgres, table)
	if err != nil {
		return nil, err
	}
	q := o.QuietLeft()
	var ms int64
	switch err := d.db.QueryRowContext(ctx, q.SQL, q.Args...).Scan(&ms); {
	case errors.Is(err, sql.ErrNoRows):
		return nil, nil
	case err != nil:
		return nil, err
	}
	return &ms, nil
}

// narrowColumns (MySQL) lists table's text columns that cannot hold every
// character (sqldialect.Outbox.NarrowColumns).
func (d *database) narrowColumns(ctx context.Context, table string) ([]string, error) {
	o, err := sqldialect.NewOutbox(sqldialect.MySQL, table)
	if err != nil {
		return nil, err
	}
	return d.strings(ctx, o.NarrowColumns())
}

// strings runs q, a query of one text column, and returns its rows, []
// for none.
func (d *database) strings(ctx context.Context, q sqldialect.Query) ([]string, error) {
	rows, err := d.db.QueryContext(ctx, q.SQL, q.Args...)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	out := []string{}
	for rows.Next() {
		var s string
		if err := rows.Scan(&s); err != nil {
			return nil, err
		}
		out = append(out, s)
	}
	return out, rows.Err()
}

// alsoOnSearchPath (PostgreSQL) lists the tables of table's name in the
// search path's other schemas (sqldialect.Outbox.AlsoOnSearchPath).
func (d *database) alsoOnSearchPath(ctx context.Context, table string) ([]string, error) {
	o, err := sqldialect.NewOutbox(sqldialect.Postgres, table)
	if err != nil {
		return nil, err
	}
	return d.strings(ctx, o.AlsoOnSearchPath())
}

// missingTableError is a table the statement needed that is not there.
type missingTableError struct {
	table string
	db    string
}

func (e *missingTableError) Error() string {
	switch e.table {
	case outbox.DefaultTable, outbox.DefaultInboxTable:
		return fmt.Sprintf("%s does not exist: run `outboxctl migrate` (database %s)", e.table, e.db)
	case sqldialect.InboxSequencesTable, sqldialect.InboxHeldTable:
		// No flag names the ordered inbox's tables, and migrate makes both
		// at once; a statement that reads both fails on either, so the
		// hint names the two.
		return fmt.Sprintf("%s or %s does not exist: run `outboxctl migrate`, which creates the ordered inbox's tables in migration 0006 (database %s)",
			sqldialect.InboxSequencesTable, sqldialect.InboxHeldTable, e.db)
	}
	return fmt.Sprintf("%s does not exist in the database %s: check --table/--inbox-table (outboxctl migrate creates %s and %s)",
		e.table, e.db, outbox.DefaultTable, outbox.DefaultInboxTable)
}

// explain turns the error of a statement on table into the migrate hint when
// the table is missing, and adds where it happened otherwise.
func (d *database) explain(err error, table string) error {
	if err == nil {
		return nil
	}
	if isMissingTable(err) {
		return &missingTableError{table: table, db: d.shown}
	}
	return err
}

// isMissingTable recognises "no such table" per database: by SQLSTATE on
// PostgreSQL, by error number on MySQL, and by the message on SQLite, whose
// code for it is the generic SQLITE_ERROR.
func isMissingTable(err error) bool {
	var pg *pgconn.PgError
	if errors.As(err, &pg) {
		return pg.Code == "42P01" || pg.Code == "3F000" // undefined_table, invalid_schema_name
	}
	var my *mysql.MySQLError
	if errors.As(err, &my) {
		return my.Number == 1146 || my.Number == 1049 // ER_NO_SUCH_TABLE, ER_BAD_DB_ERROR
	}
	msg := err.Error()
	return strings.Contains(msg, "no such table") || strings.Contains(msg, "unknown database")
}

// inbox is the library's Inbox over the inbox table, for its questions and
// its purge.
func (c *cli) inbox(d *database, purgeBatch int) (*outbox.Inbox, error) {
	// With this database's outbox marked, a skip notes the records it gave
	// up on there (outbox's noteSkipped): show read "processed" of them.
	marks, err := d.hasTable(c.ctx, c.g.table)
	if err != nil {
		return nil, err
	}
	in, err := outbox.NewInbox(d.db, outbox.InboxConfig{Dialect: d.dialect, InboxTable: c.g.inboxTable, PurgeBatch: purgeBatch, MarkOutboxProcessed: marks, OutboxTable: c.g.table})
	if err != nil {
		return nil, usagef("%v", err)
	}
	return in, nil
}

// store is the library's Store of the outbox table.
func (c *cli) store(d *database, purgeBatch int) (*outbox.Store, error) {
	s, err := outbox.NewStore(d.db, outbox.StoreConfig{
		Dialect: d.dialect, Table: c.g.table, MaxAttempts: c.g.maxAttempts, PurgeBatch: purgeBatch,
	})
	if err != nil {
		return nil, usagef("%v", err)
	}
	return s, nil
}

// openOutbox opens --db and checks the outbox table, the start of every
// command but migrate.
func (c *cli) openOutbox() (*database, error) { return c.openChecked(true) }

// openStore is openOutbox and the Store over it; the caller closes the
// database.
func (c *cli) openStore() (*database, *outbox.Store, error) {
	d, err := c.openOutbox()
	if err != nil {
		return nil, nil, err
	}
	s, err := c.store(d, 0)
	if err != nil {
		_ = d.Close()
		return nil, nil, err
	}
	return d, s, nil
}

// openChecked opens --db after checking the table names, and checks that the
// outbox table exists if the command needs it.
func (c *cli) openChecked(needOutbox bool) (*database, error) {
	if err := sqldialect.ValidTable(c.g.table); err != nil {
		return nil, usagef("--table: %v", err)
	}
	if err := sqldialect.ValidTable(c.g.inboxTable); err != nil {
		return nil, usagef("--inbox-table: %v", err)
	}
	d, err := c.open(false)
	if err != nil {
		return nil, err
	}
	if needOutbox {
		if err := d.requireTable(c.ctx, c.g.table); err != nil {
			_ = d.Close()
			return nil, err
		}
	}
	return d, nil
}
