package outbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// Round trip: the relay publishes a foreign row under the id it reads; the
// inbox (MarkOutboxProcessed) given that id must mark the row processed.
// A MySQL DECIMAL ZEROFILL's ("00000001.50"), PostgreSQL numeric's NaN and
// an SQLite INTEGER in a column without a type marked nothing.
func TestInbox_MarkOutboxProcessed_IDsTheRelayPublished_RecordMarked(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ kind, typ, id string }{
		{testdb.MySQL, "DECIMAL(10,2) UNSIGNED ZEROFILL", "1.50"},
		{testdb.MySQL, "INT UNSIGNED ZEROFILL", "42"},
		{testdb.MySQL, "DECIMAL(10,2)", "-3"},
		{testdb.Postgres, "NUMERIC", "1.50"},
		{testdb.Postgres, "NUMERIC", "-0.5"},
		{testdb.Postgres, "NUMERIC", "NaN"},
		{testdb.SQLite, "", "7"},
	} {
		t.Run(tc.kind+"_"+tc.typ+"_"+tc.id, func(t *testing.T) {
			db := outboxWithIDType(t, tc.kind, tc.typ)
			var id any = tc.id
			if tc.kind == testdb.SQLite {
				id = 7
			}
			insertForeignID(t, db, id, "x", time.Now().Add(-time.Minute))
			pub := sweptIDs(t, db)
			if len(pub) != 1 {
				t.Fatalf("published %v", pub)
			}
			t.Logf("relay published id %q", pub[0])
			in := newInbox(t, db, outbox.InboxConfig{MarkOutboxProcessed: true})
			h := in.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, nil })
			if _, err := h(message.NewMessage(pub[0], []byte("x"))); err != nil {
				t.Fatal(err)
			}
			var n int
			if err := db.Get(&n, "SELECT COUNT(*) FROM acemq_outbox WHERE processed_at IS NOT NULL"); err != nil {
				t.Fatal(err)
			}
			if n != 1 {
				t.Errorf("id column %s: the message of id %q the relay published did not mark its record processed", tc.typ, pub[0])
			}
		})
	}
}

// sweptIDs sweeps db's outbox once and returns the ids the relay published.
func sweptIDs(t *testing.T, db *testdb.DB) []string {
	t.Helper()
	dest := newRefuseOnceDest(0)
	f, err := outbox.NewForwarder(db.DB, dest, outbox.ForwarderConfig{Dialect: dialectOf(t, db), OnError: func(error, outbox.ErrorContext) {}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.Sweep(context.Background()); err != nil {
		t.Fatal(err)
	}
	return dest.snapshot()
}
