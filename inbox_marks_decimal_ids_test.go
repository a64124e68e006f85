package outbox_test

import (
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// A message whose id is not one the relay publishes for the column (another
// service's message through the same inbox) must neither mark another
// record nor fail the handler: "042" marked record 42, and "NaN" failed
// every delivery on MySQL.
func TestInbox_MarkOutboxProcessed_DecimalIDsTheRelayNeverPublishes_MarkNothing(t *testing.T) {
	for _, tc := range []struct{ kind, typ, rowID, key string }{
		{testdb.Postgres, "NUMERIC", "42", "042"},
		{testdb.Postgres, "NUMERIC", "0", "-0"},
		{testdb.MySQL, "DECIMAL(10,2)", "42", "042"},
		{testdb.MySQL, "DECIMAL(10,2)", "0", "NaN"},
	} {
		t.Run(tc.kind+"_"+tc.typ+"_"+tc.key, func(t *testing.T) {
			t.Parallel()
			db := outboxWithIDType(t, tc.kind, tc.typ)
			insertForeignID(t, db, tc.rowID, "x", time.Now().Add(-time.Minute))
			in := newInbox(t, db, outbox.InboxConfig{MarkOutboxProcessed: true})
			h := in.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, nil })
			_, err := h(message.NewMessage(tc.key, []byte("x")))
			var n int
			if err := db.Get(&n, "SELECT COUNT(*) FROM acemq_outbox WHERE processed_at IS NOT NULL"); err != nil {
				t.Fatal(err)
			}
			t.Logf("row %s, message %q: handler err %v, marked %d", tc.rowID, tc.key, err, n)
			if err != nil || n != 0 {
				t.Errorf("message %q (not an id the relay publishes) marked record %s processed: %d, handler err %v", tc.key, tc.rowID, n, err)
			}
		})
	}
}
