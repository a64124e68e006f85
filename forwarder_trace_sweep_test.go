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

		log := &traceLogger{LoggerAdapter: watermill.NopLogger{}, msg: "Outbox relay sweep"}
		dest, err := outbox.NewAMQPDestination(outbox.AMQPConfig{URLs: []string{testdb.AMQPURL()}})
		if err != nil {
			t.Fatal(err)
		}
		f, err := outbox.NewForwarder(db.DB, dest, outbox.ForwarderConfig{Dialect: d, BatchSize: 40, Logger: log, PollInterval: 20 * time.Millisecond})
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		ctx, cancel := context.WithCancel(context.Background())
		ran := make(chan error, 1)
		go func() { ran <- f.Run(ctx) }()
		defer func() { cancel(); <-ran }()
		waitFor(t, 30*time.Second, "the rows published", func() bool { return pendingCount(t, f) == 0 })
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
