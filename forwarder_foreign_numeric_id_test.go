package outbox_test

import (
	"context"
	"strings"
	"testing"
	"time"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testamqp"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// foreignIDTable makes acemq_outbox as another library might, with an id
// column of type idType, then migrates it.
func foreignIDTable(t *testing.T, db *testdb.DB, idType string) {
	t.Helper()
	ts := "DATETIME"
	if db.Kind == testdb.MySQL {
		ts = "DATETIME(6)"
	}
	stmt := "CREATE TABLE acemq_outbox (id " + idType + " NOT NULL PRIMARY KEY, exchange_name VARCHAR(255) NOT NULL, routing_key VARCHAR(255) NOT NULL," +
		" body TEXT NOT NULL, body_encoding VARCHAR(16) NOT NULL, content_type VARCHAR(255) NOT NULL, headers TEXT NOT NULL," +
		" created_at " + ts + " NOT NULL, published_at " + ts + ", attempts INTEGER NOT NULL DEFAULT 0, last_error VARCHAR(1000)," +
		" locked_by VARCHAR(64), locked_until " + ts + ")"
	if _, err := db.Exec(stmt); err != nil {
		t.Fatal(err)
	}
	migrate(t, db)
}

// A row whose id the driver hands back as a number: SQLite stores
// "1700000000123" (a snowflake id) as an INTEGER in a column of NUMERIC
// affinity (typed UUID or STRING), and MySQL's BIGINT id is one. The
// claim failed on it, every time, and no row was published again, the
// rows behind it included. It is published under its digits, once, and
// marked; a REAL (SQLite's "1.5") fails alone, stuck with its reason.
func TestForwarder_ForeignRowWithANumericID_PublishedOnceAndMarked_RelayGoesOn(t *testing.T) {
	for _, tc := range []struct{ kind, idType string }{
		{testdb.SQLite, "UUID"},
		{testdb.SQLite, "STRING"},
		{testdb.MySQL, "BIGINT"},
	} {
		t.Run(tc.kind+"_"+tc.idType, func(t *testing.T) {
			t.Parallel()
			db := testdb.New(t, tc.kind)
			foreignIDTable(t, db, tc.idType)
			b := testamqp.New(t)
			queue := b.Queue("ok")
			at := func(d time.Duration) string {
				return time.Now().UTC().Add(d).Format("2006-01-02 15:04:05.000000")
			}
			ins := "INSERT INTO acemq_outbox (id, exchange_name, routing_key, body, body_encoding, content_type, headers, created_at) VALUES (?, ?, 'ok', 'x', 'utf-8', 'text/plain', '{}', ?)"
			ids := []string{"1700000000123", "1700000000124"} // a BIGINT id holds numbers only
			if tc.kind == testdb.SQLite {
				ids[1] = "0b4c3b6e-5d1f-4a8e-9a51-2f0c1d3e4f50" // stays text: a row behind the numeric one
				if _, err := db.Exec(ins, "1.5", b.Exchange, at(-2*time.Minute)); err != nil {
					t.Fatal(err)
				}
			}
			for i, id := range ids {
				if _, err := db.Exec(ins, id, b.Exchange, at(time.Duration(i-1)*time.Minute)); err != nil {
					t.Fatal(err)
				}
			}
			if tc.kind == testdb.SQLite {
				var typ string
				if err := db.Get(&typ, "SELECT typeof(id) FROM acemq_outbox WHERE id = 1700000000123"); err != nil || typ != "integer" {
					t.Fatalf("the numeric id stored as %q (%v), want integer: the test no longer makes the case", typ, err)
				}
			}
			f := newForwarder(t, db, outbox.ForwarderConfig{MaxAttempts: 1})
			for i := 0; i < 3; i++ {
				n, err := f.Sweep(context.Background())
				t.Logf("sweep %d: published %d, err %.300v", i, n, err)
				if err != nil && strings.Contains(err.Error(), "claim") {
					t.Errorf("sweep %d failed its claim: %v", i, err)
				}
			}
			got := b.Drain(queue, len(ids)+1, 2*time.Second)
			sent := map[string]int{}
			for _, d := range got {
				sent[d.MessageId]++
			}
			for _, id := range ids {
				if sent[id] != 1 {
					t.Errorf("row %s sent %d times, want once (sent: %v)", id, sent[id], sent)
				}
			}
			if len(got) != len(ids) {
				t.Errorf("%d messages, want %d: %v", len(got), len(ids), sent)
			}
			var pending int
			if err := db.Get(&pending, "SELECT COUNT(*) FROM acemq_outbox WHERE published_at IS NULL AND attempts < 1"); err != nil {
				t.Fatal(err)
			}
			if pending != 0 {
				t.Errorf("%d rows neither marked published nor stuck", pending)
			}
			if tc.kind == testdb.SQLite {
				stuck, err := f.Store().Stuck(context.Background(), 10)
				if err != nil || len(stuck) != 1 || stuck[0].ID != "1.5" || !strings.Contains(stuck[0].LastError, "a REAL (1.5)") {
					t.Errorf("Stuck: %+v, %v; want the row of the REAL id, with its reason", stuck, err)
				}
			}
		})
	}
}
