package outbox_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/go-sql-driver/mysql"
	"github.com/jmoiron/sqlx"
	amqp "github.com/rabbitmq/amqp091-go"
	"go.uber.org/goleak"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testamqp"
	"github.com/acemq/watermill-outbox/internal/testdb"
	"github.com/acemq/watermill-outbox/sqlschema"
)

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
		connects := &countingLogger{LoggerAdapter: watermill.NopLogger{}, match: "Connected to RabbitMQ"}
		name := "outbox-test-relay-" + testdb.RandomName()
		f := newForwarder(t, db, outbox.ForwarderConfig{
			BatchSize: 10, RetryMin: 10 * time.Millisecond, RetryMax: 200 * time.Millisecond,
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

// The database connections of the relay are killed while it drains: it
// reconnects, and every committed row arrives.
func TestForwarder_DatabaseConnectionsKilled_EveryRowArrives(t *testing.T) {
	for _, kind := range []string{testdb.Postgres, testdb.MySQL} {
		t.Run(kind, func(t *testing.T) {
			db := migrated(t, kind)
			b := testamqp.New(t)
			queue := b.Queue("order.placed")
			const n = 1500
			msgs := publishBatch(t, db, b.Exchange, "order.placed", n)

			// The relay has a pool of its own, as its own process would,
			// named on PostgreSQL so that only its connections are killed:
			// other packages' tests share the server.
			relayDSN, appName := db.DSN, "outbox-relay-"+testdb.RandomName()
			if kind == testdb.Postgres {
				relayDSN += "&application_name=" + appName
			}
			relayDB := sqlx.MustOpen(db.DriverName(), relayDSN)
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
				killed += killConnections(t, killer, kind, appName)
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

// An unroutable message (no queue bound for its key) and one to a missing
// exchange each fail alone: attempts and last_error counted, reported with
// their destination, left alone at MaxAttempts and listed as stuck, and the
// other rows flow.
func TestForwarder_UnroutableAndMissingExchange_CountedStuckOthersFlow(t *testing.T) {
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		b := testamqp.New(t)
		queue := b.Queue("ok")
		publishOrdered(t, db, b.Exchange, [2]string{"ok-1", "ok"}, [2]string{"unroutable", "nobody.listens"}, [2]string{"ok-2", "ok"})
		publishOrdered(t, db, "no-such-exchange-"+testdb.RandomName(), [2]string{"lost-exchange", "ok"})
		publishOrdered(t, db, b.Exchange, [2]string{"ok-3", "ok"})

		var reported []outbox.ErrorContext
		const maxAttempts = 3
		f := newForwarder(t, db, outbox.ForwarderConfig{MaxAttempts: maxAttempts})
		for i := 0; i < 3*maxAttempts; i++ {
			_, err := f.Sweep(context.Background())
			var perr *outbox.PublishError
			if errors.As(err, &perr) {
				reported = append(reported, perr.Dest)
			}
		}
		for _, id := range []string{"ok-1", "ok-2", "ok-3"} {
			if s := stateOf(t, db, id); !s.Published {
				t.Errorf("%s not published: %+v", id, s)
			}
		}
		for id, want := range map[string]string{"unroutable": "unroutable", "lost-exchange": "does not exist"} {
			s := stateOf(t, db, id)
			if s.Published || s.Attempts != maxAttempts || !strings.Contains(s.LastError, want) {
				t.Errorf("%s: %+v, want unpublished at %d attempts with last_error about %q", id, s, maxAttempts, want)
			}
		}
		seen := countIDs(b.Drain(queue, 3, 5*time.Second))
		// ok-2 was in flight behind the unroutable one when it came back, so
		// it was sent again after it: at-least-once, never lost.
		if seen["ok-1"] != 1 || seen["ok-2"] < 1 || seen["ok-3"] != 1 || len(seen) != 3 {
			t.Errorf("queue received %v, want ok-1, ok-2, ok-3 and nothing else", seen)
		}
		var gotMissing bool
		for _, r := range reported {
			if r.MessageID == "lost-exchange" && strings.HasPrefix(r.Exchange, "no-such-exchange-") && r.RoutingKey == "ok" {
				gotMissing = true
			}
		}
		if !gotMissing {
			t.Errorf("no error reported the missing exchange with its destination: %+v", reported)
		}

		st, err := f.Store().Stats(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		if st.Stuck != 2 || st.Pending != 0 {
			t.Errorf("stats %+v, want 2 stuck and 0 pending", st)
		}
		stuck, err := f.Store().Stuck(context.Background(), 10)
		if err != nil {
			t.Fatal(err)
		}
		if len(stuck) != 2 || stuck[0].ID != "unroutable" || stuck[1].ID != "lost-exchange" || stuck[0].LastError == "" {
			t.Errorf("stuck = %+v, want unroutable then lost-exchange, with last_error", stuck)
		}

		// Left alone: more sweeps neither publish nor count it.
		if n, err := f.Sweep(context.Background()); n != 0 || err != nil {
			t.Errorf("sweep over stuck rows: %d, %v; want 0, nil", n, err)
		}
		if s := stateOf(t, db, "unroutable"); s.Attempts != maxAttempts {
			t.Errorf("a stuck row was tried again: attempts %d", s.Attempts)
		}

		// An operator binds the queue and retries: it goes.
		b.Bind(queue, "nobody.listens")
		if n, err := f.Store().Retry(context.Background(), "unroutable"); n != 1 || err != nil {
			t.Fatalf("retry: %d, %v", n, err)
		}
		if n, err := f.Sweep(context.Background()); n != 1 || err != nil {
			t.Fatalf("sweep after retry: %d, %v; want 1", n, err)
		}
		if n, err := f.Store().RetryAllStuck(context.Background()); n != 1 || err != nil {
			t.Fatalf("retry all stuck: %d, %v; want 1 (lost-exchange)", n, err)
		}
	})
}

// The rows behind a failing record are not published before it: with
// Window 1 not even sent, with the whole batch in flight not marked (and so
// sent again after it). On its retry the failed record goes alone.
func TestForwarder_FailingRecord_RowsBehindItNotPublishedBeforeIt(t *testing.T) {
	for _, window := range []int{1, 0} {
		t.Run(fmt.Sprintf("window=%d", window), func(t *testing.T) {
			eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
				b := testamqp.New(t)
				queue := b.Queue("ok")
				publishOrdered(t, db, b.Exchange, [2]string{"first", "ok"}, [2]string{"refused", "nobody.listens"}, [2]string{"behind", "ok"})

				f := newForwarder(t, db, outbox.ForwarderConfig{}, outbox.AMQPConfig{Window: window})
				n, err := f.Sweep(context.Background())
				if n != 1 || err == nil {
					t.Fatalf("sweep: %d, %v; want 1 published and the refusal", n, err)
				}
				if s := stateOf(t, db, "behind"); s.Published || s.Attempts != 0 {
					t.Fatalf("the row behind the failure: %+v; want it pending, its attempts untouched", s)
				}
				// Retried while still refused: it goes alone, and the row
				// behind it is not sent past it again.
				before := b.Count(queue)
				if n, err := f.Sweep(context.Background()); n != 0 || err == nil {
					t.Fatalf("second sweep: %d, %v; want nothing published", n, err)
				}
				if got := b.Count(queue); got != before {
					t.Fatalf("the retry let %d messages past the refused record", got-before)
				}
				// Once the failing one goes, the rest follow, in order.
				b.Bind(queue, "nobody.listens")
				sweepAll(t, f)
				var order []string
				for _, d := range b.Drain(queue, 3, 5*time.Second) {
					order = append(order, d.MessageId)
				}
				last := map[string]int{}
				for i, id := range order {
					last[id] = i
				}
				if order[0] != "first" || last["refused"] > last["behind"] || len(last) != 3 {
					t.Errorf("arrival order %v: want first, then refused before the final copy of behind", order)
				}
				if window == 1 && strings.Join(order, ",") != "first,refused,behind" {
					t.Errorf("arrival order %v, want exactly first, refused, behind", order)
				}
			})
		})
	}
}

// After a failed sweep the relay waits RetryMin, doubling up to RetryMax:
// a record that keeps failing is not hammered.
func TestForwarder_Run_FailingRecord_BackoffDoubles(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	testamqp.New(t)
	publishOrdered(t, db, "no-such-exchange-"+testdb.RandomName(), [2]string{"refused", "k"})
	var (
		mu       sync.Mutex
		attempts []time.Time
	)
	f := newForwarder(t, db, outbox.ForwarderConfig{
		MaxAttempts: 5, RetryMin: 50 * time.Millisecond, RetryMax: 400 * time.Millisecond, PollInterval: time.Hour,
		OnError: func(error, outbox.ErrorContext) {
			mu.Lock()
			defer mu.Unlock()
			attempts = append(attempts, time.Now())
		},
	})
	go func() { _ = f.Run(context.Background()) }()
	waitFor(t, 20*time.Second, "five attempts", func() bool { return stateOf(t, db, "refused").Attempts == 5 })
	mu.Lock()
	defer mu.Unlock()
	if len(attempts) != 5 {
		t.Fatalf("%d failures reported, want 5", len(attempts))
	}
	// The gaps are at least 50, 100, 200 and 400 ms: the backoff grows.
	for i, min := range []time.Duration{50, 100, 200, 400} {
		if gap := attempts[i+1].Sub(attempts[i]); gap < min*time.Millisecond {
			t.Errorf("gap %d was %s, want at least %dms", i+1, gap, min)
		}
	}
}

// Rows another library or a person wrote badly (headers that are not a JSON
// object of strings, an unknown body encoding) fail alone and at once, and
// the relay goes on with the rest in the same sweep.
func TestForwarder_PoisonRows_FailAloneStuckAtOnce_RelayGoesOn(t *testing.T) {
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		b := testamqp.New(t)
		queue := b.Queue("ok")
		insertRaw(t, db, "bad-json", b.Exchange, "ok", "{not json", "utf-8")
		insertRaw(t, db, "bad-value", b.Exchange, "ok", `{"retries": 3}`, "utf-8")
		insertRaw(t, db, "bad-encoding", b.Exchange, "ok", `{}`, "rot13")
		insertRaw(t, db, "good", b.Exchange, "ok", `{"k":"v"}`, "utf-8")

		f := newForwarder(t, db, outbox.ForwarderConfig{})
		n, err := f.Sweep(context.Background())
		if n != 1 {
			t.Fatalf("sweep published %d (%v), want the good row in the same sweep", n, err)
		}
		if !outbox.IsPermanent(err) {
			t.Errorf("sweep error %v, want permanent failures", err)
		}
		for id, want := range map[string]string{"bad-json": "headers are not a JSON object", "bad-value": `header "retries"`, "bad-encoding": "body_encoding"} {
			s := stateOf(t, db, id)
			if s.Published || s.Attempts != outbox.DefaultMaxAttempts || !strings.Contains(s.LastError, want) {
				t.Errorf("%s: %+v, want stuck at once with last_error about %q", id, s, want)
			}
		}
		if d := b.Drain(queue, 1, 5*time.Second); len(d) != 1 || d[0].MessageId != "good" || d[0].Headers["k"] != "v" {
			t.Errorf("queue received %d messages, want only the good one", len(d))
		}
	})
}

// Two relays on 5,000 rows: every id published exactly once.
func TestForwarder_TwoRelays_EveryRowPublishedExactlyOnce(t *testing.T) {
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		b := testamqp.New(t)
		queue := b.Queue("order.placed")
		const n = 5000
		publishBatch(t, db, b.Exchange, "order.placed", n)

		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		var relays []*outbox.Forwarder
		done := make(chan error, 2)
		for i := 0; i < 2; i++ {
			// Each relay with a pool of its own, as two processes have.
			pool := sqlx.MustOpen(db.DriverName(), db.DSN)
			t.Cleanup(func() { _ = pool.Close() })
			f := newForwarder(t, &testdb.DB{DB: pool, Kind: db.Kind}, outbox.ForwarderConfig{BatchSize: 50})
			relays = append(relays, f)
			go func() { done <- f.Run(ctx) }()
		}
		waitFor(t, 60*time.Second, "every row published", func() bool { return pendingCount(t, relays[0]) == 0 })
		cancel()
		for range relays {
			if err := <-done; err != nil {
				t.Fatal(err)
			}
		}
		seen := countIDs(b.Drain(queue, n, 10*time.Second))
		dups := 0
		for _, c := range seen {
			if c > 1 {
				dups++
			}
		}
		if len(seen) != n || dups != 0 {
			t.Fatalf("%d distinct ids arrived (want %d), %d of them more than once (want 0)", len(seen), n, dups)
		}
	})
}

// Close during a batch waits for it: the batch in flight is marked, and no
// goroutine of the forwarder survives.
func TestForwarder_CloseDuringBatch_WaitsForItNoGoroutineLeft(t *testing.T) {
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		defer goleak.VerifyNone(t, goleak.IgnoreCurrent(), ignorePools)
		b := testamqp.New(t)
		b.Queue("t")
		ids := publishN(t, db, b.Exchange, "t", 3)

		f := newForwarder(t, db, outbox.ForwarderConfig{})
		inBatch, release := make(chan struct{}), make(chan struct{})
		var once sync.Once
		outbox.SetAfterPublishHook(f, func([]string) error {
			once.Do(func() {
				close(inBatch)
				<-release
			})
			return nil
		})
		go func() { _ = f.Run(context.Background()) }()
		<-inBatch

		closed := make(chan error, 1)
		go func() { closed <- f.Close() }()
		select {
		case err := <-closed:
			t.Fatalf("Close returned (%v) while the batch was in flight", err)
		case <-time.After(200 * time.Millisecond): // long enough for a Close that does not wait to return
		}
		close(release)
		if err := <-closed; err != nil {
			t.Fatal(err)
		}
		for _, id := range ids {
			if !stateOf(t, db, id).Published {
				t.Errorf("%s not marked: Close did not let the batch finish", id)
			}
		}
		if err := f.Close(); err != nil {
			t.Errorf("second Close: %v", err)
		}
		if err := f.Run(context.Background()); !errors.Is(err, outbox.ErrForwarderClosed) {
			t.Errorf("Run after Close: %v, want ErrForwarderClosed", err)
		}
	})
}

// On PostgreSQL the relay wakes at commit through LISTEN/NOTIFY, with no
// poll for an hour.
func TestForwarder_Postgres_ListenNotify_WakesAtCommit(t *testing.T) {
	db := migrated(t, testdb.Postgres)
	b := testamqp.New(t)
	queue := b.Queue("t")
	f := newForwarder(t, db, outbox.ForwarderConfig{PollInterval: time.Hour})
	go func() { _ = f.Run(context.Background()) }()
	<-f.Running()
	// The first sweep ran on start; wait until the listener is in place.
	waitFor(t, 10*time.Second, "LISTEN", func() bool {
		var n int
		_ = db.Get(&n, "SELECT count(*) FROM pg_stat_activity WHERE query = 'LISTEN acemq_outbox' AND datname = current_database()")
		return n > 0
	})
	for i := 0; i < 3; i++ {
		start := time.Now()
		publishN(t, db, b.Exchange, "t", 1)
		if got := b.Drain(queue, 1, 10*time.Second); len(got) != 1 {
			t.Fatalf("message %d did not arrive within 10 s: the relay was not woken by the commit", i)
		}
		t.Logf("commit to broker: %s", time.Since(start))
	}
}

// With a relay in the same process, Notify wakes it without a poll.
func TestForwarder_Notify_WakesRelayInProcess(t *testing.T) {
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		b := testamqp.New(t)
		queue := b.Queue("t")
		f := newForwarder(t, db, outbox.ForwarderConfig{PollInterval: time.Hour, DisableListen: true})
		go func() { _ = f.Run(context.Background()) }()
		<-f.Running()
		publishN(t, db, b.Exchange, "t", 1)
		f.Notify()
		if got := b.Drain(queue, 1, 10*time.Second); len(got) != 1 {
			t.Fatal("Notify did not wake the relay")
		}
	})
}

func TestNewForwarder_Config_ErrorsNameTheField(t *testing.T) {
	db := testdb.New(t, testdb.SQLite)
	dest := outbox.NewPublisherDestination(gochannel.NewGoChannel(gochannel.Config{}, nil), nil)
	cases := map[string]outbox.ForwarderConfig{
		"BatchSize":   {BatchSize: 5000},
		"Lease":       {PublishTimeout: time.Minute, Lease: time.Minute},
		"RetryMin":    {RetryMin: time.Second, RetryMax: time.Millisecond},
		"MaxAttempts": {MaxAttempts: -1},
		"Table":       {Table: "bad-name"},
		"RelayID":     {RelayID: strings.Repeat("r", 65)},
	}
	for field, cfg := range cases {
		_, err := outbox.NewForwarder(db.DB, dest, cfg)
		var cerr *outbox.ConfigError
		if !errors.As(err, &cerr) || cerr.Field != field {
			t.Errorf("%s: err = %v, want a *ConfigError naming it", field, err)
		}
	}
	if _, err := outbox.NewForwarder(db.DB.DB, dest, outbox.ForwarderConfig{}); err == nil {
		t.Error("a *sql.DB without Dialect was accepted")
	}
	if _, err := outbox.NewAMQPDestination(outbox.AMQPConfig{URL: "http://nope"}); err == nil {
		t.Error("a non-AMQP URL was accepted")
	}
}

// A Watermill subscriber (watermill-amqp, default marshaler) receives the
// UUID, metadata and payload given to NewTxPublisher.
func TestForwarder_WatermillAMQPSubscriber_ReceivesSameUUIDMetadataPayload(t *testing.T) {
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		testdb.Require(t, "amqp")
		topic := "wm-" + testdb.RandomName()
		sub, err := wamqp.NewSubscriber(wamqp.NewDurableQueueConfig(testdb.AMQPURL()), watermill.NopLogger{})
		if err != nil {
			t.Fatal(err)
		}
		defer sub.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		msgs, err := sub.Subscribe(ctx, topic) // declares the durable queue
		if err != nil {
			t.Fatal(err)
		}
		defer testamqp.New(t).With(func(ch *amqp.Channel) error { _, err := ch.QueueDelete(topic, false, false, false); return err })

		sent := message.NewMessage(watermill.NewUUID(), []byte("\x00\xffpayload"))
		sent.Metadata.Set("tenant", "acme")
		sent.Metadata.Set("trace", "abc")
		publishInTx(t, db, topic, []*message.Message{sent}) // default exchange, routing key = topic
		f := newForwarder(t, db, outbox.ForwarderConfig{})
		if n := sweepAll(t, f); n != 1 {
			t.Fatalf("published %d", n)
		}
		select {
		case got := <-msgs:
			got.Ack()
			if got.UUID != sent.UUID || string(got.Payload) != string(sent.Payload) {
				t.Errorf("received uuid %q payload %q, want %q %q", got.UUID, got.Payload, sent.UUID, sent.Payload)
			}
			for k, v := range sent.Metadata {
				if got.Metadata.Get(k) != v {
					t.Errorf("metadata %s = %q, want %q", k, got.Metadata.Get(k), v)
				}
			}
			if got.Metadata.Get(outbox.HeaderID) != sent.UUID {
				t.Errorf("x-acemq-id = %q", got.Metadata.Get(outbox.HeaderID))
			}
		case <-ctx.Done():
			t.Fatal("the subscriber received nothing")
		}
	})
}

// Any Watermill publisher can be the destination, one message at a time.
func TestForwarder_PublisherDestination_DeliversThroughAnyWatermillPublisher(t *testing.T) {
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		ch := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 10, Persistent: true}, nil)
		ids := publishN(t, db, "", "orders", 3)
		f, err := outbox.NewForwarder(db.DB, outbox.NewPublisherDestination(ch, nil), outbox.ForwarderConfig{})
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		if n := sweepAll(t, f); n != 3 {
			t.Fatalf("published %d", n)
		}
		out, err := ch.Subscribe(context.Background(), "orders")
		if err != nil {
			t.Fatal(err)
		}
		want := map[string]bool{ids[0]: true, ids[1]: true, ids[2]: true}
		for range ids {
			m := <-out
			m.Ack()
			if !want[m.UUID] || m.Metadata.Get(outbox.HeaderID) != m.UUID {
				t.Fatalf("got %s (x-acemq-id %q), want one of %v once", m.UUID, m.Metadata.Get(outbox.HeaderID), ids)
			}
			delete(want, m.UUID)
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

// Under Run, with batches pipelined: a refused record is counted and left
// stuck, and every other row flows.
func TestForwarder_Run_PipelinedBatchesWithAFailure_OthersFlowFailureStuck(t *testing.T) {
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		b := testamqp.New(t)
		queue := b.Queue("ok")
		var keys [][2]string
		for i := 0; i < 120; i++ {
			rk := "ok"
			if i == 30 {
				rk = "nobody.listens"
			}
			keys = append(keys, [2]string{fmt.Sprintf("m-%03d", i), rk})
		}
		publishOrdered(t, db, b.Exchange, keys...)
		f := newForwarder(t, db, outbox.ForwarderConfig{BatchSize: 10, MaxAttempts: 3, RetryMin: time.Millisecond, RetryMax: 10 * time.Millisecond})
		go func() { _ = f.Run(context.Background()) }()
		waitFor(t, 30*time.Second, "the outbox to drain", func() bool {
			st, err := f.Store().Stats(context.Background())
			return err == nil && st.Pending == 0 && st.Stuck == 1
		})
		if s := stateOf(t, db, "m-030"); s.Attempts != 3 || !strings.Contains(s.LastError, "unroutable") {
			t.Errorf("the refused record: %+v", s)
		}
		seen := countIDs(b.Drain(queue, 119, 10*time.Second))
		if len(seen) != 119 {
			t.Errorf("%d distinct messages arrived, want 119", len(seen))
		}
	})
}

// embeddingDest wraps the AMQP destination by embedding it, as a user adding
// a hook might.
type embeddingDest struct {
	*outbox.AMQPDestination
	calls atomic.Int32
}

func (d *embeddingDest) Publish(ctx context.Context, records []outbox.Record) []error {
	d.calls.Add(1)
	return d.AMQPDestination.Publish(ctx, records)
}

// A destination that embeds AMQPDestination has its own Publish called under
// Run: the relay's pipelining must not go around it.
func TestForwarder_Run_WrapperEmbeddingAMQPDestination_ItsPublishIsCalled(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	b := testamqp.New(t)
	b.Queue("t")
	publishN(t, db, b.Exchange, "t", 3)
	inner, err := outbox.NewAMQPDestination(outbox.AMQPConfig{URL: testdb.AMQPURL()})
	if err != nil {
		t.Fatal(err)
	}
	dest := &embeddingDest{AMQPDestination: inner}
	f, err := outbox.NewForwarder(db.DB, dest, outbox.ForwarderConfig{})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	go func() { _ = f.Run(context.Background()) }()
	waitFor(t, 10*time.Second, "the rows to be published", func() bool { return pendingCount(t, f) == 0 })
	if dest.calls.Load() == 0 {
		t.Fatal("the wrapper's Publish was never called: Run went around it")
	}
}

// A pool capped with SetMaxOpenConns, as a service sharing its pool with the
// relay may set it: the relay takes no more connections at once than it can
// free by itself (LISTEN holds one for good, every batch in flight holds its
// claim's), so it drains instead of waiting on itself for ever.
func TestForwarder_Run_CappedPool_DrainsWithoutWaitingOnItself(t *testing.T) {
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		for _, limit := range []int{1, 2, 3} {
			t.Run(fmt.Sprintf("max_open=%d", limit), func(t *testing.T) {
				b := testamqp.New(t)
				queue := b.Queue("capped")
				ids := make(map[string]bool)
				var msgs []*message.Message
				for i := 0; i < 300; i++ {
					m := message.NewMessage(watermill.NewUUID(), []byte("x"))
					ids[m.UUID] = true
					msgs = append(msgs, m)
				}
				publishInTx(t, db, "capped", msgs, outbox.WithExchange(b.Exchange))

				db.SetMaxOpenConns(limit)
				defer db.SetMaxOpenConns(0)
				f := newForwarder(t, db, outbox.ForwarderConfig{BatchSize: 10})
				ctx, cancel := context.WithCancel(context.Background())
				done := make(chan error, 1)
				go func() { done <- f.Run(ctx) }()
				got := countIDs(b.Drain(queue, len(ids), 30*time.Second))
				cancel()
				if err := <-done; err != nil {
					t.Fatal(err)
				}
				for id := range ids {
					if got[id] == 0 {
						t.Fatalf("%d of %d messages arrived with the pool capped at %d", len(got), len(ids), limit)
					}
				}
			})
		}
	})
}

// On MySQL the pipelined relay claims a batch while the one before is in
// flight. Claims that reached rows by different paths once made a mark wait
// for the relay's own next claim (50 s, innodb_lock_wait_timeout); with the
// timeout at 1 s any such wait fails a mark, which OnError reports. Tables
// made with CREATE TABLE … LIKE and from sqlschema's SQL under another name
// pipeline alike; a table without an index on published_at still drains,
// without overlapping claims.
func TestForwarder_MySQL_PipelinedClaims_NeverWaitOnEachOther(t *testing.T) {
	db := migrated(t, testdb.MySQL)
	migs, err := sqlschema.Migrations("mysql")
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		table   string
		create  []string
		overlap bool
	}{
		{"acemq_outbox", nil, true},
		{"like_outbox", []string{"CREATE TABLE like_outbox LIKE acemq_outbox"}, true},
		{"renamed_outbox", []string{strings.ReplaceAll(migs[0].Up, "acemq_outbox", "renamed_outbox")}, true},
		{"bare_outbox", []string{"CREATE TABLE bare_outbox LIKE acemq_outbox", "ALTER TABLE bare_outbox DROP INDEX acemq_outbox_pending"}, false},
	} {
		t.Run(tc.table, func(t *testing.T) {
			for _, stmt := range tc.create {
				if _, err := db.Exec(stmt); err != nil {
					t.Fatalf("%s: %v", stmt, err)
				}
			}
			cfg, err := mysql.ParseDSN(db.DSN)
			if err != nil {
				t.Fatal(err)
			}
			if cfg.Params == nil {
				cfg.Params = map[string]string{}
			}
			cfg.Params["innodb_lock_wait_timeout"] = "1"
			pool, err := sql.Open("mysql", cfg.FormatDSN())
			if err != nil {
				t.Fatal(err)
			}
			defer pool.Close()
			b := testamqp.New(t)
			queue := b.Queue("pipelined")
			// Rows trickle in one per transaction while the relay runs on a
			// new table: claims meet a few pending rows, where the
			// optimizer's choice of path varies.
			var msgs []*message.Message
			for i := 0; i < 400; i++ {
				msgs = append(msgs, message.NewMessage(watermill.NewUUID(), []byte("x")))
			}

			var errs atomic.Int64
			var firstErr atomic.Value
			dest, err := outbox.NewAMQPDestination(outbox.AMQPConfig{URL: testdb.AMQPURL()})
			if err != nil {
				t.Fatal(err)
			}
			f, err := outbox.NewForwarder(pool, dest, outbox.ForwarderConfig{
				Dialect: outbox.MySQL, Table: tc.table, PollInterval: 5 * time.Millisecond,
				OnError: func(err error, _ outbox.ErrorContext) {
					errs.Add(1)
					firstErr.CompareAndSwap(nil, err.Error())
				},
			})
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan error, 1)
			go func() { done <- f.Run(ctx) }()
			for _, m := range msgs {
				publishInTx(t, db, "pipelined", []*message.Message{m}, outbox.WithExchange(b.Exchange), outbox.WithTable(tc.table))
			}
			got := countIDs(b.Drain(queue, len(msgs), 60*time.Second))
			waitFor(t, 30*time.Second, "every row to be marked", func() bool { return pendingCount(t, f) == 0 })
			cancel()
			if err := <-done; err != nil {
				t.Fatal(err)
			}
			if n := errs.Load(); n > 0 {
				t.Fatalf("the relay reported %d errors; the first: %v", n, firstErr.Load())
			}
			if len(got) != len(msgs) {
				t.Fatalf("%d of %d messages arrived", len(got), len(msgs))
			}
			if overlap := outbox.ClaimsOverlap(f.Store()); overlap != tc.overlap {
				t.Errorf("claims overlap: %v, want %v", overlap, tc.overlap)
			}
		})
	}
}

// Under the pipelined Run, a row the client cannot encode (a header name
// over AMQP's 255 bytes, written by hand or another library) is stuck at
// once, as under Sweep: it is not taken for a lost connection and retried
// for ever. The rows around it arrive.
func TestForwarder_Run_RowTheClientCannotEncode_StuckAtOnce(t *testing.T) {
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		b := testamqp.New(t)
		queue := b.Queue("ok")
		before := publishN(t, db, b.Exchange, "ok", 30)
		insertRaw(t, db, "long-header-name", b.Exchange, "ok", `{"`+strings.Repeat("k", 300)+`":"v"}`, "utf-8")
		after := publishN(t, db, b.Exchange, "ok", 30)

		f := newForwarder(t, db, outbox.ForwarderConfig{BatchSize: 10, RetryMin: 10 * time.Millisecond, RetryMax: 50 * time.Millisecond})
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- f.Run(ctx) }()
		waitFor(t, 30*time.Second, "the row to be stuck and the rest published", func() bool {
			return stateOf(t, db, "long-header-name").Attempts == outbox.DefaultMaxAttempts && pendingCount(t, f) == 0
		})
		cancel()
		if err := <-done; err != nil {
			t.Fatal(err)
		}
		got := countIDs(b.Drain(queue, 60, 10*time.Second))
		if s := stateOf(t, db, "long-header-name"); s.Published || !strings.Contains(s.LastError, "header name of 300 bytes") {
			t.Errorf("row: %+v, want stuck with last_error about the header name", s)
		}
		for _, id := range append(before, after...) {
			if got[id] == 0 {
				t.Fatalf("message %s never arrived (%d of 60)", id, len(got))
			}
		}
	})
}

// Under the pipelined Run, a message over which the broker closes the
// channel (its exchange deleted after the relay checked it) fails its
// record with an attempt counted, and the exchange is checked again: the
// record is stuck after MaxAttempts with "does not exist", never taken for a
// lost connection and retried for ever. (Whether the next batch's connect or
// the wait sees the closed channel first is up to timing; both must count.)
func TestForwarder_Run_ChannelClosedOverARecord_CountedNotLost(t *testing.T) {
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		b := testamqp.New(t)
		queue := b.Queue("ok")
		var lost atomic.Int64
		f := newForwarder(t, db, outbox.ForwarderConfig{
			MaxAttempts: 3, RetryMin: 10 * time.Millisecond, RetryMax: 50 * time.Millisecond, PollInterval: 20 * time.Millisecond,
			OnError: func(err error, _ outbox.ErrorContext) {
				if errors.Is(err, outbox.ErrConnectionLost) {
					lost.Add(1)
				}
			},
		})
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- f.Run(ctx) }()
		first := publishN(t, db, b.Exchange, "ok", 1)
		if got := b.Drain(queue, 1, 10*time.Second); len(got) != 1 || got[0].MessageId != first[0] {
			t.Fatalf("the first message did not arrive: the relay never checked the exchange")
		}
		b.With(func(ch *amqp.Channel) error { return ch.ExchangeDelete(b.Exchange, false, false) })
		doomed := publishN(t, db, b.Exchange, "ok", 1)[0]
		waitFor(t, 30*time.Second, "the record to be stuck", func() bool { return stateOf(t, db, doomed).Attempts == 3 })
		cancel()
		if err := <-done; err != nil {
			t.Fatal(err)
		}
		if s := stateOf(t, db, doomed); s.Published || !strings.Contains(s.LastError, "does not exist") {
			t.Errorf("record: %+v, want stuck with last_error saying the exchange does not exist", s)
		}
		if n := lost.Load(); n > 0 {
			t.Errorf("%d failures were taken for a lost connection; the broker closed the channel over the record", n)
		}
	})
}

// countingConn counts the writes that reach the socket.
type countingConn struct {
	net.Conn
	writes *atomic.Int64
}

func (c countingConn) Write(p []byte) (int, error) {
	c.writes.Add(1)
	return c.Conn.Write(p)
}

// A batch reaches the broker in a few writes, not one per message (the
// client flushes every publish): the broker reads it in a few segments
// instead of handling a hundred. A user's own Dial still dials.
func TestForwarder_BatchReachesTheSocketInAFewWrites(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	b := testamqp.New(t)
	queue := b.Queue("t")
	var writes atomic.Int64
	dial := amqp.DefaultDial(10 * time.Second)
	f := newForwarder(t, db, outbox.ForwarderConfig{BatchSize: 100}, outbox.AMQPConfig{AMQP: amqp.Config{
		Dial: func(network, addr string) (net.Conn, error) {
			c, err := dial(network, addr)
			if err != nil {
				return nil, err
			}
			return countingConn{Conn: c, writes: &writes}, nil
		},
	}})
	publishN(t, db, b.Exchange, "t", 1)
	if n := sweepAll(t, f); n != 1 { // connects, checks the exchange
		t.Fatalf("first sweep published %d", n)
	}
	publishN(t, db, b.Exchange, "t", 100)
	before := writes.Load()
	if n, err := f.Sweep(context.Background()); err != nil || n != 100 {
		t.Fatalf("sweep: %d, %v", n, err)
	}
	if w := writes.Load() - before; w > 5 {
		t.Errorf("a batch of 100 took %d writes to the socket, want a few", w)
	}
	if got := len(b.Drain(queue, 101, 10*time.Second)); got != 101 {
		t.Errorf("%d messages arrived, want 101", got)
	}
}

// A mark that fails while batches are in flight behind it (the database
// refused it) leaves nothing in flight through the backoff: the batches
// behind it are settled, not marked, and their claims end at once instead of
// holding rows (here SQLite leases) until the relay tries again.
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
	if seen := countIDs(b.Drain(queue, 60, 10*time.Second)); len(seen) != 60 {
		t.Errorf("%d distinct messages arrived, want 60", len(seen))
	}
}

// On MySQL the relay's claims and marks are prepared once per connection,
// not prepared, run and closed for every batch (go-sql-driver's way with a
// query that has arguments): a round trip and a parse fewer per statement.
func TestForwarder_MySQL_Run_PreparesItsStatementsOnce(t *testing.T) {
	db := migrated(t, testdb.MySQL)
	b := testamqp.New(t)
	queue := b.Queue("t")
	publishN(t, db, b.Exchange, "t", 100)
	db.DB.SetMaxOpenConns(1) // one session, whose counters the test reads
	prepares := func() int {
		var name string
		var n int
		if err := db.QueryRowx("SHOW SESSION STATUS LIKE 'Com_stmt_prepare'").Scan(&name, &n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	before := prepares()
	f := newForwarder(t, db, outbox.ForwarderConfig{BatchSize: 10})
	ran := make(chan error, 1)
	go func() { ran <- f.Run(context.Background()) }()
	if got := countIDs(b.Drain(queue, 100, 30*time.Second)); len(got) != 100 {
		t.Fatalf("%d distinct messages arrived, want 100", len(got))
	}
	if err := f.Close(); err != nil { // settles every batch
		t.Fatal(err)
	}
	if err := <-ran; err != nil {
		t.Fatal(err)
	}
	// Ten batches and an empty claim: unprepared, 21 prepares or more.
	if n := prepares() - before; n > 8 {
		t.Errorf("the relay prepared %d statements for 10 batches, want each of its few once", n)
	}
	var pending int
	if err := db.QueryRowx("SELECT COUNT(*) FROM acemq_outbox WHERE published_at IS NULL").Scan(&pending); err != nil {
		t.Fatal(err)
	}
	if pending != 0 {
		t.Errorf("%d rows left pending", pending)
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

// Run's start looks the pending index up and prepares the relay's
// statements with a connection from the pool. A Sweep (or any claim) that
// holds the pool's last connection meanwhile goes on, rather than wait on
// Run for the lookup while Run waits on it for the connection.
func TestForwarder_MySQL_RunStartsWhileAClaimHoldsTheLastConnection(t *testing.T) {
	db := migrated(t, testdb.MySQL)
	db.DB.SetMaxOpenConns(1)
	f := newForwarder(t, db, outbox.ForwarderConfig{})
	tx, err := db.DB.BeginTx(context.Background(), &sql.TxOptions{Isolation: sql.LevelReadCommitted})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback() }()
	waits := db.DB.Stats().WaitCount
	go func() { _ = f.Run(context.Background()) }()
	waitFor(t, 10*time.Second, "Run to wait for the pool's connection", func() bool { return db.DB.Stats().WaitCount > waits })

	claimed := make(chan error, 1)
	go func() {
		_, err := outbox.LockedClaim(f.Store(), tx) // the claim's next step: the index lookup
		claimed <- err
	}()
	select {
	case err := <-claimed:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		_ = tx.Rollback() // frees Run, and the test
		t.Fatal("the claim waited on Run's start, which waited on the claim's connection")
	}
	_ = tx.Rollback()
	select {
	case <-f.Running():
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not start once the connection was free")
	}
}

// Prepared statements that stop working (a proxy that does not keep a
// connection's statements, a server out of them) fail one claim; the relay
// then runs its statements unprepared, as it would have without them, and
// every row arrives.
func TestForwarder_MySQL_PreparedStatementsFail_RelayGoesOnUnprepared(t *testing.T) {
	db := migrated(t, testdb.MySQL)
	other := migrated(t, testdb.MySQL)
	b := testamqp.New(t)
	queue := b.Queue("t")
	f := newForwarder(t, db, outbox.ForwarderConfig{BatchSize: 10, RetryMin: 10 * time.Millisecond, RetryMax: 50 * time.Millisecond,
		OnError: func(error, outbox.ErrorContext) {}})
	ids := publishN(t, db, b.Exchange, "t", 5)
	go func() { _ = f.Run(context.Background()) }()
	<-f.Running()
	waitFor(t, 10*time.Second, "the first rows to be published", func() bool { return pendingCount(t, f) == 0 })
	if n, err := outbox.SwapPrepared(f, other.DB.DB); err != nil || n == 0 {
		t.Fatalf("swapped %d prepared statements: %v", n, err)
	}

	ids = append(ids, publishN(t, db, b.Exchange, "t", 30)...)
	f.Notify()
	waitFor(t, 20*time.Second, "the outbox to drain", func() bool { return pendingCount(t, f) == 0 })
	if seen := countIDs(b.Drain(queue, len(ids), 10*time.Second)); len(seen) != len(ids) {
		t.Errorf("%d of %d messages arrived", len(seen), len(ids))
	}
	if n := outbox.Prepared(f); n != 0 {
		t.Errorf("the relay still runs %d statements prepared after they failed", n)
	}
}
