package outbox_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jmoiron/sqlx"
	amqp "github.com/rabbitmq/amqp091-go"
	"go.uber.org/goleak"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testamqp"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// The relay process is SIGKILLed after the broker confirmed and before the
// mark: the rows are still pending, the next relay publishes them again, and
// the consumers see each message twice and none lost.
func TestForwarder_RelayKilledAfterConfirm_PublishesAgainNothingLost(t *testing.T) {
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		b := testamqp.New(t)
		queue := b.Queue("payment.captured")
		ids := publishN(t, db, b.Exchange, "payment.captured", 5)

		cmd := exec.Command(os.Args[0])
		cmd.Env = append(os.Environ(), "OUTBOX_RELAY_PROCESS=1", "OUTBOX_RELAY_DSN="+db.DSN, "OUTBOX_RELAY_DRIVER="+db.DriverName())
		out, err := cmd.CombinedOutput()
		var exit *exec.ExitError
		if !errors.As(err, &exit) || exit.Sys().(syscall.WaitStatus).Signal() != syscall.SIGKILL {
			t.Fatalf("relay process: %v, want death by SIGKILL; output:\n%s", err, out)
		}
		if got := b.Count(queue); got != 5 {
			t.Fatalf("broker holds %d messages after the confirms, want 5", got)
		}
		for _, id := range ids {
			if stateOf(t, db, id).Published {
				t.Fatalf("row %s is marked published by a relay that died before marking", id)
			}
		}

		f := newForwarder(t, db, killableRelayConfig)
		waitFor(t, 30*time.Second, "the rows to be published again", func() bool {
			if _, err := f.Sweep(context.Background()); err != nil {
				t.Fatal(err)
			}
			return pendingCount(t, f) == 0
		})
		seen := countIDs(b.Drain(queue, 10, 10*time.Second))
		for _, id := range ids {
			if seen[id] != 2 {
				t.Errorf("message %s arrived %d times, want 2 (once from each relay)", id, seen[id])
			}
		}
	})
}

// The broker closes every connection while the relay drains: it reconnects,
// and every row arrives, none marked without its confirm.
func TestForwarder_BrokerConnectionsClosedMidStream_ReconnectsEveryRowArrives(t *testing.T) {
	for _, window := range []int{1, 0} {
		t.Run(fmt.Sprintf("window=%d", window), func(t *testing.T) {
			brokerClosedMidStream(t, window)
		})
	}
}

func brokerClosedMidStream(t *testing.T, window int) {
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		defer goleak.VerifyNone(t, goleak.IgnoreCurrent(), ignorePools)
		b := testamqp.New(t)
		queue := b.Queue("order.placed")
		n := 3000
		if window == 0 {
			n = 8000 // the pipelined relay is fast
		}
		msgs := publishBatch(t, db, b.Exchange, "order.placed", n)
		addRows := func(n int) { msgs = append(msgs, publishBatch(t, db, b.Exchange, "order.placed", n)...) }

		// Window 1 keeps a message in flight nearly all the time, and the
		// default window keeps a whole batch in flight while the one before
		// is marked, so the close lands mid-batch.
		// Claims stay at 10: grown to 1,000 they drain the rows before
		// rabbitmqctl has started, and the test has to add rows and try
		// again (a grown batch lost mid-flight is released the same way).
		connects := &countingLogger{LoggerAdapter: watermill.NopLogger{}, match: "Connected to RabbitMQ"}
		name := "outbox-test-relay-" + testdb.RandomName()
		f := newForwarder(t, db, outbox.ForwarderConfig{
			BatchSize: 10, MaxBatchSize: 10, RetryMin: 10 * time.Millisecond, RetryMax: 200 * time.Millisecond,
		}, outbox.AMQPConfig{Window: window, Logger: connects, ConnectionName: name})
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- f.Run(ctx) }()
		<-f.Running()

		// rabbitmqctl takes a second or two to start: called at once, its
		// close lands while the relay is at work. On a machine so loaded
		// that the relay still finished first, more rows and another close.
		for try := 1; ; try++ {
			closed := testamqp.CloseConnections(t, name)
			if closed > 0 && pendingCount(t, f) > 0 {
				break
			}
			if try == 3 {
				t.Fatal("the relay finished before the broker closed its connection, three times: the test proved nothing")
			}
			addRows(2 * n)
			f.Notify()
		}
		waitFor(t, 60*time.Second, "every row to be published", func() bool { return pendingCount(t, f) == 0 })
		// Pending counts rows under MaxAttempts: a row the relay gave up on
		// is not pending either, and would look like a lost message below.
		if stuck, err := f.Store().Stuck(context.Background(), 10); err != nil || len(stuck) > 0 {
			t.Fatalf("stuck rows after the close (%v): %+v", err, stuck)
		}
		// The broker went away, not a record: nothing is counted against
		// any row, so an outage of any length makes no row stuck.
		var blamed int
		if err := db.Get(&blamed, "SELECT COUNT(*) FROM acemq_outbox WHERE attempts > 0"); err != nil || blamed > 0 {
			var last sql.NullString
			_ = db.Get(&last, "SELECT MAX(last_error) FROM acemq_outbox WHERE attempts > 0")
			t.Fatalf("%d rows had an attempt counted for the broker's close (%v); a last_error: %s", blamed, err, last.String)
		}
		cancel()
		if err := <-done; err != nil {
			t.Fatal(err)
		}
		if err := f.Close(); err != nil {
			t.Fatal(err)
		}
		if connects.n.Load() < 2 {
			t.Fatalf("the relay connected %d times: the close did not reach it", connects.n.Load())
		}
		deliveries := b.Drain(queue, len(msgs), 10*time.Second)
		seen := countIDs(deliveries)
		for _, m := range msgs {
			if seen[m.UUID] == 0 {
				// Seen once under full CI load and not reproduced since: say
				// all there is to say about the missing message.
				t.Fatalf("message %s never arrived (%d of %d distinct arrived, %d deliveries, %d still in the queue); its row: %+v",
					m.UUID, len(seen), len(msgs), len(deliveries), b.Count(queue), stateOf(t, db, m.UUID))
			}
		}
	})
}

// countingLogger counts the Info messages that equal match.
type countingLogger struct {
	watermill.LoggerAdapter
	match string
	n     atomic.Int32
}

func (l *countingLogger) Info(msg string, fields watermill.LogFields) {
	if msg == l.match {
		l.n.Add(1)
	}
}

func (l *countingLogger) With(watermill.LogFields) watermill.LoggerAdapter { return l }

// The database connections of the relay are killed while it drains: it
// reconnects, and every committed row arrives. The kills go on, every
// 20 ms, until a claim has failed: a relay that stopped on a failed claim
// instead of backing off leaves the rest pending. Three kills after some
// progress reached only publishes and marks on PostgreSQL (and at times on
// MySQL), and such a relay passed.
func TestForwarder_DatabaseConnectionsKilled_EveryRowArrives(t *testing.T) {
	for _, kind := range []string{testdb.Postgres, testdb.MySQL} {
		t.Run(kind, func(t *testing.T) {
			db := migrated(t, kind)
			b := testamqp.New(t)
			queue := b.Queue("order.placed")
			const n = 1500
			msgs := publishBatch(t, db, b.Exchange, "order.placed", n)

			relayDB, appName := ownRelayPool(t, db)
			relay := &testdb.DB{DB: relayDB, Kind: kind, DSN: db.DSN}
			var claimsFailed atomic.Int32
			f := newForwarder(t, relay, outbox.ForwarderConfig{
				BatchSize: 10, RetryMin: 10 * time.Millisecond, RetryMax: 200 * time.Millisecond,
				OnError: func(err error, _ outbox.ErrorContext) {
					if strings.Contains(err.Error(), "outbox: claim:") {
						claimsFailed.Add(1)
					}
				},
			})
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			done := make(chan error, 1)
			go func() { done <- f.Run(ctx) }()
			<-f.Running()
			running := func() {
				select {
				case err := <-done:
					t.Fatalf("Run returned %v with %d rows pending", err, pendingCount(t, f))
				default:
				}
			}

			killer, err := db.Conn(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			defer killer.Close()
			killed := 0
			waitFor(t, 60*time.Second, "a claim to fail under the kills", func() bool {
				running()
				killed += killConnections(t, killer, kind, appName)
				return claimsFailed.Load() > 0 || pendingCount(t, f) == 0
			})
			t.Logf("%d connections killed, %d claims failed", killed, claimsFailed.Load())
			waitFor(t, 60*time.Second, "every row to be published", func() bool { running(); return pendingCount(t, f) == 0 })
			cancel()
			if err := <-done; err != nil {
				t.Fatal(err)
			}
			if claimsFailed.Load() == 0 {
				t.Fatalf("no claim failed (%d connections killed): the test proved nothing", killed)
			}
			seen := countIDs(b.Drain(queue, n, 10*time.Second))
			for _, m := range msgs {
				if seen[m.UUID] == 0 {
					t.Fatalf("message %s never arrived (%d of %d distinct arrived, %d connections killed)", m.UUID, len(seen), n, killed)
				}
			}
		})
	}
}

// ownRelayPool opens a pool of the relay's own on db, as its own process
// would have, closed when the test ends: on PostgreSQL named appName, so
// that only its connections are killed (other packages' tests share the
// server).
func ownRelayPool(t testing.TB, db *testdb.DB) (relayDB *sqlx.DB, appName string) {
	t.Helper()
	relayDSN, appName := db.DSN, "outbox-relay-"+testdb.RandomName()
	if db.Kind == testdb.Postgres {
		relayDSN += "&application_name=" + appName
	}
	relayDB = sqlx.MustOpen(db.DriverName(), relayDSN)
	t.Cleanup(func() { _ = relayDB.Close() })
	return relayDB, appName
}

// killConnections kills the relay's connections, as a failover or a DBA
// would, and returns how many: on PostgreSQL those of its application name,
// on MySQL every other connection to the test's own database.
func killConnections(t testing.TB, killer *sql.Conn, kind, appName string) int {
	t.Helper()
	ctx := context.Background()
	switch kind {
	case testdb.Postgres:
		rows, err := killer.QueryContext(ctx, "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1", appName)
		if err != nil {
			t.Fatal(err)
		}
		defer rows.Close()
		n := 0
		for rows.Next() {
			n++
		}
		return n
	default:
		rows, err := killer.QueryContext(ctx, "SELECT id FROM information_schema.processlist WHERE db = DATABASE() AND id <> CONNECTION_ID()")
		if err != nil {
			t.Fatal(err)
		}
		var ids []int64
		for rows.Next() {
			var id int64
			if err := rows.Scan(&id); err != nil {
				t.Fatal(err)
			}
			ids = append(ids, id)
		}
		rows.Close()
		for _, id := range ids {
			_, _ = killer.ExecContext(ctx, fmt.Sprintf("KILL %d", id)) // it may be gone already
		}
		return len(ids)
	}
}

// A mark that fails while batches are in flight behind it (the database
// refused it) leaves nothing in flight through the backoff: the batches
// behind it are settled (marked, as their confirms say) and their claims
// end at once instead of holding rows (here SQLite leases) until the relay
// tries again. Only the batch whose mark failed goes out twice.
func TestForwarder_Run_MarkFailsWithBatchesInFlight_NothingHeldThroughBackoff(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	b := testamqp.New(t)
	queue := b.Queue("t")
	publishN(t, db, b.Exchange, "t", 60)
	reported := make(chan error, 8)
	f := newForwarder(t, db, outbox.ForwarderConfig{
		BatchSize: 10, RetryMin: 5 * time.Second, RetryMax: 5 * time.Second,
		OnError: func(err error, _ outbox.ErrorContext) { reported <- err },
	})
	var calls atomic.Int32
	outbox.SetAfterPublishHook(f, func([]string) error {
		if calls.Add(1) == 1 { // the first mark, with batches sent behind it
			return errors.New("injected: the database refused the marks")
		}
		return nil
	})
	go func() { _ = f.Run(context.Background()) }()
	if err := <-reported; !strings.Contains(err.Error(), "injected") {
		t.Fatalf("first error reported: %v", err)
	}
	leased := func() int {
		var n int
		if err := db.DB.QueryRowContext(context.Background(),
			"SELECT COUNT(*) FROM acemq_outbox WHERE published_at IS NULL AND locked_until IS NOT NULL").Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	waitFor(t, 2*time.Second, "no row claimed while the relay backs off", func() bool { return leased() == 0 })
	waitFor(t, 30*time.Second, "the outbox to drain after the backoff", func() bool { return pendingCount(t, f) == 0 })
	if twice := arrivedTwice(t, b, queue, 60); twice > 10 {
		t.Errorf("%d messages arrived twice: more than the batch whose mark failed (10)", twice)
	}
}

// A broker that stops reading (a memory alarm; here a proxy that stops
// reading what the relay sends, while the broker's heartbeats still come
// through) does not hang the relay, whether it needs an answer (the check of
// an exchange it has not published to yet) or only writes a batch: the
// batch's deadline cuts the connection, the relay reports it, and Close
// returns. Once the broker reads again every row arrives.
func TestForwarder_BrokerStopsReading_RelayDoesNotHang(t *testing.T) {
	for _, newExchange := range []bool{true, false} {
		t.Run(fmt.Sprintf("new_exchange=%v", newExchange), func(t *testing.T) {
			db := migrated(t, testdb.SQLite)
			proxy := testamqp.NewProxy(t)
			a, b := testamqp.New(t), testamqp.New(t)
			qa, qb := a.Queue("t"), b.Queue("t")
			if !newExchange {
				b, qb = a, qa
			}
			reported := make(chan error, 1)
			cfg := outbox.ForwarderConfig{
				PublishTimeout: time.Second, RetryMin: 50 * time.Millisecond, RetryMax: 200 * time.Millisecond,
				OnError: func(err error, _ outbox.ErrorContext) {
					select {
					case reported <- err:
					default:
					}
				},
			}
			f := newForwarder(t, db, cfg, outbox.AMQPConfig{AMQP: amqp.Config{Dial: proxy.Dial}})
			publishN(t, db, a.Exchange, "t", 1)
			go func() { _ = f.Run(context.Background()) }()
			if got := len(a.Drain(qa, 1, 10*time.Second)); got != 1 {
				t.Fatalf("%d messages arrived before the stall, want 1", got)
			}

			proxy.Stall()
			ids := publishN(t, db, b.Exchange, "t", 300) // three batches: the stall may let the first through
			f.Notify()
			select {
			case err := <-reported:
				t.Logf("reported while the broker did not read: %v", err)
			case <-time.After(20 * time.Second):
				proxy.Resume() // so that the relay can be closed
				t.Fatal("the relay reported nothing in 20 s while the broker did not read: it hangs")
			}
			closed := make(chan error, 1)
			go func() { closed <- f.Close() }()
			select {
			case <-closed:
			case <-time.After(20 * time.Second):
				proxy.Resume()
				t.Fatal("Close did not return in 20 s while the broker did not read")
			}

			proxy.Resume()
			cfg.OnError = nil
			sweepAll(t, newForwarder(t, db, cfg))
			if seen := countIDs(b.Drain(qb, len(ids), 30*time.Second)); len(seen) != len(ids) {
				t.Errorf("%d of %d messages arrived after the broker read again", len(seen), len(ids))
			}
		})
	}
}

// A memory alarm of any length makes no row stuck. Under one, RabbitMQ
// accepts connections and blocks each at its first publish
// (connection.blocked) and reads nothing more from it, so every batch's
// publish times out, on a fresh connection each time: the same head record
// lost time after time, which otherwise charges it an attempt after three
// losses in a row and makes it stuck at MaxAttempts. Once the alarm clears,
// every row arrives.
func TestForwarder_BrokerAlarm_NoAttemptCountedNoRowStuck(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	proxy := testamqp.NewProxy(t)
	b := testamqp.New(t)
	queue := b.Queue("t")
	var lastErr atomic.Value
	f := quickLossForwarder(t, db, proxy, func(err error, _ outbox.ErrorContext) { lastErr.Store(err) })
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() { _ = f.Run(ctx) }()
	<-f.Running()

	proxy.Alarm("low on memory")
	ids := publishN(t, db, b.Exchange, "t", 20)
	f.Notify()
	// Past lostRepeats (3) and MaxAttempts (2) losses at the head record.
	waitFor(t, 60*time.Second, "eight connections blocked at their first publish", func() bool { return proxy.Blocked() >= 8 })
	for _, id := range ids {
		if s := stateOf(t, db, id); s.Published || s.Attempts != 0 {
			t.Fatalf("row %s under the alarm: %+v, want unpublished with no attempt counted", id, s)
		}
	}
	if err, _ := lastErr.Load().(error); !errors.Is(err, outbox.ErrBrokerBlocked) || !errors.Is(err, outbox.ErrConnectionLost) {
		t.Errorf("error reported under the alarm: %v, want ErrBrokerBlocked and ErrConnectionLost", err)
	}
	if s := stateOf(t, db, ids[0]); !strings.Contains(s.LastError, "low on memory") {
		t.Errorf("head row's last_error %q does not give the broker's reason", s.LastError)
	}

	proxy.ClearAlarm()
	if seen := countIDs(b.Drain(queue, len(ids), 30*time.Second)); len(seen) != len(ids) {
		t.Errorf("%d of %d messages arrived once the alarm cleared", len(seen), len(ids))
	}
}

// Confirms that stop coming (a quorum queue without its majority, a
// network quiet one way) are the broker's outage: the relay drops the
// connection itself at each timeout, at the same head record, and counted
// there after three in a row as a connection lost at one record, a sound
// record was stuck after 3 + MaxAttempts timeouts (a few minutes at the
// defaults), and the records behind it overtook it. None is charged now,
// and once the confirms come back every record is published, none stuck.
func TestForwarder_ConfirmsStopComing_NoAttemptCountedNoRowStuck(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	proxy := testamqp.NewProxy(t)
	b := testamqp.New(t)
	queue := b.Queue("t")
	var timeouts atomic.Int32
	f := quickLossForwarder(t, db, proxy, func(err error, dest outbox.ErrorContext) {
		if dest.MessageID != "" && errors.Is(err, outbox.ErrConnectionLost) {
			timeouts.Add(1)
		}
	})
	ids := publishN(t, db, b.Exchange, "t", 3)
	proxy.LoseConfirms(true)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- f.Run(ctx) }()
	defer func() { cancel(); <-done }()
	// Past lostRepeats (3) and MaxAttempts (2) timeouts at the head record.
	waitFor(t, 60*time.Second, "eight publishes without a confirm", func() bool { return timeouts.Load() >= 8 })
	for _, id := range ids {
		if s := stateOf(t, db, id); s.Published || s.Attempts != 0 {
			t.Fatalf("row %s without confirms: %+v, want unpublished with no attempt counted", id, s)
		}
	}
	proxy.LoseConfirms(false)
	waitFor(t, 30*time.Second, "every row published once the confirms came back", func() bool {
		for _, id := range ids {
			if !stateOf(t, db, id).Published {
				return false
			}
		}
		return true
	})
	// Each try delivered them (the broker has what it did not confirm):
	// the copies come in the written order, the head first each time.
	got := b.Drain(queue, 0, time.Second)
	if len(got) == 0 || got[0].MessageId != ids[0] {
		t.Errorf("first delivery %v, want the head record %s first", got, ids[0])
	}
	if seen := countIDs(got); len(seen) != len(ids) {
		t.Errorf("%d of %d messages arrived", len(seen), len(ids))
	}
}

// PostgreSQL with idle_in_transaction_session_timeout shorter than a
// batch's publish (a guard DBAs set on a role or a database): the server
// ended the claim's session while its batch was out, releasing the rows'
// locks to any other relay's claim, and the mark failed, so the batch went
// out again. The claim's transaction turns the timeout off for itself.
func TestForwarder_Postgres_IdleInTransactionTimeoutShorterThanAPublish_BatchMarked(t *testing.T) {
	db := migrated(t, testdb.Postgres)
	publishN(t, db, "x", "t", 5)
	pool := sqlx.MustOpen(db.DriverName(), db.DSN+"&idle_in_transaction_session_timeout=300")
	t.Cleanup(func() { _ = pool.Close() })
	f, err := outbox.NewForwarder(pool, slowDest{800 * time.Millisecond}, outbox.ForwarderConfig{DisableListen: true})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	n, err := f.Sweep(context.Background())
	if err != nil || n != 5 {
		t.Fatalf("Sweep = %d, %v; want all 5 marked, the claim's session alive through its publish", n, err)
	}
	if p := pendingCount(t, f); p != 0 {
		t.Errorf("%d rows still pending", p)
	}
}

// slowDest confirms every record after d.
type slowDest struct{ d time.Duration }

func (s slowDest) Publish(ctx context.Context, records []outbox.Record) []error {
	time.Sleep(s.d)
	return make([]error, len(records))
}

// A Sweep whose own context ends while the broker has not yet confirmed
// (a caller that bounds each sweep, as a cron job does) ends with
// ErrConnectionLost at the head record, and it may end so at the same
// record time after time. The caller's deadline says nothing of the
// record: none of those sweeps charges it an attempt, where a connection
// lost at one record that often otherwise does (lostRepeats) and makes
// it stuck at MaxAttempts.
func TestForwarder_Sweep_CallersContextEndsBeforeTheConfirm_NoAttemptCounted(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.SQLite)
	proxy := testamqp.NewProxy(t)
	b := testamqp.New(t)
	queue := b.Queue("t")
	f := newForwarder(t, db, outbox.ForwarderConfig{PublishTimeout: time.Minute, Lease: 3 * time.Minute, MaxAttempts: 2, RetryMin: time.Millisecond, RetryMax: time.Millisecond},
		outbox.AMQPConfig{AMQP: amqp.Config{Dial: proxy.Dial}})
	id := publishN(t, db, b.Exchange, "t", 1)[0]
	proxy.LoseConfirms(true)
	for i := range 8 { // past lostRepeats (3) and MaxAttempts (2)
		ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
		n, err := f.Sweep(ctx)
		cancel()
		if n != 0 || !errors.Is(err, outbox.ErrConnectionLost) {
			t.Fatalf("sweep %d = %d, %v; want nothing published and ErrConnectionLost", i+1, n, err)
		}
	}
	if s := stateOf(t, db, id); s.Published || s.Attempts != 0 {
		t.Fatalf("row after 8 sweeps cut short by their caller: %+v, want unpublished with no attempt counted", s)
	}
	proxy.LoseConfirms(false)
	if n, err := f.Sweep(context.Background()); n != 1 || err != nil {
		t.Fatalf("sweep once the confirms come = %d, %v; want the row published", n, err)
	}
	if got := countIDs(b.Drain(queue, 1, 10*time.Second)); got[id] == 0 {
		t.Fatalf("message %s never arrived", id)
	}
}

// quickLossForwarder is a relay through proxy that loses a publish within
// 300 ms and charges a record its second attempt at most: lostRepeats (3)
// plus MaxAttempts (2) losses at the head record make it stuck, unless
// they count no attempt.
func quickLossForwarder(t *testing.T, db *testdb.DB, proxy *testamqp.Proxy, onError func(error, outbox.ErrorContext)) *outbox.Forwarder {
	t.Helper()
	cfg := outbox.ForwarderConfig{
		PublishTimeout: 300 * time.Millisecond, Lease: 2 * time.Second, MaxAttempts: 2,
		RetryMin: 10 * time.Millisecond, RetryMax: 20 * time.Millisecond,
		OnError: onError,
	}
	return newForwarder(t, db, cfg, outbox.AMQPConfig{AMQP: amqp.Config{Dial: proxy.Dial}})
}
