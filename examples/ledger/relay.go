package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/examples/internal/demo"
)

// watchConfirms is a relay's destination, RabbitMQ, with a look at what the
// broker confirmed: after the publish returns and before the Forwarder marks
// a single row, it hands confirmed the ids whose result is nil.
//
// It holds the AMQPDestination as a field rather than embedding it: an
// embedded *AMQPDestination would bring along the unexported methods the
// Forwarder's Run uses to pipeline its batches, and Run would publish
// through them without ever calling this Publish.
type watchConfirms struct {
	dest      *outbox.AMQPDestination
	confirmed func(ids []string)
}

func (w *watchConfirms) Publish(ctx context.Context, records []outbox.Record) []error {
	results := w.dest.Publish(ctx, records)
	var ids []string
	for i, err := range results {
		if err == nil {
			ids = append(ids, records[i].ID)
		}
	}
	if len(ids) > 0 {
		w.confirmed(ids)
	}
	return results
}

// Connect lets the Forwarder hold off claiming while the broker is down.
func (w *watchConfirms) Connect(ctx context.Context) error { return w.dest.Connect(ctx) }

// Close is called by Forwarder.Close.
func (w *watchConfirms) Close() error { return w.dest.Close() }

// confirmed collects the ids a relay's broker confirmed.
type confirmed struct {
	mu  sync.Mutex
	ids []string
}

func (c *confirmed) add(ids []string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.ids = append(c.ids, ids...)
}

// ours is the confirmed ids among ids, each once.
func (c *confirmed) ours(ids []string) []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return intersect(c.ids, ids)
}

// runKilledRelay is the child process of -kill-relay: an ordinary Forwarder
// whose destination, once the broker has confirmed a batch, writes the ids
// to stdout and kills this process with SIGKILL, before the Forwarder can
// mark them published. No deferred function, no Close, nothing runs after.
func runKilledRelay(ctx context.Context, dsn, amqpURL string, timeout time.Duration, stdout io.Writer, logger watermill.LoggerAdapter) error {
	if dsn == "" {
		return fmt.Errorf("-db is required with -role relay")
	}
	db, err := demo.OpenDB(ctx, dsn, "")
	if err != nil {
		return err
	}
	defer db.Close()
	dieAfterConfirm := func(ids []string) {
		for _, id := range ids {
			fmt.Fprintln(stdout, id)
		}
		self, err := os.FindProcess(os.Getpid())
		if err == nil {
			err = self.Kill() // SIGKILL on Unix, TerminateProcess on Windows
		}
		panic(fmt.Sprintf("relay 1 could not kill itself: %v", err))
	}
	svc := &demo.Service{Name: prog, DB: db, AMQPURL: amqpURL, Log: logger}
	fwd, err := svc.NewRelay(demo.Relay{
		Name: "relay 1",
		Wrap: func(dest *outbox.AMQPDestination) outbox.Destination {
			return &watchConfirms{dest: dest, confirmed: dieAfterConfirm}
		},
		Config: outbox.ForwarderConfig{PublishTimeout: killedRelayPublishTimeout, Lease: killedRelayLease},
	})
	if err != nil {
		return err
	}
	defer fwd.Close()
	// Bounded, so that a relay whose parent is gone does not relay for ever.
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	if err := fwd.Run(ctx); err != nil {
		return err
	}
	return fmt.Errorf("nothing confirmed within %s", timeout)
}
