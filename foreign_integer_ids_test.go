package outbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testamqp"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// outboxWithIDType is a database of kind whose acemq_outbox holds its ids
// in a column of type typ: on PostgreSQL this library's table, altered (it
// is empty: USING is never evaluated); elsewhere another library's
// (foreignIDTable).
func outboxWithIDType(t *testing.T, kind, typ string) *testdb.DB {
	t.Helper()
	if kind == testdb.Postgres {
		db := migrated(t, kind)
		if _, err := db.Exec("ALTER TABLE acemq_outbox ALTER id TYPE " + typ + " USING 0"); err != nil {
			t.Fatal(err)
		}
		return db
	}
	db := testdb.New(t, kind)
	foreignIDTable(t, db, typ)
	return db
}

// insertForeignID writes a foreign row of id (bound as given: an int or a string).
func insertForeignID(t *testing.T, db *testdb.DB, id any, exchange string, at time.Time) {
	t.Helper()
	q := db.Rebind("INSERT INTO acemq_outbox (id, exchange_name, routing_key, body, body_encoding, content_type, headers, created_at) VALUES (?, ?, 'ok', 'x', 'utf-8', 'text/plain', '{}', ?)")
	var created any = at.UTC()
	if db.Kind != testdb.Postgres {
		created = at.UTC().Format("2006-01-02 15:04:05.000000")
	}
	if _, err := db.Exec(q, id, exchange, created); err != nil {
		t.Fatal(err)
	}
}

// A MySQL table whose id is BIGINT UNSIGNED (Laravel's $table->id()): the
// relay must publish and mark its rows as it does a BIGINT's. Its
// claims read the ids as uint64 on the text protocol (Sweep's, and Run's
// once its prepared statements are given up), and failed every claim.
func TestForwarder_MySQLBigintUnsignedIDs_PublishedAndMarked(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, testdb.MySQL)
	foreignIDTable(t, db, "BIGINT UNSIGNED")
	b := testamqp.New(t)
	queue := b.Queue("ok")
	ids := []string{"1700000000123", "1700000000124"}
	for i, id := range ids {
		insertForeignID(t, db, id, b.Exchange, time.Now().Add(time.Duration(i-2)*time.Minute))
	}
	f := newForwarder(t, db, outbox.ForwarderConfig{MaxAttempts: 1})
	for i := 0; i < 3; i++ {
		n, err := f.Sweep(context.Background())
		t.Logf("sweep %d: published %d, err %.300v", i, n, err)
	}
	got := countIDs(b.Drain(queue, len(ids), 2*time.Second))
	for _, id := range ids {
		if got[id] != 1 {
			t.Errorf("row %s sent %d times, want once (sent %v)", id, got[id], got)
		}
		if st := stateOf(t, db, id); !st.Published {
			t.Errorf("row %s not marked published: %+v", id, st)
		}
	}
}

// SQLite: a foreign table whose id column has no declared type (BLOB
// affinity) holds an integer id as an INTEGER, which no text equals: the
// published mark bound the id as text, found nothing, and the row went out
// again at every lease's end.
func TestForwarder_SQLiteIntegerIDInAColumnWithoutAType_MarkedPublishedSentOnce(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, testdb.SQLite)
	foreignIDTable(t, db, "") // "id  NOT NULL PRIMARY KEY": no declared type
	b := testamqp.New(t)
	queue := b.Queue("ok")
	insertForeignID(t, db, 1700000000123, b.Exchange, time.Now().Add(-time.Minute))
	var typ string
	if err := db.Get(&typ, "SELECT typeof(id) FROM acemq_outbox"); err != nil || typ != "integer" {
		t.Fatalf("id stored as %q (%v), want integer", typ, err)
	}
	f := newForwarder(t, db, outbox.ForwarderConfig{MaxAttempts: 1, Lease: 2 * time.Second, PublishTimeout: time.Second})
	n, err := f.Sweep(context.Background())
	t.Logf("sweep: published %d, err %v", n, err)
	var published int
	if err := db.Get(&published, "SELECT COUNT(*) FROM acemq_outbox WHERE published_at IS NOT NULL"); err != nil {
		t.Fatal(err)
	}
	if published != 1 {
		t.Errorf("the row was sent (%d) but not marked published", n)
	}
	time.Sleep(2500 * time.Millisecond) // the lease ends
	n2, err := f.Sweep(context.Background())
	t.Logf("sweep after the lease: published %d, err %v", n2, err)
	if got := countIDs(b.Drain(queue, 3, 2*time.Second)); got["1700000000123"] != 1 {
		t.Errorf("row 1700000000123 sent %d times, want once", got["1700000000123"])
	}
}

// An inbox with MarkOutboxProcessed over a MySQL outbox whose id is an
// UNSIGNED integer: a record id above the signed range is a row's id, and
// its message must mark it.
func TestInbox_MarkOutboxProcessed_MySQLUnsignedIDs_RecordMarked(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ typ, id string }{
		{"INT UNSIGNED", "3000000000"},
		{"SMALLINT UNSIGNED", "40000"},
		{"BIGINT UNSIGNED", "10000000000000000000"},
	} {
		t.Run(tc.typ, func(t *testing.T) {
			t.Parallel()
			db := testdb.New(t, testdb.MySQL)
			foreignIDTable(t, db, tc.typ)
			insertForeignID(t, db, tc.id, "ex", time.Now())
			in := newInbox(t, db, outbox.InboxConfig{MarkOutboxProcessed: true})
			h := in.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, nil })
			if _, err := h(message.NewMessage(tc.id, []byte("x"))); err != nil {
				t.Fatal(err)
			}
			var n int
			if err := db.Get(&n, "SELECT COUNT(*) FROM acemq_outbox WHERE id = ? AND processed_at IS NOT NULL", tc.id); err != nil {
				t.Fatal(err)
			}
			if n != 1 {
				t.Errorf("message %s: its record (id column %s) was not marked processed", tc.id, tc.typ)
			}
		})
	}
}

// An integer id column: a message whose id is no record's text ("042",
// another service's order number) must not mark record 42.
func TestInbox_MarkOutboxProcessed_IntegerIDs_KeyWithALeadingZeroMarksNothing(t *testing.T) {
	t.Parallel()
	for _, kind := range []string{testdb.Postgres, testdb.MySQL} {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			db := outboxWithIDType(t, kind, "BIGINT")
			insertForeignID(t, db, "42", "ex", time.Now())
			in := newInbox(t, db, outbox.InboxConfig{MarkOutboxProcessed: true})
			h := in.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, nil })
			if _, err := h(message.NewMessage("042", []byte("x"))); err != nil {
				t.Fatal(err)
			}
			var n int
			if err := db.Get(&n, "SELECT COUNT(*) FROM acemq_outbox WHERE id = 42 AND processed_at IS NOT NULL"); err != nil {
				t.Fatal(err)
			}
			if n != 0 {
				t.Errorf("message 042 marked the record of id 42 processed")
			}
		})
	}
}

// PostgreSQL: an id column of a domain over a domain over bigint. A UUID
// message id must mark nothing, not fail the message's transaction.
func TestInbox_MarkOutboxProcessed_PostgresDomainOverADomainOverBigint_UUIDMarksNothing(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.Postgres)
	for _, s := range []string{
		"CREATE DOMAIN foreign_id1 AS bigint",
		"CREATE DOMAIN foreign_id2 AS foreign_id1",
		"ALTER TABLE acemq_outbox ALTER id TYPE foreign_id2 USING 0",
	} {
		if _, err := db.Exec(s); err != nil {
			t.Fatal(err)
		}
	}
	in := newInbox(t, db, outbox.InboxConfig{MarkOutboxProcessed: true})
	h := in.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, nil })
	if _, err := h(message.NewMessage("0b4c3b6e-5d1f-4a8e-9a51-2f0c1d3e4f50", []byte("x"))); err != nil {
		t.Errorf("a UUID message over a nested-domain bigint id: %v", err)
	}
}

// SQLite, an id column of NUMERIC affinity (typed UUID): rows written in
// one go by another library with one created_at and integer ids 9, 10,
// 11. The claim orders them (created_at, id): 9, 10, 11. They must reach
// the broker in that order.
func TestForwarder_SQLiteIntegerIDsOfOneCreatedAt_PublishedInClaimOrder(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, testdb.SQLite)
	foreignIDTable(t, db, "UUID")
	b := testamqp.New(t)
	queue := b.Queue("ok")
	at := time.Now().Add(-time.Minute)
	for _, id := range []int{9, 10, 11} {
		insertForeignID(t, db, id, b.Exchange, at)
	}
	var order []string
	if err := db.Select(&order, "SELECT CAST(id AS TEXT) FROM acemq_outbox ORDER BY created_at, id"); err != nil {
		t.Fatal(err)
	}
	t.Logf("SQLite's order: %v", order)
	f := newForwarder(t, db, outbox.ForwarderConfig{})
	if n := sweepAll(t, f); n != 3 {
		t.Fatalf("published %d", n)
	}
	var got []string
	for _, d := range b.Drain(queue, 3, 2*time.Second) {
		got = append(got, d.MessageId)
	}
	t.Logf("broker's order: %v", got)
	for i := range order {
		if i >= len(got) || got[i] != order[i] {
			t.Fatalf("published in order %v, want the claim's order %v", got, order)
		}
	}
}
