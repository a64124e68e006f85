package outbox_test

import (
	"context"
	"slices"
	"sync"
	"testing"
	"time"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testamqp"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// Each unkeyed record that keeps failing holds back the records behind it
// until MaxAttempts makes it stuck, and waits out a backoff of its own:
// RetryMin, doubling. The backoff the first bad record had grown to was
// kept for the next: behind a record to a missing exchange, each later
// one (another event nobody has bound a queue for yet) took RetryMax at
// every attempt, 100 s at the defaults against 33 s for the first, and
// held every record behind it as long (a review measured 4 minutes for
// three such records). A record made stuck now ends the backoff: the next
// sweep goes at once, and the next bad record backs off from RetryMin.
func TestForwarder_Run_BadRecordsInARow_EachBacksOffFromRetryMin(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name  string
		batch int
		amqp  outbox.AMQPConfig
	}{
		{"one_a_batch", 1, outbox.AMQPConfig{}},
		{"pipelined", 0, outbox.AMQPConfig{}},
		{"window_1", 0, outbox.AMQPConfig{Window: 1}}, // each batch through Publish
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			badRecordsInARow(t, tc.batch, tc.amqp)
		})
	}
}

func badRecordsInARow(t *testing.T, batch int, amqpCfg outbox.AMQPConfig) {
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		b := testamqp.New(t)
		queue := b.Queue("ok")
		publishOrdered(t, db, "no-such-exchange-"+testdb.RandomName(), [2]string{"lost-exchange", "ok"})
		publishOrdered(t, db, b.Exchange, [2]string{"unroutable", "nobody.listens"}, [2]string{"good", "ok"})

		const retryMin = time.Millisecond
		var (
			mu    sync.Mutex
			waits []time.Duration
		)
		f := newForwarder(t, db, outbox.ForwarderConfig{
			MaxAttempts: 3, RetryMin: retryMin, RetryMax: time.Hour, PollInterval: time.Hour,
			BatchSize: batch, MaxBatchSize: batch,
		}, amqpCfg)
		outbox.SetBackoffHook(f, func(wait time.Duration) {
			mu.Lock()
			defer mu.Unlock()
			waits = append(waits, wait)
		})
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- f.Run(ctx) }()
		waitFor(t, time.Minute, "the good record published", func() bool { return stateOf(t, db, "good").Published })
		cancel()
		if err := <-done; err != nil {
			t.Fatal(err)
		}
		for _, id := range []string{"lost-exchange", "unroutable"} {
			if s := stateOf(t, db, id); s.Published || s.Attempts != 3 {
				t.Errorf("%s: %+v, want unpublished at 3 attempts (stuck)", id, s)
			}
		}
		mu.Lock()
		defer mu.Unlock()
		// Two backoffs a record: after its first and second attempts; its
		// third makes it stuck, and the relay goes on at once.
		if want := []time.Duration{retryMin, 2 * retryMin, retryMin, 2 * retryMin}; !slices.Equal(waits, want) {
			t.Errorf("backoffs %v, want %v: each bad record from RetryMin, none after a record made stuck", waits, want)
		}
		if seen := countIDs(b.Drain(queue, 1, 5*time.Second)); seen["good"] < 1 {
			t.Errorf("queue received %v, want good", seen)
		}
	})
}
