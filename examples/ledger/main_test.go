package main

import (
	"context"
	"os"
	"testing"

	"github.com/acemq/watermill-outbox/examples/internal/demo/demotest"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// TestMain lets this test binary play the relay: -kill-relay runs the
// program's own executable with -role relay, and under go test that
// executable is this binary.
func TestMain(m *testing.M) {
	if len(os.Args) > 1 && os.Args[1] == "-role" {
		os.Exit(run(context.Background(), os.Args[1:], os.Stdout, os.Stderr))
	}
	os.Exit(m.Run())
}

// The relay is killed (SIGKILL, a real process) after the broker confirmed
// its messages and before it marked them: the rows stay pending, a second
// relay publishes them again, every capture is delivered twice, and the
// inbox keeps the ledger to one entry per capture.
func TestLedger_RelayKilledAfterConfirm_PublishedTwiceOneEntryPerCapture(t *testing.T) {
	demotest.OnEachDB(t, func(t *testing.T, args []string) {
		stdout := demotest.RunOK(t, prog, run, append(args, "-kill-relay", "-timeout", "10s")...)
		demotest.WantLines(t, stdout,
			`relay 1 \(child process \d+\): the broker confirmed 5 messages, then the relay died \(signal: killed\) before marking them published`,
			`outbox: 5 of them still pending, while the ledger consumer has received all 5 from the broker`,
			`captures\s+5`,
			`published by relay 1\s+5\s+\(confirmed, never marked\)`,
			`published by relay 2\s+5`,
			`deliveries\s+10`,
			`duplicates absorbed\s+5`,
			`processed_messages\s+5`,
			`ledger entries\s+5\s+\(5 of 5 captures with exactly one\)`,
		)
	})
}

// With one relay that lives, each capture is delivered once and nothing is
// absorbed.
func TestLedger_NoKill_OneDeliveryAndOneEntryPerCapture(t *testing.T) {
	testdb.Require(t, "amqp")
	stdout := demotest.RunOK(t, prog, run, "-amqp", testdb.AMQPURL(), "-timeout", "10s")
	demotest.WantLines(t, stdout,
		`published\s+5`,
		`deliveries\s+5`,
		`duplicates absorbed\s+0`,
		`ledger entries\s+5\s+\(5 of 5 captures with exactly one\)`,
	)
}
