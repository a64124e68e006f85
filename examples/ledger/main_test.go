package main

import (
	"bytes"
	"context"
	"os"
	"regexp"
	"strings"
	"testing"

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

func runLedger(t *testing.T, args ...string) (stdout, stderr string, code int) {
	t.Helper()
	var out, errOut bytes.Buffer
	code = run(context.Background(), args, &out, &errOut)
	t.Logf("examples/ledger %s → exit %d\n%s%s", strings.Join(args, " "), code, out.String(), errOut.String())
	return out.String(), errOut.String(), code
}

func wantLines(t *testing.T, stdout string, lines ...string) {
	t.Helper()
	for _, line := range lines {
		if !regexp.MustCompile(`(?m)^` + line + `$`).MatchString(stdout) {
			t.Errorf("no line %q in the output", line)
		}
	}
}

// The relay is killed (SIGKILL, a real process) after the broker confirmed
// its messages and before it marked them: the rows stay pending, a second
// relay publishes them again, every capture is delivered twice, and the
// inbox keeps the ledger to one entry per capture.
func TestLedger_RelayKilledAfterConfirm_PublishedTwiceOneEntryPerCapture(t *testing.T) {
	for _, kind := range testdb.Kinds {
		t.Run(kind, func(t *testing.T) {
			testdb.Require(t, "amqp")
			args := []string{"-kill-relay", "-amqp", testdb.AMQPURL(), "-timeout", "10s"}
			if kind != testdb.SQLite {
				args = append(args, "-db", testdb.New(t, kind).DSN)
			}
			stdout, stderr, code := runLedger(t, args...)
			if code != 0 {
				t.Fatalf("exit %d, want 0", code)
			}
			if stderr != "" {
				t.Errorf("stderr = %q, want nothing", stderr)
			}
			wantLines(t, stdout,
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
}

// With one relay that lives, each capture is delivered once and nothing is
// absorbed.
func TestLedger_NoKill_OneDeliveryAndOneEntryPerCapture(t *testing.T) {
	testdb.Require(t, "amqp")
	stdout, stderr, code := runLedger(t, "-amqp", testdb.AMQPURL(), "-timeout", "10s")
	if code != 0 {
		t.Fatalf("exit %d, want 0", code)
	}
	if stderr != "" {
		t.Errorf("stderr = %q, want nothing", stderr)
	}
	wantLines(t, stdout,
		`published\s+5`,
		`deliveries\s+5`,
		`duplicates absorbed\s+0`,
		`ledger entries\s+5\s+\(5 of 5 captures with exactly one\)`,
	)
}
