package outbox_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testamqp"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// traceLogger keeps the relay's Trace lines of one message.
type traceLogger struct {
	watermill.LoggerAdapter
	msg   string
	mu    sync.Mutex
	lines []watermill.LogFields
}

func (l *traceLogger) Trace(msg string, fields watermill.LogFields) {
	if msg != l.msg {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	l.lines = append(l.lines, fields)
}

func (l *traceLogger) With(watermill.LogFields) watermill.LoggerAdapter { return l }

func (l *traceLogger) taken() []watermill.LogFields {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]watermill.LogFields(nil), l.lines...)
}

// A drain says at Trace, sweep by sweep, what each claimed and settled and
// where its time went (the claim, the look at what a keyed claim passed
// over, the wait for confirms and the send, the marks): what a user
// finds a drain slower than the broker takes by, without a patched build.
// Every row claimed once, every claimed batch settled, no line for the
// idle polls after.
func TestForwarder_TraceLog_SaysEachSweepsRowsAndTimes(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, d outbox.Dialect) {
		broker := testamqp.New(t)
		queue := broker.Queue("rk")
		const n, keys = 300, 10
		msgs := make([]*message.Message, n)
		for i := range msgs {
			msgs[i] = message.NewMessage(watermill.NewUUID(), []byte("x"))
			if i%2 == 0 { // keyed and unkeyed records mixed
				msgs[i].Metadata.Set(outbox.MetadataAggregateID, fmt.Sprintf("k%d", i%keys))
			}
		}
		publishInTx(t, db, "rk", msgs, outbox.TxPublisherConfig{Exchange: broker.Exchange})

		dest, err := outbox.NewAMQPDestination(outbox.AMQPConfig{URLs: []string{testdb.AMQPURL()}})
		if err != nil {
			t.Fatal(err)
		}
		log := drainTraced(t, db, dest, outbox.ForwarderConfig{Dialect: d, BatchSize: 40})
		if got := broker.Drain(queue, n, 10*time.Second); len(got) != n {
			t.Fatalf("queue received %d messages, want %d", len(got), n)
		}

		lines := log.taken()
		claimed, claims, settled := 0, 0, 0
		for _, l := range lines {
			c, _ := l["claimed"].(int)
			s, _ := l["settled_batches"].(int)
			if c == 0 && s == 0 {
				t.Errorf("a sweep that claimed and settled nothing logged: %v", l)
			}
			if c > l["asked"].(int) {
				t.Errorf("a sweep claimed more than it asked for: %v", l)
			}
			for _, k := range []string{"claim_ms", "look_ms", "send_ms", "settle_ms", "publish_ms"} {
				if v, ok := l[k].(float64); !ok || v < 0 {
					t.Errorf("%s = %v in %v; want a duration in ms", k, l[k], l)
				}
			}
			if c > 0 {
				claims++
				if l["claim_ms"].(float64) == 0 {
					t.Errorf("a claim of %d rows took no time: %v", c, l)
				}
			}
			claimed += c
			settled += s
		}
		if claimed != n || claims < n/40 {
			t.Errorf("the sweeps logged %d rows claimed in %d claims; want %d in at least %d", claimed, claims, n, n/40)
		}
		// Each batch claimed is settled once, in a later sweep (pipelined)
		// or in its own (published outside the pipeline).
		if settled != claims {
			t.Errorf("the sweeps logged %d batches settled of %d claimed", settled, claims)
		}
		before := len(lines)
		time.Sleep(200 * time.Millisecond) // ten idle polls
		if after := len(log.taken()); after != before {
			t.Errorf("idle polls logged %d sweep lines; want none", after-before)
		}
	})
}

// drainTraced runs a Forwarder of cfg into dest, its Trace sweep lines
// kept (PollInterval 20 ms), until no row of db is pending; the relay runs
// on until the test ends.
func drainTraced(t *testing.T, db *testdb.DB, dest outbox.Destination, cfg outbox.ForwarderConfig) *traceLogger {
	t.Helper()
	log := &traceLogger{LoggerAdapter: watermill.NopLogger{}, msg: "Outbox relay sweep"}
	cfg.Logger, cfg.PollInterval = log, 20*time.Millisecond
	f, err := outbox.NewForwarder(db.DB, dest, cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	ran := make(chan error, 1)
	go func() { ran <- f.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-ran; _ = f.Close() })
	waitFor(t, 30*time.Second, "the rows published", func() bool { return pendingCount(t, f) == 0 })
	return log
}

// confirmWaitDest is a Destination without a pipeline whose broker takes wait to
// confirm a batch.
type confirmWaitDest struct{ wait time.Duration }

func (d confirmWaitDest) Publish(_ context.Context, recs []outbox.Record) []error {
	time.Sleep(d.wait)
	return make([]error, len(recs))
}

// The README: send_ms is "the wait for confirms before the next batch goes
// out, and its send", settle_ms "the marks and COMMIT", and a drain whose
// claim_ms and settle_ms fill the sweep waits for the database. A relay
// whose batches go through Publish (a Destination without a pipeline, an
// AMQPDestination with a Window, a pool too small to pipeline) publishes in
// the settle phase. Its send, confirms and marks are publish_ms, not
// settle_ms, and the batch counts as settled.
func TestForwarder_TraceLog_UnpipelinedBatch_BrokerWaitNotInSettle(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.SQLite)
	publishN(t, db, "x", "rk", 5)
	const wait = 300 * time.Millisecond
	log := drainTraced(t, db, confirmWaitDest{wait}, outbox.ForwarderConfig{Dialect: outbox.SQLite})
	time.Sleep(100 * time.Millisecond)

	lines := log.taken()
	if len(lines) == 0 {
		t.Fatal("no sweep line")
	}
	for _, l := range lines {
		if l["claimed"].(int) == 0 {
			continue
		}
		if l["settled_batches"].(int) == 0 {
			t.Errorf("a sweep that published and marked its batch says settled_batches 0: %v", l)
		}
		if p, _ := l["publish_ms"].(float64); p < float64(wait.Milliseconds()) {
			t.Errorf("publish_ms %v for a batch whose publish waited %s: %v", l["publish_ms"], wait, l)
		}
		if l["settle_ms"].(float64) >= float64(wait.Milliseconds()) {
			t.Errorf("the broker's %s wait counted as settle_ms (the marks and COMMIT, per the README), send_ms %v: %v", wait, l["send_ms"], l)
		}
	}
}
