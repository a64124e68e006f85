package outbox_test

import (
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

const numberTakenLine = "Ordered inbox: a message whose number the key applied already, under another id, acked without running: two writers number the key " +
	"(a producer keying rows in their headers beside one numbering aggregate_id and seq from acemq_outbox_sequences?), or its number was skipped " +
	"(outboxctl skip-gap, skip-held), or processed_messages was purged since; logged once a minute a key"

// A user review's foreign producer keyed rows in their headers, which the
// publisher's numbering does not see: a message published from Go got a
// number its key had applied, under another id, and the ordered inbox
// acked it without running, with no word. It still does (the key's order
// is kept, and the number was applied), and says so once a minute a key;
// a redelivery of a message it applied is a duplicate without a word.
func TestOrderedInbox_NumberAppliedUnderAnotherID_AckedAndSaid(t *testing.T) {
	testdb.Each(t, func(t *testing.T, db *testdb.DB) {
		migrate(t, db)
		createEffects(t, db)
		logs := &recordingLogger{}
		in := newInbox(t, db, outbox.InboxConfig{ConsumerName: "ledger", Ordered: true, Logger: logs})
		var applied applyLog
		h := in.Middleware(applied.handler(t, db))
		deliver(t, h, "rails-hk", 1, 2)
		deliver(t, h, "rails-hk", 1) // the same message again

		const said = numberTakenLine
		if got := logs.find(said); len(got) != 0 {
			t.Fatalf("a redelivery of an applied message was said to be another's: %v", got)
		}
		for _, id := range []string{"go-published-1", "go-published-2"} {
			msg := message.NewMessage(id, []byte("from Go"))
			msg.Metadata.Set(outbox.HeaderAggregateID, "rails-hk")
			msg.Metadata.Set(outbox.HeaderSeq, "1")
			if _, err := h(msg); err != nil {
				t.Fatalf("delivery of %s: %v, want an ack", id, err)
			}
		}
		if got := applied.of("rails-hk"); len(got) != 2 {
			t.Fatalf("applied %v, want 1 and 2 only", got)
		}
		got := logs.find(said)
		if len(got) != 1 || got[0]["message_uuid"] != "go-published-1" || got[0]["aggregate_id"] != "rails-hk" || got[0]["seq"] != int64(1) || got[0]["last_applied"] != int64(2) {
			t.Errorf("logged %v; want one line, of go-published-1, key rails-hk seq 1, last applied 2", got)
		}
	})
}

// On a processed_messages another library created with message_id under a
// case-insensitive collation, the key of "GO-1" finds the row of "go-1": a
// message acked by a number its key applied under the id "go-1" was taken
// for a redelivery of that message, and not said.
func TestOrderedInbox_NumberAppliedUnderAnIDDifferingInCase_Said(t *testing.T) {
	for _, kind := range []string{testdb.Postgres, testdb.MySQL, testdb.SQLite} {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			db := caseBlindKeys(t, kind)
			logs := &recordingLogger{}
			in := newInbox(t, db, outbox.InboxConfig{ConsumerName: "ledger", Ordered: true, Logger: logs})
			var applied applyLog
			h := in.Middleware(applied.handler(t, db))
			for i, id := range []string{"go-1", "go-2", "go-1", "GO-1"} {
				msg := message.NewMessage(id, []byte("x"))
				msg.Metadata.Set(outbox.HeaderAggregateID, "ci-key")
				msg.Metadata.Set(outbox.HeaderSeq, []string{"1", "2", "1", "1"}[i])
				if _, err := h(msg); err != nil {
					t.Fatalf("delivery %d (%s): %v, want an ack", i+1, id, err)
				}
			}
			if got := applied.of("ci-key"); len(got) != 2 {
				t.Fatalf("applied %v, want 1 and 2 only", got)
			}
			got := logs.find(numberTakenLine)
			if len(got) != 1 || got[0]["message_uuid"] != "GO-1" {
				t.Errorf("logged %v; want one line, of GO-1 (go-1's redelivery says nothing)", got)
			}
		})
	}
}
