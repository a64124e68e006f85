package outbox_test

import (
	"context"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testamqp"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// On SQLite a service's writers hold the write lock most of the time, in
// transactions of 4 ms with 0.5 ms between them, from a connection of
// their own as another process would. The relay's claims and marks still
// get the lock between two of them within the pool's busy_timeout (100
// ms), every time: the relay tries again every fraction of a millisecond.
// SQLite's own wait for a busy lock tries about nine times in 100 ms
// (after 1, 2, 5, 10, 15, 20, 25 ms …) and, now and then, lands in no gap:
// with it, one of the two hundred claims and marks failed in each of ten
// runs. (At 40 ms and sixty writes it also failed every run, but the
// relay's own wait came too near its limit under a loaded CI.) Each
// connection's busy_timeout is back at 100 ms afterwards.
func TestForwarder_SQLite_ServicesHoldTheWriteLock_ClaimsAndMarksGetItBetween(t *testing.T) {
	db := testdb.New(t, testdb.SQLite)
	migrate(t, db)
	const rows = 100
	msgs := make([]*message.Message, rows)
	for i := range msgs {
		msgs[i] = message.NewMessage(testdb.RandomName(), []byte("x"))
	}
	publishInTx(t, db, "busy", msgs)

	dsn := strings.Replace(db.DSN, "_busy_timeout=10000", "_busy_timeout=100", 1)
	if dsn == db.DSN {
		t.Fatalf("DSN %s sets no _busy_timeout=10000 to replace", db.DSN)
	}
	pool, err := sqlx.Open("sqlite3", dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	pool.SetMaxOpenConns(1) // the connection the relay used is the one asked after
	services, err := sqlx.Open("sqlite3", db.DSN)
	if err != nil {
		t.Fatal(err)
	}
	defer services.Close()

	ctx, stop := context.WithCancel(context.Background())
	var (
		wg    sync.WaitGroup
		held  = make(chan struct{})
		holds atomic.Int64
	)
	wg.Add(1)
	go func() {
		defer wg.Done()
		for ctx.Err() == nil {
			tx, err := services.Begin() // BEGIN IMMEDIATE (_txlock): the write lock
			if err != nil {
				t.Errorf("services: %v", err)
				return
			}
			if holds.Add(1) == 1 {
				close(held)
			}
			time.Sleep(4 * time.Millisecond)
			if err := tx.Commit(); err != nil {
				t.Errorf("services: %v", err)
				return
			}
			time.Sleep(500 * time.Microsecond)
		}
	}()
	defer func() { stop(); wg.Wait() }()

	broker := &capture{}
	f, err := outbox.NewForwarder(pool, outbox.NewPublisherDestination(broker, nil), outbox.ForwarderConfig{BatchSize: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	<-held
	started := holds.Load()
	for i := range rows {
		n, err := f.Sweep(context.Background())
		if err != nil || n != 1 {
			t.Fatalf("sweep %d: published %d, err %v; want 1 and no error", i+1, n, err)
		}
		time.Sleep(5 * time.Millisecond) // the broker's time, as it were: the services' turn
	}
	during := holds.Load() - started
	stop()
	wg.Wait()
	if during < rows {
		t.Fatalf("the services took the lock %d times during the %d sweeps, want at least %d: the test did not contend", during, rows, rows)
	}
	if len(broker.msgs) != rows {
		t.Fatalf("published %d messages, want %d", len(broker.msgs), rows)
	}
	var ms int
	if err := pool.Get(&ms, "PRAGMA busy_timeout"); err != nil || ms != 100 {
		t.Fatalf("busy_timeout after the sweeps %d (%v), want 100", ms, err)
	}
}

// A wake-up's probe that meets the write lock held past the relay's
// busy_timeout by a writer that then rolls back (or held it only to read)
// lets the claim run: the row whose commit woke the relay goes out once
// the lock is free. The busy probe said "nothing to claim", and a rollback
// writes nothing to the log, so nothing woke the relay again: the row
// waited for the poll (an hour here).
func TestForwarder_SQLite_WakeProbeBusy_WriterRollsBack_RowStillGoesOut(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	dsn := strings.Replace(db.DSN, "_busy_timeout=10000", "_busy_timeout=300", 1)
	if dsn == db.DSN {
		t.Fatalf("DSN %s sets no _busy_timeout=10000 to replace", db.DSN)
	}
	relayDB := otherPool(t, &testdb.DB{DB: db.DB, Kind: db.Kind, DSN: dsn, Name: db.Name})
	b := testamqp.New(t)
	queue := b.Queue("t")
	f := newForwarder(t, relayDB, outbox.ForwarderConfig{PollInterval: time.Hour, MinPollInterval: time.Hour})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- f.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	<-f.Running()
	waitFor(t, 10*time.Second, "the watch", func() bool { return outbox.Woken(f) })

	// A service's connection, as another process's: BEGIN and COMMIT by
	// hand, so that it takes the write lock again at once after its commit.
	conn, err := db.DB.Conn(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	exec := func(q string, args ...any) {
		t.Helper()
		if _, err := conn.ExecContext(context.Background(), q, args...); err != nil {
			t.Fatal(err)
		}
	}
	exercised := 0
	for try := 0; try < 10 && exercised < 2; try++ {
		id := watermill.NewUUID()
		exec("BEGIN IMMEDIATE")
		exec("INSERT INTO acemq_outbox (id, exchange_name, routing_key, body, body_encoding, content_type, headers, created_at) VALUES (?, ?, 't', 'x', 'utf-8', 'text/plain', '{}', ?)",
			id, b.Exchange, time.Now().UTC().Format("2006-01-02 15:04:05.000000"))
		exec("COMMIT")
		// The next transaction holds the lock past the relay's
		// busy_timeout (300 ms), and rolls back.
		exec("BEGIN IMMEDIATE")
		time.Sleep(time.Second)
		if got := b.Drain(queue, 1, 50*time.Millisecond); len(got) == 1 {
			exec("ROLLBACK")
			t.Logf("try %d: the relay took the lock before the writer", try)
			continue
		}
		exec("ROLLBACK")
		exercised++
		start := time.Now()
		if got := b.Drain(queue, 1, 10*time.Second); len(got) != 1 || got[0].MessageId != id {
			t.Fatalf("try %d: a row whose wake-up probe met a writer that then rolled back did not arrive within 10 s (PollInterval 1 h); pending %d", try, pendingCount(t, f))
		}
		t.Logf("try %d: arrived %s after the rollback", try, time.Since(start).Round(time.Millisecond))
	}
	if exercised == 0 {
		t.Fatal("in 10 tries the relay always took the lock before the writer: the case was not exercised")
	}
}

// lockingDestination confirms every record, and as it takes its first
// batch has another connection take SQLite's write lock for hold: the
// relay's mark of that batch then finds the lock busy past its busy
// timeout.
type lockingDestination struct {
	other *sqlx.DB
	hold  time.Duration
	once  sync.Once
	sends atomic.Int64
	freed chan time.Time
}

func (d *lockingDestination) Publish(_ context.Context, records []outbox.Record) []error {
	d.sends.Add(int64(len(records)))
	d.once.Do(func() {
		lock, err := d.other.Begin() // BEGIN IMMEDIATE: the write lock
		if err != nil {
			panic(err)
		}
		go func() {
			time.Sleep(d.hold) // another process's transaction, of that length
			_ = lock.Rollback()
			d.freed <- time.Now()
		}()
	})
	return make([]error, len(records))
}

// relayMeetingALock is a database of one pending record, id, and a relay
// on a pool of a 200 ms busy timeout whose destination confirms it and, as
// it takes it, has another connection hold the write lock for hold.
func relayMeetingALock(t *testing.T, hold time.Duration) (db *testdb.DB, id string, dest *lockingDestination, f *outbox.Forwarder) {
	t.Helper()
	db = migrated(t, testdb.SQLite)
	id = publishN(t, db, "", "busy.mark", 1)[0]
	dsn := strings.Replace(db.DSN, "_busy_timeout=10000", "_busy_timeout=200", 1)
	if dsn == db.DSN {
		t.Fatalf("DSN %s sets no _busy_timeout=10000 to replace", db.DSN)
	}
	relayDB := otherPool(t, &testdb.DB{DB: db.DB, Kind: db.Kind, DSN: dsn, Name: db.Name})
	dest = &lockingDestination{other: otherPool(t, db).DB, hold: hold, freed: make(chan time.Time, 1)}
	f, err := outbox.NewForwarder(relayDB.DB, dest, outbox.ForwarderConfig{Dialect: outbox.SQLite, Lease: 60 * time.Second, PublishTimeout: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = f.Close() })
	return db, id, dest, f
}

// A mark of a batch the broker confirmed that finds SQLite's write lock
// held past the busy timeout by another process (a batch job, a VACUUM)
// is tried again once the lock is free, within the relay's own lease: the
// rows were left "pending" under that lease, and sent again when it ended
// (a review held the lock 12 s; two confirmed rows waited 60 s, then went
// out a second time).
func TestForwarder_SQLite_MarkMeetsALockPastTheBusyTimeout_MarkedOnceFreeNotSentAgain(t *testing.T) {
	t.Parallel()
	db, id, dest, f := relayMeetingALock(t, 1500*time.Millisecond)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- f.Run(ctx) }()
	defer func() { cancel(); <-done }()
	select {
	case <-dest.freed:
	case <-time.After(20 * time.Second):
		t.Fatal("the relay published nothing")
	}
	waitFor(t, 10*time.Second, "the record marked published once the lock was free", func() bool {
		return outboxStateOf(t, db, id).Published
	})
	if n := dest.sends.Load(); n != 1 {
		t.Errorf("the record was sent %d times, want once", n)
	}
}

// The same lock met as the relay is told to stop: the mark's tries again
// end with Run, within a busy timeout or so, rather than go on past a
// stop's bound until the lock ends or the lease nears its end (a code
// review: Run's sweep kept its batches' context from ending, and the
// tries never saw the stop).
func TestForwarder_SQLite_MarkMeetsALockAsTheRelayStops_TriesEndWithRun(t *testing.T) {
	t.Parallel()
	_, _, dest, f := relayMeetingALock(t, 8*time.Second)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- f.Run(ctx) }()
	waitFor(t, 10*time.Second, "the batch sent", func() bool { return dest.sends.Load() > 0 })
	time.Sleep(time.Second) // the mark has met the lock: a busy timeout of 200 ms, and its tries again
	cancel()
	stopped := time.Now()
	select {
	case <-done:
	case <-time.After(3 * time.Second):
		<-done
		t.Errorf("Run returned %s after its context ended, the lock held: the mark's tries went on", time.Since(stopped).Round(time.Millisecond))
	}
	<-dest.freed
}
