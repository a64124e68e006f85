package outbox_test

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"reflect"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// On MySQL the publisher writes its arguments into the statement (one round
// trip where go-sql-driver would prepare, execute and close): the row holds
// every value exactly as given, whatever it holds and whatever the
// session's sql_mode makes of quotes and backslashes, and nothing is
// prepared.
func TestTxPublisher_MySQL_OneRoundTrip_ValuesExactUnderEverySQLMode(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.MySQL)
	ctx := context.Background()
	awkward := "it's \\' \"q\" ? -- # /* ` \x00 ζ 😀 \\x41"
	modes := []string{"", "NO_BACKSLASH_ESCAPES,ANSI_QUOTES,PIPES_AS_CONCAT", "STRICT_ALL_TABLES,NO_ZERO_DATE"}
	for i, mode := range modes {
		unkeyed := message.NewMessage("unkeyed-"+string(rune('a'+i))+"'?", []byte(awkward+" body"))
		unkeyed.Metadata.Set("h'?\\", awkward)
		unkeyed.Metadata.Set(outbox.MetadataContentType, "text/plain; q='?'")
		keyed := message.NewMessage("keyed-"+string(rune('a'+i)), []byte{0xff, 0x00, '\'', '\\'}) // stored as base64
		key := strings.ReplaceAll(awkward, "\x00", "")                                            // a key holds no NUL
		keyed.Metadata.Set(outbox.MetadataAggregateID, key)
		keyed.Metadata.Set(outbox.MetadataRoutingKey, "rk.'?\\")

		tx, err := db.BeginTxx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := tx.ExecContext(ctx, "SET SESSION sql_mode = '"+mode+"'"); err != nil {
			t.Fatal(err)
		}
		before := sessionPrepares(t, tx)
		pub, err := outbox.NewTxPublisher(tx, outbox.TxPublisherConfig{Exchange: "ex'\\?"})
		if err != nil {
			t.Fatal(err)
		}
		if err := pub.Publish("topic`?", unkeyed, keyed); err != nil {
			t.Fatalf("sql_mode %q: publish: %v", mode, err)
		}
		// A retried transaction's message again: the slow path (read back,
		// give the numbers back) runs inlined too.
		if err := pub.Publish("topic`?", keyed); err != nil {
			t.Fatalf("sql_mode %q: publish again: %v", mode, err)
		}
		if n := sessionPrepares(t, tx) - before; n != 0 {
			t.Errorf("sql_mode %q: %d statements prepared, want 0 (every statement in one round trip)", mode, n)
		}
		if _, err := tx.ExecContext(ctx, "SET SESSION sql_mode = DEFAULT"); err != nil {
			t.Fatal(err)
		}
		if err := tx.Commit(); err != nil {
			t.Fatal(err)
		}

		for _, m := range []*message.Message{unkeyed, keyed} {
			var r row
			if err := db.Get(&r, "SELECT * FROM acemq_outbox WHERE id = ?", m.UUID); err != nil {
				t.Fatalf("sql_mode %q: reading %q: %v", mode, m.UUID, err)
			}
			body := []byte(r.Body)
			if r.BodyEncoding == "base64" {
				if body, err = base64.StdEncoding.DecodeString(r.Body); err != nil {
					t.Fatal(err)
				}
			}
			if string(body) != string(m.Payload) || r.Exchange != "ex'\\?" {
				t.Errorf("sql_mode %q: %q body %q exchange %q, want %q, %q", mode, m.UUID, body, r.Exchange, m.Payload, "ex'\\?")
			}
			var headers map[string]string
			if err := json.Unmarshal([]byte(r.Headers), &headers); err != nil {
				t.Fatalf("sql_mode %q: headers %s: %v", mode, r.Headers, err)
			}
			for k, v := range m.Metadata {
				if k == outbox.MetadataRoutingKey || k == outbox.MetadataAggregateID {
					continue // the row's columns, checked below
				}
				if got := headers[k]; got != v {
					t.Errorf("sql_mode %q: %q header %q = %q, want %q", mode, m.UUID, k, got, v)
				}
			}
		}
		var u, k row
		_ = db.Get(&u, "SELECT * FROM acemq_outbox WHERE id = ?", unkeyed.UUID)
		_ = db.Get(&k, "SELECT * FROM acemq_outbox WHERE id = ?", keyed.UUID)
		if u.RoutingKey != "topic`?" || u.ContentType != "text/plain; q='?'" || u.AggregateID.Valid {
			t.Errorf("sql_mode %q: unkeyed row %+v", mode, u)
		}
		if k.RoutingKey != "rk.'?\\" || k.AggregateID.String != key || k.Seq.Int64 != int64(i+1) {
			t.Errorf("sql_mode %q: keyed row routing key %q key %q seq %d, want %q %q %d", mode, k.RoutingKey, k.AggregateID.String, k.Seq.Int64, "rk.'?\\", key, i+1)
		}
	}
}

// sessionPrepares is the session's count of prepared statements so far, on
// a transaction's connection, or a pool's with one connection.
func sessionPrepares(t testing.TB, tx interface {
	QueryRowx(query string, args ...any) *sqlx.Row
}) int64 {
	t.Helper()
	var (
		name string
		n    int64
	)
	if err := tx.QueryRowx("SHOW SESSION STATUS LIKE 'Com_stmt_prepare'").Scan(&name, &n); err != nil {
		t.Fatal(err)
	}
	return n
}

// The inbox's own statements in a message's transaction (its key, and the
// outbox record marked processed) go in one round trip each on MySQL too,
// and the key, whatever it holds, dedupes the next delivery. The handler
// reads the session's prepare count: between two messages on the one
// connection nothing was prepared.
func TestInbox_MySQL_OneRoundTrip_KeyExact(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.MySQL)
	db.SetMaxOpenConns(1)
	var counts []int64
	ran := 0
	h := newInbox(t, db, outbox.InboxConfig{MarkOutboxProcessed: true}).Middleware(func(msg *message.Message) ([]*message.Message, error) {
		ran++
		tx, _ := outbox.TxFromContext(msg.Context())
		counts = append(counts, sessionPrepares(t, tx))
		return nil, nil
	})
	ids := []string{"first'it''s'\\?", "second\"`--#/*"}
	for _, id := range append(ids, ids...) {
		if _, err := h(message.NewMessage(id, []byte("x"))); err != nil {
			t.Fatalf("%q: %v", id, err)
		}
	}
	if ran != 2 || len(counts) != 2 || counts[1] != counts[0] {
		t.Errorf("handler ran %d times (want 2), prepare counts %v (want equal)", ran, counts)
	}
	var stored []string
	if err := db.Select(&stored, "SELECT message_id FROM processed_messages ORDER BY message_id"); err != nil {
		t.Fatal(err)
	}
	if strings.Join(stored, "|") != strings.Join(ids, "|") {
		t.Errorf("processed_messages holds %q, want %q", stored, ids)
	}
}

// A key that is not UTF-8 (AMQP header strings are bytes, and another
// language's producer may send any) is applied in order on MySQL, held and
// all: its statements go with arguments, which the varbinary key columns
// store as they are, where a _utf8mb4 literal would be refused.
func TestOrderedInbox_MySQL_KeyNotUTF8_AppliedInOrder(t *testing.T) {
	db := migrated(t, testdb.MySQL)
	createEffects(t, db)
	var l applyLog
	h := orderedInbox(t, db, outbox.InboxConfig{}).Middleware(l.handler(t, db))
	key := "k\xff\xfe"
	for _, seq := range []int{1, 3, 2} {
		m := message.NewMessage(fmt.Sprintf("bytes-%d", seq), []byte("event"))
		m.Metadata.Set(outbox.HeaderAggregateID, key)
		m.Metadata.Set(outbox.HeaderSeq, strconv.Itoa(seq))
		if _, err := h(m); err != nil {
			t.Fatalf("seq %d: %v", seq, err)
		}
	}
	if got := l.of(key); !reflect.DeepEqual(got, upTo(3)) {
		t.Errorf("applied %v, want [1 2 3]", got)
	}
	if n := countHeld(t, db); n != 0 {
		t.Errorf("%d held, want 0", n)
	}
}

// Two transactions, each with a gap lock on acemq_outbox (an inbox marking
// an id of another service's processed, under REPEATABLE READ), publish on
// one key: the second one's insert deadlocks the first, which InnoDB rolls
// back whole, counter raise and all. The first's Publish must not then
// give its numbers back: run outside the transaction, that would commit
// the counter below the number the second took, and every later Publish
// on the key would fail.
func TestTxPublisher_MySQL_DeadlockedPublish_CounterStaysWithTheCommittedNumbers(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.MySQL)
	if _, err := db.Exec("CREATE TABLE work (id int AUTO_INCREMENT PRIMARY KEY, v int)"); err != nil {
		t.Fatal(err)
	}
	inTx(t, db, true, []*message.Message{keyed("a")})
	t1, err := db.Beginx()
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = t1.Rollback() }()
	t2, err := db.Beginx()
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = t2.Rollback() }()
	mark := "UPDATE acemq_outbox SET processed_at = NOW(6) WHERE id = ? AND processed_at IS NULL"
	for _, tx := range []*sqlx.Tx{t1, t2} {
		if _, err := tx.Exec(mark, "zzzz-of-another-service"); err != nil {
			t.Fatal(err)
		}
	}
	for range 20 { // the second did more work: InnoDB rolls back the first
		if _, err := t2.Exec("INSERT INTO work (v) VALUES (1)"); err != nil {
			t.Fatal(err)
		}
	}
	p1, err := outbox.NewTxPublisher(t1)
	if err != nil {
		t.Fatal(err)
	}
	p2, err := outbox.NewTxPublisher(t2)
	if err != nil {
		t.Fatal(err)
	}
	first := keyed("a")
	first.UUID = "zzzz-returned-1" // in the locked gap, after every row
	firstErr := make(chan error, 1)
	go func() { firstErr <- p1.Publish("orders", first) }()
	// The first publish's insert waits for the second's gap lock (MariaDB
	// shows it running, "Sending data", or in LOCK WAIT).
	waitFor(t, 10*time.Second, "the first publish waiting for a lock", func() bool {
		select {
		case err := <-firstErr:
			t.Fatalf("the first publish returned without waiting: %v", err)
		default:
		}
		var n int
		if err := db.Get(&n, "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE DB = DATABASE() AND INFO LIKE 'INSERT INTO `acemq_outbox`%'"); err != nil {
			t.Logf("reading the process list: %v", err)
		}
		return n > 0
	})
	if err := p2.Publish("orders", keyed("a")); err != nil {
		t.Fatalf("second publish: %v", err)
	}
	if err := t2.Commit(); err != nil {
		t.Fatal(err)
	}
	if err := <-firstErr; err == nil || !strings.Contains(err.Error(), "Error 1213") {
		t.Fatalf("first publish: %v, want the deadlock (1213)", err)
	}
	_ = t1.Rollback()
	var last int64
	if err := db.Get(&last, "SELECT last_seq FROM acemq_outbox_sequences WHERE aggregate_id = 'a'"); err != nil {
		t.Fatal(err)
	}
	if seqs := seqsOf(t, db, "a"); last != 2 || !reflect.DeepEqual(seqs, []int64{1, 2}) {
		t.Fatalf("counter of a %d, committed numbers %v; want 2 and [1 2]", last, seqs)
	}
	inTx(t, db, true, []*message.Message{keyed("a")})
	if seqs := seqsOf(t, db, "a"); !reflect.DeepEqual(seqs, []int64{1, 2, 3}) {
		t.Errorf("numbers after one more publish %v, want [1 2 3]", seqs)
	}
}
