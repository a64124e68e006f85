package outbox_test

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// With MarkOutboxProcessed, the handler's transaction marks the outbox
// record of every message, including one whose id is in no row of this
// outbox (another service's). On MySQL under REPEATABLE READ a locking
// read that finds no row locks the gap where it would be, until commit:
// the service's own outbox inserts into that gap (on a small table, any id
// above the last) waited for the whole handler. These tests hold the
// handler for seconds and ask that the service's writes do not wait for it.

// foreignID is the id of a message from another service's outbox: above
// every id these tests publish, so in the gap a missing-row lock would take.
const foreignID = "f0000000-0000-0000-0000-00000000beef"

func TestInbox_MySQL_MarkForeignID_ServicePublishDoesNotWaitForHandler(t *testing.T) {
	db := migrated(t, testdb.MySQL)
	publishOrdered(t, db, "", [2]string{"00000000-0000-0000-0000-000000000001", "orders"})
	in := newInbox(t, db, outbox.InboxConfig{MarkOutboxProcessed: true})
	entered, release := make(chan struct{}), make(chan struct{})
	handled := make(chan error, 1)
	go func() {
		_, err := in.Middleware(func(*message.Message) ([]*message.Message, error) {
			close(entered)
			<-release
			return nil, nil
		})(message.NewMessage(foreignID, []byte("x")))
		handled <- err
	}()
	<-entered

	// A business transaction of the service, while the handler holds its
	// transaction open for up to handlerHeld.
	const handlerHeld, want = 3 * time.Second, time.Second
	start := time.Now()
	published := make(chan error, 1)
	go func() {
		published <- commitPublish(db, "billing", []*message.Message{message.NewMessage("f1000000-0000-0000-0000-000000000002", []byte("x"))})
	}()
	var took time.Duration
	var err error
	select {
	case err = <-published:
		took = time.Since(start)
		close(release)
	case <-time.After(handlerHeld):
		close(release)
		err = <-published
		took = time.Since(start)
	}
	if herr := <-handled; herr != nil {
		t.Fatalf("handler's delivery: %v", herr)
	}
	if err != nil {
		t.Fatalf("publish: %v", err)
	}
	t.Logf("publish beside a handler held %s took %s", handlerHeld, took)
	if took >= want {
		t.Errorf("the service's publish took %s, waiting for the inbox's handler of a message not from this outbox; want under %s", took, want)
	}
}

func TestInbox_MySQL_MarkForeignIDs_HandlersPublishingDoNotDeadlock(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.MySQL)
	publishOrdered(t, db, "", [2]string{"00000000-0000-0000-0000-000000000001", "orders"})
	in := newInbox(t, db, outbox.InboxConfig{MarkOutboxProcessed: true})
	var runs, arrived atomic.Int32
	bothMarked := make(chan struct{})
	h := in.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		if runs.Add(1) <= 2 {
			// Both transactions have marked their record before either
			// publishes into the gap above the last row.
			if arrived.Add(1) == 2 {
				close(bothMarked)
			}
			select {
			case <-bothMarked:
			case <-time.After(10 * time.Second):
				return nil, errors.New("the other delivery never reached its handler")
			}
		}
		tx, _ := outbox.TxFromContext(msg.Context())
		pub, err := outbox.NewTxPublisher(tx)
		if err != nil {
			return nil, err
		}
		// f19…, f29…: an id of each handler's own, in the same gap.
		return nil, pub.Publish("billing", message.NewMessage(msg.UUID[:2]+"9"+msg.UUID[3:], []byte("x")))
	})
	ids := []string{"f1000000-0000-0000-0000-00000000beef", "f2000000-0000-0000-0000-00000000beef"}
	errs := make(chan error, len(ids))
	for _, id := range ids {
		go func() {
			_, err := h(message.NewMessage(id, []byte("x")))
			errs <- err
		}()
	}
	for range ids {
		if err := <-errs; err != nil {
			t.Error(err)
		}
	}
	if n := runs.Load(); n != 2 {
		t.Errorf("2 deliveries ran their handler %d times: a transaction was refused (deadlock) and run again", n)
	}
	if n := countRows(t, db); n != 3 {
		t.Errorf("%d outbox rows, want 3 (the first and one per handler)", n)
	}
}

// Under the ordered inbox a message ahead of its predecessor is held in
// acemq_inbox_held and acked: the held row is its durable copy, and a copy
// sent again only makes another "held again". So the hold's transaction
// marks its outbox record processed, and Republish leaves it alone for as
// long as its key waits; when its turn comes it is applied, once.
func TestOrderedInbox_HeldMessage_RecordMarkedNotResentAtEachBoot_AppliedOnceLater(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		createEffects(t, db)
		one, two := keyedMsg("order-7", 1), keyedMsg("order-7", 2)
		publishOrdered(t, db, "", [2]string{one.UUID, "orders"}, [2]string{two.UUID, "orders"})
		var ran atomic.Int32
		h := orderedInbox(t, db, outbox.InboxConfig{MarkOutboxProcessed: true}).Middleware(writeEffect(t, db, &ran))
		rp, err := outbox.NewRepublisher(db.DB, outbox.RepublisherConfig{TrackedTopics: outbox.NewTrackedTopics("orders"), Grace: time.Minute})
		if err != nil {
			t.Fatal(err)
		}
		ageRecords(t, db, time.Hour, two.UUID) // sent an hour ago; seq 1 is not sent yet
		deliver(t, h, "order-7", 2)            // held: seq 1 has not come
		if !recordProcessed(t, db, two.UUID) {
			t.Error("a held message's record not marked processed")
		}
		resent := 0
		for boot := 1; boot <= 3; boot++ {
			n, err := rp.Republish(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			resent += int(n)
			ageRecords(t, db, time.Hour, two.UUID) // as if the relay had sent it again
			deliver(t, h, "order-7", 2)            // held again
		}
		if resent != 0 || ran.Load() != 0 {
			t.Errorf("over 3 boots the held record was sent again %d times, and the handler ran %d times; want 0 and 0", resent, ran.Load())
		}
		deliver(t, h, "order-7", 1) // applies 1, then the held 2
		deliver(t, h, "order-7", 2) // a late copy: a duplicate
		assertEffectsOnce(t, db, "order-7", 2)
		if n := ran.Load(); n != 2 || countHeld(t, db) != 0 || !recordProcessed(t, db, one.UUID) {
			t.Errorf("handler ran %d times (want 2), %d held (want 0), seq 1's record processed %v (want true)", n, countHeld(t, db), recordProcessed(t, db, one.UUID))
		}
	})
}

// A copy of a message held before MarkOutboxProcessed was on (a service
// that turned it on with Republish) marks its record in the transaction
// that finds it held again, as a duplicate's copy does on the unordered
// path: otherwise every boot would send it again while its key waits.
func TestOrderedInbox_CopyOfAMessageHeldUnmarked_RecordMarkedWhenHeldAgain(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		createEffects(t, db)
		two := keyedMsg("k", 2)
		publishOrdered(t, db, "", [2]string{two.UUID, "t"})
		var ran atomic.Int32
		deliver(t, orderedInbox(t, db, outbox.InboxConfig{}).Middleware(writeEffect(t, db, &ran)), "k", 2)
		if recordProcessed(t, db, two.UUID) {
			t.Fatal("record marked by an inbox without MarkOutboxProcessed")
		}
		h := orderedInbox(t, db, outbox.InboxConfig{MarkOutboxProcessed: true}).Middleware(writeEffect(t, db, &ran))
		deliver(t, h, "k", 2) // held again
		if !recordProcessed(t, db, two.UUID) {
			t.Error("record of a message held again not marked processed")
		}
		deliver(t, h, "k", 1)
		assertEffectsOnce(t, db, "k", 2)
	})
}

// The mark waits for its record's row lock, and a session holding it FOR
// UPDATE kept a review's deliveries waiting until their Timeout, with an
// error that named no lock. It still waits (the relay's claim holds the
// lock until its mark, every batch, and a mark skipped would be sent
// again by Republish), and its error says what it waited for.
func TestInbox_MarkWaitsForARowLockTillTheDeliverysEnd_ErrorNamesTheLock(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.Postgres)
	ctx := context.Background()
	ids := publishN(t, db, "payments", "payment.authorized", 1)
	if _, err := db.ExecContext(ctx, "UPDATE acemq_outbox SET published_at = now()"); err != nil {
		t.Fatal(err)
	}
	locker, err := db.BeginTxx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = locker.Rollback() }()
	if _, err := locker.ExecContext(ctx, "SELECT 1 FROM acemq_outbox WHERE id = $1 FOR UPDATE", ids[0]); err != nil {
		t.Fatal(err)
	}
	h := newInbox(t, db, outbox.InboxConfig{ConsumerName: "ledger", MarkOutboxProcessed: true}).
		Middleware(func(*message.Message) ([]*message.Message, error) { return nil, nil })
	msgCtx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	msg := message.NewMessage(ids[0], []byte(`{}`))
	msg.SetContext(msgCtx)
	_, err = h(msg)
	if err == nil || !strings.Contains(err.Error(), "row lock") {
		t.Errorf("delivery behind a FOR UPDATE of its record: %v, want an error naming the row lock", err)
	}
}
