package outbox_test

import (
	"context"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/prometheus/client_golang/prometheus"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testamqp"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// An inbox with MarkOutboxProcessed over a pool capped at one connection
// (PostgreSQL): the message's transaction holds the pool's connection, and
// the first mark looks up the outbox's id type on the pool. It must not
// wait for ever for a connection only it can free.
func TestInbox_Postgres_PoolOfOne_MarkOutboxProcessed_DoesNotWaitOnItself(t *testing.T) {
	db := migrated(t, testdb.Postgres)
	createEffects(t, db)
	b := testamqp.New(t)
	msg := message.NewMessage(watermill.NewUUID(), []byte("x"))
	publishInTx(t, db, "t", []*message.Message{msg}, outbox.TxPublisherConfig{Exchange: b.Exchange})

	db.DB.SetMaxOpenConns(1)
	in := newInbox(t, db, outbox.InboxConfig{MarkOutboxProcessed: true})
	var ran atomic.Int32
	h := in.Middleware(writeEffect(t, db, &ran))

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	delivery := message.NewMessage(msg.UUID, msg.Payload)
	delivery.SetContext(ctx)
	done := make(chan error, 1)
	go func() { _, err := h(delivery); done <- err }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("delivery failed: %v", err)
		}
	case <-time.After(10 * time.Second):
		cancel() // frees the pool's wait, so that the test can clean up
		err := <-done
		t.Fatalf("the delivery hung for 10 s on a pool of one connection (MarkOutboxProcessed); after its context was cancelled it returned %v", err)
	}
	if !recordProcessed(t, db, msg.UUID) {
		t.Errorf("record %s not marked processed", msg.UUID)
	}
}

// A relay and an inbox with MarkOutboxProcessed sharing one capped pool
// (PostgreSQL without LISTEN, MySQL: a pool of two, one batch in flight). The
// consumer receives a message of the batch in flight before the relay marks
// it (the relay marks a batch after claiming the next), and its
// transaction's mark of processed_at waits for the relay's row lock. The
// relay must not then wait for a connection to claim its next batch before
// it marks the one in flight: that connection is the inbox's, which waits
// for the relay.
//
// With Metrics, the relay's reading of the gauges' figures at the top of a
// sweep waited for a connection the same way (a pool of three: two
// batches in flight, the inbox's connection).
func TestForwarder_RelayAndInboxShareACappedPool_InboxWaitingForABatchInFlight_NoDeadlock(t *testing.T) {
	for _, kind := range []string{testdb.Postgres, testdb.MySQL} {
		t.Run(kind, func(t *testing.T) { relayAndInboxOnACappedPool(t, kind, 2, outbox.ForwarderConfig{}) })
	}
	t.Run("postgres, metrics", func(t *testing.T) {
		m, err := outbox.NewMetrics(prometheus.NewRegistry())
		if err != nil {
			t.Fatal(err)
		}
		relayAndInboxOnACappedPool(t, testdb.Postgres, 3, outbox.ForwarderConfig{Metrics: m, StatsInterval: time.Millisecond})
	})
}

// relayAndInboxOnACappedPool drains 20 rows with a relay (cfg, batches of
// 10) and an inbox that share a pool capped at limit, the inbox's delivery
// of the first batch's first message waiting for its row lock while the
// relay claims the next batch.
func relayAndInboxOnACappedPool(t *testing.T, kind string, limit int, cfg outbox.ForwarderConfig) {
	db := migrated(t, kind)
	createEffects(t, db)
	b := testamqp.New(t)
	queue := b.Queue("t")
	msgs := publishBatch(t, db, b.Exchange, "t", 20)

	pool, appName := ownRelayPool(t, db)
	pool.SetMaxOpenConns(limit)
	shared := &testdb.DB{DB: pool, Kind: db.Kind, DSN: db.DSN, Name: db.Name}

	in := newInbox(t, shared, outbox.InboxConfig{MarkOutboxProcessed: true})
	var ran atomic.Int32
	h := in.Middleware(writeEffect(t, shared, &ran))
	// A first delivery of a message from elsewhere, so that the inbox's
	// look-up of the outbox's id type is done (see the test above).
	if _, err := h(message.NewMessage(watermill.NewUUID(), []byte("warm-up"))); err != nil {
		t.Fatal(err)
	}

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	inboxDone := make(chan error, 1)
	var started atomic.Bool
	dest := newHookedDest(t)
	dest.beforeConnect = func(sent, _ int32) error {
		if sent != 1 || !started.CompareAndSwap(false, true) {
			return nil
		}
		// The first batch is in flight, its confirms in: the consumer has
		// its first message.
		delivery := message.NewMessage(msgs[0].UUID, msgs[0].Payload)
		delivery.SetContext(ctx)
		go func() { _, err := h(delivery); inboxDone <- err }()
		deadline := time.Now().Add(10 * time.Second)
		for {
			var n int
			q, args := "SELECT COUNT(*) FROM pg_stat_activity WHERE application_name = $1 AND wait_event_type = 'Lock'", []any{appName}
			if kind == testdb.MySQL {
				q, args = "SELECT COUNT(*) FROM information_schema.processlist WHERE db = DATABASE() AND state = 'Updating' AND info LIKE 'UPDATE `acemq_outbox`%processed_at%'", nil
			}
			if err := db.Get(&n, q, args...); err != nil {
				t.Error(err)
				return nil
			}
			if n > 0 {
				return nil
			}
			if time.Now().After(deadline) {
				var procs []string
				_ = db.Select(&procs, "SELECT CONCAT(id, ' ', command, ' ', COALESCE(state, ''), ' ', COALESCE(info, '')) FROM information_schema.processlist WHERE db = DATABASE()")
				t.Errorf("the inbox never waited for the relay's row lock; sessions: %q", procs)
				return nil
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	cfg.BatchSize, cfg.MaxBatchSize, cfg.DisableListen = 10, 10, true
	f, err := outbox.NewForwarder(pool, dest, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	runCtx, stop := context.WithCancel(context.Background())
	runDone := make(chan error, 1)
	go func() { runDone <- f.Run(runCtx) }()

	pending := func() int { return countPending(t, db) }
	deadline := time.Now().Add(15 * time.Second)
	for pending() > 0 && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
	}
	left := pending()
	if left > 0 {
		cancel() // the inbox's wait ends, its connection goes back, and the relay goes on
	}
	var inboxErr error
	select {
	case inboxErr = <-inboxDone:
	case <-time.After(10 * time.Second):
		t.Error("the inbox's delivery never returned")
	}
	if left > 0 {
		deadline := time.Now().Add(10 * time.Second)
		for pending() > 0 && time.Now().Before(deadline) {
			time.Sleep(50 * time.Millisecond)
		}
		after := pending()
		stop()
		<-runDone
		t.Fatalf("deadlock: %d of 20 rows still pending after 15 s; the inbox's delivery (waiting for the relay's row lock) returned, once cancelled: %v; "+
			"10 s after that cancel, %d rows pending", left, inboxErr, after)
	}
	stop()
	<-runDone
	if inboxErr != nil {
		t.Fatalf("inbox: %v", inboxErr)
	}
	b.Drain(queue, 20, 10*time.Second)
}

// A relay alone on a pool capped far above what it needs, to a database
// whose connections take 80 ms to open (a remote server: TCP, TLS,
// SCRAM). The short wait for a connection that a claim with batches in
// flight allows itself (see the test above) cut the dial of a new one
// short: every such claim failed though the pool was idle, the dial was
// wasted, and the relay never had two batches in flight (41 dials and
// 2.3 s against 4 and 0.6 s uncapped). It pipelines as uncapped now.
func TestForwarder_CappedPoolSlowToConnect_RelayStillPipelines(t *testing.T) {
	db := migrated(t, testdb.Postgres)
	b := testamqp.New(t)
	queue := b.Queue("t")
	const n = 400
	publishBatch(t, db, b.Exchange, "t", n)

	drain := func(maxOpen int) (dials, inFlight int32) {
		cfg, err := pgx.ParseConfig(db.DSN)
		if err != nil {
			t.Fatal(err)
		}
		var dialed atomic.Int32
		cfg.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
			dialed.Add(1)
			select {
			case <-time.After(80 * time.Millisecond):
			case <-ctx.Done():
				return nil, ctx.Err()
			}
			return (&net.Dialer{}).DialContext(ctx, network, addr)
		}
		pool := stdlib.OpenDB(*cfg)
		defer pool.Close()
		pool.SetMaxOpenConns(maxOpen)
		var peak atomic.Int32
		dest := newHookedDest(t)
		dest.beforeConnect = func(sent, waited int32) error {
			if d := sent - waited; d > peak.Load() {
				peak.Store(d)
			}
			return nil
		}
		f, err := outbox.NewForwarder(pool, dest, outbox.ForwarderConfig{Dialect: outbox.Postgres, BatchSize: 10, MaxBatchSize: 10, DisableListen: true})
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- f.Run(ctx) }()
		waitFor(t, 60*time.Second, "the drain", func() bool { return countPending(t, db) == 0 })
		cancel()
		<-done
		b.Drain(queue, n, 10*time.Second)
		return dialed.Load(), peak.Load()
	}
	dials, peak := drain(10)
	if _, err := db.Exec("UPDATE acemq_outbox SET published_at = NULL"); err != nil {
		t.Fatal(err)
	}
	udials, upeak := drain(0)
	t.Logf("capped at 10: %d dials, %d batches in flight at most; uncapped: %d, %d", dials, peak, udials, upeak)
	if peak < upeak || dials > udials+2 {
		t.Errorf("capped at 10, an idle pool: %d batch(es) in flight at most and %d dials, against %d and %d uncapped", peak, dials, upeak, udials)
	}
}

// countPending counts db's unpublished rows, on a connection of db's pool,
// not the relay's.
func countPending(t testing.TB, db *testdb.DB) int {
	t.Helper()
	var n int
	if err := db.Get(&n, "SELECT COUNT(*) FROM acemq_outbox WHERE published_at IS NULL"); err != nil {
		t.Fatal(err)
	}
	return n
}
