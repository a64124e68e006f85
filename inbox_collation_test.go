package outbox_test

import (
	"strings"
	"sync/atomic"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// A processed_messages another library created with message_id under a
// case-insensitive collation (MySQL's utf8mb4_general_ci, SQLite's NOCASE, a nondeterministic ICU
// collation on PostgreSQL)
// takes "ORDER-1" for the key of "order-1": the second message, a message
// of its own, was acked as a duplicate without running, its effect lost.
// Its delivery fails now, naming the cause, and the first message's
// redelivery is still a duplicate.
func TestInbox_KeyColumnComparesCaseInsensitively_DeliveryFailsNotAckedAsDuplicate(t *testing.T) {
	for _, kind := range []string{testdb.Postgres, testdb.MySQL, testdb.SQLite} {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			db := caseBlindKeys(t, kind)
			var ran atomic.Int32
			h := newInbox(t, db, outbox.InboxConfig{}).Middleware(writeEffect(t, db, &ran))
			if _, err := h(message.NewMessage("order-1", []byte("1"))); err != nil {
				t.Fatalf("first delivery: %v", err)
			}
			_, err := h(message.NewMessage("ORDER-1", []byte("2")))
			if err == nil {
				t.Fatal(`message "ORDER-1": acked as a duplicate of "order-1", want the delivery to fail`)
			}
			if !strings.Contains(err.Error(), "case") {
				t.Errorf("error %q does not name the cause (ids that differ in case taken for one)", err)
			}
			var effects int // all of them: the effects table may compare without case too
			if err := db.Get(&effects, "SELECT COUNT(*) FROM effects"); err != nil {
				t.Fatal(err)
			}
			if effects != 1 {
				t.Errorf("%d effects, want the first message's only", effects)
			}
			if _, err := h(message.NewMessage("order-1", []byte("1"))); err != nil {
				t.Errorf("the first message delivered again: %v, want a duplicate acked", err)
			}
			if ran.Load() != 1 {
				t.Errorf("the handler ran %d times, want once", ran.Load())
			}
		})
	}
}

// A processed_messages another library made on PostgreSQL with message_id
// a uuid holds the UUID, not the text it came as: a message whose id is a
// UUID in upper case reads back in lower case. Its redelivery is still
// the same message, acked as a duplicate (a byte-for-byte comparison of
// the key read back failed it at every redelivery, for ever).
func TestInbox_Postgres_UUIDKeyColumn_RedeliveryOfAnUpperCaseUUID_IsADuplicate(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.Postgres)
	createEffects(t, db)
	if _, err := db.Exec("ALTER TABLE processed_messages ALTER COLUMN message_id TYPE uuid USING message_id::uuid"); err != nil {
		t.Fatal(err)
	}
	var ran atomic.Int32
	h := newInbox(t, db, outbox.InboxConfig{}).Middleware(writeEffect(t, db, &ran))
	for _, id := range []string{"3F2C1A9E-8B7D-4E6F-9A0B-1C2D3E4F5A6B", "{0c2d3e4f-5a6b-4e6f-9a0b-1c2d3e4f5a6b}"} {
		for i := 0; i < 2; i++ {
			if _, err := h(message.NewMessage(id, []byte("1"))); err != nil {
				t.Fatalf("delivery %d of %s: %v", i+1, id, err)
			}
		}
	}
	if ran.Load() != 2 {
		t.Errorf("the handler ran %d times for two messages delivered twice each, want twice", ran.Load())
	}
}

// caseBlindKeys is a migrated database with an effects table whose
// processed_messages another library created with message_id under a
// case-insensitive collation (MySQL's utf8mb4_general_ci, SQLite's NOCASE,
// a nondeterministic ICU collation on PostgreSQL).
func caseBlindKeys(t *testing.T, kind string) *testdb.DB {
	t.Helper()
	alter := map[string][]string{
		testdb.Postgres: {
			"CREATE COLLATION case_blind (provider = icu, locale = 'und-u-ks-level2', deterministic = false)",
			"ALTER TABLE processed_messages ALTER COLUMN message_id TYPE varchar(64) COLLATE case_blind",
		},
		testdb.MySQL: {"ALTER TABLE processed_messages MODIFY message_id varchar(64) CHARACTER SET utf8mb4 COLLATE utf8mb4_general_ci NOT NULL"},
		testdb.SQLite: {
			"DROP TABLE processed_messages",
			"CREATE TABLE processed_messages (consumer_name TEXT NOT NULL, message_id TEXT NOT NULL COLLATE NOCASE," +
				" processed_at DATETIME NOT NULL DEFAULT (strftime('%Y-%m-%d %H:%M:%f000', 'now')), PRIMARY KEY (consumer_name, message_id))",
		},
	}
	db := migrated(t, kind)
	createEffects(t, db)
	for _, stmt := range alter[kind] {
		if _, err := db.Exec(stmt); err != nil {
			t.Fatal(err)
		}
	}
	return db
}

// The unordered inbox refuses to take "ORDER-1" for a duplicate of
// "order-1" when processed_messages (created by another library) compares
// message_id without case (TestInbox_KeyColumnComparesCaseInsensitively_…).
// The ordered inbox's in-order path must not lose the message either: a
// keyed "ORDER-1" that is its key's next must run, or fail, never be acked
// as a duplicate without running. It was acked unrun on all three
// databases: the in-order statements moved the key, the dedupe key's
// insert met "order-1", and the re-read of the key took the message for a
// duplicate of its own seq.
func TestOrderedInbox_KeyColumnComparesCaseInsensitively_InOrderMessageNotAckedUnrun(t *testing.T) {
	for _, kind := range []string{testdb.Postgres, testdb.MySQL, testdb.SQLite} {
		t.Run(kind, func(t *testing.T) {
			db := caseBlindKeys(t, kind)
			var l applyLog
			h := orderedInbox(t, db, outbox.InboxConfig{}).Middleware(l.handler(t, db))
			first := message.NewMessage("order-1", []byte("a1"))
			first.Metadata.Set(outbox.HeaderAggregateID, "a")
			first.Metadata.Set(outbox.HeaderSeq, "1")
			if _, err := h(first); err != nil {
				t.Fatalf("first: %v", err)
			}
			second := message.NewMessage("ORDER-1", []byte("b1"))
			second.Metadata.Set(outbox.HeaderAggregateID, "b")
			second.Metadata.Set(outbox.HeaderSeq, "1")
			_, err := h(second)
			ran := len(l.of("b")) == 1
			if err == nil && !ran {
				t.Fatalf(`key "b" seq 1, message "ORDER-1": acked (nil error) without running its handler, as a duplicate of "order-1" for key "a": the message is lost`)
			}
			t.Logf("second delivery: err=%v ran=%v", err, ran)
		})
	}
}
