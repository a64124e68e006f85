package outbox_test

import (
	"fmt"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// A table another library made with a uuid id (a variant the relay's own
// tests cover): a message whose id is a UUID written in upper case (Swift's,
// .NET's uuidString) is published, committed, and the transaction retried.
// The retry must be a retry: no error, one row. It failed for ever: the
// read-back looked the id up as PostgreSQL prints a uuid, missed, and took
// the miss for a collation's conflict.
func TestTxPublisher_UUIDIDColumn_RetryOfAnUpperCaseID_IsARetry(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.Postgres)
	db.MustExec("ALTER TABLE acemq_outbox ALTER id TYPE uuid USING id::uuid")
	for _, key := range []string{"", "k"} {
		t.Run("key="+key, func(t *testing.T) {
			id := strings.ToUpper(watermill.NewUUID())
			mk := func() *message.Message {
				m := message.NewMessage(id, []byte("x"))
				if key != "" {
					m.Metadata.Set(outbox.MetadataAggregateID, key)
				}
				return m
			}
			if err := commitPublish(db, "orders", []*message.Message{mk()}); err != nil {
				t.Fatalf("first publish: %v", err)
			}
			if err := commitPublish(db, "orders", []*message.Message{mk()}); err != nil {
				t.Fatalf("retry of the committed transaction (same message, same id %s): %v", id, err)
			}
		})
	}
}

// A keyed call bigger than SQLite's bound on arguments (32,766) that meets
// one id already in the table: a retried transaction. The call's own rows
// are deleted before it runs again, in statements SQLite takes: in one,
// the retry failed with "too many SQL variables".
func TestTxPublisher_SQLite_KeyedCallOverTheArgumentBound_MeetingAnExistingID_IsARetry(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.SQLite)
	first := keyed("k")
	inTx(t, db, true, []*message.Message{first})
	n := 33000
	msgs := make([]*message.Message, 0, n+1)
	msgs = append(msgs, first) // already committed: a retry
	for i := 0; i < n; i++ {
		msgs = append(msgs, keyed("k"))
	}
	if err := commitPublish(db, "orders", msgs); err != nil {
		t.Fatalf("Publish of %d keyed messages, one of them a retry: %.400v", len(msgs), err)
	}
	seqs := seqsOf(t, db, "k")
	if len(seqs) != n+1 || seqs[len(seqs)-1] != int64(n+1) {
		t.Fatalf("%d rows, last seq %v; want %d rows, 1..%d", len(seqs), fmt.Sprint(seqs[len(seqs)-1]), n+1, n+1)
	}
}
