package outbox_test

import (
	"context"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"
	amqp "github.com/rabbitmq/amqp091-go"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testamqp"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// A key's records published at different instants in the reverse of their
// seq order (seq 1 sent again later, by an earlier boot's Republish or an
// operator's resend, while seq 2 waited inside Grace) are made pending in
// published_at order. With a batch's end between them, seq 2 is pending
// while seq 1 is still published, so a relay (in another process, or
// the one the plugin's Notify wakes) sends seq 2 again before seq 1: the
// README allows a key's later record first only for equal published_at
// split at a batch's end. A batch makes the earlier records of its keys
// pending first now (RepublishEarlier).
func TestRepublish_KeyedRecordsOfDifferentPublishedAt_EarlierSeqGoesFirst(t *testing.T) {
	eachMigrated(t, func(t *testing.T, db *testdb.DB, d outbox.Dialect) {
		b := testamqp.New(t)
		topic := "orders-" + testdb.RandomName()
		queue := b.Queue(topic)
		key := "k-" + testdb.RandomName()
		cfg := outbox.TxPublisherConfig{Exchange: b.Exchange}
		var msgs []*message.Message
		for seq := 1; seq <= 2; seq++ { // numbered 1 and 2 by the publisher
			m := message.NewMessage(key+"-"+strconv.Itoa(seq), []byte("event"))
			m.Metadata.Set(outbox.MetadataAggregateID, key)
			msgs = append(msgs, m)
		}
		publishInTx(t, db, topic, msgs, cfg)
		seq1, seq2 := key+"-1", key+"-2"
		fillers := publishBatch(t, db, b.Exchange, topic, outbox.DefaultPurgeBatch)
		f := newForwarder(t, db, outbox.ForwarderConfig{})
		if n := sweepAll(t, f); n != outbox.DefaultPurgeBatch+2 {
			t.Fatalf("published %d", n)
		}
		b.With(func(ch *amqp.Channel) error { _, err := ch.QueuePurge(queue, false); return err })
		// seq 2 published 3 h ago; seq 1 sent again 1 h ago (an earlier
		// boot's Republish, seq 2 then inside Grace); the fillers between.
		at := time.Now().Add(-2 * time.Hour).UTC()
		var arg any = at
		if db.Kind != testdb.Postgres {
			arg = at.Format("2006-01-02 15:04:05.000000")
		}
		db.MustExec(db.Rebind("UPDATE acemq_outbox SET published_at = ? WHERE id <> ? AND id <> ?"), arg, seq1, seq2)
		_ = fillers
		ageRecords(t, db, 3*time.Hour, seq2)
		ageRecords(t, db, 1*time.Hour, seq1)
		var rows []struct {
			ID string `db:"id"`
			P  string `db:"p"`
		}
		if err := db.Select(&rows, "SELECT id, CAST(published_at AS CHAR(40)) AS p FROM acemq_outbox ORDER BY published_at, id LIMIT 2"); err != nil {
			t.Fatal(err)
		}
		t.Logf("first by published_at: %+v", rows)

		var atSecondBatch struct {
			seq1Published, seq2Published, hooked bool
		}
		var h func(string)
		h = func(q string) {
			if atSecondBatch.hooked || !isRepublishPick(q, true) {
				return
			}
			atSecondBatch.hooked = true
			t.Logf("hooked: %s", q)
			// A relay elsewhere claims between the batches.
			t.Logf("before the relay: seq1 %+v seq2 %+v", stateOf(t, db, seq1), stateOf(t, db, seq2))
			t.Logf("relay sent %d", sweepAll(t, f))
			atSecondBatch.seq1Published = stateOf(t, db, seq1).Published
			atSecondBatch.seq2Published = stateOf(t, db, seq2).Published
		}
		hdb := hookedDB(t, db, func(q string) { h(q) })
		rp, err := outbox.NewRepublisher(hdb, outbox.RepublisherConfig{Dialect: d, TrackedTopics: outbox.NewTrackedTopics(topic), Grace: 10 * time.Minute})
		if err != nil {
			t.Fatal(err)
		}
		n, err := rp.Republish(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		sweepAll(t, f)
		ds := b.Drain(queue, int(n), 20*time.Second)
		var order []string
		for _, dl := range ds {
			if id := toStr(dl.Headers["x-acemq-id"]); id == seq1 || id == seq2 || dl.MessageId == seq1 || dl.MessageId == seq2 {
				if id == "" {
					id = dl.MessageId
				}
				order = append(order, id)
			}
		}
		t.Logf("Republish made %d pending; %d deliveries", n, len(ds))
		if !atSecondBatch.hooked {
			t.Fatal("no second batch")
		}
		if len(order) < 2 || order[0] != seq1 {
			t.Errorf("the broker got key %s as %v (at the second batch seq 1 published %v, seq 2 %v); want seq 1 first: seq 2 was made pending, and sent, while seq 1 was not yet", key, order, atSecondBatch.seq1Published, atSecondBatch.seq2Published)
		}
	})
}

func toStr(v any) string {
	switch x := v.(type) {
	case int64:
		return strconv.FormatInt(x, 10)
	case string:
		return x
	}
	return "?"
}

// On SQLite another library's row whose routing_key (or exchange_name) is
// a BLOB of the topic's bytes (Python's sqlite3 binding bytes, say) is
// sent by the relay to that topic as any other, and the consumer marks it
// processed by its id; but Republish compared the column with TEXT, which
// SQLite never finds equal to a BLOB: the message lost in the broker was
// never sent again. It gives each topic as a BLOB too now (textIn).
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
