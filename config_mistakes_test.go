package outbox_test

import (
	"context"
	"database/sql"
	"errors"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/jmoiron/sqlx"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// A Dialect set against the database handle's driver (a configuration
// copied from a service on another database) is refused where it is set,
// naming both. It was taken: NewInbox over SQLite with MySQL's Dialect
// returned no error, and Migrate over SQLite with PostgreSQL's failed with
// "no such function: pg_advisory_xact_lock", which named nothing of the
// cause (a review's finding). The driver's own Dialect, or none with a
// *sqlx handle, is taken as before.
func TestDialect_SetAgainstTheDriver_RefusedNamingBoth(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, d outbox.Dialect) {
		wrong := outbox.MySQL
		if d == outbox.MySQL {
			wrong = outbox.SQLite
		}
		refused := func(what string, err error) {
			t.Helper()
			var cerr *outbox.ConfigError
			if !errors.As(err, &cerr) || cerr.Field != "Dialect" || !strings.Contains(err.Error(), wrong.Name()) || !strings.Contains(err.Error(), d.Name()) {
				t.Errorf("%s with %s's Dialect over %s: %v; want a ConfigError of Dialect naming both", what, wrong.Name(), d.Name(), err)
			}
		}
		_, err := outbox.NewInbox(db.DB, outbox.InboxConfig{Dialect: wrong})
		refused("NewInbox", err)
		_, err = outbox.NewInbox(db.DB.DB, outbox.InboxConfig{Dialect: wrong})
		refused("NewInbox (*sql.DB)", err)
		_, err = outbox.NewStore(db.DB.DB, outbox.StoreConfig{Dialect: wrong})
		refused("NewStore", err)
		_, err = outbox.NewForwarder(db.DB, outbox.NewPublisherDestination(nopPublisher{}, nil), outbox.ForwarderConfig{Dialect: wrong})
		refused("NewForwarder", err)
		_, err = outbox.NewRepublisher(db.DB, outbox.RepublisherConfig{Dialect: wrong, TrackedTopics: outbox.NewTrackedTopics("orders")})
		refused("NewRepublisher", err)
		refused("Migrate", outbox.Migrate(context.Background(), db.DB.DB, wrong))
		tx, err := db.Beginx()
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = tx.Rollback() }()
		_, err = outbox.NewTxPublisher(tx, outbox.TxPublisherConfig{Dialect: wrong})
		refused("NewTxPublisher", err)

		// The driver's own, given or not, is taken.
		for _, given := range []outbox.Dialect{d, nil} {
			if _, err := outbox.NewInbox(db.DB, outbox.InboxConfig{Dialect: given}); err != nil {
				t.Errorf("NewInbox with Dialect %v: %v", given, err)
			}
			if _, err := outbox.NewStore(db.DB, outbox.StoreConfig{Dialect: given}); err != nil {
				t.Errorf("NewStore with Dialect %v: %v", given, err)
			}
			if _, err := outbox.NewTxPublisher(tx, outbox.TxPublisherConfig{Dialect: given}); err != nil {
				t.Errorf("NewTxPublisher with Dialect %v: %v", given, err)
			}
		}
		_ = tx.Rollback() // SQLite's: it holds the write lock Migrate takes
		if err := outbox.Migrate(context.Background(), db.DB.DB, d); err != nil {
			t.Errorf("Migrate with the driver's Dialect: %v", err)
		}
	})
}

// nopPublisher publishes nothing; a destination for constructors' checks.
type nopPublisher struct{}

func (nopPublisher) Publish(string, ...*message.Message) error { return nil }
func (nopPublisher) Close() error                              { return nil }

// A service started before its tables were made: the publisher, the
// relay and the inbox each say what to do, beside the database's own
// error, which stays in the chain. Each gave the database's error alone
// ("relation \"acemq_outbox\" does not exist"), and on MySQL the relay's
// first log lines were about statements it could not prepare (a
// review's finding).
func TestUnmigrated_PublisherRelayInbox_SayToMigrate(t *testing.T) {
	t.Parallel()
	for _, kind := range testdb.Kinds {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			db := testdb.New(t, kind) // not migrated
			d := dialectOf(t, db)
			says := func(what string, err error) {
				t.Helper()
				if err == nil || !strings.Contains(err.Error(), "outbox.Migrate") {
					t.Errorf("%s on an unmigrated database: %v; want it to say to run outbox.Migrate", what, err)
				}
			}
			tx, err := db.Beginx()
			if err != nil {
				t.Fatal(err)
			}
			pub, err := outbox.NewTxPublisher(tx, outbox.TxPublisherConfig{Dialect: d})
			if err != nil {
				t.Fatal(err)
			}
			says("Publish", pub.Publish("orders", message.NewMessage("m-1", []byte("{}"))))
			_ = tx.Rollback()

			f, err := outbox.NewForwarder(db.DB, outbox.NewPublisherDestination(nopPublisher{}, nil), outbox.ForwarderConfig{Dialect: d})
			if err != nil {
				t.Fatal(err)
			}
			_, err = f.Sweep(context.Background())
			says("Sweep", err)

			in, err := outbox.NewInbox(db.DB, outbox.InboxConfig{Dialect: d, ConsumerName: "billing"})
			if err != nil {
				t.Fatal(err)
			}
			_, err = in.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, nil })(acemqMessage("m-1"))
			says("the inbox", err)

			// A handler's own table missing is the service's business: its
			// error is not taken for the inbox's.
			migrate(t, db)
			in, err = outbox.NewInbox(db.DB, outbox.InboxConfig{Dialect: d, ConsumerName: "billing"})
			if err != nil {
				t.Fatal(err)
			}
			_, err = in.Middleware(func(msg *message.Message) ([]*message.Message, error) {
				tx, _ := outbox.TxFromContext(msg.Context())
				_, err := tx.Exec("INSERT INTO no_such_orders (id) VALUES (1)")
				return nil, err
			})(acemqMessage("m-2"))
			if err == nil || strings.Contains(err.Error(), "outbox.Migrate") {
				t.Errorf("the inbox, its handler's table missing: %v; want the handler's error without the hint", err)
			}
		})
	}
}

// A DSN naming a MySQL database that is not there (a typo) is no missing
// table: outbox.Migrate cannot make a database, and fails with the same
// error; the relay is not told to run it (a review's catch).
func TestUnmigrated_MySQLUnknownDatabase_NotToldToMigrate(t *testing.T) {
	t.Parallel()
	testdb.Require(t, testdb.MySQL)
	cfg, err := mysql.ParseDSN(testdb.MySQLDSN())
	if err != nil {
		t.Fatal(err)
	}
	cfg.DBName = "no_such_database_" + testdb.RandomName()
	db, err := sqlx.Open("mysql", cfg.FormatDSN())
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	f, err := outbox.NewForwarder(db, outbox.NewPublisherDestination(nopPublisher{}, nil), outbox.ForwarderConfig{Dialect: outbox.MySQL})
	if err != nil {
		t.Fatal(err)
	}
	if _, err = f.Sweep(context.Background()); err == nil || strings.Contains(err.Error(), "outbox.Migrate") {
		t.Errorf("Sweep over a database that does not exist: %v; want its error, without a hint to run outbox.Migrate", err)
	}
}

// The library's tables are named in an error as whole words: a handler's
// own table whose name starts with one of theirs
// (processed_messages_archive) is the service's, and its error gets no
// hint (a review's catch: it was matched as a substring).
func TestUnmigrated_HandlersOwnTableNamedLikeTheLibrarys_NoHint(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, d outbox.Dialect) {
		in, err := outbox.NewInbox(db.DB, outbox.InboxConfig{Dialect: d, ConsumerName: "billing"})
		if err != nil {
			t.Fatal(err)
		}
		_, err = in.Middleware(func(msg *message.Message) ([]*message.Message, error) {
			tx, _ := outbox.TxFromContext(msg.Context())
			_, err := tx.Exec("INSERT INTO processed_messages_archive (id) VALUES (1)")
			return nil, err
		})(acemqMessage("m-1"))
		if err == nil || strings.Contains(err.Error(), "is missing") {
			t.Errorf("the inbox, its handler's own table missing: %v; want the handler's error without the hint", err)
		}
	})
}

// Migrate makes the tables of the default names only: a relay whose Table
// names another, missing, is told to create that one, not to run Migrate,
// which ran already (a review's catch).
func TestUnmigrated_TableOfAnotherNameMissing_ToldToCreateIt(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, d outbox.Dialect) {
		f, err := outbox.NewForwarder(db.DB, outbox.NewPublisherDestination(nopPublisher{}, nil), outbox.ForwarderConfig{Dialect: d, Table: "orders_outbox"})
		if err != nil {
			t.Fatal(err)
		}
		_, err = f.Sweep(context.Background())
		if err == nil || !strings.Contains(err.Error(), "create orders_outbox") || strings.Contains(err.Error(), "run outbox.Migrate") {
			t.Errorf("Sweep over a Table of another name, missing after Migrate: %v; want to be told to create orders_outbox", err)
		}
	})
}

// The Dialect check takes lib/pq and a pgx connector's *sql.DB
// (sql.OpenDB) for PostgreSQL's, and refuses MySQL's over them.
func TestDialect_PqAndPgxConnector_TakenForPostgres(t *testing.T) {
	t.Parallel()
	testdb.Require(t, testdb.Postgres)
	cfg, err := pgx.ParseConfig(testdb.PostgresDSN())
	if err != nil {
		t.Fatal(err)
	}
	viaConnector := sql.OpenDB(stdlib.GetConnector(*cfg))
	defer viaConnector.Close()
	pq, err := sql.Open("postgres", testdb.PostgresDSN())
	if err != nil {
		t.Fatal(err)
	}
	defer pq.Close()
	for name, db := range map[string]*sql.DB{"pgx connector": viaConnector, "lib/pq": pq} {
		if _, err := outbox.NewStore(db, outbox.StoreConfig{Dialect: outbox.Postgres}); err != nil {
			t.Errorf("%s with Postgres: %v", name, err)
		}
		if _, err := outbox.NewStore(db, outbox.StoreConfig{Dialect: outbox.MySQL}); err == nil {
			t.Errorf("%s with MySQL: taken", name)
		}
	}
}

// SQLite opened without _txlock=immediate (mattn/go-sqlite3's default is
// deferred): a service's transaction that read before it publishes fails
// at once when another commit came between, busy timeout or not. The
// publisher's error says what the README requires, beside the driver's
// "database is locked" (a review's finding: 430 to 518 of 1,000 such
// transactions failed beside a relay, with nothing said of the cause).
func TestTxPublisher_SQLiteDeferredTransactionLocked_SaysToOpenImmediate(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.SQLite)
	deferred, err := sqlx.Open("sqlite3", strings.Replace(db.DSN, "_txlock=immediate", "_txlock=deferred", 1))
	if err != nil {
		t.Fatal(err)
	}
	defer deferred.Close()
	tx, err := deferred.Beginx()
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback() }()
	var n int
	if err := tx.Get(&n, "SELECT COUNT(*) FROM acemq_outbox"); err != nil { // the read that takes its snapshot
		t.Fatal(err)
	}
	publishInTx(t, db, "orders", []*message.Message{message.NewMessage("committed-between", []byte("{}"))})
	pub, err := outbox.NewTxPublisher(tx, outbox.TxPublisherConfig{Dialect: outbox.SQLite})
	if err != nil {
		t.Fatal(err)
	}
	err = pub.Publish("orders", message.NewMessage("after-the-read", []byte("{}")))
	if err == nil || !strings.Contains(err.Error(), "database is locked") || !strings.Contains(err.Error(), "_txlock=immediate") {
		t.Errorf("Publish in a deferred transaction behind another's commit: %v; want database is locked, and to be told of _txlock=immediate", err)
	}
}

// A *sql.Tx carries no driver name, so its Dialect is the caller's word.
// Given another database's (a service with a pool on each, one's config on
// the other's transaction), Publish failed with that database's bare syntax
// error (PostgreSQL's "syntax error at or near" a backquote, MariaDB's
// "Error 1064"), which named neither the Dialect nor what to check. It
// names the Dialect now.
func TestTxPublisher_TxOfAnotherDatabase_ErrorNamesTheDialect(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		kind string
		d    outbox.Dialect
	}{{testdb.Postgres, outbox.MySQL}, {testdb.MySQL, outbox.Postgres}, {testdb.SQLite, outbox.MySQL}} {
		t.Run(c.kind+"-as-"+c.d.Name(), func(t *testing.T) {
			db := migrated(t, c.kind)
			tx, err := db.DB.DB.Begin()
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = tx.Rollback() }()
			pub, err := outbox.NewTxPublisher(tx, outbox.TxPublisherConfig{Dialect: c.d})
			if err != nil {
				t.Fatal(err)
			}
			err = pub.Publish("orders", message.NewMessage("order-1", []byte("x")))
			if err == nil || !strings.Contains(err.Error(), "written for Dialect "+c.d.Name()) {
				t.Errorf("Publish through a %s transaction with Dialect %s: %v; want an error naming the Dialect", c.kind, c.d.Name(), err)
			}
		})
	}
}
