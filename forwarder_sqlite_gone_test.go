package outbox_test

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// leasedRelayProcess runs a relay over the SQLite file OUTBOX_RELAY_DSN
// names, with an hour's lease, whose destination never returns: it prints
// "claimed" once it holds rows under its lease, and then waits to be
// killed. Reaching the end is a failure (exit 3).
func leasedRelayProcess() int {
	db, err := sqlx.Open("sqlite3", os.Getenv("OUTBOX_RELAY_DSN"))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	f, err := outbox.NewForwarder(db, outbox.NewPublisherDestination(stalledPublisher{}, nil), outbox.ForwarderConfig{
		PublishTimeout: time.Hour, Lease: 4 * time.Hour, RelayID: os.Getenv("OUTBOX_RELAY_ID"),
	})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	err = f.Run(context.Background())
	fmt.Fprintf(os.Stderr, "relay process ended: %v\n", err)
	return 3
}

// stalledPublisher says, once, that a batch reached it, and never returns.
type stalledPublisher struct{}

func (stalledPublisher) Publish(string, ...*message.Message) error {
	fmt.Println("claimed")
	select {}
}
func (stalledPublisher) Close() error { return nil }

// startLeasedRelay starts leasedRelayProcess over db and returns once it
// holds rows under its lease; kill kills it with SIGKILL and waits for it.
func startLeasedRelay(t *testing.T, db *testdb.DB, relayID string) (kill func()) {
	t.Helper()
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), "OUTBOX_LEASED_RELAY_PROCESS=1", "OUTBOX_RELAY_DSN="+db.DSN, "OUTBOX_RELAY_ID="+relayID)
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	killed := false
	kill = func() {
		if !killed {
			killed = true
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
		}
	}
	t.Cleanup(kill)
	line, err := bufio.NewReader(out).ReadString('\n')
	if strings.TrimSpace(line) != "claimed" {
		t.Fatalf("relay process: %q, %v; want it to say it claimed", line, err)
	}
	return kill
}

// On SQLite a claim is a lease, and a relay killed with rows in flight
// left them, and their keys, for the rest of its lease (60 s by default):
// a restarted in-process relay runs under a new RelayID, and a user
// review's edge till had 205 rows late by up to 60 s after each power
// cut. A running relay holds a lock beside the database that the operating
// system lets go when its process dies, and other relays take the leases
// of a relay whose lock is free, but not those of one that runs, nor those
// of a relay that holds no such lock (another library's). A relay whose
// RelayID is set by hand takes back its former run's leases.
func TestForwarder_SQLiteRelayKilledWithRowsInFlight_TakenBackNotAtItsLeasesEnd(t *testing.T) {
	for _, when := range []string{"started after the kill", "running beside it", "started again under its RelayID"} {
		t.Run(when, func(t *testing.T) {
			db := migrated(t, testdb.SQLite)
			ids := publishN(t, db, "", "payment.captured", 20)
			relayID := ""
			if when == "started again under its RelayID" {
				relayID = "till-relay"
			}
			kill := startLeasedRelay(t, db, relayID)
			leased := 0
			if err := db.Get(&leased, "SELECT COUNT(*) FROM acemq_outbox WHERE published_at IS NULL AND locked_by IS NOT NULL"); err != nil || leased == 0 {
				t.Fatalf("%d rows under the killed relay's lease (%v), want some", leased, err)
			}
			if when != "running beside it" {
				kill()
			}
			// Another library's relay's lease: no lock to tell, left alone.
			foreign := publishN(t, db, "", "payment.captured", 1)[0]
			if _, err := db.Exec("UPDATE acemq_outbox SET locked_by = 'rails-relay', locked_until = ? WHERE id = ?", time.Now().Add(time.Hour).UTC().Format("2006-01-02 15:04:05.000000"), foreign); err != nil {
				t.Fatal(err)
			}

			got := &slowCapture{}
			f, err := outbox.NewForwarder(db.DB, outbox.NewPublisherDestination(got, nil), outbox.ForwarderConfig{RelayID: relayID})
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan error, 1)
			go func() { done <- f.Run(ctx) }()
			defer func() {
				cancel()
				if err := <-done; err != nil && !errors.Is(err, context.Canceled) {
					t.Errorf("run: %v", err)
				}
			}()
			if when == "running beside it" {
				// Not taken from a relay that runs: its rows are in flight.
				time.Sleep(1500 * time.Millisecond) // long past the relay's first look (at its start)
				if n := len(got.got()); n > len(ids)-leased {
					t.Fatalf("the relay published %d rows, %d of them under the lease of a relay that runs", n, n-(len(ids)-leased))
				}
				kill()
			}
			start := time.Now()
			waitFor(t, 20*time.Second, "the killed relay's rows published", func() bool { return len(got.got()) >= len(ids) })
			t.Logf("%d rows leased for an hour taken back and published %s after the kill", leased, time.Since(start).Round(time.Millisecond))
			if stateOf(t, db, foreign).Published || slices.Contains(got.got(), foreign) {
				t.Errorf("the row under another library's relay's lease was published")
			}
		})
	}
}

// gatePublisher signals when a publish reaches it and returns once released.
type gatePublisher struct {
	reached chan struct{}
	release chan struct{}
}

func (g *gatePublisher) Publish(string, ...*message.Message) error {
	select {
	case g.reached <- struct{}{}:
	default:
	}
	<-g.release
	return nil
}
func (g *gatePublisher) Close() error { return nil }

// Sweep runs beside Run ("a request that wants its message on the broker
// before it answers"), and Run's start on SQLite ends the leases of its
// own RelayID, a former run's: it ended those of a Sweep of the same
// Forwarder in flight, and another relay published its row again (a code
// review). The start waits for the Sweep.
func TestForwarder_SQLiteRunStartedBesideASweep_SweepsLeasesKept(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	ids := publishN(t, db, "", "payment.captured", 1)

	gate := &gatePublisher{reached: make(chan struct{}, 1), release: make(chan struct{})}
	f1, err := outbox.NewForwarder(db.DB, outbox.NewPublisherDestination(gate, nil), outbox.ForwarderConfig{RelayID: "relay-a"})
	if err != nil {
		t.Fatal(err)
	}
	sweepDone := make(chan struct{})
	go func() {
		defer close(sweepDone)
		_, _ = f1.Sweep(context.Background())
	}()
	select {
	case <-gate.reached:
	case <-time.After(10 * time.Second):
		t.Fatal("Sweep never published")
	}
	var leased int
	if err := db.Get(&leased, "SELECT COUNT(*) FROM acemq_outbox WHERE locked_by = 'relay-a'"); err != nil || leased != 1 {
		t.Fatalf("leased %d (%v), want the Sweep's row under its lease", leased, err)
	}

	ctx, cancel := context.WithCancel(context.Background())
	runDone := make(chan error, 1)
	go func() { runDone <- f1.Run(ctx) }()
	defer func() {
		close(gate.release)
		<-sweepDone
		cancel()
		<-runDone
		_ = f1.Close()
	}()

	// Run's start ends the lease of the Sweep in flight.
	deadline := time.Now().Add(time.Second)
	for time.Now().Before(deadline) {
		_ = db.Get(&leased, "SELECT COUNT(*) FROM acemq_outbox WHERE locked_by = 'relay-a'")
		if leased == 0 {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}

	// Another relay now claims the row the Sweep is still publishing.
	got := &slowCapture{}
	f2, err := outbox.NewForwarder(db.DB, outbox.NewPublisherDestination(got, nil), outbox.ForwarderConfig{RelayID: "relay-b"})
	if err != nil {
		t.Fatal(err)
	}
	defer f2.Close()
	n, _ := f2.Sweep(context.Background())
	if n > 0 {
		t.Fatalf("double publish: row %s is in flight in f1's Sweep and another relay published it again (%v)", ids[0], got.got())
	}
}
