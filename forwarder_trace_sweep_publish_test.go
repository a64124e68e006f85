package outbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

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
	log := &traceLogger{LoggerAdapter: watermill.NopLogger{}, msg: "Outbox relay sweep"}
	f, err := outbox.NewForwarder(db.DB, confirmWaitDest{wait}, outbox.ForwarderConfig{Dialect: outbox.SQLite, Logger: log, PollInterval: 20 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	ctx, cancel := context.WithCancel(context.Background())
	ran := make(chan error, 1)
	go func() { ran <- f.Run(ctx) }()
	defer func() { cancel(); <-ran }()
	waitFor(t, 30*time.Second, "the rows published", func() bool { return pendingCount(t, f) == 0 })
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
