package outbox_test

import (
	"context"
	"errors"
	"testing"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// A second Run while the first runs is ErrForwarderInUse, not
// ErrForwarderClosed: a supervisor that takes ErrForwarderClosed for a
// clean stop took a second start for one (an API review). After the first
// returned, Run is ErrForwarderClosed: a Forwarder runs once.
func TestForwarder_RunWhileRunning_InUse_RunAfterItReturned_Closed(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	f := newForwarder(t, db, outbox.ForwarderConfig{})
	ctx, cancel := context.WithCancel(context.Background())
	first := make(chan error, 1)
	go func() { first <- f.Run(ctx) }()
	<-f.Running()
	if err := f.Run(context.Background()); !errors.Is(err, outbox.ErrForwarderInUse) || errors.Is(err, outbox.ErrForwarderClosed) {
		t.Errorf("Run while a Run runs: %v, want ErrForwarderInUse", err)
	}
	cancel()
	if err := <-first; err != nil {
		t.Fatalf("first Run: %v", err)
	}
	if err := f.Run(context.Background()); !errors.Is(err, outbox.ErrForwarderClosed) || errors.Is(err, outbox.ErrForwarderInUse) {
		t.Errorf("Run after a Run returned: %v, want ErrForwarderClosed", err)
	}
}
