package outbox_test

import (
	"errors"
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

// publishAlone commits one message on topic in a transaction of its own,
// from any goroutine (it reports, rather than failing the test).
func publishAlone(db *testdb.DB, id, topic string) error {
	tx, err := db.Beginx()
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback() }()
	pub, err := outbox.NewTxPublisher(tx)
	if err != nil {
		return err
	}
	if err := pub.Publish(topic, message.NewMessage(id, []byte("x"))); err != nil {
		return err
	}
	return tx.Commit()
}

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
	go func() { published <- publishAlone(db, "f1000000-0000-0000-0000-000000000002", "billing") }()
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
