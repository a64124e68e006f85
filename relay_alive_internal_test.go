package outbox

import (
	"context"
	"os"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/acemq/watermill-outbox/internal/testdb"
)

// stallingDestination's publisher says when a batch reaches it, and returns
// once released.
type stallingPublisher struct {
	reached chan string
	release chan struct{}
}

func (g *stallingPublisher) Publish(_ string, msgs ...*message.Message) error {
	for _, m := range msgs {
		select {
		case g.reached <- m.UUID:
		default:
		}
	}
	<-g.release
	return nil
}
func (g *stallingPublisher) Close() error { return nil }

type countingPublisher struct{ n int }

func (c *countingPublisher) Publish(_ string, msgs ...*message.Message) error {
	c.n += len(msgs)
	return nil
}
func (c *countingPublisher) Close() error { return nil }

// A relay that found a gone relay's file free and then ended its leases,
// in two steps, ended the first leases of that relay started again under
// its RelayID between the two, and deleted its file (a code review): a
// third relay published its rows again. The file stays locked from the
// check until the leases are ended and it is unlinked, and a relay
// starting under that RelayID waits for it.
func TestTakeBack_RelayRestartedUnderItsRelayIDMeanwhile_WaitsItsLeasesKept(t *testing.T) {
	db := testdb.New(t, testdb.SQLite)
	ctx := context.Background()
	if err := Migrate(ctx, db.DB, SQLite); err != nil {
		t.Fatal(err)
	}
	tx, err := db.DB.Begin()
	if err != nil {
		t.Fatal(err)
	}
	p, err := NewTxPublisher(tx, TxPublisherConfig{Dialect: SQLite})
	if err != nil {
		t.Fatal(err)
	}
	if err := p.Publish("t", message.NewMessage(watermill.NewUUID(), []byte("x"))); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	s, err := NewStore(db.DB, StoreConfig{Dialect: SQLite})
	if err != nil {
		t.Fatal(err)
	}
	file, err := s.databaseFile(ctx)
	if err != nil || file == "" {
		t.Fatalf("the database's file: %q, %v", file, err)
	}
	// A killed run of relay "till" left its file, locked by nobody.
	path := aliveFile(file, "till")
	if err := os.WriteFile(path, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	defer os.Remove(path)

	// Another relay finds it free, and holds it while it ends the leases.
	release, gone, err := lockGone(path)
	if err != nil || !gone {
		t.Fatalf("lockGone: %v, %v; want the file of a gone relay", gone, err)
	}
	// till starts again meanwhile: it waits for the file, claiming nothing.
	gate := &stallingPublisher{reached: make(chan string, 1), release: make(chan struct{})}
	till, err := NewForwarder(db.DB, NewPublisherDestination(gate, nil), ForwarderConfig{RelayID: "till"})
	if err != nil {
		t.Fatal(err)
	}
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- till.Run(rctx) }()
	defer func() { close(gate.release); cancel(); <-done; _ = till.Close() }()
	select {
	case id := <-gate.reached:
		t.Fatalf("till claimed and sent %s while another relay held its file to end its leases", id)
	case <-time.After(300 * time.Millisecond): // long enough for a claim, were it not waiting
	}
	end := s.q.EndLeases("till")
	if _, err := db.DB.Exec(end.SQL, end.Args...); err != nil {
		t.Fatal(err)
	}
	release(true)

	var inFlight string
	select {
	case inFlight = <-gate.reached:
	case <-time.After(20 * time.Second):
		t.Fatal("till never claimed once the file was let go")
	}
	if _, gone, err := lockGone(path); err != nil || gone {
		t.Fatalf("lockGone of the running till's file: %v, %v; want it held", gone, err)
	}
	c := &countingPublisher{}
	third, err := NewForwarder(db.DB, NewPublisherDestination(c, nil), ForwarderConfig{RelayID: "third"})
	if err != nil {
		t.Fatal(err)
	}
	defer third.Close()
	if n, _ := third.Sweep(ctx); n > 0 {
		t.Fatalf("%s, in flight at the running till, published again by a third relay", inFlight)
	}
}

// The lock files of relays that ended with no lease in flight (kill -9 at
// almost any moment of a flow, a crash loop): no look for leases removed
// them, and they piled up beside the database, one per relay killed (a
// review: seven after seven kills). A running relay's look removes every
// such file no process holds, and leaves a running relay's.
func TestTakeBack_GoneRelaysFilesWithoutLeases_Removed_RunningRelaysKept(t *testing.T) {
	db := testdb.New(t, testdb.SQLite)
	ctx := context.Background()
	if err := Migrate(ctx, db.DB, SQLite); err != nil {
		t.Fatal(err)
	}
	gone := []string{aliveFile(db.Name, "killed-1"), aliveFile(db.Name, "killed-2")}
	for _, path := range gone {
		if err := os.WriteFile(path, nil, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	running := aliveFile(db.Name, "running")
	release, err := holdFile(running, time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer release()
	f, err := NewForwarder(db.DB, NewPublisherDestination(&countingPublisher{}, nil), ForwarderConfig{Dialect: SQLite, Logger: watermill.NopLogger{}})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.endLeasesOfGone(ctx, db.Name); err != nil {
		t.Fatal(err)
	}
	for _, path := range gone {
		if _, err := os.Stat(path); err == nil {
			t.Errorf("%s, a gone relay's lock file, is still there", path)
		}
	}
	if _, err := os.Stat(running); err != nil {
		t.Errorf("a running relay's lock file: %v", err)
	}
}
