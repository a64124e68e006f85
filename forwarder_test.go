package outbox_test

import (
	"context"
	"errors"
	"math"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jmoiron/sqlx"
	amqp "github.com/rabbitmq/amqp091-go"
	"go.uber.org/goleak"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testamqp"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

func TestForwarder_CommittedRowsArriveWithEveryProperty_RolledBackNever(t *testing.T) {
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		b := testamqp.New(t)
		queue := b.Queue("order.placed")

		msg := message.NewMessage(watermill.NewUUID(), []byte("\xff\x00 binary body"))
		msg.Metadata.Set("tenant", "acme")
		msg.Metadata.Set(outbox.MetadataContentType, "application/x-test")
		publishInTx(t, db, "order.placed", []*message.Message{msg}, outbox.TxPublisherConfig{Exchange: b.Exchange})

		tx, _ := db.Beginx()
		pub, _ := outbox.NewTxPublisher(tx, outbox.TxPublisherConfig{Exchange: b.Exchange})
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
		if d.MessageId != msg.UUID || d.Headers[outbox.HeaderMessageID] != msg.UUID || d.Headers[outbox.HeaderWatermillUUID] != msg.UUID {
			t.Errorf("ids: message_id %q, x-acemq-id %v, watermill uuid %v; want %s", d.MessageId, d.Headers[outbox.HeaderMessageID], d.Headers[outbox.HeaderWatermillUUID], msg.UUID)
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

// Two relays on 5,000 rows: every id published exactly once.
func TestForwarder_TwoRelays_EveryRowPublishedExactlyOnce(t *testing.T) {
	t.Parallel()
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
	t.Parallel()
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

// Lease must be at least 2 × PublishTimeout, which overflowed for a
// PublishTimeout past half of time.Duration's range: the default lease of
// 60 s was taken beside an unbounded publish, and a second relay would
// have published the rows still in flight.
func TestNewForwarder_PublishTimeoutPastHalfTheDurationRange_LeaseRefused(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, testdb.SQLite)
	dest := outbox.NewPublisherDestination(gochannel.NewGoChannel(gochannel.Config{}, nil), nil)
	for _, pt := range []time.Duration{math.MaxInt64, math.MaxInt64/2 + 1} {
		_, err := outbox.NewForwarder(db.DB, dest, outbox.ForwarderConfig{PublishTimeout: pt})
		var cerr *outbox.ConfigError
		if !errors.As(err, &cerr) || cerr.Field != "Lease" {
			t.Errorf("PublishTimeout %s with the default Lease: err = %v, want a *ConfigError naming Lease", pt, err)
		}
	}
	for _, c := range []outbox.ForwarderConfig{
		{PublishTimeout: math.MaxInt64 / 2, Lease: math.MaxInt64 - 1},
		{PublishTimeout: time.Second, Lease: 2 * time.Second},
		// The default Lease grows with PublishTimeout: a PublishTimeout of
		// 45 s alone was refused as longer than half of 60 s.
		{PublishTimeout: 45 * time.Second},
	} {
		f, err := outbox.NewForwarder(db.DB, dest, c)
		if err != nil {
			t.Errorf("PublishTimeout %s, Lease %s (at least twice it): %v", c.PublishTimeout, c.Lease, err)
			continue
		}
		_ = f.Close()
	}
	if _, err := outbox.NewForwarder(db.DB, dest, outbox.ForwarderConfig{PublishTimeout: time.Second, Lease: 2*time.Second - 1}); err == nil {
		t.Error("a Lease 1 ns short of 2 × PublishTimeout was taken")
	}
}

func TestNewForwarder_Config_ErrorsNameTheField(t *testing.T) {
	t.Parallel()
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
	// The backoff marker in locked_by, which a retry clears: a relay of
	// that name would have its claims cleared too.
	if _, err := outbox.NewForwarder(db.DB, dest, outbox.ForwarderConfig{RelayID: "retry-after"}); err == nil {
		t.Error(`RelayID "retry-after" was accepted`)
	}
	if _, err := outbox.NewForwarder(db.DB.DB, dest, outbox.ForwarderConfig{}); err == nil {
		t.Error("a *sql.DB without Dialect was accepted")
	}
	if _, err := outbox.NewAMQPDestination(outbox.AMQPConfig{URLs: []string{"http://nope"}}); err == nil {
		t.Error("a non-AMQP URL was accepted")
	}
}

// A Watermill subscriber (watermill-amqp, default marshaler) receives the
// UUID, metadata and payload given to NewTxPublisher.
func TestForwarder_WatermillAMQPSubscriber_ReceivesSameUUIDMetadataPayload(t *testing.T) {
	t.Parallel()
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
			if got.Metadata.Get(outbox.HeaderMessageID) != sent.UUID {
				t.Errorf("x-acemq-id = %q", got.Metadata.Get(outbox.HeaderMessageID))
			}
		case <-ctx.Done():
			t.Fatal("the subscriber received nothing")
		}
	})
}

// Any Watermill publisher can be the destination, one message at a time.
func TestForwarder_PublisherDestination_DeliversThroughAnyWatermillPublisher(t *testing.T) {
	t.Parallel()
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
			if !want[m.UUID] || m.Metadata.Get(outbox.HeaderMessageID) != m.UUID {
				t.Fatalf("got %s (x-acemq-id %q), want one of %v once", m.UUID, m.Metadata.Get(outbox.HeaderMessageID), ids)
			}
			delete(want, m.UUID)
		}
	})
}

// LastSweep is zero before Run, and a running relay's moves on with every
// poll, with nothing to publish: what a liveness probe reads.
func TestForwarder_LastSweep_MovesOnWhileRunning(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	f := newForwarder(t, db, outbox.ForwarderConfig{PollInterval: 20 * time.Millisecond})
	if !f.LastSweep().IsZero() {
		t.Fatalf("LastSweep before Run: %s, want the zero time", f.LastSweep())
	}
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	go func() { _ = f.Run(ctx) }()
	<-f.Running()
	deadline := time.Now().Add(10 * time.Second)
	for f.LastSweep().IsZero() && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	first := f.LastSweep()
	if first.IsZero() {
		t.Fatal("no sweep ended within 10 s of Run")
	}
	for !f.LastSweep().After(first) && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	if !f.LastSweep().After(first) {
		t.Errorf("LastSweep stayed at %s for 10 s with a poll of 20 ms", first)
	}
}
