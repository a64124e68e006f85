package outbox_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// On SQLite, a write of the handler's that its own context interrupts
// rolls the whole transaction back (sqlite3_interrupt inside an explicit
// transaction), and every later statement on the connection commits on
// its own. ErrTxRolledBackUnderHandler promises that such a delivery is nacked, the
// dedupe key and the key's sequence gone with the rollback. On the ordered
// inbox's paths that write after the handler (a key holding messages, and
// every held apply) the delete of the held rows and the advance of the key
// ran after the rollback, each committed on its own: the key moved past a
// message whose effect was rolled back, and a held message's row, its
// only copy, was deleted. The message was lost, and the redelivery (for a
// delivery) acked as a duplicate. The inbox now checks the transaction is
// still open before writing after the handler.
func TestOrderedInbox_SQLite_HandlerWriteInterrupted_HeldMessageNotLost(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	createEffects(t, db)
	h, interrupted := interruptingHandler(t, "2")
	in := orderedInbox(t, db, outbox.InboxConfig{})
	mw := in.Middleware(h)
	if _, err := mw(keyedMsg("k", 2)); err != nil { // held
		t.Fatal(err)
	}
	if _, err := mw(keyedMsg("k", 1)); err != nil { // applied; 2's held apply is interrupted
		t.Fatal(err)
	}
	if !*interrupted {
		t.Fatal("the held message's handler did not run")
	}
	var last int64
	if err := db.Get(&last, "SELECT last_seq FROM acemq_inbox_sequences WHERE aggregate_id = 'k'"); err != nil {
		t.Fatal(err)
	}
	held := countHeld(t, db)
	effects2 := countEffects(t, db, keyedMsg("k", 2).UUID)
	t.Logf("after the interrupted held apply: last_seq %d, held %d, effects of seq 2: %d", last, held, effects2)
	if effects2 == 0 && held == 0 {
		t.Errorf("seq 2 lost: its effect was rolled back, yet its held row is deleted and the key's last applied is %d", last)
	}
	// Whatever happened, an ApplyHeld and a redelivery must end with seq 2 applied once.
	if _, err := in.ApplyHeld(context.Background()); err != nil {
		t.Logf("ApplyHeld: %v", err)
	}
	if n := countEffects(t, db, keyedMsg("k", 2).UUID); n != 1 {
		t.Errorf("seq 2 has %d effects after ApplyHeld, want 1", n)
	}
}

// The same on a delivery that is its key's next while the key holds a
// later message (the path that reads the key's row first): the delivery
// is nacked, but the key's advance committed on its own, so the
// redelivery is acked as a duplicate and the message never runs.
func TestOrderedInbox_SQLite_HandlerWriteInterrupted_DeliveryNotLost(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	createEffects(t, db)
	h, interrupted := interruptingHandler(t, "1")
	mw := orderedInbox(t, db, outbox.InboxConfig{}).Middleware(h)
	if _, err := mw(keyedMsg("k", 2)); err != nil { // held: the key now holds a message
		t.Fatal(err)
	}
	_, err := mw(keyedMsg("k", 1))
	t.Logf("delivery of 1: %v", err)
	if !*interrupted {
		t.Fatal("the handler's interrupted write did not run")
	}
	if err == nil {
		t.Fatalf("delivery of 1 acked though its transaction was rolled back under the handler")
	}
	if _, err := mw(keyedMsg("k", 1)); err != nil { // the redelivery
		t.Fatalf("redelivery of 1: %v", err)
	}
	if n := countEffects(t, db, keyedMsg("k", 1).UUID); n != 1 {
		t.Errorf("seq 1 has %d effects after its redelivery was acked, want 1: lost", n)
	}
}

// interruptingHandler writes the message's effect, then, for the first
// message of seq, a best-effort write with a deadline of its own that
// SQLite interrupts, its failure only logged: the interrupt rolls the
// whole transaction back. interrupted says whether that write ran.
func interruptingHandler(t *testing.T, seq string) (message.HandlerFunc, *bool) {
	interrupted := new(bool)
	return func(msg *message.Message) ([]*message.Message, error) {
		tx, ok := outbox.TxFromContext(msg.Context())
		if !ok {
			return nil, errors.New("no tx")
		}
		if _, err := tx.ExecContext(msg.Context(), "INSERT INTO effects (message_id, note) VALUES (?, ?)", msg.UUID, string(msg.Payload)); err != nil {
			return nil, err
		}
		if msg.Metadata.Get(outbox.HeaderSeq) == seq && !*interrupted {
			*interrupted = true
			ctx, cancel := context.WithTimeout(msg.Context(), 30*time.Millisecond)
			defer cancel()
			_, err := tx.ExecContext(ctx, "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 500000000) "+
				"INSERT INTO effects (message_id, note) SELECT 'audit', 'x' FROM c WHERE x < 0")
			t.Logf("best-effort write: %v", err)
		}
		return nil, nil
	}, interrupted
}
