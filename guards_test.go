package outbox_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"reflect"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/prometheus/client_golang/prometheus"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// Guards of code no other test held (a mutation run over 7a0ede3..57a5c26
// found it unguarded): each fails when the code it names is broken.

// A connect with a deadline gives each node its share of it: a hung node
// first in line does not spend the whole of it, and the healthy node after
// it is reached within the same Connect.
func TestConnectWithADeadline_HungNodeFirst_HealthyNodeReachedInOneConnect(t *testing.T) {
	hung := hungNode(t)
	dest, err := outbox.NewAMQPDestination(outbox.AMQPConfig{URLs: []string{hung, testdb.AMQPURL()}})
	if err != nil {
		t.Fatal(err)
	}
	defer dest.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	if err := dest.Connect(ctx); err != nil {
		t.Fatalf("connect past a hung node within 3 s: %v", err)
	}
}

// A round of connects cut short by its context (cancelled, no deadline, so
// no share) at a hung node starts the next round after it.
func TestConnectCancelledAtAHungNode_NextConnectStartsAfterIt(t *testing.T) {
	hung := hungNode(t)
	dest, err := outbox.NewAMQPDestination(outbox.AMQPConfig{URLs: []string{hung, testdb.AMQPURL()}})
	if err != nil {
		t.Fatal(err)
	}
	defer dest.Close()
	connect := func() error {
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		timer := time.AfterFunc(time.Second, cancel)
		defer timer.Stop()
		return dest.Connect(ctx)
	}
	if err := connect(); err == nil {
		t.Fatal("first connect, cut short at the hung node, succeeded")
	}
	if err := connect(); err != nil {
		t.Fatalf("second connect: %v, want the healthy node after the hung one", err)
	}
}

// A held message's apply (drain, here by ApplyHeld) that PostgreSQL refuses
// under REPEATABLE READ for a concurrent transaction on the key's row
// (SQLSTATE 40001) runs again, as a delivery's does.
func TestOrderedInbox_Postgres_RepeatableRead_HeldApplyRunAgain(t *testing.T) {
	db := migrated(t, testdb.Postgres)
	createEffects(t, db)
	var failing atomic.Bool
	failing.Store(true)
	l := applyLog{fail: func(msg *message.Message) error {
		if msg.UUID == keyedMsg("acct-1", 2).UUID && failing.Load() {
			return errors.New("not yet")
		}
		return nil
	}}
	in := orderedInbox(t, db, outbox.InboxConfig{ConsumerName: "ledger", Isolation: sql.LevelRepeatableRead})
	h := in.Middleware(l.handler(t, db))
	deliver(t, h, "acct-1", 2, 1) // 2 held; 1 applied, and 2's apply fails: 2 stays held, ready
	if got := l.of("acct-1"); !reflect.DeepEqual(got, []int{1}) {
		t.Fatalf("applied %v, want [1]", got)
	}
	failing.Store(false)

	// Another transaction changes the key's row and holds it; ApplyHeld's
	// apply of 2 takes its snapshot and waits for the row; the other commits.
	other, err := db.Beginx()
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = other.Rollback() }()
	if _, err := other.Exec("UPDATE acemq_inbox_sequences SET held = held WHERE consumer_name = 'ledger' AND aggregate_id = 'acct-1'"); err != nil {
		t.Fatal(err)
	}
	type result struct {
		n   int
		err error
	}
	done := make(chan result, 1)
	go func() {
		n, err := in.ApplyHeld(context.Background())
		done <- result{n, err}
	}()
	time.Sleep(500 * time.Millisecond)
	if err := other.Commit(); err != nil {
		t.Fatal(err)
	}
	if r := <-done; r.err != nil || r.n != 1 {
		t.Fatalf("ApplyHeld: %d applied, %v; want 1 applied, run again after the serialization failure", r.n, r.err)
	}
	if got := l.of("acct-1"); !reflect.DeepEqual(got, []int{1, 2}) {
		t.Errorf("applied %v, want [1 2]", got)
	}
	assertEffectsOnce(t, db, "acct-1", 2)
}

// Metadata with more keys than the relay can send with its own headers
// added (AMQP clients read at most 8192 entries of a table; the relay adds
// up to 8) is refused at Publish, not written as a row the relay can never
// send; at the limit it is taken.
func TestTxPublisher_MetadataWithTooManyKeys_Refused(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	withKeys := func(id string, n int) *message.Message {
		m := message.NewMessage(id, []byte("x"))
		for i := range n {
			m.Metadata.Set(fmt.Sprintf("k%05d", i), "")
		}
		return m
	}
	tx, err := db.Beginx()
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback() }()
	pub, err := outbox.NewTxPublisher(tx)
	if err != nil {
		t.Fatal(err)
	}
	var invalid *outbox.InvalidMessageError
	if err := pub.Publish("t", withKeys("too-many", 8192-8+1)); !errors.As(err, &invalid) || invalid.Field != "metadata" {
		t.Errorf("Publish of 8185 metadata keys: %v, want an InvalidMessageError of its metadata", err)
	}
	if err := pub.Publish("t", withKeys("at-the-limit", 8192-8)); err != nil {
		t.Errorf("Publish of 8184 metadata keys: %v, want it taken", err)
	}
	var c int
	if err := tx.Get(&c, "SELECT COUNT(*) FROM acemq_outbox"); err != nil || c != 1 {
		t.Errorf("%d rows (%v), want 1", c, err)
	}
}

// A keyed call of several statements whose context ends as its savepoint
// is released: the rows are written, so the release runs anyway and the
// call succeeds; released under the ended context, it failed, and the
// call's error stood over 1,500 rows and numbers the caller's commit kept.
func TestTxPublisher_KeyedCallContextEndsAtRelease_NoErrorOverWrittenRows(t *testing.T) {
	eachMigrated(t, func(t *testing.T, db *testdb.DB, d outbox.Dialect) {
		stx, ctx, pub := cancellingPublisher(t, db, d, func(q string) bool { return strings.HasPrefix(q, "RELEASE SAVEPOINT") })
		var many []*message.Message
		for i := 0; i < 1500; i++ {
			m := keyed(fmt.Sprintf("rk-%d", i%3))
			m.SetContext(ctx)
			many = append(many, m)
		}
		perr := pub.Publish("t", many...)
		if err := stx.Commit(); err != nil {
			t.Fatalf("commit: %v", err)
		}
		var n int
		if err := db.Get(&n, "SELECT COUNT(*) FROM acemq_outbox WHERE aggregate_id LIKE 'rk-%'"); err != nil {
			t.Fatal(err)
		}
		if perr != nil && n != 0 {
			t.Errorf("Publish failed (%v), yet its %d rows committed", perr, n)
		}
		if perr == nil && n != 1500 {
			t.Errorf("Publish succeeded, %d rows committed, want 1500", n)
		}
	})
}

// Under AllowMissingID a message with no id runs its handler outside the
// dedupe path, and a panic there is still turned into Watermill's
// RecoveredPanicError, stack and all, not left to kill the process.
func TestInbox_AllowMissingID_HandlerPanics_RecoveredWithItsStack(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	h := newInbox(t, db, outbox.InboxConfig{ConsumerName: "boom", AllowMissingID: true}).Middleware(func(*message.Message) ([]*message.Message, error) {
		var m map[string]int
		m["x"] = 1 // a nil map's write
		return nil, nil
	})
	var err error
	func() {
		defer func() {
			if r := recover(); r != nil {
				t.Fatalf("the handler's panic came out of the inbox: %v", r)
			}
		}()
		_, err = h(message.NewMessage("", nil))
	}()
	var p middleware.RecoveredPanicError
	if !errors.As(err, &p) {
		t.Fatalf("error %v, want a middleware.RecoveredPanicError", err)
	}
	if !strings.Contains(p.Stacktrace, "TestInbox_AllowMissingID_HandlerPanics") {
		t.Errorf("stack %q does not name the panicking function", p.Stacktrace)
	}
}

// A copy of a message held already is acked and counted a duplicate (its
// own outcome, inboxHeldAgain, keeps its outbox record unmarked, and was
// added to the duplicates' case of the metrics); the apply of the held
// message then counts it processed.
func TestOrderedInbox_CopyOfAHeldMessage_CountedDuplicate(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	createEffects(t, db)
	reg := prometheus.NewRegistry()
	m, err := outbox.NewMetrics(reg)
	if err != nil {
		t.Fatal(err)
	}
	var l applyLog
	h := orderedInbox(t, db, outbox.InboxConfig{ConsumerName: "ledger", Metrics: m}).Middleware(l.handler(t, db))
	deliver(t, h, "k", 2, 2) // held, then its copy
	if got := metricValue(t, reg, "outbox_inbox_duplicates_total", "ledger"); got != 1 {
		t.Errorf("outbox_inbox_duplicates_total{consumer=ledger} = %v after a held message's copy, want 1", got)
	}
	deliver(t, h, "k", 1) // applies 1, then the held 2
	for name, want := range map[string]float64{"outbox_inbox_duplicates_total": 1, "outbox_inbox_processed_total": 2} {
		if got := metricValue(t, reg, name, "ledger"); got != want {
			t.Errorf("%s{consumer=ledger} = %v, want %v", name, got, want)
		}
	}
}

// A router that has a handler of its own under the relay's name refuses
// the relay's plugin with ErrForwarderInUse (Watermill panics on a second
// handler of one name), whatever the plugin's registry of relays holds.
func TestForwarderPlugin_RouterHandlerOfTheRelaysName_Refused(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	r := newRouterWithConsumer(t)
	ch := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	t.Cleanup(func() { _ = ch.Close() })
	r.AddConsumerHandler("outbox-relay acemq_outbox", "elsewhere", ch, func(*message.Message) error { return nil })
	r.AddPlugin(newForwarder(t, db, outbox.ForwarderConfig{}).Plugin())
	done := make(chan error, 1)
	go func() {
		defer func() {
			if p := recover(); p != nil {
				done <- fmt.Errorf("router Run panicked: %v", p)
			}
		}()
		done <- r.Run(context.Background())
	}()
	select {
	case err := <-done:
		if !errors.Is(err, outbox.ErrForwarderInUse) {
			t.Fatalf("router Run: %v, want ErrForwarderInUse", err)
		}
	case <-time.After(20 * time.Second):
		_ = r.Close()
		t.Fatal("the router ran with a relay under its own handler's name")
	}
}
