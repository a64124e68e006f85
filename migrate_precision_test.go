package outbox_test

import (
	"context"
	"database/sql"
	"errors"
	"regexp"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
	"github.com/acemq/watermill-outbox/internal/testrails"
	"github.com/acemq/watermill-outbox/sqlschema"
)

// railsSecondsTable makes the acemq_outbox of Rails before 7.0, whose
// t.datetime kept whole seconds: datetime(0) on MySQL, timestamp(0) on
// PostgreSQL.
func railsSecondsTable(t *testing.T, db *testdb.DB) {
	t.Helper()
	testrails.CreateTable(t, db)
	toSeconds(t, db)
}

// toSeconds makes the times of Rails' acemq_outbox whole seconds.
func toSeconds(t *testing.T, db *testdb.DB) {
	t.Helper()
	alter := "ALTER TABLE acemq_outbox MODIFY created_at datetime NOT NULL, MODIFY published_at datetime NULL, MODIFY locked_until datetime NULL"
	if db.Kind == testdb.Postgres {
		alter = "ALTER TABLE acemq_outbox ALTER created_at TYPE timestamp(0), ALTER published_at TYPE timestamp(0), ALTER locked_until TYPE timestamp(0)"
	}
	if _, err := db.Exec(alter); err != nil {
		t.Fatal(err)
	}
}

// onSecondsTables runs fn on the Rails table of whole seconds, migrated, on
// MySQL and on PostgreSQL.
func onSecondsTables(t *testing.T, fn func(t *testing.T, db *testdb.DB)) {
	for _, kind := range []string{testdb.MySQL, testdb.Postgres} {
		t.Run(kind, func(t *testing.T) {
			db := testdb.New(t, kind)
			railsSecondsTable(t, db)
			migrate(t, db)
			fn(t, db)
		})
	}
}

// beginPublisher begins a transaction on db, rolled back at the test's end
// unless committed, and a publisher on it.
func beginPublisher(t *testing.T, db *testdb.DB, cfg ...outbox.TxPublisherConfig) (*sqlx.Tx, *outbox.TxPublisher) {
	t.Helper()
	tx, err := db.Beginx()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tx.Rollback() })
	pub, err := outbox.NewTxPublisher(tx, cfg...)
	if err != nil {
		t.Fatal(err)
	}
	return tx, pub
}

// The publisher tells the rows of its call from those already there by
// created_at, to the microsecond. On a table that rounded it to seconds, a
// retried call (an id there already, and a new keyed message) took every
// row for one already there: it gave back the numbers of rows it had
// written, the key's counter fell behind the table, and every later
// publish on the key failed.
func TestMigrate_SecondsPrecisionTable_RetriedKeyedPublish_KeyKeepsNumbering(t *testing.T) {
	onSecondsTables(t, func(t *testing.T, db *testdb.DB) {
		publish := func(msgs ...*message.Message) error {
			tx, pub := beginPublisher(t, db)
			if err := pub.Publish("orders", msgs...); err != nil {
				_ = tx.Rollback() // now: its locks would hold the next call
				return err
			}
			return tx.Commit()
		}
		msgs := []*message.Message{keyed("order-7"), keyed("order-7"), keyed("order-7"), keyed("order-7"), keyed("order-7")}
		if err := publish(msgs[0]); err != nil {
			t.Fatal(err)
		}
		if err := publish(msgs[0], msgs[1]); err != nil { // a retried transaction, with a new message
			t.Fatalf("retried call: %v", err)
		}
		for i, m := range msgs[2:] {
			if err := publish(m); err != nil {
				t.Errorf("publish #%d after the retried call: %v", i+3, err)
			}
		}
		if got := seqsOf(t, db, "order-7"); len(got) != len(msgs) {
			t.Errorf("key order-7 holds numbers %v, want 1 to %d", got, len(msgs))
		}
		for i, m := range msgs {
			var n int
			if err := db.Get(&n, db.Rebind("SELECT COUNT(*) FROM acemq_outbox WHERE id = ?"), m.UUID); err != nil || n == 0 {
				t.Errorf("message %d has no row (%v)", i+1, err)
				continue
			}
			if _, seq := seqOf(t, db, m.UUID); seq != int64(i+1) {
				t.Errorf("message %d numbered %d, want %d", i+1, seq, i+1)
			}
		}
	})
}

// The same table: a call whose id is taken by a row to another destination
// fails with DuplicateIDError, and nothing of the call stays. Rounded, its
// new row was not taken for its own, and stayed in the transaction.
func TestMigrate_SecondsPrecisionTable_ConflictingCall_NothingOfTheCallStays(t *testing.T) {
	onSecondsTables(t, func(t *testing.T, db *testdb.DB) {
		publishInTx(t, db, "orders", []*message.Message{message.NewMessage("shared-id", []byte("a"))}, outbox.TxPublisherConfig{Exchange: "shop"})
		tx, pub := beginPublisher(t, db, outbox.TxPublisherConfig{Exchange: "billing"})
		err := pub.Publish("orders", message.NewMessage("shared-id", []byte("a")), message.NewMessage("new-id", []byte("b")))
		var dup *outbox.DuplicateIDError
		if !errors.As(err, &dup) {
			t.Fatalf("Publish: %v, want a DuplicateIDError", err)
		}
		var n int
		if err := tx.Get(&n, tx.Rebind("SELECT COUNT(*) FROM acemq_outbox WHERE id = ?"), "new-id"); err != nil {
			t.Fatal(err)
		}
		if n != 0 {
			t.Errorf("the refused call left %d row(s) of its own in the transaction, want none", n)
		}
	})
}

// timeColumn is what 0011 must keep of a time column, and its precision.
type timeColumn struct {
	Type, Nullable, Default, Extra, Comment string
	Precision                               int
}

func timeColumns(t *testing.T, db *testdb.DB) map[string]timeColumn {
	t.Helper()
	q := `SELECT column_name, data_type, is_nullable, COALESCE(column_default, ''), '', '', COALESCE(datetime_precision, -1)
		FROM information_schema.columns WHERE table_schema = current_schema() AND table_name = 'acemq_outbox'`
	if db.Kind == testdb.MySQL {
		q = `SELECT COLUMN_NAME, DATA_TYPE, IS_NULLABLE, COALESCE(COLUMN_DEFAULT, ''), EXTRA, COLUMN_COMMENT, COALESCE(DATETIME_PRECISION, -1)
			FROM information_schema.COLUMNS WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'acemq_outbox'`
	}
	rows, err := db.Query(q + " AND column_name IN ('created_at', 'published_at', 'locked_until', 'processed_at')")
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	cols := map[string]timeColumn{}
	for rows.Next() {
		var name string
		var c timeColumn
		if err := rows.Scan(&name, &c.Type, &c.Nullable, &c.Default, &c.Extra, &c.Comment, &c.Precision); err != nil {
			t.Fatal(err)
		}
		cols[name] = c
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return cols
}

// currentTimestamp says whether a column's default is the time of the
// insert, as each database spells it.
func currentTimestamp(def string) bool {
	return insertTime.MatchString(def)
}

var insertTime = regexp.MustCompile(`^(?i)(current_timestamp|now)(\([0-6]?\))?$`)

// 0011 raises a coarse time column to microseconds and keeps the rest of
// it: timestamp stays timestamp and timestamptz timestamptz (datetime and
// timestamp on MySQL), NOT NULL or not, a literal default as it was, a
// default or ON UPDATE of the insert's time as CURRENT_TIMESTAMP(6).
func TestMigrate_CoarseTimeColumns_RaisedToMicrosecondsKeepingTypeNullabilityDefault(t *testing.T) {
	t.Parallel()
	for _, kind := range []string{testdb.MySQL, testdb.Postgres} {
		t.Run(kind, func(t *testing.T) {
			db := testdb.New(t, kind)
			testrails.CreateTable(t, db)
			stmts := []string{
				"ALTER TABLE acemq_outbox MODIFY created_at datetime NOT NULL DEFAULT CURRENT_TIMESTAMP," +
					" MODIFY published_at timestamp(3) NULL DEFAULT (CURRENT_TIMESTAMP(3) + INTERVAL 1 DAY)," +
					" MODIFY locked_until datetime(2) NULL DEFAULT '2000-01-01 00:00:00' COMMENT 'end of the lease'," +
					" ADD processed_at timestamp NULL DEFAULT CURRENT_TIMESTAMP ON UPDATE CURRENT_TIMESTAMP",
			}
			if kind == testdb.Postgres {
				stmts = []string{
					"ALTER TABLE acemq_outbox ALTER created_at TYPE timestamp(0), ALTER created_at SET DEFAULT now()," +
						" ALTER published_at TYPE timestamptz(3), ALTER locked_until TYPE timestamp(2)," +
						" ALTER locked_until SET DEFAULT '2000-01-01 00:00:00', ADD processed_at timestamptz(0) NOT NULL DEFAULT now()",
				}
			}
			for _, s := range stmts {
				if _, err := db.Exec(s); err != nil {
					t.Fatal(err)
				}
			}
			before := timeColumns(t, db)
			rels := relFiles(t, db, false)
			migrate(t, db)
			after := timeColumns(t, db)
			if len(after) != 4 {
				t.Fatalf("time columns after Migrate: %v, want 4", after)
			}
			for name, b := range before {
				a := after[name]
				t.Logf("%s: %+v -> %+v", name, b, a)
				if a.Precision != 6 || a.Type != b.Type || a.Nullable != b.Nullable || a.Comment != b.Comment {
					t.Errorf("%s became %+v, was %+v: want precision 6 and the same type, nullability and comment", name, a, b)
				}
				switch {
				case currentTimestamp(b.Default):
					if !currentTimestamp(a.Default) || (kind == testdb.MySQL && !strings.Contains(a.Default, "6")) {
						t.Errorf("%s: default %q became %q, want the insert's time to the microsecond", name, b.Default, a.Default)
					}
				case strings.HasPrefix(strings.Trim(b.Default, "'"), "2000-01-01 00:00:00"):
					if !strings.HasPrefix(strings.Trim(a.Default, "'"), "2000-01-01 00:00:00") {
						t.Errorf("%s: default %q became %q, want the same literal", name, b.Default, a.Default)
					}
				case a.Default != b.Default:
					t.Errorf("%s: default %q became %q", name, b.Default, a.Default)
				}
				if strings.Contains(strings.ToLower(b.Extra), "on update") && !strings.Contains(strings.ToLower(a.Extra), "on update current_timestamp(6)") {
					t.Errorf("%s: %q became %q, want ON UPDATE CURRENT_TIMESTAMP(6)", name, b.Extra, a.Extra)
				}
			}
			if kind == testdb.Postgres {
				// Raising a timestamp's precision rewrites no row and rebuilds
				// no index, as 0011's comment says.
				if got := relFiles(t, db, false); !sameRelFiles(got, rels) {
					t.Errorf("files of the table and its indexes %v became %v: rewritten", rels, got)
				}
			}
		})
	}
}

// A table whose times have microseconds already, as 0001 and Rails 7
// make it, is left as it is: on MySQL 0011 prepares DO 0 (an ALTER would
// rebuild the table), on PostgreSQL no file of the table changes. Run
// again on a coarse table it found nothing more to do.
func TestMigrate_MicrosecondTable_0011ChangesNothing(t *testing.T) {
	t.Parallel()
	for _, kind := range []string{testdb.MySQL, testdb.Postgres} {
		for _, table := range []string{"0001", "rails", "rails-seconds-migrated"} {
			t.Run(kind+"/"+table, func(t *testing.T) {
				db := testdb.New(t, kind)
				switch table {
				case "rails":
					testrails.CreateTable(t, db)
				case "rails-seconds-migrated":
					railsSecondsTable(t, db)
				}
				migrate(t, db)
				before, rels := timeColumns(t, db), relFiles(t, db, true)
				m := migration11(t, db)
				if kind == testdb.MySQL {
					ctx := context.Background()
					conn, err := db.Conn(ctx) // the statement is prepared in a session variable
					if err != nil {
						t.Fatal(err)
					}
					defer conn.Close()
					for _, stmt := range sqlschema.Statements(m.Up) {
						if _, err := conn.ExecContext(ctx, stmt); err != nil {
							t.Fatal(err)
						}
						if strings.Contains(stmt, "GROUP_CONCAT") {
							break // the ALTER prepared, not run
						}
					}
					var ddl string
					if err := conn.QueryRowContext(ctx, "SELECT @acemq_ddl").Scan(&ddl); err != nil {
						t.Fatal(err)
					}
					if ddl != "DO 0" {
						t.Errorf("0011 on a table at microseconds prepares %q, want DO 0", ddl)
					}
				}
				// 0011 again, as goose or golang-migrate would run it, then
				// Migrate again.
				for _, stmt := range sqlschema.Statements(m.Up) {
					if _, err := db.Exec(stmt); err != nil {
						t.Fatalf("0011 again: %v", err)
					}
				}
				migrate(t, db)
				assertMigratedOnce(t, db)
				after := timeColumns(t, db)
				for name, b := range before {
					if a := after[name]; a != b || a.Precision != 6 {
						t.Errorf("%s: %+v became %+v, want it at 6 and unchanged", name, b, a)
					}
				}
				if got := relFiles(t, db, true); !sameRelFiles(got, rels) {
					t.Errorf("files of the table and its indexes %v became %v: rewritten", rels, got)
				}
			})
		}
	}
}

func migration11(t *testing.T, db *testdb.DB) sqlschema.Migration {
	t.Helper()
	migs, err := sqlschema.Migrations(dialectOf(t, db).Name())
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range migs {
		if m.Version == 11 {
			return m
		}
	}
	t.Fatal("no migration 0011")
	return sqlschema.Migration{}
}

// relFiles names the storage of acemq_outbox and of its indexes, with
// partial or without the partial ones (which PostgreSQL builds again when a
// column they name changes type, precision or not): on PostgreSQL their
// relfilenodes, which a rewrite or rebuild changes; on MySQL nothing (its
// test reads the statement 0011 prepares).
func relFiles(t *testing.T, db *testdb.DB, partial bool) map[string]int64 {
	t.Helper()
	files := map[string]int64{}
	if db.Kind != testdb.Postgres {
		return files
	}
	rows, err := db.Query(`SELECT c.relname, c.relfilenode FROM pg_class c
		WHERE c.oid = 'acemq_outbox'::regclass OR c.oid IN (SELECT indexrelid FROM pg_index WHERE indrelid = 'acemq_outbox'::regclass AND (indpred IS NULL OR $1))`, partial)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	for rows.Next() {
		var name string
		var node sql.NullInt64
		if err := rows.Scan(&name, &node); err != nil {
			t.Fatal(err)
		}
		files[name] = node.Int64
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	if len(files) == 0 {
		t.Fatal("acemq_outbox has no files to compare")
	}
	return files
}

// sameRelFiles says whether every file of before is in after unchanged.
func sameRelFiles(after, before map[string]int64) bool {
	for k, v := range before {
		if after[k] != v {
			return false
		}
	}
	return true
}

// A table of whole seconds that Migrate has not raised (migrated by an
// earlier release, or by a tool that stopped before 0011): a call that
// meets rows already there cannot tell its own, and fails naming the
// migration, rather than give back the numbers of rows it wrote or leave
// a refused call's rows behind. The key's numbers stay whole.
func TestTxPublisher_SecondsPrecisionTableNotMigrated_CallMeetingItsRowsFailsNamingMigrate(t *testing.T) {
	onSecondsTables(t, func(t *testing.T, db *testdb.DB) {
		toSeconds(t, db) // back to seconds after Migrate
		first, second, third := keyed("order-7"), keyed("order-7"), keyed("order-7")
		publishInTx(t, db, "orders", []*message.Message{first})

		tx, pub := beginPublisher(t, db)
		err := pub.Publish("orders", first, second) // a retried transaction, with a new message
		if err == nil || !strings.Contains(err.Error(), "outbox.Migrate") {
			t.Errorf("retried call on the table of seconds: %v, want an error naming outbox.Migrate", err)
		}
		_ = tx.Rollback()
		publishInTx(t, db, "orders", []*message.Message{second})
		publishInTx(t, db, "orders", []*message.Message{third})
		for i, m := range []*message.Message{first, second, third} {
			if _, seq := seqOf(t, db, m.UUID); seq != int64(i+1) {
				t.Errorf("message %d numbered %d, want %d", i+1, seq, i+1)
			}
		}

		// The table named with its schema: the lookup of its precision
		// finds it there.
		tx, pub = beginPublisher(t, db, outbox.TxPublisherConfig{Exchange: "billing", Table: db.Name + ".acemq_outbox"})
		err = pub.Publish("orders", message.NewMessage(first.UUID, []byte("a")), message.NewMessage("new-id", []byte("b")))
		if err == nil || !strings.Contains(err.Error(), "outbox.Migrate") {
			t.Errorf("conflicting call on the table of seconds: %v, want an error naming outbox.Migrate", err)
		}
		_ = tx.Rollback()
	})
}

// With explicit_defaults_for_timestamp OFF (MariaDB's default before
// 10.10), an ALTER TABLE gives the first timestamp NOT NULL without a
// default DEFAULT CURRENT_TIMESTAMP ON UPDATE CURRENT_TIMESTAMP: created_at
// would change at every update of its row (every relay's mark). 0011,
// run under OFF on a table migrated up to 0010 under ON, keeps it without.
func TestMigrate_MySQLExplicitDefaultsForTimestampOff_0011KeepsTimestampWithoutDefault(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, testdb.MySQL)
	testrails.CreateTable(t, db)
	if _, err := db.Exec("ALTER TABLE acemq_outbox MODIFY created_at timestamp NOT NULL"); err != nil {
		t.Fatal(err)
	}
	migrate(t, db)
	for _, stmt := range []string{"ALTER TABLE acemq_outbox MODIFY created_at timestamp NOT NULL", "DELETE FROM acemq_schema_migrations WHERE version = 11"} {
		if _, err := db.Exec(stmt); err != nil {
			t.Fatal(err)
		}
	}
	sep := "?"
	if strings.Contains(db.DSN, "?") {
		sep = "&"
	}
	off, err := sql.Open("mysql", db.DSN+sep+"explicit_defaults_for_timestamp=OFF")
	if err != nil {
		t.Fatal(err)
	}
	defer off.Close()
	if err := outbox.Migrate(context.Background(), off, outbox.MySQL); err != nil {
		t.Fatal(err)
	}
	c := timeColumns(t, db)["created_at"]
	if c.Precision != 6 || c.Type != "timestamp" || c.Nullable != "NO" || c.Default != "" || c.Extra != "" {
		t.Errorf("created_at became %+v, want timestamp(6) NOT NULL without a default or ON UPDATE", c)
	}
	var on int
	if err := off.QueryRow("SELECT @@SESSION.explicit_defaults_for_timestamp").Scan(&on); err != nil || on != 0 {
		t.Errorf("the pool's session reads explicit_defaults_for_timestamp %d (%v) after Migrate, want it OFF again", on, err)
	}
}

// 0011 on PostgreSQL rewrites no row and keeps the plain indexes over the
// times (Rails' acemq_outbox_pending); the partial ones are built again,
// as its comment says.
func TestMigrate_PostgresSecondsTable_0011RewritesNoRowKeepsPlainIndexes(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, testdb.Postgres)
	railsSecondsTable(t, db)
	migrate(t, db)
	toSeconds(t, db)
	if _, err := db.Exec("DELETE FROM acemq_schema_migrations WHERE version = 11"); err != nil {
		t.Fatal(err)
	}
	rels := relFiles(t, db, false)
	migrate(t, db)
	if got := relFiles(t, db, false); !sameRelFiles(got, rels) || len(got) != len(rels) {
		t.Errorf("files of the table and its indexes %v became %v: rewritten", rels, got)
	}
	for name, c := range timeColumns(t, db) {
		if c.Precision != 6 {
			t.Errorf("%s keeps %d digits after 0011, want 6", name, c.Precision)
		}
	}
	t.Logf("table and indexes: %v", rels)
}

// A view over a PostgreSQL table of whole seconds (the estate's "what is
// stuck in the outbox", made a view): PostgreSQL changes no column a view
// reads, and Migrate failed at every boot with "cannot alter type of a
// column used by a view or rule", naming nothing. It now fails naming the
// views (and a rule on the table itself) and what to do, having changed
// nothing; a view over other columns only is no obstacle, and once they
// are gone 0011 runs.
func TestMigrate_PostgresSecondsTableUnderAView_FailsNamingTheViewThenMigrates(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, testdb.Postgres)
	railsSecondsTable(t, db)
	for _, v := range []string{
		"CREATE VIEW acemq_outbox_stuck AS SELECT id, exchange_name, attempts, created_at FROM acemq_outbox WHERE published_at IS NULL AND attempts >= 10",
		"CREATE MATERIALIZED VIEW acemq_outbox_daily AS SELECT date_trunc('day', published_at) AS day, count(*) FROM acemq_outbox GROUP BY 1",
		"CREATE VIEW acemq_outbox_errors AS SELECT id, last_error FROM acemq_outbox", // no time column
		"CREATE TABLE outbox_audit (created_at timestamp)",
		"CREATE RULE acemq_outbox_audit AS ON UPDATE TO acemq_outbox DO ALSO INSERT INTO outbox_audit VALUES (NEW.created_at)",
	} {
		if _, err := db.Exec(v); err != nil {
			t.Fatal(err)
		}
	}
	err := outbox.Migrate(context.Background(), db.DB.DB, outbox.Postgres)
	if err == nil {
		t.Fatal("Migrate raised the times under a view, or left them coarse without a word")
	}
	for _, want := range []string{"acemq_outbox_stuck", "acemq_outbox_daily", "rule acemq_outbox_audit", "timestamp(6)"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("Migrate's error %q does not name %s", err, want)
		}
	}
	if strings.Contains(err.Error(), "acemq_outbox_errors") {
		t.Errorf("Migrate's error %q names a view that reads no time column", err)
	}
	for name, c := range timeColumns(t, db) {
		if c.Precision == 6 {
			t.Errorf("%s changed by the Migrate that failed", name)
		}
	}
	for _, v := range []string{"DROP VIEW acemq_outbox_stuck", "DROP MATERIALIZED VIEW acemq_outbox_daily", "DROP RULE acemq_outbox_audit ON acemq_outbox"} {
		if _, err := db.Exec(v); err != nil {
			t.Fatal(err)
		}
	}
	migrate(t, db)
	for name, c := range timeColumns(t, db) {
		if c.Precision != 6 {
			t.Errorf("%s keeps %d digits once the views were dropped, want 6", name, c.Precision)
		}
	}
}

// 0011 on MySQL copies each column's default back and rebuilds the table.
// A zero date default (an older server's habit), on a time column or
// another, failed that rebuild under MySQL 8's default sql_mode (strict,
// NO_ZERO_DATE), and long column comments cut the built statement at
// MySQL 8's group_concat_max_len of 1024: Migrate failed at every boot,
// where before 0011 it had nothing to do. The session's settings come back
// after it.
func TestMigrate_MySQL0011_ZeroDateDefaultsStrictModeShortGroupConcat_Migrated(t *testing.T) {
	t.Parallel()
	comment := strings.Repeat("c", 300)
	for name, alter := range map[string]string{
		"zero default on created_at": "ALTER TABLE acemq_outbox MODIFY created_at datetime NOT NULL DEFAULT '0000-00-00 00:00:00'",
		"zero default elsewhere":     "ALTER TABLE acemq_outbox MODIFY created_at datetime NOT NULL, ADD legacy_at datetime NOT NULL DEFAULT '0000-00-00 00:00:00'",
		"long comments": "ALTER TABLE acemq_outbox MODIFY created_at datetime NOT NULL COMMENT '" + comment + "', MODIFY published_at datetime NULL COMMENT '" + comment +
			"', MODIFY locked_until datetime NULL COMMENT '" + comment + "'",
	} {
		t.Run(name, func(t *testing.T) {
			db := testdb.New(t, testdb.MySQL)
			testrails.CreateTable(t, db)
			migrate(t, db)
			ctx := context.Background()
			conn, err := db.DB.DB.Conn(ctx)
			if err != nil {
				t.Fatal(err)
			}
			for _, s := range []string{"SET SESSION sql_mode = ''", alter, "DELETE FROM acemq_schema_migrations WHERE version = 11"} {
				if _, err := conn.ExecContext(ctx, s); err != nil {
					t.Fatal(err)
				}
			}
			_ = conn.Close()
			const mode = "STRICT_TRANS_TABLES,NO_ZERO_IN_DATE,NO_ZERO_DATE,ERROR_FOR_DIVISION_BY_ZERO,NO_ENGINE_SUBSTITUTION"
			sep := "?"
			if strings.Contains(db.DSN, "?") {
				sep = "&"
			}
			strict, err := sql.Open("mysql", db.DSN+sep+"sql_mode=%27"+mode+"%27&group_concat_max_len=1024")
			if err != nil {
				t.Fatal(err)
			}
			defer strict.Close()
			strict.SetMaxOpenConns(1)
			if err := outbox.Migrate(ctx, strict, outbox.MySQL); err != nil {
				t.Fatalf("Migrate: %v", err)
			}
			for col, c := range timeColumns(t, db) {
				if c.Precision != 6 {
					t.Errorf("%s keeps %d digits after 0011", col, c.Precision)
				}
			}
			var got string
			var gcml int
			if err := strict.QueryRowContext(ctx, "SELECT @@SESSION.sql_mode, @@SESSION.group_concat_max_len").Scan(&got, &gcml); err != nil {
				t.Fatal(err)
			}
			if got != mode || gcml != 1024 {
				t.Errorf("the session after Migrate: sql_mode %q, group_concat_max_len %d; want %q and 1024 back", got, gcml, mode)
			}
		})
	}
}
