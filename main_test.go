package outbox_test

import (
	"context"
	"flag"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"syscall"
	"testing"

	"github.com/jmoiron/sqlx"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// TestMain doubles as a relay process that a test can kill for real: with
// OUTBOX_RELAY_PROCESS set, the test binary runs one sweep of a forwarder and
// SIGKILLs itself in the window the test names, instead of running tests.
// With OUTBOX_INBOX_PROCESS set it is a consumer behind an at-most-once
// inbox that dies in its handler (inboxProcess); with
// OUTBOX_QUIET_RELAY_PROCESS, a relay that runs until it is killed
// (quietRelayProcess).
func TestMain(m *testing.M) {
	if os.Getenv("OUTBOX_RELAY_PROCESS") != "" {
		os.Exit(relayProcess())
	}
	if os.Getenv("OUTBOX_INBOX_PROCESS") != "" {
		os.Exit(inboxProcess())
	}
	if os.Getenv("OUTBOX_LEASED_RELAY_PROCESS") != "" {
		os.Exit(leasedRelayProcess())
	}
	if os.Getenv("OUTBOX_QUIET_RELAY_PROCESS") != "" {
		os.Exit(quietRelayProcess())
	}
	flag.Parse()
	if w := os.Getenv("OUTBOX_TEST_CLAIM_WINDOW"); w != "" {
		// Every claim windowed, so narrowly that the relay's tests run
		// through claims beyond their windows (see the CI's keyed run).
		n, err := strconv.Atoi(w)
		if err != nil || n < 1 {
			fmt.Fprintf(os.Stderr, "OUTBOX_TEST_CLAIM_WINDOW=%q: want a number of entries, 1 or more\n", w)
			os.Exit(2)
		}
		outbox.SetEveryClaimWindow(n)
	}
	raiseParallel()
	os.Exit(m.Run())
}

// raiseParallel runs up to four of the tests that call t.Parallel at once
// where -parallel's default (GOMAXPROCS) is lower and the command line does
// not set it. They wait on the databases and the broker far more than on
// the CPU (the package used about half a core of two), so two at a time
// left the CI machine idle for much of its budget. The tests that measure
// time, count goroutines or share state stay serial and never run beside
// them; -parallel on the command line still decides.
func raiseParallel() {
	set := false
	flag.Visit(func(f *flag.Flag) { set = set || f.Name == "test.parallel" })
	if !set {
		_ = flag.Set("test.parallel", strconv.Itoa(max(runtime.GOMAXPROCS(0), 4)))
	}
}

// relayProcess sweeps once and dies by SIGKILL between the broker's confirms
// and the marks. Reaching the end is a failure (exit 3).
func relayProcess() int {
	f, err := processRelay(killableRelayConfig)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	outbox.SetAfterPublishHook(f, func(published []string) error {
		if len(published) > 0 {
			_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
			select {} // the signal is on its way
		}
		return nil
	})
	n, err := f.Sweep(context.Background())
	fmt.Fprintf(os.Stderr, "relay process survived its sweep: %d published, %v\n", n, err)
	return 3
}

// processRelay is the relay of a relay process: over the pool the test
// named (OUTBOX_RELAY_DRIVER, OUTBOX_RELAY_DSN), to the test broker.
func processRelay(cfg outbox.ForwarderConfig) (*outbox.Forwarder, error) {
	db, err := sqlx.Open(os.Getenv("OUTBOX_RELAY_DRIVER"), os.Getenv("OUTBOX_RELAY_DSN"))
	if err != nil {
		return nil, err
	}
	dest, err := outbox.NewAMQPDestination(outbox.AMQPConfig{URLs: []string{testdb.AMQPURL()}})
	if err != nil {
		return nil, err
	}
	return outbox.NewForwarder(db, dest, cfg)
}
