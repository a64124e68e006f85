package outbox_test

import (
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// An acemq_outbox whose ids another library made integers: a PostgreSQL
// bigint, a MySQL BIGINT. An inbox with MarkOutboxProcessed bound every
// message id to "id = ?". On PostgreSQL a UUID is no bigint: the
// statement failed and aborted the message's transaction, delivery after
// delivery. On MySQL "42-order-created" reads as 42: the record of id 42
// was marked processed by another message. Now a message id that is no
// integer marks nothing, and the record's own id marks it.
func TestInbox_MarkOutboxProcessed_ForeignIntegerIDs_OtherIDsMarkNothing(t *testing.T) {
	for _, kind := range []string{testdb.Postgres, testdb.MySQL} {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			db := outboxWithIDType(t, kind, "BIGINT")
			insertForeign(t, db, "ex", "ok", foreignRow{id: "42", body: "x", bodyEncoding: "utf-8", contentType: "text/plain", headers: "{}"})
			processed := func() bool {
				var n int
				if err := db.Get(&n, "SELECT COUNT(*) FROM acemq_outbox WHERE id = 42 AND processed_at IS NOT NULL"); err != nil {
					t.Fatal(err)
				}
				return n == 1
			}
			in := newInbox(t, db, outbox.InboxConfig{MarkOutboxProcessed: true})
			ran := 0
			h := in.Middleware(func(*message.Message) ([]*message.Message, error) { ran++; return nil, nil })
			for _, id := range []string{"0b4c3b6e-5d1f-4a8e-9a51-2f0c1d3e4f50", "42-order-created", "+42", "99999999999999999999"} {
				if _, err := h(message.NewMessage(id, []byte("x"))); err != nil {
					t.Errorf("message %s: %v", id, err)
				}
				if processed() {
					t.Fatalf("message %s marked the record of id 42 processed", id)
				}
			}
			if _, err := h(message.NewMessage("42", []byte("x"))); err != nil {
				t.Errorf("message 42: %v", err)
			}
			if !processed() {
				t.Errorf("message 42 did not mark its record processed")
			}
			if ran != 5 {
				t.Errorf("the handler ran %d times, want 5", ran)
			}
		})
	}
}
