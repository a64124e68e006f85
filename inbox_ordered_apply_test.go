package outbox_test

import (
	"context"
	"fmt"
	"reflect"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	mysqldrv "github.com/go-sql-driver/mysql"
	"github.com/jmoiron/sqlx"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/sqldialect"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// sqlDialect is the sqldialect value behind an outbox dialect.
func sqlDialect(t testing.TB, d outbox.Dialect) sqldialect.Dialect {
	t.Helper()
	sd, ok := map[string]sqldialect.Dialect{"postgres": sqldialect.Postgres, "mysql": sqldialect.MySQL, "sqlite": sqldialect.SQLite}[d.Name()]
	if !ok {
		t.Fatalf("no sqldialect for %s", d.Name())
	}
	return sd
}

// The in-order statements (sqldialect.OrderedInbox.Apply), whatever their
// number on a database, decide alike: all done only for the key's next
// sequence number with nothing held and an id not processed, and then the
// key is at seq and the id recorded; otherwise no id is recorded and the
// key is where it was, but for a next message whose id was processed
// already, past which the key moves on. MySQL is run twice, the second time
// with clientFoundRows, which changes what its result counts.
func TestOrderedInbox_InOrderStatements_AllDoneOnlyForTheNextOfAKeyHoldingNothing(t *testing.T) {
	t.Parallel()
	type row struct{ last, held int64 }
	cases := []struct {
		name      string
		key       *row // nil: the key has no row
		processed bool // the message's id is in processed_messages already
		seq       int64
		done      bool
		lastAfter int64 // 0 also stands for no row
	}{
		{name: "new key, seq 1", seq: 1, done: true, lastAfter: 1},
		{name: "new key, seq 3", seq: 3, done: false, lastAfter: 0},
		{name: "next", key: &row{2, 0}, seq: 3, done: true, lastAfter: 3},
		{name: "last applied again", key: &row{2, 0}, seq: 2, done: false, lastAfter: 2},
		{name: "older", key: &row{2, 0}, seq: 1, done: false, lastAfter: 2},
		{name: "ahead", key: &row{2, 0}, seq: 5, done: false, lastAfter: 2},
		{name: "next, key holds messages", key: &row{2, 1}, seq: 3, done: false, lastAfter: 2},
		{name: "seq 1, key at 0 holding nothing", key: &row{0, 0}, seq: 1, done: true, lastAfter: 1},
		{name: "seq 1, key at 0 holding messages", key: &row{0, 1}, seq: 1, done: false, lastAfter: 0},
		{name: "next, id processed already", key: &row{2, 0}, processed: true, seq: 3, done: false, lastAfter: 3},
	}
	run := func(t *testing.T, db *testdb.DB, d outbox.Dialect) {
		ctx := context.Background()
		sd := sqlDialect(t, d)
		in, err := sqldialect.NewInbox(sd, outbox.DefaultInboxTable)
		if err != nil {
			t.Fatal(err)
		}
		ordered := sqldialect.NewOrderedInbox(sd)
		for i, c := range cases {
			consumer := fmt.Sprintf("c%d", i)
			m := sqldialect.InOrder{Consumer: consumer, Key: "k", Seq: c.seq, MessageID: fmt.Sprintf("m%d", i), At: time.Now()}
			if c.key != nil {
				db.MustExec(db.Rebind("INSERT INTO acemq_inbox_sequences (consumer_name, aggregate_id, last_seq, held) VALUES (?, ?, ?, ?)"), consumer, "k", c.key.last, c.key.held)
			}
			if c.processed {
				q := in.Insert(consumer, m.MessageID, time.Now())
				db.MustExec(q.SQL, q.Args...)
			}
			tx, err := db.BeginTxx(ctx, nil)
			if err != nil {
				t.Fatal(err)
			}
			done := true
			for _, step := range ordered.Apply(in, m) {
				res, err := tx.ExecContext(ctx, step.SQL, step.Args...)
				if err != nil {
					t.Fatalf("%s: %v", c.name, err)
				}
				if done, err = step.Done(res); err != nil {
					t.Fatalf("%s: %v", c.name, err)
				}
				if !done {
					break
				}
			}
			if err := tx.Commit(); err != nil {
				t.Fatal(err)
			}
			if done != c.done {
				t.Errorf("%s: done %v, want %v", c.name, done, c.done)
			}
			var last int64
			if err := db.Get(&last, db.Rebind("SELECT COALESCE(MAX(last_seq), 0) FROM acemq_inbox_sequences WHERE consumer_name = ? AND aggregate_id = ?"), consumer, "k"); err != nil {
				t.Fatal(err)
			}
			if last != c.lastAfter {
				t.Errorf("%s: key at %d after, want %d", c.name, last, c.lastAfter)
			}
			var recorded int
			if err := db.Get(&recorded, db.Rebind("SELECT COUNT(*) FROM processed_messages WHERE consumer_name = ? AND message_id = ?"), consumer, m.MessageID); err != nil {
				t.Fatal(err)
			}
			if want := c.done || c.processed; (recorded == 1) != want {
				t.Errorf("%s: %d dedupe rows for the message, want one: %v", c.name, recorded, want)
			}
		}
	}
	eachMigrated(t, run)
	t.Run("mysql clientFoundRows", func(t *testing.T) {
		db := migrated(t, testdb.MySQL)
		run(t, withClientFoundRows(t, db), outbox.MySQL)
	})
}

// withClientFoundRows is a second pool on db's database whose DSN sets
// clientFoundRows: an UPDATE then counts the rows it matched, changed or not.
func withClientFoundRows(t testing.TB, db *testdb.DB) *testdb.DB {
	t.Helper()
	cfg, err := mysqldrv.ParseDSN(db.DSN)
	if err != nil {
		t.Fatal(err)
	}
	cfg.ClientFoundRows = true
	pool, err := sqlx.Open("mysql", cfg.FormatDSN())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = pool.Close() })
	return &testdb.DB{DB: pool, Kind: testdb.MySQL, DSN: cfg.FormatDSN()}
}

// A message whose id was processed (before the consumer was ordered, say)
// and which arrives as its key's next is a duplicate: acked without
// running, and its key moves on past it, so the next runs.
func TestOrderedInbox_NextWhoseIDWasProcessed_AckedWithoutRunningKeyMovesOn(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		createEffects(t, db)
		db.MustExec(db.Rebind("INSERT INTO processed_messages (consumer_name, message_id, processed_at) VALUES (?, ?, CURRENT_TIMESTAMP)"), "fulfilment", keyedMsg("a", 2).UUID)
		var l applyLog
		h := orderedInbox(t, db, outbox.InboxConfig{}).Middleware(l.handler(t, db))
		deliver(t, h, "a", 1, 2, 3)
		if got, want := l.of("a"), []int{1, 3}; !reflect.DeepEqual(got, want) {
			t.Fatalf("applied %v, want %v: seq 2's id was processed", got, want)
		}
		if n := countHeld(t, db); n != 0 {
			t.Errorf("%d held, want 0: seq 3 came after the key moved past 2", n)
		}
	})
}

// Copies of a key's messages delivered at once, each copy in order (a
// redelivery racing the first delivery, on several consumers): each
// sequence number runs once, in order, and no delivery fails (a deadlock
// between the in-order statements of two copies would).
func TestOrderedInbox_ConcurrentCopiesInOrder_EachSeqRunsOnceNoneFails(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		createEffects(t, db)
		var l applyLog
		h := orderedInbox(t, db, outbox.InboxConfig{}).Middleware(l.handler(t, db))
		const n, copies = 20, 4
		keys := []string{"hot", "warm"}
		var wg sync.WaitGroup
		start := make(chan struct{})
		errs := make(chan error, n*copies*len(keys))
		for w := 0; w < copies*len(keys); w++ {
			wg.Add(1)
			go func(key string) {
				defer wg.Done()
				<-start
				for s := 1; s <= n; s++ {
					if _, err := h(keyedMsg(key, s)); err != nil {
						errs <- fmt.Errorf("%s seq %d: %w", key, s, err)
					}
				}
			}(keys[w%len(keys)])
		}
		close(start)
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Errorf("delivery: %v", err)
		}
		for _, key := range keys {
			if got := l.of(key); !reflect.DeepEqual(got, upTo(n)) {
				t.Errorf("%s applied %v, want 1..%d once each in order", key, got, n)
			}
			assertEffectsOnce(t, db, key, n)
		}
		if n := countHeld(t, db); n != 0 {
			t.Errorf("%d held, want 0", n)
		}
	})
}

// On MySQL every in-order statement goes in one round trip, its arguments
// in its text, not prepared, run and closed for every message
// (go-sql-driver's way with a statement that has arguments), and no
// statement is kept prepared on a connection, which a proxy might lose.
func TestOrderedInbox_MySQL_NothingPrepared(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.MySQL)
	createEffects(t, db)
	db.DB.SetMaxOpenConns(1) // one session, whose counters the test reads
	var l applyLog
	h := orderedInbox(t, db, outbox.InboxConfig{}).Middleware(l.handler(t, db))
	const n = 20
	before := sessionPrepares(t, db)
	// In order, then a gap: held, then applied from the database.
	deliver(t, h, "a", upTo(n)...)
	deliver(t, h, "b", 1, 3, 2)
	// Per message the handler's effect, prepared, run and closed by the
	// driver (the test's own statement); nothing of the inbox's.
	if got := sessionPrepares(t, db) - before; got != n+3 {
		t.Errorf("%d prepares for %d messages, want %d: the handler's effects only", got, n+3, n+3)
	}
	if got := l.of("a"); !reflect.DeepEqual(got, upTo(n)) {
		t.Errorf("a applied %v, want 1..%d", got, n)
	}
	if got := l.of("b"); !reflect.DeepEqual(got, upTo(3)) {
		t.Errorf("b applied %v, want 1..3", got)
	}
}

// Under MarkOutboxProcessed the ordered inbox marks the outbox record of a
// message applied by the in-order statements, as of one applied after its
// predecessor, in the same transaction, and of a held message in the
// hold's (see TestOrderedInbox_HeldMessage_RecordMarkedNotResentAtEachBoot_AppliedOnceLater).
func TestOrderedInbox_MarkOutboxProcessed_AppliedAndHeldMarkedInTheirTransaction(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		createEffects(t, db)
		ids := publishN(t, db, "", "order.placed", 3)
		var ran atomic.Int32
		h := orderedInbox(t, db, outbox.InboxConfig{MarkOutboxProcessed: true}).Middleware(writeEffect(t, db, &ran))
		msg := func(i int) *message.Message {
			m := message.NewMessage(ids[i], []byte("x"))
			m.Metadata.Set(outbox.HeaderAggregateID, "a")
			m.Metadata.Set(outbox.HeaderSeq, strconv.Itoa(i+1))
			return m
		}
		for _, i := range []int{0, 2} {
			if _, err := h(msg(i)); err != nil {
				t.Fatal(err)
			}
		}
		if !recordProcessed(t, db, ids[0]) || recordProcessed(t, db, ids[1]) || !recordProcessed(t, db, ids[2]) {
			t.Fatalf("after seq 1 and 3 (held): processed %v, %v and %v, want true, false (not arrived) and true", recordProcessed(t, db, ids[0]), recordProcessed(t, db, ids[1]), recordProcessed(t, db, ids[2]))
		}
		if _, err := h(msg(1)); err != nil {
			t.Fatal(err)
		}
		for i, id := range ids {
			if !recordProcessed(t, db, id) {
				t.Errorf("seq %d applied but its record not marked processed", i+1)
			}
		}
		if n := ran.Load(); n != 3 {
			t.Errorf("handler ran %d times, want 3", n)
		}
	})
}
