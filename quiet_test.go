package outbox_test

import (
	"bufio"
	"bytes"
	"context"
	"database/sql"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/jmoiron/sqlx"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testamqp"
	"github.com/acemq/watermill-outbox/internal/testdb"
	"github.com/acemq/watermill-outbox/internal/testutil"
)

// The quiet sequence's time, as the trigger reads it: ahead of the
// database's clock (quiet), or not.
func quietAhead(t testing.TB, db *testdb.DB) bool {
	t.Helper()
	var ahead sql.NullBool
	if err := db.Get(&ahead, "SELECT pg_sequence_last_value('acemq_outbox_quiet') > (extract(epoch FROM clock_timestamp()) * 1000)::bigint"); err != nil {
		t.Fatal(err)
	}
	return ahead.Valid && ahead.Bool
}

func setQuiet(t testing.TB, db *testdb.DB, aheadMs int64) {
	t.Helper()
	if _, err := db.Exec("SELECT setval('acemq_outbox_quiet', GREATEST(0, (extract(epoch FROM clock_timestamp()) * 1000)::bigint + $1))", aheadMs); err != nil {
		t.Fatal(err)
	}
}

// commitOne commits one message to the outbox in a transaction of its own.
func commitOne(db *testdb.DB, exchange string) (string, error) {
	ids, err := commitN(db, exchange, 1)
	if err != nil {
		return "", err
	}
	return ids[0], nil
}

// commitN commits n messages to the outbox in a transaction of their own.
func commitN(db *testdb.DB, exchange string, n int) ([]string, error) {
	tx, err := db.Beginx()
	if err != nil {
		return nil, err
	}
	defer func() { _ = tx.Rollback() }()
	pub, err := outbox.NewTxPublisher(tx, outbox.TxPublisherConfig{Exchange: exchange})
	if err != nil {
		return nil, err
	}
	ids := make([]string, n)
	msgs := make([]*message.Message, n)
	for i := range msgs {
		msgs[i] = message.NewMessage(watermill.NewUUID(), []byte("{}"))
		ids[i] = msgs[i].UUID
	}
	if err := pub.Publish("t", msgs...); err != nil {
		return nil, err
	}
	return ids, tx.Commit()
}

// quietRelay runs a relay that keeps the trigger quiet above 20 records a
// second and otherwise polls once an hour (setup, if any, sees it before
// it runs), and returns it with its broker,
// queue, a stop (cancel, then Run's error) and a flow: commits one every
// 5 ms until cond holds (10 s at most), and returns how many it committed.
func quietRelay(t *testing.T, db *testdb.DB, setup ...func(*outbox.Forwarder)) (b *testamqp.Broker, queue string, stop func() error, flow func(what string, cond func() bool) int) {
	t.Helper()
	b = testamqp.New(t)
	queue = b.Queue("t")
	f := newForwarder(t, db, outbox.ForwarderConfig{PollInterval: time.Hour, QuietAbove: 20})
	for _, fn := range setup {
		fn(f)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- f.Run(ctx) }()
	t.Cleanup(cancel)
	<-f.Running()
	waitFor(t, 10*time.Second, "the relay to listen", func() bool { return outbox.Woken(f) })
	stop = func() error { cancel(); return <-done }
	flow = func(what string, cond func() bool) int {
		t.Helper()
		n := 0
		for deadline := time.Now().Add(10 * time.Second); !cond(); n++ {
			if time.Now().After(deadline) {
				t.Fatalf("no %s within 10 s of a flow", what)
			}
			if _, err := commitOne(db, b.Exchange); err != nil {
				t.Fatal(err)
			}
			time.Sleep(5 * time.Millisecond)
		}
		return n
	}
	return b, queue, stop, flow
}

// keptQuiet opens a transaction that publishes one message while a flow
// keeps the trigger quiet, so that it holds the table's advisory lock, and
// returns it with the message and how many the flow committed. On a
// stalled machine the flow may have ended just before the insert; then it
// tries again.
func keptQuiet(t *testing.T, db *testdb.DB, exchange string, flow func(string, func() bool) int) (*sqlx.Tx, *message.Message, int) {
	t.Helper()
	sent := 0
	for try := 0; try < 5; try++ {
		sent += flow("quiet trigger", func() bool { return quietAhead(t, db) })
		tx := db.MustBegin()
		pub, err := outbox.NewTxPublisher(tx, outbox.TxPublisherConfig{Exchange: exchange})
		if err != nil {
			t.Fatal(err)
		}
		msg := message.NewMessage(watermill.NewUUID(), []byte("kept quiet"))
		if err := pub.Publish("t", msg); err != nil {
			t.Fatal(err)
		}
		var quiet bool
		if err := tx.Get(&quiet, "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()"+
			" AND classid = 1633906033::oid AND objid = 'acemq_outbox'::regclass::oid)"); err != nil {
			t.Fatal(err)
		}
		if quiet {
			t.Cleanup(func() { _ = tx.Rollback() })
			return tx, msg, sent
		}
		_ = tx.Rollback()
	}
	t.Fatal("in 5 tries, no insert during a flow was kept quiet")
	return nil, nil, 0
}

// notifications listens on a connection of its own and counts what the
// trigger sends for db's table (the channel is the database's, and other
// tests' schemas notify on it at the same time).
type notifications struct {
	mu sync.Mutex
	n  int
}

func (ns *notifications) count() int {
	ns.mu.Lock()
	defer ns.mu.Unlock()
	return ns.n
}

func listenTo(t *testing.T, db *testdb.DB) *notifications {
	t.Helper()
	ns := &notifications{}
	pool := otherPool(t, db)
	conn, err := pool.Conn(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	t.Cleanup(func() { cancel(); <-done; _ = conn.Close() })
	listening := make(chan error, 1)
	go func() {
		defer close(done)
		_ = conn.Raw(func(dc any) error {
			pc := dc.(*stdlib.Conn).Conn()
			_, err := pc.Exec(ctx, "LISTEN acemq_outbox")
			listening <- err
			for err == nil {
				var n *pgconn.Notification
				if n, err = pc.WaitForNotification(ctx); err == nil && n.Payload == db.Name+".acemq_outbox" {
					ns.mu.Lock()
					ns.n++
					ns.mu.Unlock()
				}
			}
			return nil
		})
	}()
	if err := <-listening; err != nil {
		t.Fatal(err)
	}
	return ns
}

// The trigger of migration 0010 sends nothing while the quiet sequence's
// time is ahead of the clock, and notifies as before when it is 0 or has
// lapsed (a relay that died). A transaction it kept quiet holds the
// table's advisory lock, shared, until it ends: what a relay leaving its
// flow waits for. A role that may only write the table (a service) writes
// it either way, and a REPEATABLE READ transaction sees the time the
// relay set after it began.
func TestMigrate_Postgres_QuietTrigger(t *testing.T) {
	db := migrated(t, testdb.Postgres)
	ns := listenTo(t, db)
	heard := func(want int, what string) {
		t.Helper()
		if want > 0 {
			waitFor(t, 10*time.Second, what, func() bool { return ns.count() >= want })
		}
		time.Sleep(200 * time.Millisecond) // time for one more to come, were there one
		if got := ns.count(); got != want {
			t.Fatalf("%s: %d notifications, want %d", what, got, want)
		}
	}
	mustCommit := func() {
		t.Helper()
		if _, err := commitOne(db, "x"); err != nil {
			t.Fatal(err)
		}
	}
	mustCommit()
	heard(1, "a commit, the sequence never set")

	setQuiet(t, db, 60_000)
	mustCommit()
	mustCommit()
	heard(1, "two commits while the time is ahead")

	setQuiet(t, db, -1) // lapsed
	mustCommit()
	heard(2, "a commit after the time lapsed")
	if _, err := db.Exec("SELECT setval('acemq_outbox_quiet', 0)"); err != nil {
		t.Fatal(err)
	}
	mustCommit()
	heard(3, "a commit with the time cleared")

	// A transaction kept quiet holds the lock until it ends.
	over := func() bool {
		t.Helper()
		var ok bool
		if err := db.Get(&ok, "SELECT pg_try_advisory_xact_lock((1633906033::bigint << 32) | 'acemq_outbox'::regclass::oid::bigint)"); err != nil {
			t.Fatal(err)
		}
		return ok
	}
	setQuiet(t, db, 60_000)
	tx := db.MustBegin()
	pub, err := outbox.NewTxPublisher(tx, outbox.TxPublisherConfig{Exchange: "x"})
	if err != nil {
		t.Fatal(err)
	}
	if err := pub.Publish("t", message.NewMessage(watermill.NewUUID(), nil)); err != nil {
		t.Fatal(err)
	}
	if over() {
		t.Fatal("the lock was free while a transaction the trigger kept quiet was open")
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	if !over() {
		t.Fatal("the lock was held after the quiet transaction committed")
	}
	heard(3, "the quiet transaction")

	// The read under the lock: a transaction that read the time ahead, then
	// waited for the lock while the relay cleared the time and took the
	// lock, notifies.
	relay, err := db.Conn(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	defer relay.Close()
	if _, err := relay.ExecContext(context.Background(), "SELECT pg_advisory_lock((1633906033::bigint << 32) | 'acemq_outbox'::regclass::oid::bigint)"); err != nil {
		t.Fatal(err)
	}
	committed := make(chan error, 1)
	go func() { _, err := commitOne(db, "x"); committed <- err }()
	waitFor(t, 10*time.Second, "the insert to wait for the lock", func() bool {
		var n int
		_ = db.Get(&n, "SELECT COUNT(*) FROM pg_locks WHERE locktype = 'advisory' AND classid = 1633906033::oid"+
			" AND objid = 'acemq_outbox'::regclass::oid AND NOT granted")
		return n > 0
	})
	if _, err := db.Exec("SELECT setval('acemq_outbox_quiet', 0)"); err != nil {
		t.Fatal(err)
	}
	if _, err := relay.ExecContext(context.Background(), "SELECT pg_advisory_unlock_all()"); err != nil {
		t.Fatal(err)
	}
	if err := <-committed; err != nil {
		t.Fatal(err)
	}
	heard(4, "a commit that read the time again after waiting for the lock")

	// REPEATABLE READ: the snapshot is taken before the relay clears the
	// time; the trigger reads the sequence's value of the moment.
	rr, err := db.BeginTxx(context.Background(), &sql.TxOptions{Isolation: sql.LevelRepeatableRead})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = rr.Rollback() }()
	if _, err := rr.Exec("SELECT 1 FROM acemq_outbox LIMIT 1"); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec("SELECT setval('acemq_outbox_quiet', 0)"); err != nil {
		t.Fatal(err)
	}
	pub, err = outbox.NewTxPublisher(rr, outbox.TxPublisherConfig{Exchange: "x"})
	if err != nil {
		t.Fatal(err)
	}
	if err := pub.Publish("t", message.NewMessage(watermill.NewUUID(), nil)); err != nil {
		t.Fatal(err)
	}
	if err := rr.Commit(); err != nil {
		t.Fatal(err)
	}
	heard(5, "a REPEATABLE READ transaction that began while the time was ahead")

	// A role that may write the table, and nothing else of the schema.
	_, svc := newRole(t, db, "", "USAGE ON SCHEMA "+db.Name, "SELECT, INSERT ON ALL TABLES IN SCHEMA "+db.Name)
	for i, ahead := range []int64{60_000, -60_000} {
		setQuiet(t, db, ahead)
		if _, err := commitOne(svc, "x"); err != nil {
			t.Fatalf("a service's role writing the outbox, the time %d ms ahead: %v", ahead, err)
		}
		heard(5+i, "a service role's commit")
	}
	if _, err := svc.Exec("SELECT setval('acemq_outbox_quiet', 0)"); err == nil {
		t.Error("a role without UPDATE on the sequence set it")
	}
}

// A relay in a flow keeps the trigger quiet and finds the flow's rows by
// polling (it polls at most once an hour when it counts on NOTIFY); once
// the flow ends it clears the time, and an idle commit wakes it again by
// NOTIFY. Stopped in a flow, it clears the time too.
func TestForwarder_Postgres_Flow_KeepsTheTriggerQuiet_ThenNotifyWakesItAgain(t *testing.T) {
	db := migrated(t, testdb.Postgres)
	b, queue, stop, flow := quietRelay(t, db)
	sent := flow("quiet trigger", func() bool { return quietAhead(t, db) })
	ns := listenTo(t, db)
	// Next to none. A stall of the machine that empties a window of the
	// flow (100 ms without a row claimed) lets the relay leave it until a
	// second of flow has passed, longer than 50 commits take: CI's load
	// made one such run notify 48 times. One run may; the next one, once
	// the relay is back in the flow, may not.
	for try := 1; ; try++ {
		before, more := ns.count(), 0
		sent += flow("end of 50 commits", func() bool { more++; return more > 50 })
		if got := b.Drain(queue, sent, 10*time.Second); len(got) != sent {
			t.Fatalf("%d of %d messages of the flow arrived within 10 s", len(got), sent)
		}
		sent = 0
		n := ns.count() - before
		if n <= 25 {
			break
		}
		if try == 2 {
			t.Errorf("%d notifications for 50 commits in the flow, want next to none", n)
			break
		}
		t.Logf("%d notifications for 50 commits in the flow: the relay left it for a moment; once more", n)
		sent = flow("quiet trigger again", func() bool { return quietAhead(t, db) })
	}

	waitFor(t, 10*time.Second, "the time cleared after the flow", func() bool { return !quietAhead(t, db) })
	time.Sleep(300 * time.Millisecond) // the relay waits for NOTIFY again, once an hour for its poll
	start := time.Now()
	if _, err := commitOne(db, b.Exchange); err != nil {
		t.Fatal(err)
	}
	if got := b.Drain(queue, 1, 10*time.Second); len(got) != 1 {
		t.Fatal("an idle commit after the flow did not wake the relay")
	}
	if took := time.Since(start); took > 2*time.Second {
		t.Errorf("an idle commit after the flow took %s to the broker", took)
	}

	flow("quiet trigger again", func() bool { return quietAhead(t, db) })
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	if quietAhead(t, db) {
		t.Error("the trigger stays quiet after the relay stopped in a flow")
	}
}

// A transaction the trigger kept quiet during a flow and that commits after
// the relay left it is not left to the poll (once an hour here): the relay
// polls until every such transaction has ended, then looks once more.
func TestForwarder_Postgres_LeavingTheFlow_WaitsForTheTransactionsKeptQuiet(t *testing.T) {
	db := migrated(t, testdb.Postgres)
	b, queue, _, flow := quietRelay(t, db)
	tx, late, sent := keptQuiet(t, db, b.Exchange, flow)
	if got := b.Drain(queue, sent, 10*time.Second); len(got) != sent {
		t.Fatalf("%d of %d messages of the flow arrived", len(got), sent)
	}
	waitFor(t, 10*time.Second, "the relay to leave the flow", func() bool { return !quietAhead(t, db) })
	time.Sleep(500 * time.Millisecond)
	start := time.Now()
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	got := b.Drain(queue, 1, 10*time.Second)
	if len(got) != 1 || got[0].MessageId != late.UUID {
		t.Fatalf("the transaction kept quiet, committed after the flow, did not reach the broker within 10 s (%d messages)", len(got))
	}
	if took := time.Since(start); took > 2*time.Second {
		t.Errorf("it took %s from its commit", took)
	}
}

// The last of the transactions the trigger kept quiet may commit in the
// middle of the relay's sweep: after its claim, before it finds the lock
// free and counts on NOTIFY again. That commit woke nobody and the claim
// missed it, so the relay looks once more at once rather than leave it to
// the poll (once an hour here).
func TestForwarder_Postgres_LeavingTheFlow_LooksOnceMoreAfterTheLastQuietCommit(t *testing.T) {
	db := migrated(t, testdb.Postgres)
	var inSweep atomic.Pointer[func()]
	b, queue, _, flow := quietRelay(t, db, func(f *outbox.Forwarder) {
		outbox.SetAfterPublishHook(f, func([]string) error {
			if fn := inSweep.Swap(nil); fn != nil {
				(*fn)()
			}
			return nil
		})
	})
	tx, late, sent := keptQuiet(t, db, b.Exchange, flow)
	if got := b.Drain(queue, sent, 10*time.Second); len(got) != sent {
		t.Fatalf("%d of %d messages of the flow arrived", len(got), sent)
	}
	waitFor(t, 10*time.Second, "the relay to leave the flow", func() bool { return !quietAhead(t, db) })
	time.Sleep(100 * time.Millisecond) // it polls meanwhile: the transaction is open

	// The next sweep that publishes commits the transaction after its
	// claim. What it publishes is a row whose insert did not notify
	// either (the time set ahead for it here), found by the relay's poll.
	committed := make(chan error, 1)
	commit := func() { committed <- tx.Commit() }
	inSweep.Store(&commit)
	setQuiet(t, db, 60_000)
	polled, err := commitOne(db, b.Exchange)
	setQuiet(t, db, -60_000)
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	got := b.Drain(queue, 2, 10*time.Second)
	select {
	case err := <-committed:
		if err != nil {
			t.Fatal(err)
		}
	default:
		t.Fatal("no sweep published the row the relay was to poll for")
	}
	ids := map[string]bool{}
	for _, m := range got {
		ids[m.MessageId] = true
	}
	if !ids[polled] || !ids[late.UUID] {
		t.Fatalf("within 10 s: the polled row %v, the transaction committed in the sweep %v; want both", ids[polled], ids[late.UUID])
	}
	if took := time.Since(start); took > 2*time.Second {
		t.Errorf("it took %s", took)
	}
}

// A relay that stops while a transaction its flow kept quiet is still open
// waits for it (stopGrace at most), then wakes the table's other relays:
// that commit woke nobody, and the other relays, which got no NOTIFY
// during the flow, poll once an hour here.
func TestForwarder_Postgres_StoppingRelay_WakesTheOthersForWhatItKeptQuiet(t *testing.T) {
	db := migrated(t, testdb.Postgres)
	for try := 0; try < 3; try++ {
		b, queue, stop, flow := quietRelay(t, db)
		tx, late, sent := keptQuiet(t, db, b.Exchange, flow)
		if got := b.Drain(queue, sent, 10*time.Second); len(got) != sent {
			t.Fatalf("%d of %d messages of the flow arrived", len(got), sent)
		}
		// The other relay starts now: in the flow it would take the
		// notified rows of its first second, and the flow might never reach
		// QuietAbove for the first.
		other := newForwarder(t, db, outbox.ForwarderConfig{PollInterval: time.Hour, QuietAbove: -1})
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- other.Run(ctx) }()
		stopOther := sync.OnceValue(func() error { cancel(); return <-done })
		t.Cleanup(func() { _ = stopOther() })
		<-other.Running()
		waitFor(t, 10*time.Second, "the other relay to listen", func() bool { return outbox.Woken(other) })
		// The commit must come once the relay has stopped sweeping (else
		// it claims the row itself), before its wait (stopGrace, 250 ms)
		// ends, and late enough that a wake-up sent at once, without the
		// wait, has been and gone.
		begin := time.Now()
		stopped := make(chan error, 1)
		go func() { stopped <- stop() }()
		time.Sleep(150 * time.Millisecond)
		waited := false
		select {
		case err := <-stopped:
			if took := time.Since(begin); took < 250*time.Millisecond {
				t.Fatalf("the relay stopped in %s (%v) while a transaction it kept quiet was open: it must wait for it (250 ms at most)", took.Round(time.Millisecond), err)
			}
			waited = true
		default:
		}
		if time.Since(begin) > 200*time.Millisecond {
			// This goroutine overslept: the relay's wait may end before
			// the commit.
			_ = tx.Rollback()
			if !waited {
				<-stopped
			}
			_ = stopOther()
			t.Logf("the commit came %s after the stop began: again", time.Since(begin).Round(time.Millisecond))
			continue
		}
		start := time.Now()
		if err := tx.Commit(); err != nil {
			t.Fatal(err)
		}
		if err := <-stopped; err != nil {
			t.Fatalf("the relay stopped with %v", err)
		}
		got := b.Drain(queue, 1, 10*time.Second)
		if len(got) != 1 || got[0].MessageId != late.UUID {
			t.Fatalf("the transaction kept quiet, committed as its relay stopped, did not reach the broker within 10 s (%d messages)", len(got))
		}
		if took := time.Since(start); took > 2*time.Second {
			t.Errorf("it took %s from its commit", took)
		}
		return
	}
	t.Fatal("in 3 tries this test did not commit within 200 ms of the stop: the machine is too loaded for it")
}

// A relation of the quiet sequence's name that is not a sequence would make
// the trigger fail every insert: Migrate refuses it, and says why.
func TestMigrate_Postgres_QuietNameTakenByATable_FailsClearly(t *testing.T) {
	db := testdb.New(t, testdb.Postgres)
	if _, err := db.Exec("CREATE TABLE acemq_outbox_quiet (x int)"); err != nil {
		t.Fatal(err)
	}
	err := outbox.Migrate(context.Background(), db.DB, outbox.Postgres)
	if err == nil || !strings.Contains(err.Error(), "acemq_outbox_quiet is there and is not a sequence") {
		t.Fatalf("migrate with a table named acemq_outbox_quiet: %v, want an error saying it is not a sequence", err)
	}
}

// A relay that cannot clear the time (its UPDATE on the sequence revoked in
// a flow) leaves the trigger quiet until the time lapses: it counts on
// NOTIFY again only after that, polling meanwhile, so the commits of that
// second are not left to its poll (once an hour here).
func TestForwarder_Postgres_ClearFails_RelayPollsUntilTheTimeLapses(t *testing.T) {
	db := migrated(t, testdb.Postgres)
	role, relayDB := newRole(t, db, "", "USAGE ON SCHEMA "+db.Name,
		"SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA "+db.Name,
		"USAGE, SELECT, UPDATE ON ALL SEQUENCES IN SCHEMA "+db.Name)
	relayDB.SetMaxOpenConns(10)
	b, queue, _, flow := quietRelay(t, relayDB)
	commit := func() string {
		t.Helper()
		id, err := commitOne(db, b.Exchange)
		if err != nil {
			t.Fatal(err)
		}
		return id
	}
	sent := flow("quiet trigger", func() bool { return quietAhead(t, db) })
	if got := b.Drain(queue, sent, 10*time.Second); len(got) != sent {
		t.Fatalf("%d of %d messages of the flow arrived", len(got), sent)
	}
	// The relay renews the time every half second: the next renewal
	// fails, and so does its clear. Commits go on, each of them waited
	// for: none may wait for the poll.
	if _, err := db.Exec("REVOKE UPDATE ON SEQUENCE acemq_outbox_quiet FROM " + role); err != nil {
		t.Fatal(err)
	}
	sawQuiet := false
	for end := time.Now().Add(2500 * time.Millisecond); time.Now().Before(end); {
		sawQuiet = sawQuiet || quietAhead(t, db)
		start := time.Now()
		id := commit()
		got := b.Drain(queue, 1, 3*time.Second)
		if len(got) != 1 || got[0].MessageId != id {
			t.Fatalf("a commit %s after the UPDATE was revoked did not arrive within 3 s (quiet: %v)", time.Since(start).Round(time.Millisecond), quietAhead(t, db))
		}
		time.Sleep(30 * time.Millisecond)
	}
	if quietAhead(t, db) {
		t.Error("the time is still ahead 2.5 s after the relay lost the right to renew it")
	}
	if !sawQuiet {
		t.Log("the time had lapsed before the first commit: the window this test is about was not exercised")
	}
}

// A relay whose setval keeps failing (its UPDATE on the quiet sequence
// revoked while it runs) says so once, not at every entry window of a
// flow: it tries again at each, and the look that succeeds between two of
// them is no setval that succeeded. Once one has, the next failure is
// logged again. It logged the failure at every entry, every other second
// of the flow here.
func TestForwarder_Postgres_SetKeepsFailingInAFlow_LoggedOnceUntilOneSucceeds(t *testing.T) {
	db := migrated(t, testdb.Postgres)
	role, relayDB := newRole(t, db, "", "USAGE ON SCHEMA "+db.Name,
		"SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA "+db.Name,
		"USAGE, SELECT, UPDATE ON ALL SEQUENCES IN SCHEMA "+db.Name)
	relayDB.SetMaxOpenConns(10)
	b := testamqp.New(t)
	queue := b.Queue("t")
	log := &testutil.ErrorLog{}
	f := newForwarder(t, relayDB, outbox.ForwarderConfig{PollInterval: time.Hour, QuietAbove: 20, Logger: log})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- f.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	<-f.Running()
	// Read at the LISTEN's look, with the privilege: the relay takes the
	// sequence as its own to set until its next look, a minute on.
	waitFor(t, 10*time.Second, "the relay to listen", func() bool { return outbox.Woken(f) })
	if _, err := db.Exec("REVOKE UPDATE ON SEQUENCE acemq_outbox_quiet FROM " + role); err != nil {
		t.Fatal(err)
	}

	// A flow of 200 commits a second, above QuietAbove for 5.5 s: the
	// relay tries to enter it at about 1, 3 and 5 s (each failed entry
	// leaves the flow for the 1.1 s the time it may have set lasts).
	sent := 0
	for end := time.Now().Add(5500 * time.Millisecond); time.Now().Before(end); sent++ {
		if _, err := commitOne(db, b.Exchange); err != nil {
			t.Fatal(err)
		}
		time.Sleep(5 * time.Millisecond)
	}
	if got := b.Drain(queue, sent, 10*time.Second); len(got) != sent {
		t.Fatalf("%d of %d messages of the flow arrived", len(got), sent)
	}
	logged := func() []string {
		return log.Msgs()
	}
	msgs := logged()
	for _, m := range msgs {
		t.Logf("logged: %s", m)
	}
	if len(msgs) == 0 || !strings.Contains(msgs[0], "keep the NOTIFY trigger quiet") {
		t.Fatalf("logged %q, want first that the relay cannot keep the trigger quiet", msgs)
	}
	if len(msgs) != 1 {
		t.Fatalf("%d errors logged while the same setval kept failing, want 1", len(msgs))
	}

	// Once a setval succeeded, the next failure is news again.
	if _, err := db.Exec("GRANT UPDATE ON SEQUENCE acemq_outbox_quiet TO " + role); err != nil {
		t.Fatal(err)
	}
	quietFlowUntil(t, db, b.Exchange, "quiet trigger", func() bool { return quietAhead(t, db) })
	if _, err := db.Exec("REVOKE UPDATE ON SEQUENCE acemq_outbox_quiet FROM " + role); err != nil {
		t.Fatal(err)
	}
	quietFlowUntil(t, db, b.Exchange, "failed renewal logged", func() bool { return len(logged()) >= 2 })
	t.Logf("logged: %s", logged()[1])
}

// quietFlowUntil commits one message every 5 ms until cond holds (10 s at
// most), and returns how many it committed.
func quietFlowUntil(t *testing.T, db *testdb.DB, exchange, what string, cond func() bool) int {
	t.Helper()
	n := 0
	for deadline := time.Now().Add(10 * time.Second); !cond(); n++ {
		if time.Now().After(deadline) {
			t.Fatalf("no %s within 10 s of a flow", what)
		}
		if _, err := commitOne(db, exchange); err != nil {
			t.Fatal(err)
		}
		time.Sleep(5 * time.Millisecond)
	}
	return n
}

// answerLost is a TCP proxy to a PostgreSQL server that passes the first
// statement setting the quiet time ahead (the relay's entry into a flow)
// to the server and cuts the client's connection as that statement's
// answer comes back: the server ran it, the client sees its connection
// reset. ran is set then.
type answerLost struct {
	addr  string
	armed atomic.Bool // the statement went through a connection
	ran   atomic.Bool
}

func newAnswerLost(t *testing.T, server string) *answerLost {
	t.Helper()
	p := &answerLost{}
	p.addr = tcpProxy(t, server, func(dst, src net.Conn, target *atomic.Bool, toServer bool) {
		p.pipe(dst, src, target, !toServer)
	})
	return p
}

// pipe copies src to dst; from the server (answers), it cuts both at the
// target statement's CommandComplete.
func (p *answerLost) pipe(dst, src net.Conn, target *atomic.Bool, answers bool) {
	defer func() { _ = dst.Close(); _ = src.Close() }()
	buf := make([]byte, 64<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			got := buf[:n]
			switch {
			case !answers && bytes.Contains(got, []byte("setval($1::regclass, (extract")) && p.armed.CompareAndSwap(false, true):
				target.Store(true)
			case answers && target.Load() && bytes.Contains(got, []byte("SELECT 1\x00")):
				p.ran.Store(true)
				return
			}
			if _, err := dst.Write(got); err != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

// A relay entering a flow whose setval ran on the server but whose answer
// was lost (a connection reset; a context cut at stop) takes the time as
// possibly set: it clears it and polls until the transactions it kept
// quiet have ended. setval is not transactional: the relay took the set
// as failed, neither polled nor cleared, and waited for NOTIFYs the
// trigger kept quiet, so a commit of that second waited for the poll
// (once an hour here).
func TestForwarder_Postgres_EntrySetRanButItsAnswerWasLost_RelayStillFindsTheCommitsKeptQuiet(t *testing.T) {
	db := migrated(t, testdb.Postgres)
	u, err := url.Parse(db.DSN)
	if err != nil {
		t.Fatal(err)
	}
	p := newAnswerLost(t, u.Host)
	u.Host = p.addr
	proxied := otherPool(t, &testdb.DB{DB: db.DB, Kind: db.Kind, DSN: u.String(), Name: db.Name})
	b, queue, _, flow := quietRelay(t, proxied)
	sent := flow("setval whose answer was lost", p.ran.Load)
	id, err := commitOne(db, b.Exchange)
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	for _, m := range b.Drain(queue, sent+1, 10*time.Second) {
		if m.MessageId == id {
			t.Logf("arrived %s after its commit", time.Since(start).Round(time.Millisecond))
			return
		}
	}
	t.Fatalf("a commit right after the relay's entry setval ran with its answer lost did not reach the broker within 10 s (the poll is an hour); quiet now: %v", quietAhead(t, db))
}

// A relay that dies in a flow (SIGKILL: no clear, no wake-up) leaves the
// trigger quiet until the time it set last lapses, a second at most after
// its death. The commits of that second, and the transaction the flow kept
// quiet that commits after the death, notify nobody: another relay finds
// them at its poll (once an hour here) or at the first commit after the
// lapse, which notifies again. What the dead relay had claimed is claimable
// again, and nothing is lost.
func TestForwarder_Postgres_RelayDiesInAFlow_TheTimeLapsesThenNotifyWakesTheOthers(t *testing.T) {
	db := migrated(t, testdb.Postgres)
	b := testamqp.New(t)
	queue := b.Queue("t")

	dying := startQuietRelayProcess(t, db)
	var ids []string
	commit := func() {
		t.Helper()
		// Ten rows a commit: the other relay takes its share of the flow,
		// and on a loaded machine (CI, beside the other packages) commits
		// of one row each left the dying relay's share below its 20 a
		// second, and the trigger never quiet.
		more, err := commitN(db, b.Exchange, 10)
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, more...)
	}
	// 30 s at most: on a loaded machine the dying relay's share of the
	// flow took over 10 s to stay above QuietAbove.
	flow := func(what string, cond func() bool) int {
		t.Helper()
		n := 0
		for deadline := time.Now().Add(30 * time.Second); !cond(); n++ {
			if time.Now().After(deadline) {
				t.Fatalf("no %s within 30 s of a flow", what)
			}
			commit()
			time.Sleep(5 * time.Millisecond)
		}
		return n
	}
	// The other relay listens first, and the dying relay's flow then
	// keeps a transaction quiet, just before the kill. The other way round
	// (the transaction first), a dying relay that left its flow for a
	// moment while the other took its share of the rows (a loaded
	// machine: CI beside the other packages) could not go quiet again
	// while that transaction stayed open, and the test waited in vain.
	other := newForwarder(t, db, outbox.ForwarderConfig{PollInterval: time.Hour, QuietAbove: -1})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- other.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	<-other.Running()
	more := 0
	flow("the other relay to listen", func() bool { more++; return outbox.Woken(other) && more > 20 })
	// A dying relay that left its flow after it kept the transaction quiet
	// (a stall) cannot go quiet again while the transaction is open: the
	// transaction is rolled back, and the flow kept quiet again.
	var (
		tx   *sqlx.Tx
		late *message.Message
	)
	for try := 1; ; try++ {
		tx, late, _ = keptQuiet(t, db, b.Exchange, flow)
		if quietAhead(t, db) {
			break
		}
		_ = tx.Rollback()
		if try == 5 {
			t.Fatal("in 5 tries, the trigger was never still quiet once a transaction was kept quiet")
		}
	}

	if err := dying.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	_ = dying.Wait()
	var until, now int64
	if err := db.QueryRow("SELECT pg_sequence_last_value('acemq_outbox_quiet'), (extract(epoch FROM clock_timestamp()) * 1000)::bigint").Scan(&until, &now); err != nil {
		t.Fatal(err)
	}
	if until <= now {
		t.Fatal("the trigger was not quiet when its relay died in the flow: the test proved nothing")
	}
	if until-now > 1000 {
		t.Errorf("the dead relay left the trigger quiet %d ms ahead, want a second at most", until-now)
	}

	// In the time it left: a commit, and the transaction its flow kept
	// quiet. Neither notifies.
	commit()
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	ids = append(ids, late.UUID)
	waitFor(t, 3*time.Second, "the time to lapse", func() bool { return !quietAhead(t, db) })

	commit() // notifies: the other relay wakes, and takes every row
	seen := map[string]bool{}
	for deadline := time.Now().Add(10 * time.Second); len(seen) < len(ids) && time.Now().Before(deadline); {
		for _, d := range b.Drain(queue, 1, time.Until(deadline)) {
			seen[d.MessageId] = true
		}
	}
	var missing []string
	for _, id := range ids {
		if !seen[id] {
			missing = append(missing, id)
		}
	}
	if len(missing) > 0 {
		t.Fatalf("%d of %d messages did not reach the broker within 10 s of the first commit after the lapse (the other relay polls once an hour): %v", len(missing), len(ids), missing)
	}
}

// startQuietRelayProcess starts this test binary as a relay over db
// (quietRelayProcess) and returns once it listens; the test kills it.
func startQuietRelayProcess(t *testing.T, db *testdb.DB) *exec.Cmd {
	t.Helper()
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), "OUTBOX_QUIET_RELAY_PROCESS=1", "OUTBOX_RELAY_DSN="+db.DSN, "OUTBOX_RELAY_DRIVER="+db.DriverName())
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	stderr := &testutil.LockedBuffer{}
	cmd.Stderr = stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	ready := make(chan string, 1)
	go func() {
		line, _ := bufio.NewReader(out).ReadString('\n')
		ready <- line
	}()
	select {
	case line := <-ready:
		if strings.TrimSpace(line) != "listening" {
			t.Fatalf("relay process: %q; stderr:\n%s", line, stderr.String())
		}
	case <-time.After(20 * time.Second):
		t.Fatalf("relay process did not listen within 20 s; stderr:\n%s", stderr.String())
	}
	return cmd
}

// quietRelayProcess runs a relay as quietRelay's (the trigger quiet above 20
// records a second, a poll once an hour) until it is killed, and says
// "listening" once it listens. Reaching the end is a failure (exit 3).
func quietRelayProcess() int {
	f, err := processRelay(outbox.ForwarderConfig{PollInterval: time.Hour, QuietAbove: 20})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	// A test binary that died before killing it (a -timeout panic) must
	// not leave it running with its connections.
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- f.Run(ctx) }()
	for deadline := time.Now().Add(15 * time.Second); !outbox.Woken(f); {
		select {
		case err := <-done:
			fmt.Fprintf(os.Stderr, "relay process: Run returned %v\n", err)
			return 3
		case <-time.After(10 * time.Millisecond): // polling the relay's state
		}
		if time.Now().After(deadline) {
			fmt.Fprintln(os.Stderr, "relay process: not listening after 15 s")
			return 3
		}
	}
	fmt.Println("listening")
	err = <-done
	fmt.Fprintf(os.Stderr, "relay process: Run returned %v\n", err)
	return 3
}
