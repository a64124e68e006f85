package outbox_test

import (
	"bytes"
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jmoiron/sqlx"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/rowcodec"
	"github.com/acemq/watermill-outbox/internal/testdb"
	"github.com/acemq/watermill-outbox/sqlschema"
)

// row is an acemq_outbox row as read back.
type row struct {
	ID           string         `db:"id"`
	Exchange     string         `db:"exchange_name"`
	RoutingKey   string         `db:"routing_key"`
	Body         string         `db:"body"`
	BodyEncoding string         `db:"body_encoding"`
	ContentType  string         `db:"content_type"`
	Headers      string         `db:"headers"`
	CreatedAt    time.Time      `db:"created_at"`
	PublishedAt  sql.NullTime   `db:"published_at"`
	Attempts     int            `db:"attempts"`
	LastError    sql.NullString `db:"last_error"`
	LockedBy     sql.NullString `db:"locked_by"`
	LockedUntil  sql.NullTime   `db:"locked_until"`
	ProcessedAt  sql.NullTime   `db:"processed_at"`
	AggregateID  sql.NullString `db:"aggregate_id"`
	Seq          sql.NullInt64  `db:"seq"`
}

func readRows(t testing.TB, db *testdb.DB) []row {
	t.Helper()
	var rows []row
	if err := db.Select(&rows, "SELECT * FROM acemq_outbox ORDER BY created_at, id"); err != nil {
		t.Fatalf("reading acemq_outbox: %v", err)
	}
	return rows
}

func TestTxPublisher_Commit_RowHoldsExactColumnValues(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		msg := message.NewMessage(watermill.NewUUID(), []byte(`{"order":42,"name":"Zoë <&>"}`))
		msg.Metadata.Set("tenant", "acme")
		msg.Metadata.Set("trace", `a"b\c`)
		msg.Metadata.Set(outbox.MetadataContentType, "application/json")

		before := time.Now().UTC().Add(-time.Millisecond)
		publishInTx(t, db, "order.placed", []*message.Message{msg}, outbox.TxPublisherConfig{Exchange: "shop-events"})
		// Stamps run ahead of the wall clock by the microseconds a call
		// reserves for its rows, one each, and the package's other tests
		// publish at the same moment (a CI run saw this row 15 ms after
		// the call returned, behind a parallel test's 15,000 rows): a
		// second's margin still catches a time zone's hours.
		after := time.Now().UTC().Add(time.Second)

		rows := readRows(t, db)
		if len(rows) != 1 {
			t.Fatalf("rows = %d, want 1", len(rows))
		}
		r := rows[0]
		want := row{
			ID: msg.UUID, Exchange: "shop-events", RoutingKey: "order.placed",
			Body: `{"order":42,"name":"Zoë <&>"}`, BodyEncoding: "utf-8",
			ContentType: "application/json", CreatedAt: r.CreatedAt, Headers: r.Headers,
		}
		if r != want {
			t.Errorf("row =\n %+v\nwant\n %+v", r, want)
		}
		var headers map[string]string
		if err := json.Unmarshal([]byte(r.Headers), &headers); err != nil {
			t.Fatalf("headers %q are not a JSON object of strings: %v", r.Headers, err)
		}
		if fmt.Sprint(headers) != fmt.Sprint(map[string]string(msg.Metadata)) {
			t.Errorf("headers = %v, want the metadata %v", headers, msg.Metadata)
		}
		if r.CreatedAt.Before(before) || r.CreatedAt.After(after) {
			t.Errorf("created_at = %v, want between %v and %v (now, UTC)", r.CreatedAt, before, after)
		}
	})
}

func TestTxPublisher_CreatedAt_KeepsMicrosecondsAndCallOrder(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		var msgs []*message.Message
		for i := 0; i < 5; i++ {
			// Ids in reverse order: ORDER BY created_at, id must still give
			// the order of the call, not of the ids.
			msgs = append(msgs, message.NewMessage(fmt.Sprintf("id-%d", 9-i), []byte(fmt.Sprint(i))))
		}
		publishInTx(t, db, "t", msgs)
		publishInTx(t, db, "t", []*message.Message{message.NewMessage("id-0", []byte("5"))})

		rows := readRows(t, db)
		if len(rows) != 6 {
			t.Fatalf("rows = %d, want 6", len(rows))
		}
		subMilli := false
		for i, r := range rows {
			if r.Body != fmt.Sprint(i) {
				t.Errorf("row %d has body %q: the relay would send the messages out of the order they were given", i, r.Body)
			}
			if i > 0 && !r.CreatedAt.After(rows[i-1].CreatedAt) {
				t.Errorf("created_at not strictly increasing: %v then %v", rows[i-1].CreatedAt, r.CreatedAt)
			}
			if r.CreatedAt.Nanosecond()%int(time.Millisecond) != 0 {
				subMilli = true
			}
		}
		if !subMilli {
			t.Errorf("no created_at has sub-millisecond digits: %v; the column lost precision", rows[0].CreatedAt)
		}
	})
}

func TestTxPublisher_Rollback_LeavesNoRow(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		tx, err := db.Beginx()
		if err != nil {
			t.Fatal(err)
		}
		pub, err := outbox.NewTxPublisher(tx)
		if err != nil {
			t.Fatal(err)
		}
		if err := pub.Publish("order.placed", message.NewMessage(watermill.NewUUID(), []byte("x"))); err != nil {
			t.Fatal(err)
		}
		if err := tx.Rollback(); err != nil {
			t.Fatal(err)
		}
		if n := countRows(t, db); n != 0 {
			t.Fatalf("rows after rollback = %d, want 0", n)
		}
	})
}

func TestTxPublisher_SameIDTwice_LeavesOneRowAndNoError(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		id := watermill.NewUUID()
		first := message.NewMessage(id, []byte("first"))
		// A retried transaction: the same id in a second transaction, and
		// twice in one call.
		publishInTx(t, db, "t", []*message.Message{first})
		publishInTx(t, db, "t", []*message.Message{message.NewMessage(id, []byte("retry")), message.NewMessage(id, []byte("again"))})

		rows := readRows(t, db)
		if len(rows) != 1 {
			t.Fatalf("rows = %d, want 1", len(rows))
		}
		if rows[0].Body != "first" {
			t.Errorf("body = %q, want the first write kept", rows[0].Body)
		}
	})
}

func TestTxPublisher_IDsDifferingOnlyInCase_AreTwoRows(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		publishInTx(t, db, "t", []*message.Message{message.NewMessage("abc", []byte("1")), message.NewMessage("ABC", []byte("2"))})
		if n := countRows(t, db); n != 2 {
			t.Fatalf("rows = %d, want 2: a case-insensitive id column dropped a message as a duplicate", n)
		}
	})
}

func TestTxPublisher_BinaryAndLargeBodies_RoundTripByteForByte(t *testing.T) {
	t.Parallel()
	binary := make([]byte, 64<<10)
	for i := range binary {
		binary[i] = byte(i*7 + i/256) // invalid UTF-8 throughout
	}
	cases := []struct {
		name     string
		body     []byte
		encoding string
	}{
		{"64KiB non-UTF-8", binary, rowcodec.BodyBase64},
		{"valid UTF-8 with NUL", []byte("a\x00b"), rowcodec.BodyBase64},
		{"empty", []byte{}, rowcodec.BodyUTF8},
		{"4-byte UTF-8", []byte("🦀 payment.captured"), rowcodec.BodyUTF8},
		{"6MiB text", bytes.Repeat([]byte("order line ü\n"), 6<<20/14), rowcodec.BodyUTF8},
		{"5MiB binary", bytes.Repeat(binary, 80), rowcodec.BodyBase64},
	}
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		for _, c := range cases {
			t.Run(c.name, func(t *testing.T) {
				id := watermill.NewUUID()
				publishInTx(t, db, "t", []*message.Message{message.NewMessage(id, c.body)})
				var r row
				if err := db.Get(&r, "SELECT * FROM acemq_outbox WHERE id = "+placeholder(db, 1), id); err != nil {
					t.Fatal(err)
				}
				if r.BodyEncoding != c.encoding {
					t.Errorf("body_encoding = %q, want %q", r.BodyEncoding, c.encoding)
				}
				got, err := rowcodec.DecodeBody(r.Body, r.BodyEncoding)
				if err != nil {
					t.Fatal(err)
				}
				if !bytes.Equal(got, c.body) {
					t.Errorf("body read back differs: %d bytes, want %d", len(got), len(c.body))
				}
			})
		}
	})
}

func TestTxPublisher_BadInput_TypedErrorAndNothingOfTheCallWritten(t *testing.T) {
	t.Parallel()
	long := func(n int) string { return strings.Repeat("x", n) }
	withMeta := func(k, v string) *message.Message {
		m := message.NewMessage(watermill.NewUUID(), []byte("x"))
		m.Metadata.Set(k, v)
		return m
	}
	cases := []struct {
		name  string
		topic string
		bad   *message.Message
		field string
	}{
		{"empty id", "t", message.NewMessage("", []byte("x")), "id"},
		{"65-character id", "t", message.NewMessage(long(65), []byte("x")), "id"},
		{"id with a space", "t", message.NewMessage("a b", []byte("x")), "id"},
		{"id with non-ASCII", "t", message.NewMessage("zoë", []byte("x")), "id"},
		{"empty topic", "", message.NewMessage(watermill.NewUUID(), []byte("x")), "topic"},
		{"256-byte routing key", long(256), message.NewMessage(watermill.NewUUID(), []byte("x")), "routing key"},
		{"invalid UTF-8 topic", "a\xffb", message.NewMessage(watermill.NewUUID(), []byte("x")), "routing key"},
		{"256-byte exchange in metadata", "t", withMeta(outbox.MetadataExchange, long(256)), "exchange"},
		{"256-byte routing key in metadata", "t", withMeta(outbox.MetadataRoutingKey, long(256)), "routing key"},
		{"256-byte content type", "t", withMeta(outbox.MetadataContentType, long(256)), "content type"},
		{"invalid UTF-8 metadata value", "t", withMeta("k", "\xff"), "metadata"},
		{"invalid UTF-8 metadata key", "t", withMeta("\xfe", "v"), "metadata"},
		{"nil message", "t", nil, "message"},
	}
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		for _, c := range cases {
			t.Run(c.name, func(t *testing.T) {
				tx, err := db.Beginx()
				if err != nil {
					t.Fatal(err)
				}
				defer func() { _ = tx.Rollback() }()
				pub, err := outbox.NewTxPublisher(tx)
				if err != nil {
					t.Fatal(err)
				}
				good := message.NewMessage(watermill.NewUUID(), []byte("fine"))
				err = pub.Publish(c.topic, good, c.bad)
				var invalid *outbox.InvalidMessageError
				if !errors.As(err, &invalid) || !errors.Is(err, outbox.ErrInvalidMessage) {
					t.Fatalf("err = %v, want an *InvalidMessageError", err)
				}
				wantIndex := 1
				if c.topic != "t" {
					wantIndex = 0 // the topic fails the first message already
				}
				if invalid.Field != c.field || invalid.Index != wantIndex {
					t.Errorf("error names field %q index %d, want %q index %d: %v", invalid.Field, invalid.Index, c.field, wantIndex, err)
				}
				// The caller may still commit: nothing of the call may be in it.
				if err := tx.Commit(); err != nil {
					t.Fatal(err)
				}
				if n := countRows(t, db); n != 0 {
					t.Fatalf("rows = %d after a refused call, want 0 (not even the valid message)", n)
				}
			})
		}
	})
}

func TestTxPublisher_FinishedTransaction_ErrTxDone(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		for _, finish := range []string{"commit", "rollback"} {
			t.Run(finish, func(t *testing.T) {
				tx, err := db.Beginx()
				if err != nil {
					t.Fatal(err)
				}
				pub, err := outbox.NewTxPublisher(tx)
				if err != nil {
					t.Fatal(err)
				}
				if finish == "commit" {
					err = tx.Commit()
				} else {
					err = tx.Rollback()
				}
				if err != nil {
					t.Fatal(err)
				}
				err = pub.Publish("t", message.NewMessage(watermill.NewUUID(), []byte("late")))
				if !errors.Is(err, outbox.ErrTxDone) {
					t.Fatalf("err = %v, want ErrTxDone", err)
				}
				if n := countRows(t, db); n != 0 {
					t.Fatalf("rows = %d, want 0", n)
				}
			})
		}
	})
}

func TestTxPublisher_CanceledMessageContext_NoRow(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		tx, err := db.Beginx()
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = tx.Rollback() }()
		pub, err := outbox.NewTxPublisher(tx)
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		msg := message.NewMessage(watermill.NewUUID(), []byte("x"))
		msg.SetContext(ctx)
		if err := pub.Publish("t", msg); !errors.Is(err, context.Canceled) {
			t.Fatalf("err = %v, want context.Canceled: the message's context must govern the statement", err)
		}
		_ = tx.Rollback()
		if n := countRows(t, db); n != 0 {
			t.Fatalf("rows = %d, want 0", n)
		}
	})
}

func TestTxPublisher_Close_IdempotentConcurrentAndRefusesPublish(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		tx, err := db.Beginx()
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = tx.Rollback() }()
		pub, err := outbox.NewTxPublisher(tx)
		if err != nil {
			t.Fatal(err)
		}
		var wg sync.WaitGroup
		for i := 0; i < 10; i++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				if err := pub.Close(); err != nil {
					t.Errorf("Close: %v", err)
				}
			}()
		}
		wg.Wait()
		err = pub.Publish("t", message.NewMessage(watermill.NewUUID(), []byte("x")))
		if !errors.Is(err, outbox.ErrPublisherClosed) {
			t.Fatalf("err = %v, want ErrPublisherClosed", err)
		}
		if err := tx.Commit(); err != nil {
			t.Fatal(err)
		}
		if n := countRows(t, db); n != 0 {
			t.Fatalf("rows = %d, want 0", n)
		}
	})
}

func TestTxPublisher_FiftyConcurrentTransactions_AllRows(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		const n = 50
		var wg sync.WaitGroup
		errs := make(chan error, n)
		for i := 0; i < n; i++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				errs <- func() error {
					tx, err := db.Beginx()
					if err != nil {
						return err
					}
					defer func() { _ = tx.Rollback() }()
					pub, err := outbox.NewTxPublisher(tx)
					if err != nil {
						return err
					}
					if err := pub.Publish("t", message.NewMessage(watermill.NewUUID(), []byte("x"))); err != nil {
						return err
					}
					return tx.Commit()
				}()
			}()
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			if err != nil {
				t.Error(err)
			}
		}
		if got := countRows(t, db); got != n {
			t.Fatalf("rows = %d, want %d", got, n)
		}
	})
}

func TestTxPublisher_ManyMessagesInOneCall_AllRows(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		var msgs []*message.Message
		for i := 0; i < 2500; i++ { // three statements' worth
			msgs = append(msgs, message.NewMessage(watermill.NewUUID(), []byte(fmt.Sprint(i))))
		}
		publishInTx(t, db, "t", msgs)
		rows := readRows(t, db)
		if len(rows) != len(msgs) {
			t.Fatalf("rows = %d, want %d", len(rows), len(msgs))
		}
		for i, r := range rows {
			if r.Body != fmt.Sprint(i) {
				t.Fatalf("row %d has body %q: order lost across statements", i, r.Body)
			}
		}
	})
}

// refuseBoom makes the database refuse, with the error "boom refused",
// the insert of the outbox row whose id is "boom": a failure in whichever
// statement of a call writes that row.
func refuseBoom(t testing.TB, db *testdb.DB) {
	t.Helper()
	refuse := map[string][]string{
		testdb.Postgres: {
			`CREATE FUNCTION refuse_boom() RETURNS trigger AS $$ BEGIN RAISE EXCEPTION 'boom refused'; END $$ LANGUAGE plpgsql`,
			`CREATE TRIGGER refuse_boom BEFORE INSERT ON acemq_outbox FOR EACH ROW WHEN (NEW.id = 'boom') EXECUTE FUNCTION refuse_boom()`,
		},
		testdb.MySQL: {
			"CREATE TRIGGER refuse_boom BEFORE INSERT ON acemq_outbox FOR EACH ROW BEGIN IF NEW.id = 'boom' THEN SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'boom refused'; END IF; END",
		},
		testdb.SQLite: {
			"CREATE TRIGGER refuse_boom BEFORE INSERT ON acemq_outbox WHEN NEW.id = 'boom' BEGIN SELECT RAISE(ABORT, 'boom refused'); END",
		},
	}
	for _, stmt := range refuse[db.Kind] {
		if _, err := db.Exec(stmt); err != nil {
			t.Fatal(err)
		}
	}
}

// publishRefusedCallThenCommit publishes msgs, whose last is "boom", in a
// transaction that first ran before (if any); it wants the trigger's
// refusal, and commits after it as a caller may on MySQL and SQLite, where
// a failed statement leaves the transaction open. It reports false on
// PostgreSQL, whose failed statement aborted the transaction: nothing can
// commit there.
func publishRefusedCallThenCommit(t *testing.T, db *testdb.DB, msgs []*message.Message, before func(tx *sqlx.Tx)) bool {
	t.Helper()
	tx, err := db.Beginx()
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback() }()
	if before != nil {
		before(tx)
	}
	pub, err := outbox.NewTxPublisher(tx)
	if err != nil {
		t.Fatal(err)
	}
	if err := pub.Publish("t", msgs...); err == nil || !strings.Contains(err.Error(), "boom refused") {
		t.Fatalf("err = %v, want the trigger's refusal", err)
	}
	if db.Kind == testdb.Postgres {
		return false
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	return true
}

// A database refusal in the third statement of a call must undo the first
// two, even on MySQL and SQLite where a failed statement does not abort the
// transaction and the caller may commit after our error.
func TestTxPublisher_FailureInLaterStatement_WritesNothingOfTheCall(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		refuseBoom(t, db)
		var msgs []*message.Message
		for i := 0; i < 2100; i++ {
			msgs = append(msgs, message.NewMessage(watermill.NewUUID(), []byte("x")))
		}
		msgs = append(msgs, message.NewMessage("boom", []byte("x")))
		committed := publishRefusedCallThenCommit(t, db, msgs, func(tx *sqlx.Tx) {
			if _, err := tx.Exec("INSERT INTO acemq_outbox (id, exchange_name, routing_key, body, body_encoding, content_type, headers, created_at) VALUES ('before', '', 't', 'x', 'utf-8', '', '{}', '2026-01-01 00:00:00')"); err != nil {
				t.Fatal(err)
			}
		})
		if !committed {
			return
		}
		var ids []string
		if err := db.Select(&ids, "SELECT id FROM acemq_outbox"); err != nil {
			t.Fatal(err)
		}
		if len(ids) != 1 || ids[0] != "before" {
			t.Fatalf("%d rows committed, want only the caller's own earlier row: the call was half written", len(ids))
		}
	})
}

// The same for a keyed call of several statements (publishKeyed's
// savepoint): the refusal in its last statement undoes the rows of the
// earlier ones and their numbers. Without the rollback to the savepoint a
// caller committing after the error kept 2000 rows of a call that
// returned an error, each with a number of the key.
func TestTxPublisher_KeyedFailureInLaterStatement_WritesNothingOfTheCall(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		refuseBoom(t, db)
		inTx(t, db, true, []*message.Message{keyed("k")}) // k: 1
		var msgs []*message.Message
		for i := 0; i < 2100; i++ {
			msgs = append(msgs, keyed("k"))
		}
		boom := message.NewMessage("boom", []byte("x"))
		boom.Metadata.Set(outbox.MetadataAggregateID, "k")
		if !publishRefusedCallThenCommit(t, db, append(msgs, boom), nil) {
			return
		}
		if rows := countRows(t, db); rows != 1 {
			t.Errorf("%d rows committed, want only k's first: the refused keyed call was half written", rows)
		}
		if seqs, last := seqsOf(t, db, "k"), lastSeq(t, db, "k"); len(seqs) != 1 || last != 1 {
			t.Errorf("k has %d numbered rows, its counter at %d; want 1 and 1", len(seqs), last)
		}
	})
}

func TestNewTxPublisher_Config_ErrorsNameTheOption(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, testdb.SQLite)
	tx, err := db.Beginx()
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback() }()
	pg := []outbox.TxPublisherConfig{{Dialect: outbox.Postgres}}
	cases := []struct {
		name  string
		tx    any
		cfg   []outbox.TxPublisherConfig
		field string
	}{
		{"*sql.Tx without dialect", tx.Tx, nil, "Dialect"},
		{"not a transaction", db.DB, nil, "tx"},
		{"nil *sql.Tx", (*sql.Tx)(nil), nil, "tx"},
		// watermill-sql's adapters around no transaction were taken, and
		// Publish panicked.
		{"watermill-sql TxFromStdSQL(nil)", wsql.TxFromStdSQL(nil), pg, "tx"},
		{"watermill-sql TxFromPgx(nil)", wsql.TxFromPgx(nil), pg, "tx"},
		{"nil *watermill-sql StdSQLTx", (*wsql.StdSQLTx)(nil), pg, "tx"},
		{"nil *watermill-sql PgxTx", (*wsql.PgxTx)(nil), pg, "tx"},
		{"watermill-sql StdSQLTx value without a transaction", wsql.StdSQLTx{}, pg, "tx"},
		{"watermill-sql PgxTx around a nil pgx tx", wsql.PgxTx{Tx: (*nilPgxTx)(nil)}, pg, "tx"},
		{"table with a quote", tx, []outbox.TxPublisherConfig{{Table: `x"; DROP TABLE y; --`}}, "Table"},
		{"table with two dots", tx, []outbox.TxPublisherConfig{{Table: "a.b.c"}}, "Table"},
		{"exchange over 255 bytes", tx, []outbox.TxPublisherConfig{{Exchange: strings.Repeat("e", 256)}}, "Exchange"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := outbox.NewTxPublisher(c.tx, c.cfg...)
			var cfgErr *outbox.ConfigError
			if !errors.As(err, &cfgErr) || cfgErr.Field != c.field {
				t.Fatalf("err = %v, want a *ConfigError naming %s", err, c.field)
			}
		})
	}
}

func TestNewTxPublisher_SQLTxWithDialect_AndCustomTable(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, d outbox.Dialect) {
		create := map[string]string{
			testdb.Postgres: "CREATE TABLE custom_outbox (LIKE acemq_outbox INCLUDING ALL)",
			testdb.MySQL:    "CREATE TABLE custom_outbox LIKE acemq_outbox",
		}[db.Kind]
		if db.Kind == testdb.SQLite {
			migs, err := sqlschema.Migrations("sqlite")
			if err != nil {
				t.Fatal(err)
			}
			create = strings.ReplaceAll(migs[0].Up, "acemq_outbox", "custom_outbox")
		}
		if _, err := db.Exec(create); err != nil {
			t.Fatal(err)
		}
		tx, err := db.DB.DB.Begin()
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = tx.Rollback() }()
		pub, err := outbox.NewTxPublisher(tx, outbox.TxPublisherConfig{Dialect: d, Table: "custom_outbox",
			TopicMapper: func(topic string) (string, string) { return "ex-" + topic, "rk-" + topic }})
		if err != nil {
			t.Fatal(err)
		}
		if err := pub.Publish("orders", message.NewMessage("m1", []byte("x"))); err != nil {
			t.Fatal(err)
		}
		if err := tx.Commit(); err != nil {
			t.Fatal(err)
		}
		var got struct {
			Exchange   string `db:"exchange_name"`
			RoutingKey string `db:"routing_key"`
		}
		if err := db.Get(&got, "SELECT exchange_name, routing_key FROM custom_outbox WHERE id = 'm1'"); err != nil {
			t.Fatal(err)
		}
		if got.Exchange != "ex-orders" || got.RoutingKey != "rk-orders" {
			t.Errorf("destination = %+v, want the mapper's", got)
		}
		if n := countRows(t, db); n != 0 {
			t.Errorf("acemq_outbox has %d rows, want 0: WithTable was ignored", n)
		}
	})
}

func TestNewTxPublisher_WatermillSQLTx_PgxNativeAndStdSQL(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, testdb.Postgres)
	ctx := context.Background()
	if err := outbox.Migrate(ctx, db.DB.DB, outbox.Postgres); err != nil {
		t.Fatal(err)
	}
	conn, err := pgx.Connect(ctx, db.DSN)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	pgxTx, err := conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	pub, err := outbox.NewTxPublisher(wsql.TxFromPgx(pgxTx), outbox.TxPublisherConfig{Dialect: outbox.Postgres})
	if err != nil {
		t.Fatal(err)
	}
	if err := pub.Publish("t", message.NewMessage("via-pgx", []byte("\xff binary"))); err != nil {
		t.Fatal(err)
	}
	if err := pgxTx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if err := pub.Publish("t", message.NewMessage("late", []byte("x"))); !errors.Is(err, outbox.ErrTxDone) {
		t.Errorf("publish on a committed pgx tx: err = %v, want ErrTxDone", err)
	}

	stdTx, err := db.DB.DB.Begin()
	if err != nil {
		t.Fatal(err)
	}
	pub, err = outbox.NewTxPublisher(wsql.TxFromStdSQL(stdTx), outbox.TxPublisherConfig{Dialect: outbox.Postgres})
	if err != nil {
		t.Fatal(err)
	}
	if err := pub.Publish("t", message.NewMessage("via-std", []byte("x"))); err != nil {
		t.Fatal(err)
	}
	if err := stdTx.Commit(); err != nil {
		t.Fatal(err)
	}
	var ids []string
	if err := db.Select(&ids, "SELECT id FROM acemq_outbox ORDER BY id"); err != nil {
		t.Fatal(err)
	}
	if fmt.Sprint(ids) != "[via-pgx via-std]" {
		t.Fatalf("ids = %v, want [via-pgx via-std]", ids)
	}
}

// A call that holds a message twice (one row) and a message whose id a row
// to another destination holds is refused whole: the row of the message
// given twice is taken out too. The call's later copy once carried another
// stamp than the row, so the row was not recognised as the call's and
// stayed, to be published if the caller committed after the error.
func TestTxPublisher_SameIDTwiceAndAConflict_NothingOfTheCallWritten(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		taken := message.NewMessage(watermill.NewUUID(), []byte("x"))
		publishInTx(t, db, "topic-a", []*message.Message{taken})

		tx, err := db.Beginx()
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = tx.Rollback() }()
		pub, _ := outbox.NewTxPublisher(tx)
		m := message.NewMessage(watermill.NewUUID(), []byte("y"))
		if err := pub.Publish("topic-b", m, m.Copy(), taken.Copy()); !errors.Is(err, outbox.ErrDuplicateID) {
			t.Fatalf("err = %v, want ErrDuplicateID", err)
		}
		if err := tx.Commit(); err != nil {
			t.Fatal(err)
		}
		if rows := readRows(t, db); len(rows) != 1 || rows[0].ID != taken.UUID {
			t.Fatalf("rows %+v, want only %s: nothing of the refused call", rows, taken.UUID)
		}
	})
}

// A copy of a message (Watermill's Copy keeps the UUID) published to a
// second topic would be dropped as a "retry" and lost without a word: it is
// refused instead, and nothing of that call is written.
func TestTxPublisher_SameIDToAnotherDestination_DuplicateIDErrorNothingWritten(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		msg := message.NewMessage(watermill.NewUUID(), []byte("x"))
		publishInTx(t, db, "topic-a", []*message.Message{msg})

		tx, err := db.Beginx()
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = tx.Rollback() }()
		pub, _ := outbox.NewTxPublisher(tx)
		fresh := message.NewMessage(watermill.NewUUID(), []byte("other"))
		err = pub.Publish("topic-b", fresh, msg.Copy())
		var dup *outbox.DuplicateIDError
		if !errors.As(err, &dup) || !errors.Is(err, outbox.ErrDuplicateID) || dup.RoutingKey != "topic-a" || dup.WantRoutingKey != "topic-b" {
			t.Fatalf("err = %v, want a *DuplicateIDError naming topic-a and topic-b", err)
		}
		// The caller may still commit: nothing of the refused call is in it.
		if err := tx.Commit(); err != nil {
			t.Fatal(err)
		}
		rows := readRows(t, db)
		if len(rows) != 1 || rows[0].RoutingKey != "topic-a" {
			t.Fatalf("rows %+v, want only the first message: nothing of the refused call", rows)
		}

		// In one call, too.
		tx2, _ := db.Beginx()
		defer func() { _ = tx2.Rollback() }()
		pub2, _ := outbox.NewTxPublisher(tx2)
		m := message.NewMessage(watermill.NewUUID(), []byte("y"))
		err = pub2.Publish("t", m)
		if err == nil {
			err = pub2.Publish("t", m.Copy()) // the same place again: fine
		}
		if err != nil {
			t.Fatalf("the same message to the same place again: %v", err)
		}
		withKey := m.Copy()
		withKey.Metadata.Set(outbox.MetadataRoutingKey, "elsewhere")
		if err := pub2.Publish("t", message.NewMessage(watermill.NewUUID(), nil), withKey); !errors.Is(err, outbox.ErrDuplicateID) {
			t.Fatalf("err = %v, want ErrDuplicateID", err)
		}
		var invalid *outbox.InvalidMessageError
		if err := pub2.Publish("t", m, withKey); !errors.As(err, &invalid) || invalid.Field != "id" {
			t.Fatalf("err = %v, want an *InvalidMessageError on the id within one call", err)
		}
	})
}

// Under REPEATABLE READ, MySQL's default, a transaction reads the snapshot of
// its first read, while its insert sees the rows committed since. A row of
// the same id that another transaction committed after the caller's first
// read was skipped by MySQL's insert and yet invisible to a plain read back:
// the publisher said the message was written nowhere. The read back is a
// current read, as the insert: the retry is one row, and another
// destination or key is ErrDuplicateID. PostgreSQL's insert refuses such a
// row as a serialization failure, which the caller's retry of its
// transaction meets in its new snapshot. (SQLite's writer holds the
// database from its first statement: nothing commits inside its
// transaction.)
func TestTxPublisher_RepeatableRead_IDCommittedAfterTheSnapshot(t *testing.T) {
	t.Parallel()
	for _, kind := range []string{testdb.MySQL, testdb.Postgres} {
		db := migrated(t, kind)
		for _, tc := range []struct {
			name, topic, firstKey, key string
			dup                        bool
		}{
			{name: "same destination", topic: "orders"},
			{name: "same destination keyed", topic: "orders", firstKey: "k", key: "k"},
			{name: "unkeyed over keyed", topic: "orders", firstKey: "k"},
			{name: "other destination", topic: "billing", dup: true},
			{name: "other key", topic: "orders", firstKey: "k", key: "k2", dup: true},
		} {
			t.Run(kind+"/"+tc.name, func(t *testing.T) {
				id := watermill.NewUUID()
				first := message.NewMessage(id, []byte("x"))
				if tc.firstKey != "" {
					first.Metadata.Set(outbox.MetadataAggregateID, tc.firstKey)
				}
				caller, err := db.BeginTxx(context.Background(), &sql.TxOptions{Isolation: sql.LevelRepeatableRead})
				if err != nil {
					t.Fatal(err)
				}
				defer func() { _ = caller.Rollback() }()
				var n int
				if err := caller.Get(&n, "SELECT COUNT(*) FROM acemq_outbox"); err != nil { // the snapshot
					t.Fatal(err)
				}
				inTx(t, db, true, []*message.Message{first}) // to orders, committed after it
				p, err := outbox.NewTxPublisher(caller)
				if err != nil {
					t.Fatal(err)
				}
				again := message.NewMessage(id, []byte("x"))
				if tc.key != "" {
					again.Metadata.Set(outbox.MetadataAggregateID, tc.key)
				}
				err = p.Publish(tc.topic, again)
				var state interface{ SQLState() string }
				switch {
				case kind == testdb.Postgres:
					if !errors.As(err, &state) || state.SQLState() != "40001" {
						t.Fatalf("publish of an id committed since the snapshot: %v, want PostgreSQL's serialization failure (40001)", err)
					}
				case tc.dup && !errors.Is(err, outbox.ErrDuplicateID):
					t.Fatalf("publish of an id committed since the snapshot to %s under %q: %v, want ErrDuplicateID", tc.topic, tc.key, err)
				case !tc.dup && err != nil:
					t.Fatalf("publish of an id committed since the snapshot: %v, want nil (a retry)", err)
				}
				_ = caller.Commit()
				var rows int
				if err := db.Get(&rows, db.Rebind("SELECT COUNT(*) FROM acemq_outbox WHERE id = ?"), id); err != nil || rows != 1 {
					t.Fatalf("rows of the id: %d (%v), want 1", rows, err)
				}
				if tc.firstKey != "" {
					var last int64
					if err := db.Get(&last, db.Rebind("SELECT last_seq FROM acemq_outbox_sequences WHERE aggregate_id = ?"), tc.firstKey); err != nil {
						t.Fatal(err)
					}
					if seqs := seqsOf(t, db, tc.firstKey); int64(len(seqs)) != last {
						t.Errorf("counter of %q at %d over rows numbered %v: a number given out to no row", tc.firstKey, last, seqs)
					}
				}
			})
		}
	}
}

// nilPgxTx is a pgx.Tx implementation, of which a nil pointer is no
// transaction.
type nilPgxTx struct{ pgx.Tx }

// With pgx's own transaction (watermill-sql's TxFromPgx), an error the
// server raises while the read back of a retried id runs reaches the
// caller only through pgx's Rows.Err: watermill-sql's Rows closes without
// it. It read as no rows, and the publisher said the message had been
// skipped for another unique key ("does another row hold its next seq"),
// the server's SQLSTATE gone: a caller that retries its transaction on a
// serialization failure (40001) did not. A row-security policy raises
// such an error here, for the read back alone.
func TestTxPublisher_PgxNative_ReadBackError_IsTheServers(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.Postgres)
	ctx := context.Background()
	publishInTx(t, db, "t", []*message.Message{message.NewMessage("dup", []byte("x"))})
	for _, s := range []string{
		`CREATE FUNCTION boom(id text) RETURNS boolean LANGUAGE plpgsql AS $$ BEGIN IF id = 'dup' AND current_query() ILIKE 'SELECT%' THEN RAISE EXCEPTION 'simulated serialization failure' USING ERRCODE = '40001'; END IF; RETURN true; END $$`,
		`ALTER TABLE acemq_outbox ENABLE ROW LEVEL SECURITY`,
		`ALTER TABLE acemq_outbox FORCE ROW LEVEL SECURITY`,
		`CREATE POLICY sel ON acemq_outbox FOR SELECT USING (boom(id))`,
		`CREATE POLICY ins ON acemq_outbox FOR INSERT WITH CHECK (true)`,
	} {
		if _, err := db.Exec(s); err != nil {
			t.Fatal(err)
		}
	}
	// Row security binds roles that are not superusers.
	_, as := newRole(t, db, db.Name, "USAGE ON SCHEMA "+db.Name, "SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA "+db.Name)
	conn, err := pgx.Connect(ctx, as.DSN)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = conn.Close(ctx) }()
	tx, err := conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	p, err := outbox.NewTxPublisher(wsql.TxFromPgx(tx), outbox.TxPublisherConfig{Dialect: outbox.Postgres})
	if err != nil {
		t.Fatal(err)
	}
	err = p.Publish("t", message.NewMessage("dup", []byte("x")))
	var state interface{ SQLState() string }
	if !errors.As(err, &state) || state.SQLState() != "40001" {
		t.Fatalf("publish: %v, want the server's error (SQLSTATE 40001)", err)
	}
}
