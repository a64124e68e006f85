package outbox_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/jmoiron/sqlx"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testamqp"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// On SQLite another library's row whose routing_key (or exchange_name) is
// a BLOB of the topic's bytes (Python's sqlite3 binding bytes, say) is
// sent by the relay to that topic as any other, and the consumer marks it
// processed by its id; but Republish compared the column with TEXT, which
// SQLite never finds equal to a BLOB: the message lost in the broker was
// never sent again. It reads the column as TEXT there now (textIn).
func TestRepublish_SQLiteBlobRoutingKey_LostRecordSentAgain(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	b := testamqp.New(t)
	topic := "orders-" + testdb.RandomName()
	queue := b.Queue(topic)
	if _, err := db.Exec(`INSERT INTO acemq_outbox (id, exchange_name, routing_key, body, headers, created_at)
		VALUES ('blob-rk-1', ?, CAST(? AS BLOB), '{}', '{}', '2026-01-01 00:00:00.000000')`, b.Exchange, topic); err != nil {
		t.Fatal(err)
	}
	var typ string
	if err := db.Get(&typ, "SELECT typeof(routing_key) FROM acemq_outbox WHERE id = 'blob-rk-1'"); err != nil {
		t.Fatal(err)
	}
	f := newForwarder(t, db, outbox.ForwarderConfig{})
	if n := sweepAll(t, f); n != 1 {
		t.Fatalf("relay published %d, want 1", n)
	}
	if got := b.Drain(queue, 1, 10*time.Second); len(got) != 1 {
		t.Fatalf("the queue bound to %q got %d messages: the relay did not route it there", topic, len(got))
	}
	// Drained above: the message is lost to the consumer, and an hour passes.
	ageRecords(t, db, time.Hour, "blob-rk-1")
	rp, err := outbox.NewRepublisher(db.DB, outbox.RepublisherConfig{TrackedTopics: outbox.NewTrackedTopics(topic), Grace: 10 * time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	n, err := rp.Republish(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if n != 1 || stateOf(t, db, "blob-rk-1").Published {
		t.Errorf("routing_key stored as %s, relayed to %q: Republish made %d pending, the record still published (never sent again)", typ, topic, n)
	}
}

// On MySQL, an acemq_outbox whose time columns are TIMESTAMP (another
// library's, Laravel's) converts through the session's time_zone. A record
// another service (connected at UTC) marked published a minute ago, inside
// Grace, is made pending by a Republisher whose pool's session is at
// -05:00: its UTC cutoff reads as five hours later. The forwarder logs
// such a session (checkZone); the Republisher compared as if at UTC, and
// every boot resent every record of the last five hours. It shifts the
// times it compares by the session's offset now (zoneShift).
func TestRepublish_MySQLTimestampColumns_SessionNotUTC_GraceKept(t *testing.T) {
	db := migrated(t, testdb.MySQL)
	db.MustExec("ALTER TABLE acemq_outbox MODIFY published_at TIMESTAMP(6) NULL, MODIFY processed_at TIMESTAMP(6) NULL")
	topic := "orders-" + testdb.RandomName()
	id := publishN(t, db, "", topic, 1)[0]
	// Another service, connected at UTC, marked it published a minute ago.
	db.MustExec("SET time_zone = '+00:00'")
	conn, err := db.DB.Conn(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := conn.ExecContext(context.Background(), "SET time_zone = '+00:00'"); err != nil {
		t.Fatal(err)
	}
	if _, err := conn.ExecContext(context.Background(), "UPDATE acemq_outbox SET published_at = UTC_TIMESTAMP(6) - INTERVAL 1 MINUTE WHERE id = ?", id); err != nil {
		t.Fatal(err)
	}
	_ = conn.Close()
	sep := "?"
	if strings.Contains(db.DSN, "?") {
		sep = "&"
	}
	zoned, err := sqlx.Open("mysql", db.DSN+sep+"time_zone=%27-05%3A00%27")
	if err != nil {
		t.Fatal(err)
	}
	defer zoned.Close()
	rp, err := outbox.NewRepublisher(zoned, outbox.RepublisherConfig{TrackedTopics: outbox.NewTrackedTopics(topic), Grace: 10 * time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	n, err := rp.Republish(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if n != 0 || !stateOf(t, db, id).Published {
		t.Errorf("a record published a minute ago (Grace 10 min), read through a -05:00 session: Republish made %d pending", n)
	}
}
