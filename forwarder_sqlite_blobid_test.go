package outbox_test

import (
	"context"
	"database/sql"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// A row whose id another library stored as a BLOB on SQLite (a UUID's 16
// raw bytes, which the id's CHECK on length() takes) was claimed and
// published, and its marks, binding the id as TEXT, matched nothing
// (SQLite's TEXT never equals a BLOB): it went out again at every lease's
// end, for ever, never charged an attempt. It now fails alone at its
// first claim, unpublished, stuck with a reason naming the id, and the
// record beside it is published once.
func TestForwarder_SQLiteRowWithABlobID_StuckUnpublishedWithItsReason(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	if _, err := db.Exec(`INSERT INTO acemq_outbox (id, exchange_name, routing_key, body, headers, created_at)
		VALUES (X'0123456789ABCDEF0123456789ABCDEF', '', 'orders', '{}', '{}', '2026-01-01 00:00:00.000000')`); err != nil {
		t.Fatal(err)
	}
	ids := publishN(t, db, "", "orders", 1)
	pub := newRefusingPublisher("", "")
	f, err := outbox.NewForwarder(db.DB, outbox.NewPublisherDestination(pub, nil), outbox.ForwarderConfig{Dialect: outbox.SQLite, PublishTimeout: 100 * time.Millisecond, Lease: 200 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	blob := string([]byte{0x01, 0x23, 0x45, 0x67, 0x89, 0xAB, 0xCD, 0xEF, 0x01, 0x23, 0x45, 0x67, 0x89, 0xAB, 0xCD, 0xEF})
	for i := 0; i < 3; i++ {
		_, err := f.Sweep(context.Background())
		t.Logf("sweep %d: %.300v", i, err)
		waitFor(t, time.Second, "the lease to run out", func() bool {
			var leased int
			_ = db.QueryRow("SELECT COUNT(*) FROM acemq_outbox WHERE locked_until > strftime('%Y-%m-%d %H:%M:%f', 'now')").Scan(&leased)
			return leased == 0
		})
	}
	if n := pub.sent(blob); n != 0 {
		t.Errorf("the row of a BLOB id was published %d times", n)
	}
	if n, st := pub.sent(ids[0]), stateOf(t, db, ids[0]); n != 1 || !st.Published {
		t.Errorf("the record beside it sent %d times, published %v; want once, marked", n, st.Published)
	}
	var attempts int
	var lastError, lockedBy sql.NullString
	if err := db.QueryRow("SELECT attempts, last_error, locked_by FROM acemq_outbox WHERE typeof(id) = 'blob'").Scan(&attempts, &lastError, &lockedBy); err != nil {
		t.Fatal(err)
	}
	if attempts != outbox.DefaultMaxAttempts || !strings.Contains(lastError.String, "column id: a BLOB of 16 bytes (hex 0123456789ABCDEF0123456789ABCDEF)") || lockedBy.Valid {
		t.Errorf("the row of a BLOB id: attempts %d, last_error %q, locked_by %v; want stuck at %d, the BLOB named, no lease", attempts, lastError.String, lockedBy, outbox.DefaultMaxAttempts)
	}
	stuck, err := f.Store().Stuck(context.Background(), 10)
	if err != nil || len(stuck) != 1 || stuck[0].ID != blob {
		t.Errorf("Stuck: %+v, %v; want the row of the BLOB id", stuck, err)
	}
}

// A published mark that finds fewer rows than it names is logged: its
// record went out and stays unmarked. Here a row deleted between the
// broker's confirm and the mark, which only a lease leaves possible (a
// locking claim holds its rows until its marks).
func TestForwarder_SQLitePublishedMarkFindsFewerRows_ShortfallLogged(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	ids := publishN(t, db, "", "orders", 2)
	logs := watermill.NewCaptureLogger()
	f, err := outbox.NewForwarder(db.DB, outbox.NewPublisherDestination(newRefusingPublisher("", ""), nil), outbox.ForwarderConfig{Dialect: outbox.SQLite, Logger: logs})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	outbox.SetAfterPublishHook(f, func([]string) error {
		_, err := db.Exec("DELETE FROM acemq_outbox WHERE id = ?", ids[1])
		return err
	})
	if _, err := f.Sweep(context.Background()); err != nil {
		t.Fatal(err)
	}
	for _, l := range logs.Captured()[watermill.ErrorLogLevel] {
		if strings.Contains(l.Msg, "fewer rows") && l.Fields["marked"] == int64(1) && l.Fields["published"] == 2 {
			return
		}
	}
	t.Errorf("no error logged for a mark of 2 published records that found 1 row; logged %+v", logs.Captured())
}
