package outbox_test

import (
	"context"
	"crypto/sha256"
	"database/sql"
	"encoding/base32"
	"encoding/hex"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// The key the README gives for an id processed_messages.message_id
// cannot hold as it is, computed here from its description.
func digestKey(id string) string {
	sum := sha256.Sum256([]byte(id))
	return "sha256 " + strings.ToLower(base32.StdEncoding.WithPadding(base32.NoPadding).EncodeToString(sum[:]))
}

// ids whose messages another library's relay can send, which the inbox's
// varchar(64) key column cannot hold as they are: longer than 64 bytes
// (two alike in their first 64), with spaces, UTF-8, a NUL, bytes that are
// not UTF-8. It refused each at every delivery.
var unkeepableIDs = []string{
	strings.Repeat("a", 65),
	strings.Repeat("order-", 11) + "tail-one",
	strings.Repeat("order-", 11) + "tail-two",
	strings.Repeat("z", 255),
	"order 17",
	"commande-réémise-17",
	"nul\x00inside",
	"not-utf8-\xff\xfe",
}

// effectsByHex is a handler that makes its effect in the inbox's
// transaction (on the pool at most once), keyed by the hex of the message's x-acemq-id (which a text
// column may not hold as it is), and counts its runs per id.
type effectsByHex struct {
	mu  sync.Mutex
	ran map[string]int
}

func (e *effectsByHex) handler(db *testdb.DB) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		id := msg.Metadata.Get(outbox.HeaderMessageID)
		var on interface {
			ExecContext(context.Context, string, ...any) (sql.Result, error)
		} = db.DB
		if tx, ok := outbox.TxFromContext(msg.Context()); ok {
			on = tx // at most once: none
		}
		if _, err := on.ExecContext(msg.Context(), db.Rebind("INSERT INTO long_effects (id_hex) VALUES (?)"), hex.EncodeToString([]byte(id))); err != nil {
			return nil, err
		}
		e.mu.Lock()
		defer e.mu.Unlock()
		e.ran[id]++
		return nil, nil
	}
}

func acemqMessage(id string) *message.Message {
	msg := message.NewMessage(watermill.NewUUID(), []byte("x"))
	msg.Metadata.Set(outbox.HeaderMessageID, id)
	return msg
}

// Each such message runs once, under a key of its own (two ids alike in
// their first 64 bytes are two messages), its redelivery is acked without
// running, and the key stored is the one the README describes, so that a
// service in another language can find it.
func TestInbox_IDsTheKeyColumnCannotHold_DedupedUnderTheirDigest(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		db.MustExec("CREATE TABLE long_effects (id_hex varchar(600) NOT NULL)")
		for _, cfg := range []outbox.InboxConfig{
			{ConsumerName: "plain", MarkOutboxProcessed: true},
			{ConsumerName: "at-most-once", AtMostOnce: true},
			{ConsumerName: "ordered", Ordered: true},
		} {
			e := &effectsByHex{ran: map[string]int{}}
			h := newInbox(t, db, cfg).Middleware(e.handler(db))
			for round := range 2 {
				for _, id := range unkeepableIDs {
					if _, err := h(acemqMessage(id)); err != nil {
						t.Fatalf("%s: delivery %d of %q: %v, want nil (ack)", cfg.ConsumerName, round+1, id, err)
					}
				}
			}
			for _, id := range unkeepableIDs {
				if e.ran[id] != 1 {
					t.Errorf("%s: %q ran %d times over two deliveries, want 1", cfg.ConsumerName, id, e.ran[id])
				}
				var n int
				if err := db.Get(&n, db.Rebind("SELECT COUNT(*) FROM processed_messages WHERE consumer_name = ? AND message_id = ?"), cfg.ConsumerName, digestKey(id)); err != nil {
					t.Fatal(err)
				}
				if n != 1 {
					t.Errorf("%s: no key %q in processed_messages for %q", cfg.ConsumerName, digestKey(id), id)
				}
			}
		}
		var effects int
		if err := db.Get(&effects, "SELECT COUNT(*) FROM long_effects"); err != nil {
			t.Fatal(err)
		}
		if want := 3 * len(unkeepableIDs); effects != want {
			t.Errorf("%d effects, want %d", effects, want)
		}
	})
}

// A keyed message whose id is over 64 bytes arrives before its predecessor:
// held under its digest, applied in order once the predecessor is, its
// handler given the id itself (its UUID, as the inbox dedupes on), and its
// redelivery after is acked without running.
func TestOrderedInbox_HeldMessageWithALongID_AppliedInOrderOnceUnderItsID(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		idOf := func(seq int) string { return strings.Repeat("evt ", 30) + strconv.Itoa(seq) }
		var saw []string
		h := orderedInbox(t, db, outbox.InboxConfig{}).Middleware(func(msg *message.Message) ([]*message.Message, error) {
			saw = append(saw, msg.Metadata.Get(outbox.HeaderSeq)+" "+msg.UUID)
			return nil, nil
		})
		for _, seq := range []int{2, 1, 2} {
			msg := keyedMsg("acct-1", seq)
			msg.UUID = idOf(seq)
			msg.Metadata.Set(outbox.HeaderMessageID, idOf(seq))
			if _, err := h(msg); err != nil {
				t.Fatalf("seq %d: %v, want nil (ack)", seq, err)
			}
		}
		if want := []string{"1 " + idOf(1), "2 " + idOf(2)}; !slices.Equal(saw, want) {
			t.Errorf("the handler saw %q, want %q", saw, want)
		}
		if n := countHeld(t, db); n != 0 {
			t.Errorf("%d messages still held", n)
		}
	})
}

// A row of another library's table whose id is a varchar(255)'s, published
// by the relay as it is: the inbox marks it processed (MarkOutboxProcessed)
// under that id, and dedupes it under its digest.
func TestInbox_MarkOutboxProcessed_ForeignRowWithALongID_Marked(t *testing.T) {
	t.Parallel()
	for _, kind := range []string{testdb.Postgres, testdb.MySQL, testdb.SQLite} {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			db := outboxWithIDType(t, kind, "varchar(255)")
			id := "invoice " + strings.Repeat("0123456789", 20) + " ré-émise"
			insertForeignID(t, db, id, "x", time.Now().Add(-time.Minute))
			if pub := sweptIDs(t, db); len(pub) != 1 || pub[0] != id {
				t.Fatalf("the relay published %q, want [%q]", pub, id)
			}
			var ran int
			h := newInbox(t, db, outbox.InboxConfig{MarkOutboxProcessed: true}).Middleware(func(*message.Message) ([]*message.Message, error) {
				ran++
				return nil, nil
			})
			for range 2 {
				if _, err := h(acemqMessage(id)); err != nil {
					t.Fatal(err)
				}
			}
			var marked int
			if err := db.Get(&marked, "SELECT COUNT(*) FROM acemq_outbox WHERE processed_at IS NOT NULL"); err != nil {
				t.Fatal(err)
			}
			if ran != 1 || marked != 1 {
				t.Errorf("the handler ran %d times (want 1), %d records marked processed (want 1)", ran, marked)
			}
		})
	}
}
