package outbox_test

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testamqp"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// The README's middleware chain, through a router, with the broker's own
// publisher (watermill-amqp's) for the poison topic. middleware.Timeout
// cancels the message's context as the last attempt returns, and
// watermill-amqp publishes with that context: PoisonQueue's publish failed
// at once, the router nacked the message, and it came back, for ever (a
// review counted 129 runs of one message in 10 s), never set aside. Now it
// is on the poison topic after its retries, acked, and its record counts
// as processed.
func TestInbox_PoisonPublisher_ReadmeChainWithTheBrokersPublisher_SetAsideAfterItsRetries(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		b := testamqp.New(t)
		orders, poisoned := b.Queue(), b.Queue()
		id := publishN(t, db, "", "order.placed", 1)[0]
		in := newInbox(t, db, outbox.InboxConfig{MarkOutboxProcessed: true})
		pub, err := wamqp.NewPublisher(wamqp.NewDurableQueueConfig(testdb.AMQPURL()), watermill.NopLogger{})
		if err != nil {
			t.Fatal(err)
		}
		defer pub.Close()
		poisonQueue, err := middleware.PoisonQueue(in.PoisonPublisher(pub), poisoned)
		if err != nil {
			t.Fatal(err)
		}
		router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
		if err != nil {
			t.Fatal(err)
		}
		// The router's message, as the router acks or nacks it.
		delivered := make(chan *message.Message, 8)
		router.AddMiddleware(
			func(h message.HandlerFunc) message.HandlerFunc {
				return func(msg *message.Message) ([]*message.Message, error) {
					delivered <- msg
					return h(msg)
				}
			},
			poisonQueue,
			middleware.Retry{MaxRetries: 3, InitialInterval: time.Millisecond, ResetContextOnRetry: true}.Middleware,
			middleware.Timeout(30*time.Second),
			in.Middleware,
		)
		var runs atomic.Int32
		router.AddConsumerHandler("fulfil-orders", orders, amqpSubscriber(t), func(*message.Message) error {
			runs.Add(1)
			return errors.New("no such warehouse")
		})
		router.AddPlugin(in.Plugin()) // as the README's chain: a running router's poison is set aside
		done := make(chan error, 1)
		go func() { done <- router.Run(context.Background()) }()
		<-router.Running()
		publishRaw(t, b, orders, id)

		var msg *message.Message
		select {
		case msg = <-delivered:
		case <-time.After(20 * time.Second):
			t.Fatal("the message was never delivered")
		}
		// Acked by the router once set aside, not nacked: what reaches the
		// broker after is watermill-amqp's (a router closed as it acks may
		// still see its subscriber nack: a race of watermill-amqp's, which
		// this test does not judge).
		select {
		case <-msg.Acked():
		case <-msg.Nacked():
			t.Fatal("the message was nacked: it comes back, its retries run again")
		case <-time.After(20 * time.Second):
			t.Fatal("the message was neither acked nor nacked within 20 s")
		}
		deadline := time.Now().Add(20 * time.Second)
		for b.Count(poisoned) == 0 && time.Now().Before(deadline) {
			time.Sleep(20 * time.Millisecond) // polling the broker
		}
		if err := router.Close(); err != nil {
			t.Fatal(err)
		}
		if err := <-done; err != nil {
			t.Fatal(err)
		}
		got := b.Drain(poisoned, 1, time.Second)
		if len(got) != 1 || runs.Load() != 4 {
			t.Fatalf("poison topic holds %d messages after the handler ran %d times; want 1 after 4 (a run and 3 retries)", len(got), runs.Load())
		}
		if got[0].MessageId != id && got[0].Headers[outbox.HeaderMessageID] != id {
			t.Errorf("poison topic holds %q (headers %v), want message %s", got[0].MessageId, got[0].Headers, id)
		}
		if len(delivered) > 0 {
			t.Errorf("the message was delivered %d times more after it was acked", len(delivered))
		}
		if !outboxStateOf(t, db, id).Processed {
			t.Error("the record of the message set aside is not marked processed")
		}
		var note string
		if err := db.Get(&note, db.Rebind("SELECT last_error FROM acemq_outbox WHERE id = ?"), id); err != nil || !strings.HasPrefix(note, "set aside by ") {
			t.Errorf("the record's last_error %q (%v); want who set it aside, where and why", note, err)
		}
	})
}

// An ordered consumer behind the README's chain: a key's message whose
// handler keeps failing is set aside after its retries, and the key's next
// is held behind it (not applied out of order), a gap that Gaps surfaces for
// the operator to skip. Before, the poison topic's publish failed on the
// context Timeout had ended, the message came back for ever, and the key
// went no further, with no gap to see.
func TestOrderedInbox_PoisonPublisher_KeysFailingMessageSetAsideNextHeldBehindIt(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		createEffects(t, db)
		in := newInbox(t, db, outbox.InboxConfig{Ordered: true})
		poison := &poisonRecorder{}
		pq, err := middleware.PoisonQueue(in.PoisonPublisher(poison), "payments.poison")
		if err != nil {
			t.Fatal(err)
		}
		log := &applyLog{fail: func(msg *message.Message) error {
			if msg.Metadata.Get(outbox.HeaderSeq) == "2" {
				return errors.New("the ledger refuses it")
			}
			return nil
		}}
		h := pq(middleware.Retry{MaxRetries: 2, InitialInterval: time.Millisecond, ResetContextOnRetry: true}.Middleware(
			middleware.Timeout(30 * time.Second)(in.Middleware(log.handler(t, db)))))
		for seq := 1; seq <= 3; seq++ {
			msg := keyedMsg("pay-1", seq)
			msg.SetContext(context.Background())
			if _, err := h(msg); err != nil {
				t.Fatalf("seq %d: %v; want it acked (applied, set aside or held)", seq, err)
			}
		}
		if got := log.of("pay-1"); len(got) != 1 || got[0] != 1 {
			t.Errorf("applied %v, want [1]: seq 3 must wait for seq 2", got)
		}
		if poison.count() != 1 || poison.msgs[0].Metadata.Get(outbox.HeaderSeq) != "2" {
			t.Fatalf("poison topic holds %d messages; want seq 2 alone", poison.count())
		}
		gaps, err := in.Gaps(context.Background(), 0)
		if err != nil {
			t.Fatal(err)
		}
		if len(gaps) != 1 || gaps[0].AggregateID != "pay-1" || gaps[0].LastApplied != 1 || gaps[0].LowestHeld != 3 {
			t.Fatalf("gaps %+v, want pay-1 applied to 1 with seq 3 held", gaps)
		}
	})
}

// A keyed message set aside through the outbox holds its key's later
// messages, and no command sent it again once its cause was fixed (a user
// review: 42 of 150 keys stopped; retry refuses a published record, the
// reviewer cleared published_at and processed_at by hand). Store.Resend
// makes its record pending again, processed mark cleared: delivered again
// and failing again, its copy goes to the poison topic again (it was
// written once, and not again); fixed, it is applied, and what was held
// behind it.
func TestOrderedInbox_PoisonOutbox_ResendAfterTheFix_KeyAppliedInOrder(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, d outbox.Dialect) {
		createEffects(t, db)
		msgs := []*message.Message{keyedMsg("pay-1", 1), keyedMsg("pay-1", 2), keyedMsg("pay-1", 3)}
		for _, msg := range msgs {
			msg.Metadata.Set(outbox.MetadataAggregateID, "pay-1")
		}
		publishInTx(t, db, "payments", msgs, outbox.TxPublisherConfig{})
		db.MustExec("UPDATE acemq_outbox SET published_at = created_at") // the relay sent them
		in := newInbox(t, db, outbox.InboxConfig{Ordered: true, MarkOutboxProcessed: true})
		h, log, broken := setAsideChain(t, db, in, func(msg *message.Message) bool { return msg.Metadata.Get(outbox.HeaderSeq) == "2" })
		copies := func() (n, pending int) {
			t.Helper()
			q := db.Rebind("SELECT COUNT(*), COUNT(*) - COUNT(published_at) FROM acemq_outbox WHERE routing_key = ?")
			if err := db.QueryRow(q, "payments.poison").Scan(&n, &pending); err != nil {
				t.Fatal(err)
			}
			return n, pending
		}
		deliver(t, h, "pay-1", 1, 2, 3)
		if got := log.of("pay-1"); len(got) != 1 || !outboxStateOf(t, db, "pay-1-2").Processed {
			t.Fatalf("applied %v, seq 2 processed %v; want [1], seq 2 set aside and marked processed", got, outboxStateOf(t, db, "pay-1-2").Processed)
		}
		if n, pending := copies(); n != 1 || pending != 1 {
			t.Fatalf("%d poison copies, %d pending; want 1 pending", n, pending)
		}
		// Its record says so, for outboxctl show: "processed" read as
		// applied (a user review).
		var note string
		if err := db.Get(&note, db.Rebind("SELECT last_error FROM acemq_outbox WHERE id = ?"), "pay-1-2"); err != nil ||
			!strings.HasPrefix(note, "set aside by fulfilment to payments.poison as ") || !strings.HasSuffix(note, ": the ledger refuses it") {
			t.Errorf("the record's last_error %q (%v); want who set it aside, where and why", note, err)
		}
		db.MustExec(db.Rebind("UPDATE acemq_outbox SET published_at = created_at WHERE routing_key = ?"), "payments.poison") // the relay sent it

		store, err := outbox.NewStore(db.DB, outbox.StoreConfig{Dialect: d})
		if err != nil {
			t.Fatal(err)
		}
		resend := func() {
			t.Helper()
			if n, err := store.Resend(context.Background(), "pay-1-2", "pay-1-1-not-there"); err != nil || n != 1 {
				t.Fatalf("Resend: %d, %v; want the one record", n, err)
			}
			if st := outboxStateOf(t, db, "pay-1-2"); st.Published || st.Processed {
				t.Fatalf("after Resend: %+v; want pending, not processed", st)
			}
			db.MustExec(db.Rebind("UPDATE acemq_outbox SET published_at = created_at WHERE id = ?"), "pay-1-2") // the relay sent it again
		}
		resend()
		deliver(t, h, "pay-1", 2) // not fixed: set aside again
		if n, pending := copies(); n != 1 || pending != 1 {
			t.Fatalf("set aside again: %d poison copies, %d pending; want its one copy pending again", n, pending)
		}

		broken.Store(false)
		resend()
		deliver(t, h, "pay-1", 2)
		if got := log.of("pay-1"); len(got) != 3 || got[1] != 2 || got[2] != 3 {
			t.Fatalf("applied %v after the fix and a resend; want [1 2 3]", got)
		}
		if !outboxStateOf(t, db, "pay-1-2").Processed {
			t.Error("seq 2 applied, its record not marked processed")
		}
		// Applied: the set-aside note went with the resend (a code review:
		// it stayed, and outboxctl show said "set aside, not applied").
		if err := db.Get(&note, db.Rebind("SELECT COALESCE(last_error, '') FROM acemq_outbox WHERE id = ?"), "pay-1-2"); err != nil || strings.HasPrefix(note, "set aside by ") {
			t.Errorf("applied after a resend, its last_error %q (%v); want the note gone", note, err)
		}
		if gaps, err := in.Gaps(context.Background(), 0); err != nil || len(gaps) != 0 {
			t.Errorf("gaps %+v (%v); want none", gaps, err)
		}
	})
}

// A held message whose handler fails when a delivery of its key releases
// it was logged with the delivery's id and seq (a user review: on-call
// chased seq 257 for a handler failing on seq 209), at ERROR at each
// delivery of the key (1,871 of 2,446 lines of a consumer's log). The line
// names the held message, the delivery as released_by, once a minute.
func TestOrderedInbox_HeldMessageFailsWhenReleased_LoggedAsItselfOnceAMinute(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		createEffects(t, db)
		rec := &recordingLogger{}
		in := newInbox(t, db, outbox.InboxConfig{Ordered: true, Logger: rec})
		log := &applyLog{fail: func(msg *message.Message) error {
			if msg.Metadata.Get(outbox.HeaderSeq) == "3" {
				return errors.New("the ledger refuses it")
			}
			return nil
		}}
		deliver(t, in.Middleware(log.handler(t, db)), "pay-1", 1, 3, 2, 4, 5)
		if got := log.of("pay-1"); len(got) != 2 {
			t.Fatalf("applied %v, want [1 2]: seq 3 fails, 4 and 5 wait for it", got)
		}
		var lines []watermill.LogFields
		rec.mu.Lock()
		for _, l := range rec.logs {
			if strings.HasPrefix(l.msg, "Held message could not be applied") {
				lines = append(lines, l.fields)
			}
		}
		rec.mu.Unlock()
		if len(lines) != 1 || lines[0]["message_uuid"] != "pay-1-3" || lines[0]["seq"] != int64(3) || lines[0]["released_by"] != "pay-1-2" {
			t.Fatalf("logged %v; want one line of pay-1-3 (seq 3), released by pay-1-2", lines)
		}

		// Its row says why the key waits, for outboxctl held (a user
		// review: "nothing: next held", with no word of why); its handler,
		// once mended, never sees it.
		gaps, _, err := in.ListGaps(context.Background(), 0, 10)
		if err != nil || len(gaps) != 1 || gaps[0].Missing() != 0 || !strings.HasSuffix(gaps[0].NextError, " the ledger refuses it") {
			t.Fatalf("gaps %+v (%v); want pay-1 waiting for its held seq 3, its error noted", gaps, err)
		}
		mended := make(chan string, 64)
		log.mu.Lock()
		log.fail = func(msg *message.Message) error {
			for k := range msg.Metadata {
				mended <- k
			}
			return nil
		}
		log.mu.Unlock()
		if _, err := in.ApplyHeld(context.Background()); err != nil {
			t.Fatal(err)
		}
		if got := log.of("pay-1"); len(got) != 5 {
			t.Fatalf("applied %v after the mend, want [1 2 3 4 5]", got)
		}
		close(mended)
		for k := range mended {
			if strings.HasPrefix(k, "x-acemq-inbox-") {
				t.Errorf("the handler saw the inbox's own metadata %q", k)
			}
		}
	})
}

// A message set aside and then applied after all, delivered again (a copy
// the broker still had) or released from the ordered inbox's hold, kept
// its record's "set aside by …" note, and outboxctl show said "set aside,
// not applied" of an applied record (an on-call review). Its apply takes
// the note out; a mark of a duplicate does not.
func TestInbox_SetAsideThenApplied_RecordLosesTheNote(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		createEffects(t, db)
		msgs := []*message.Message{keyedMsg("pay-7", 1), message.NewMessage("plain-1", []byte("x"))}
		msgs[0].Metadata.Set(outbox.MetadataAggregateID, "pay-7")
		publishInTx(t, db, "payments", msgs, outbox.TxPublisherConfig{})
		db.MustExec("UPDATE acemq_outbox SET published_at = created_at") // the relay sent them
		h, log, broken := setAsideChain(t, db, newInbox(t, db, outbox.InboxConfig{Ordered: true, MarkOutboxProcessed: true}), func(*message.Message) bool { return true })
		note := func(id string) string {
			t.Helper()
			var s string
			if err := db.Get(&s, db.Rebind("SELECT COALESCE(last_error, '') FROM acemq_outbox WHERE id = ?"), id); err != nil {
				t.Fatal(err)
			}
			return s
		}
		unkeyed := message.NewMessage("plain-1", []byte("x"))
		unkeyed.Metadata.Set(outbox.HeaderSeq, "1") // for applyLog; no key: the plain inbox
		for _, msg := range []*message.Message{keyedMsg("pay-7", 1), unkeyed} {
			if _, err := h(msg.Copy()); err != nil {
				t.Fatal(err)
			}
			if n := note(msg.UUID); !strings.HasPrefix(n, "set aside by ") {
				t.Fatalf("%s set aside: last_error %q, want the note", msg.UUID, n)
			}
		}
		broken.Store(false)
		for _, msg := range []*message.Message{keyedMsg("pay-7", 1), unkeyed} {
			if _, err := h(msg.Copy()); err != nil { // a copy the broker still had: applied now
				t.Fatal(err)
			}
			if n := note(msg.UUID); n != "" || !outboxStateOf(t, db, msg.UUID).Processed {
				t.Errorf("%s applied after it was set aside: last_error %q, processed %v; want no note, processed", msg.UUID, n, outboxStateOf(t, db, msg.UUID).Processed)
			}
		}
		if got, plain := log.of("pay-7"), log.of(""); len(got) != 1 || len(plain) != 1 {
			t.Errorf("pay-7 applied %v, plain-1 %v; want each once", got, plain)
		}
	})
}

// setAsideChain is the README's chain, PoisonQueue with PoisonOutbox to
// "payments.poison" and Retry, before in, over a handler that logs what it applies and, while
// broken, fails on the messages refuses names; broken starts set.
func setAsideChain(t *testing.T, db *testdb.DB, in *outbox.Inbox, refuses func(*message.Message) bool) (h message.HandlerFunc, log *applyLog, broken *atomic.Bool) {
	t.Helper()
	pq, err := middleware.PoisonQueue(in.PoisonOutbox(), "payments.poison")
	if err != nil {
		t.Fatal(err)
	}
	broken = new(atomic.Bool)
	broken.Store(true)
	log = &applyLog{fail: func(msg *message.Message) error {
		if broken.Load() && refuses(msg) {
			return errors.New("the ledger refuses it")
		}
		return nil
	}}
	h = pq(middleware.Retry{MaxRetries: 1, InitialInterval: time.Millisecond, ResetContextOnRetry: true}.Middleware(
		middleware.Timeout(30 * time.Second)(in.Middleware(log.handler(t, db)))))
	return h, log, broken
}
