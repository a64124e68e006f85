package main

import (
	"bytes"
	"context"
	"regexp"
	"strings"
	"testing"

	"github.com/acemq/watermill-outbox/internal/testdb"
)

func runOrders(t *testing.T, args ...string) (stdout, stderr string, code int) {
	t.Helper()
	var out, errOut bytes.Buffer
	code = run(context.Background(), args, &out, &errOut)
	t.Logf("examples/orders %s → exit %d\n%s%s", strings.Join(args, " "), code, out.String(), errOut.String())
	return out.String(), errOut.String(), code
}

// The whole program against the local services: every order that
// committed is published and fulfilled exactly once, and the rejected ones
// leave neither an order row nor an outbox row. SQLite runs with no -db at
// all, the configuration `go run ./examples/orders` has.
func TestOrders_CommittedOrdersFulfilledOnce_RejectedLeaveNoRows(t *testing.T) {
	for _, kind := range testdb.Kinds {
		t.Run(kind, func(t *testing.T) {
			testdb.Require(t, "amqp")
			args := []string{"-amqp", testdb.AMQPURL(), "-timeout", "15s"}
			if kind != testdb.SQLite {
				args = append(args, "-db", testdb.New(t, kind).DSN)
			}
			stdout, stderr, code := runOrders(t, args...)
			if code != 0 {
				t.Fatalf("exit %d, want 0", code)
			}
			if stderr != "" {
				t.Errorf("stderr = %q, want nothing", stderr)
			}
			for _, line := range []string{
				`placed\s+8`,
				`rejected\s+2\s+\(left 0 order rows, 0 outbox rows\)`,
				`published\s+8`,
				`fulfilled\s+8\s+\(each once\)`,
				`6\s+grinder\s+1\s+89\.00\s+rejected: grinder out of stock`,
				`10\s+grinder\s+1\s+89\.00\s+rejected: grinder out of stock`,
			} {
				if !regexp.MustCompile(`(?m)^` + line + `$`).MatchString(stdout) {
					t.Errorf("no line %q in the output", line)
				}
			}
			if n := strings.Count(stdout, "fulfilled once\n"); n != 8 {
				t.Errorf("%d orders fulfilled once, want 8", n)
			}
		})
	}
}

// Without a broker the program says so in one line, with the password
// hidden and the way to start one, and exits 1 before it touches a database.
func TestOrders_NoBroker_OneLineOnStderrExit1(t *testing.T) {
	stdout, stderr, code := runOrders(t, "-amqp", "amqp://guest:guest@127.0.0.1:1/")
	if code != 1 {
		t.Errorf("exit %d, want 1", code)
	}
	if stdout != "" {
		t.Errorf("stdout = %q, want nothing", stdout)
	}
	want := regexp.MustCompile(`^examples/orders: no RabbitMQ at amqp://guest:\*\*\*@127\.0\.0\.1:1/ \(.*connection refused\); start one with: docker compose up -d rabbitmq\n$`)
	if !want.MatchString(stderr) {
		t.Errorf("stderr = %q, want one line matching %s", stderr, want)
	}
}
