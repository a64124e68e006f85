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
	"github.com/jmoiron/sqlx"

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
			handledOnceAndMarked(t, db, id, 2)
		})
	}
}

// A keyed message deduped on a UUID over 64 bytes (no x-acemq-id: a
// Watermill publisher's) held, then applied: its handler is given the
// UUID, as the message delivered in turn is, not the digest its row keeps,
// whether its predecessor comes or its gap is skipped (a review's catch:
// the UUID was nowhere in the held row).
func TestOrderedInbox_HeldMessageDedupedOnALongUUID_HandlerGivenTheUUID(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		idOf := func(seq int) string { return strings.Repeat("watermill-uuid-", 5) + strconv.Itoa(seq) }
		saw := map[string]string{}
		in := orderedInbox(t, db, outbox.InboxConfig{})
		h := in.Middleware(func(msg *message.Message) ([]*message.Message, error) {
			saw[msg.Metadata.Get(outbox.HeaderSeq)] = msg.UUID
			return nil, nil
		})
		deliver := func(key string, seq int) {
			msg := keyedMsg(key, seq)
			msg.UUID = idOf(seq)
			if _, err := h(msg); err != nil {
				t.Fatalf("%s seq %d: %v", key, seq, err)
			}
		}
		deliver("acct-1", 2)
		deliver("acct-1", 1)
		for seq := 1; seq <= 2; seq++ {
			if got := saw[strconv.Itoa(seq)]; got != idOf(seq) {
				t.Errorf("seq %d: the handler saw UUID %q, want %q", seq, got, idOf(seq))
			}
		}
		deliver("acct-2", 2)
		if err := in.SkipGap(context.Background(), "fulfilment", "acct-2", 1, 1); err != nil {
			t.Fatal(err)
		}
		if got := saw["2"]; got != idOf(2) {
			t.Errorf("acct-2 seq 2 after its gap was skipped: the handler saw UUID %q, want %q", got, idOf(2))
		}
	})
}

// processed_messages as another library's inbox left it (message_id
// varchar(255)), holding the ids over 64 bytes it processed as they are:
// a service that moves to this library under the same consumer name and
// table acks a redelivery of one as a duplicate, in the plain inbox and
// at most once. Looked up under its digest alone, it ran again (a
// review's catch).
func TestInbox_ForeignTableHoldingALongIDAsItIs_RedeliveryIsADuplicate(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		widenProcessedIDs(db)
		id := "invoice " + strings.Repeat("0123456789", 10)
		for _, consumer := range []string{"plain", "at-most-once"} {
			db.MustExec(db.Rebind("INSERT INTO processed_messages (consumer_name, message_id, processed_at) VALUES (?, ?, ?)"), consumer, id, hourAgo(db))
			ran := 0
			h := newInbox(t, db, outbox.InboxConfig{ConsumerName: consumer, AtMostOnce: consumer == "at-most-once"}).Middleware(func(*message.Message) ([]*message.Message, error) {
				ran++
				return nil, nil
			})
			msg := acemqMessage(id)
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second) // at most once, a key it waited on for ever
			msg.SetContext(ctx)
			_, err := h(msg)
			cancel()
			if err != nil || ran != 0 {
				t.Errorf("%s: a message the table holds as processed, its id as it is (%d bytes): ran %d times, %v; want acked without running", consumer, len(id), ran, err)
			}
			if _, err := h(acemqMessage(id + "-2")); err != nil || ran != 1 {
				t.Errorf("%s: another long id: ran %d times, %v; want once", consumer, ran, err)
			}
		}
	})
}

// The same table, for an ordered consumer: a keyed message whose id it
// holds as it is was processed before the move. Its key's next, it is a
// duplicate and its key moves past it; ahead of its predecessor, it is
// held, and moved past, not run, when its turn comes; delivered again, a
// duplicate. The messages after it run in order. Before, the ordered inbox
// did not look, and ran it again on both paths.
func TestOrderedInbox_ForeignTableHoldingALongIDAsItIs_MovedPastNotRunAgain(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		widenProcessedIDs(db)
		idOf := func(key string, seq int) string {
			return key + " event " + strings.Repeat("0123456789", 8) + " " + strconv.Itoa(seq)
		}
		db.MustExec(db.Rebind("INSERT INTO processed_messages (consumer_name, message_id, processed_at) VALUES (?, ?, ?), (?, ?, ?)"),
			"fulfilment", idOf("acct-next", 1), hourAgo(db), "fulfilment", idOf("acct-ahead", 2), hourAgo(db))
		var saw []string
		h := orderedInbox(t, db, outbox.InboxConfig{}).Middleware(func(msg *message.Message) ([]*message.Message, error) {
			saw = append(saw, msg.Metadata.Get(outbox.HeaderAggregateID)+" "+msg.Metadata.Get(outbox.HeaderSeq))
			return nil, nil
		})
		deliver := func(key string, seq int) {
			msg := keyedMsg(key, seq)
			msg.Metadata.Set(outbox.HeaderMessageID, idOf(key, seq))
			if _, err := h(msg); err != nil {
				t.Fatalf("%s seq %d: %v, want nil (ack)", key, seq, err)
			}
		}
		for _, d := range []struct {
			key string
			seq int
		}{{"acct-next", 1}, {"acct-next", 2}, {"acct-next", 1}, {"acct-ahead", 2}, {"acct-ahead", 1}, {"acct-ahead", 3}, {"acct-ahead", 2}} {
			deliver(d.key, d.seq)
		}
		if want := []string{"acct-next 2", "acct-ahead 1", "acct-ahead 3"}; !slices.Equal(saw, want) {
			t.Errorf("the handler ran for %q, want %q: the messages processed under their ids as they are not again, the others in order", saw, want)
		}
		if n := countHeld(t, db); n != 0 {
			t.Errorf("%d messages still held", n)
		}
	})
}

// A held message whose id another library's inbox processed as it is
// after it was held (two consumers on one queue while a service moves, or
// a held row written without the look at its arrival): applied in turn,
// it moves its key past it without running. The apply of a held message
// did not look for its id as it is, and its handler ran (the thirty-
// seventh session's documented limit).
func TestOrderedInbox_HeldIDProcessedAsItIsElsewhereSinceItWasHeld_MovedPastNotRun(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		idOf, deliver, saw := longIDsOfOneKey(t, db)
		deliver(3) // held ahead of 1 and 2
		deliver(2)
		if n := countHeld(t, db); n != 2 {
			t.Fatalf("%d messages held, want 2", n)
		}
		// Another library's inbox processes seq 2 under its id as it is.
		db.MustExec(db.Rebind("INSERT INTO processed_messages (consumer_name, message_id, processed_at) VALUES (?, ?, ?)"), "fulfilment", idOf(2), hourAgo(db))
		deliver(1)
		if want := []string{"1", "3"}; !slices.Equal(*saw, want) {
			t.Errorf("the handler ran for %q, want %q: seq 2, processed elsewhere while held, moved past, seq 3 applied after it", *saw, want)
		}
		if n := countHeld(t, db); n != 0 {
			t.Errorf("%d messages still held", n)
		}
		deliver(2) // a redelivery is a duplicate
		if len(*saw) != 2 {
			t.Errorf("the handler ran for %q after seq 2's redelivery", (*saw)[2:])
		}
	})
}

// widenProcessedIDs makes processed_messages.message_id a varchar(255), as
// another library's inbox may have created it (SQLite's TEXT holds any).
func widenProcessedIDs(db *testdb.DB) {
	switch db.Kind {
	case testdb.Postgres:
		db.MustExec("ALTER TABLE processed_messages ALTER message_id TYPE varchar(255)")
	case testdb.MySQL:
		db.MustExec("ALTER TABLE processed_messages MODIFY message_id varchar(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL")
	}
}

// hourAgo is a processed_at an hour ago, as db's column takes it.
func hourAgo(db *testdb.DB) any {
	at := time.Now().Add(-time.Hour).UTC()
	if db.Kind != testdb.Postgres {
		return at.Format("2006-01-02 15:04:05.000000")
	}
	return at
}

// An id another library's table holds and the relay publishes as it is,
// which PostgreSQL's text could not hold: a NUL in MySQL's varchar, bytes
// that are not UTF-8 in SQLite's TEXT. MarkOutboxProcessed marks its
// record, which Republish would otherwise send again at every boot. It
// was skipped wherever PostgreSQL refuses it bound (a review's catch).
func TestInbox_MarkOutboxProcessed_IDOnlyPostgresRefuses_MarkedElsewhere(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ kind, id string }{
		{testdb.MySQL, "nul\x00inside"},
		{testdb.SQLite, "nul\x00inside"},
		{testdb.SQLite, "id-\xff\xfe-1"},
	} {
		t.Run(tc.kind+"_"+hex.EncodeToString([]byte(tc.id)), func(t *testing.T) {
			t.Parallel()
			db := outboxWithIDType(t, tc.kind, "varchar(255)")
			insertForeignID(t, db, tc.id, "x", time.Now().Add(-time.Minute))
			if pub := sweptIDs(t, db); len(pub) != 1 || pub[0] != tc.id {
				t.Fatalf("the relay published %q, want [%q]", pub, tc.id)
			}
			handledOnceAndMarked(t, db, tc.id, 1)
		})
	}
}

// handledOnceAndMarked delivers the message of id deliveries times to an
// inbox with MarkOutboxProcessed over db, whose outbox holds its record
// alone: the handler must run once, and the record be marked processed.
func handledOnceAndMarked(t *testing.T, db *testdb.DB, id string, deliveries int) {
	t.Helper()
	ran := 0
	h := newInbox(t, db, outbox.InboxConfig{MarkOutboxProcessed: true}).Middleware(func(*message.Message) ([]*message.Message, error) {
		ran++
		return nil, nil
	})
	for range deliveries {
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
}

// processed_messages another library created on MySQL in a narrower
// character set (utf8mb3; latin1, MySQL 5.7's default) with a wide
// message_id, and a long id with a character that charset cannot hold:
// the read of the id as it is, which MySQL refuses ("Illegal mix of
// collations"), counts as finding nothing, and the message is deduped
// under its digest, which the table takes. In the message's transaction
// that read failed every delivery (a review's catch).
func TestInbox_ForeignNarrowCharsetTable_LongIDItCannotHold_DedupedUnderTheDigest(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ charset, id string }{
		{"utf8mb3", "invoice \U0001F600 " + strings.Repeat("0123456789", 7)},
		{"latin1", "invoice \u2603 " + strings.Repeat("0123456789", 7)},
	} {
		t.Run(tc.charset, func(t *testing.T) {
			t.Parallel()
			db := migrated(t, testdb.MySQL)
			db.MustExec("ALTER TABLE processed_messages MODIFY message_id varchar(255) CHARACTER SET " + tc.charset + " COLLATE " + tc.charset + "_bin NOT NULL")
			for _, cfg := range []outbox.InboxConfig{{ConsumerName: "plain"}, {ConsumerName: "at-most-once", AtMostOnce: true}} {
				ran := 0
				h := newInbox(t, db, cfg).Middleware(func(*message.Message) ([]*message.Message, error) {
					ran++
					return nil, nil
				})
				for i := range 2 {
					msg := acemqMessage(tc.id)
					ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
					msg.SetContext(ctx)
					_, err := h(msg)
					cancel()
					if err != nil {
						t.Errorf("%s: delivery %d: %v, want nil (ack)", cfg.ConsumerName, i+1, err)
					}
				}
				if ran != 1 {
					t.Errorf("%s: ran %d times over two deliveries, want 1", cfg.ConsumerName, ran)
				}
			}
		})
	}
}

// processed_messages another library left with a long id as it is, and a
// pool with a lock_timeout: while a migration holds the table (ACCESS
// EXCLUSIVE, as an ALTER TABLE does), the read of the id as it is times
// out, and the delivery fails, to be redelivered; taken for nothing found,
// the insert of the digest after the lock went succeeded and the message
// ran again (a review's catch).
func TestInbox_ReadOfALongIDAsItIsFails_DeliveryFailsNotRunAgain(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.Postgres)
	db.MustExec("ALTER TABLE processed_messages ALTER message_id TYPE varchar(255)")
	id := "invoice " + strings.Repeat("0123456789", 10)
	db.MustExec(db.Rebind("INSERT INTO processed_messages (consumer_name, message_id, processed_at) VALUES (?, ?, ?)"), "plain", id, time.Now().Add(-time.Hour).UTC())
	pool, err := sqlx.Open("pgx", db.DSN+"&lock_timeout=400")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = pool.Close() })
	in, err := outbox.NewInbox(pool, outbox.InboxConfig{ConsumerName: "plain"})
	if err != nil {
		t.Fatal(err)
	}
	ran := 0
	h := in.Middleware(func(*message.Message) ([]*message.Message, error) { ran++; return nil, nil })
	locker, err := db.Beginx()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := locker.Exec("LOCK TABLE processed_messages IN ACCESS EXCLUSIVE MODE"); err != nil {
		t.Fatal(err)
	}
	go func() { time.Sleep(600 * time.Millisecond); _ = locker.Commit() }()
	msg := acemqMessage(id)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	msg.SetContext(ctx)
	if _, err := h(msg); ran != 0 || err == nil {
		t.Errorf("a message the table holds as processed, its read timed out: ran %d times, %v; want a failed delivery", ran, err)
	}
	if _, err := h(acemqMessage(id)); ran != 0 || err != nil {
		t.Errorf("its redelivery: ran %d times, %v; want acked without running", ran, err)
	}
}

// The key moves between the look for a held message's id and its apply (a
// delivery, or another consumer, applies it meanwhile): the apply finds
// the next message after it, which is looked for in turn before it runs.
// It was applied without the look, and seq 3, processed as it is by
// another library's inbox, ran again (a review's catch). The move is made
// deterministic by a trigger on the carry's insert of seq 2's digest,
// which does what another consumer's apply of seq 2 does.
func TestOrderedInbox_Postgres_HeldApply_KeyMovedBetweenLookAndApply_NextLookedForToo(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.Postgres)
	idOf, deliver, saw := longIDsOfOneKey(t, db)
	deliver(3)
	deliver(2)
	if n := countHeld(t, db); n != 2 {
		t.Fatalf("%d messages held, want 2", n)
	}
	// Another library's inbox processed seq 2 and seq 3 under their ids as they are.
	for _, s := range []int{2, 3} {
		db.MustExec(db.Rebind("INSERT INTO processed_messages (consumer_name, message_id, processed_at) VALUES (?, ?, ?)"), "fulfilment", idOf(s), hourAgo(db))
	}
	db.MustExec(`CREATE FUNCTION move_past_2() RETURNS trigger AS $$
BEGIN
  IF NEW.message_id = '` + digestKey(idOf(2)) + `' THEN
    DELETE FROM acemq_inbox_held WHERE aggregate_id = 'acct-1' AND seq = 2;
    UPDATE acemq_inbox_sequences SET last_seq = 2, held = held - 1 WHERE aggregate_id = 'acct-1';
  END IF;
  RETURN NEW;
END $$ LANGUAGE plpgsql`)
	db.MustExec(`CREATE TRIGGER move_past_2 AFTER INSERT ON processed_messages FOR EACH ROW EXECUTE FUNCTION move_past_2()`)
	deliver(1)
	if want := []string{"1"}; !slices.Equal(*saw, want) {
		t.Errorf("the handler ran for %q, want %q: seq 2 moved past by another consumer, seq 3 processed as it is elsewhere", *saw, want)
	}
	if n := countHeld(t, db); n != 0 {
		t.Errorf("%d messages still held", n)
	}
}

// longIDsOfOneKey widens db's processed_messages.message_id as another
// library's inbox may have made it, and returns the long id of seq of key
// acct-1, a delivery of it to an ordered inbox over db (acked), and the
// seqs its handler ran for.
func longIDsOfOneKey(t *testing.T, db *testdb.DB) (idOf func(seq int) string, deliver func(seq int), saw *[]string) {
	t.Helper()
	widenProcessedIDs(db)
	idOf = func(seq int) string {
		return "acct-1 event " + strings.Repeat("0123456789", 8) + " " + strconv.Itoa(seq)
	}
	saw = new([]string)
	h := orderedInbox(t, db, outbox.InboxConfig{}).Middleware(func(msg *message.Message) ([]*message.Message, error) {
		*saw = append(*saw, msg.Metadata.Get(outbox.HeaderSeq))
		return nil, nil
	})
	deliver = func(seq int) {
		t.Helper()
		msg := keyedMsg("acct-1", seq)
		msg.Metadata.Set(outbox.HeaderMessageID, idOf(seq))
		if _, err := h(msg); err != nil {
			t.Fatalf("seq %d: %v, want nil (ack)", seq, err)
		}
	}
	return idOf, deliver, saw
}
