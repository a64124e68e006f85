package outbox_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"
	amqp "github.com/rabbitmq/amqp091-go"
	"go.uber.org/goleak"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testamqp"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// newForwarder returns a forwarder over db to the test broker, closed when
// the test ends.
func newForwarder(t testing.TB, db *testdb.DB, cfg outbox.ForwarderConfig, amqpCfg ...outbox.AMQPConfig) *outbox.Forwarder {
	t.Helper()
	ac := outbox.AMQPConfig{}
	if len(amqpCfg) > 0 {
		ac = amqpCfg[0]
	}
	ac.URL = testdb.AMQPURL()
	dest, err := outbox.NewAMQPDestination(ac)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Logger == nil {
		cfg.Logger = watermill.NewStdLogger(os.Getenv("OUTBOX_TEST_DEBUG") != "", false)
	}
	f, err := outbox.NewForwarder(db.DB, dest, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := f.Close(); err != nil {
			t.Errorf("close forwarder: %v", err)
		}
	})
	return f
}

// publishN commits n messages on topic, one transaction each, and returns
// their ids in order.
func publishN(t testing.TB, db *testdb.DB, exchange, topic string, n int) []string {
	t.Helper()
	ids := make([]string, n)
	for i := range ids {
		msg := message.NewMessage(watermill.NewUUID(), []byte(fmt.Sprintf(`{"n":%d}`, i)))
		ids[i] = msg.UUID
		publishInTx(t, db, topic, []*message.Message{msg}, outbox.WithExchange(exchange))
	}
	return ids
}

// sweepAll sweeps until a sweep publishes nothing, and returns the total.
func sweepAll(t testing.TB, f *outbox.Forwarder) int {
	t.Helper()
	total := 0
	for {
		n, err := f.Sweep(context.Background())
		total += n
		if err != nil {
			t.Fatalf("sweep: %v", err)
		}
		if n == 0 {
			return total
		}
	}
}

type rowState struct {
	Published bool
	Attempts  int
	LastError string
}

func stateOf(t testing.TB, db *testdb.DB, id string) rowState {
	t.Helper()
	var r struct {
		Published bool    `db:"published"`
		Attempts  int     `db:"attempts"`
		LastError *string `db:"last_error"`
	}
	q := "SELECT published_at IS NOT NULL AS published, attempts, last_error FROM acemq_outbox WHERE id = " + placeholder(db, 1)
	if err := db.Get(&r, q, id); err != nil {
		t.Fatalf("row %s: %v", id, err)
	}
	s := rowState{Published: r.Published, Attempts: r.Attempts}
	if r.LastError != nil {
		s.LastError = *r.LastError
	}
	return s
}

func TestForwarder_CommittedRowsArriveWithEveryProperty_RolledBackNever(t *testing.T) {
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		b := testamqp.New(t)
		queue := b.Queue("order.placed")

		msg := message.NewMessage(watermill.NewUUID(), []byte("\xff\x00 binary body"))
		msg.Metadata.Set("tenant", "acme")
		msg.Metadata.Set(outbox.MetadataContentType, "application/x-test")
		publishInTx(t, db, "order.placed", []*message.Message{msg}, outbox.WithExchange(b.Exchange))

		tx, _ := db.Beginx()
		pub, _ := outbox.NewTxPublisher(tx, outbox.WithExchange(b.Exchange))
		if err := pub.Publish("order.placed", message.NewMessage("rolled-back", []byte("no"))); err != nil {
			t.Fatal(err)
		}
		_ = tx.Rollback()

		f := newForwarder(t, db, outbox.ForwarderConfig{})
		if n := sweepAll(t, f); n != 1 {
			t.Fatalf("published %d, want 1", n)
		}
		got := b.Drain(queue, 1, 5*time.Second)
		if len(got) != 1 {
			t.Fatalf("queue received %d messages, want 1 (the rolled-back one must never arrive)", len(got))
		}
		d := got[0]
		if string(d.Body) != "\xff\x00 binary body" {
			t.Errorf("body = %q", d.Body)
		}
		if d.MessageId != msg.UUID || d.Headers[outbox.HeaderID] != msg.UUID || d.Headers[outbox.WatermillUUIDHeader] != msg.UUID {
			t.Errorf("ids: message_id %q, x-acemq-id %v, watermill uuid %v; want %s", d.MessageId, d.Headers[outbox.HeaderID], d.Headers[outbox.WatermillUUIDHeader], msg.UUID)
		}
		if d.Headers["tenant"] != "acme" || d.ContentType != "application/x-test" {
			t.Errorf("headers %v, content type %q", d.Headers, d.ContentType)
		}
		if d.DeliveryMode != 2 {
			t.Errorf("delivery mode %d, want persistent (2)", d.DeliveryMode)
		}
		if d.Exchange != b.Exchange || d.RoutingKey != "order.placed" {
			t.Errorf("arrived via %q/%q", d.Exchange, d.RoutingKey)
		}
		if d.Timestamp.IsZero() || time.Since(d.Timestamp) > time.Minute {
			t.Errorf("timestamp %v, want the row's created_at", d.Timestamp)
		}
		if s := stateOf(t, db, msg.UUID); !s.Published || s.Attempts != 0 {
			t.Errorf("row state %+v, want published with 0 attempts", s)
		}
	})
}

// waitFor polls cond until it holds or the deadline passes.
func waitFor(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", timeout, what)
		}
		time.Sleep(20 * time.Millisecond) // polling a condition, with a deadline
	}
}

// pendingCount is the forwarder's backlog; -1 while the database refuses
// (its connections being killed under it, say).
func pendingCount(t testing.TB, f *outbox.Forwarder) int64 {
	t.Helper()
	st, err := f.Store().Stats(context.Background())
	if err != nil {
		t.Logf("stats: %v", err)
		return -1
	}
	return st.Pending
}

// ignorePools ignores the goroutines database/sql drivers keep per pooled
// connection: the pool owns them, not the code under test.
var ignorePools = goleak.IgnoreTopFunction("github.com/go-sql-driver/mysql.(*mysqlConn).startWatcher.func1")

// countIDs counts deliveries per x-acemq-id.
func countIDs(ds []amqp.Delivery) map[string]int {
	m := map[string]int{}
	for _, d := range ds {
		m[d.MessageId]++
	}
	return m
}

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
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		defer goleak.VerifyNone(t, goleak.IgnoreCurrent(), ignorePools)
		b := testamqp.New(t)
		queue := b.Queue("order.placed")
		const n = 1500
		var msgs []*message.Message
		for i := 0; i < n; i++ {
			msgs = append(msgs, message.NewMessage(watermill.NewUUID(), []byte("x")))
		}
		publishInTx(t, db, "order.placed", msgs, outbox.WithExchange(b.Exchange))

		// Window 1 keeps a message in flight nearly all the time, so the
		// close lands mid-batch.
		var brokerErrors atomic.Int32
		f := newForwarder(t, db, outbox.ForwarderConfig{
			BatchSize: 10, RetryMin: 10 * time.Millisecond, RetryMax: 200 * time.Millisecond,
			OnError: func(err error, _ outbox.ErrorContext) { brokerErrors.Add(1) },
		}, outbox.AMQPConfig{Window: 1})
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- f.Run(ctx) }()
		<-f.Running()

		waitFor(t, 30*time.Second, "the relay to be under way", func() bool { p := pendingCount(t, f); return p >= 0 && p < n })
		testamqp.CloseAllConnections(t)
		if pendingCount(t, f) == 0 {
			t.Fatal("the relay finished before the broker closed its connection: the test proved nothing")
		}
		waitFor(t, 60*time.Second, "every row to be published", func() bool { return pendingCount(t, f) == 0 })
		cancel()
		if err := <-done; err != nil {
			t.Fatal(err)
		}
		if err := f.Close(); err != nil {
			t.Fatal(err)
		}
		if brokerErrors.Load() == 0 {
			t.Fatal("the relay saw no failure: the close did not reach it mid-stream")
		}
		seen := countIDs(b.Drain(queue, n, 10*time.Second))
		for _, m := range msgs {
			if seen[m.UUID] == 0 {
				t.Fatalf("message %s never arrived (%d of %d distinct arrived)", m.UUID, len(seen), n)
			}
		}
	})
}

// The database connections of the relay are killed while it drains: it
// reconnects, and every committed row arrives.
func TestForwarder_DatabaseConnectionsKilled_EveryRowArrives(t *testing.T) {
	for _, kind := range []string{testdb.Postgres, testdb.MySQL} {
		t.Run(kind, func(t *testing.T) {
			db := testdb.New(t, kind)
			if err := outbox.Migrate(context.Background(), db.DB.DB, dialectOf(t, db)); err != nil {
				t.Fatal(err)
			}
			b := testamqp.New(t)
			queue := b.Queue("order.placed")
			const n = 1500
			var msgs []*message.Message
			for i := 0; i < n; i++ {
				msgs = append(msgs, message.NewMessage(watermill.NewUUID(), []byte("x")))
			}
			publishInTx(t, db, "order.placed", msgs, outbox.WithExchange(b.Exchange))

			// The relay has a pool of its own, as its own process would.
			relayDB := sqlx.MustOpen(db.DriverName(), db.DSN)
			defer relayDB.Close()
			relay := &testdb.DB{DB: relayDB, Kind: kind, DSN: db.DSN}
			f := newForwarder(t, relay, outbox.ForwarderConfig{BatchSize: 50, RetryMin: 10 * time.Millisecond, RetryMax: 200 * time.Millisecond})
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			done := make(chan error, 1)
			go func() { done <- f.Run(ctx) }()
			<-f.Running()

			killer, err := db.Conn(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			defer killer.Close()
			killed := 0
			for round := 0; round < 3; round++ {
				var before int64
				waitFor(t, 30*time.Second, "the database to answer", func() bool { before = pendingCount(t, f); return before >= 0 })
				if before == 0 {
					break
				}
				waitFor(t, 30*time.Second, "progress", func() bool { p := pendingCount(t, f); return p >= 0 && p < before })
				killed += killConnections(t, killer, kind)
			}
			waitFor(t, 60*time.Second, "every row to be published", func() bool { return pendingCount(t, f) == 0 })
			cancel()
			if err := <-done; err != nil {
				t.Fatal(err)
			}
			if killed == 0 {
				t.Fatal("killed no connection: the test proved nothing")
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

// killConnections kills every other connection to the test's database, as a
// failover or a DBA would, and returns how many.
func killConnections(t testing.TB, killer *sql.Conn, kind string) int {
	t.Helper()
	ctx := context.Background()
	var q string
	switch kind {
	case testdb.Postgres:
		q = "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid() AND backend_type = 'client backend'"
		rows, err := killer.QueryContext(ctx, q)
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
