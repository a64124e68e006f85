package outbox_test

import (
	"context"
	"fmt"
	"net"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testamqp"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// Under Run, with batches pipelined: a refused record is counted and left
// stuck, and every other row flows.
func TestForwarder_Run_PipelinedBatchesWithAFailure_OthersFlowFailureStuck(t *testing.T) {
	t.Parallel()
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
	t.Parallel()
	db := migrated(t, testdb.SQLite)
	b := testamqp.New(t)
	b.Queue("t")
	publishN(t, db, b.Exchange, "t", 3)
	inner, err := outbox.NewAMQPDestination(outbox.AMQPConfig{URLs: []string{testdb.AMQPURL()}})
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
	t.Parallel()
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
				publishInTx(t, db, "capped", msgs, outbox.TxPublisherConfig{Exchange: b.Exchange})

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
