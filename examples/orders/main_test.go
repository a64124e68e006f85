package main

import (
	"regexp"
	"strings"
	"testing"

	"github.com/acemq/watermill-outbox/examples/internal/demo/demotest"
)

// The whole program against the local services, the whole of what a
// service does with the outbox: every order that committed is published
// and fulfilled exactly once, the rejected ones leave neither an order row
// nor an outbox row, each fulfilment's order.fulfilled message, returned by
// its handler behind the inbox, is published through the outbox by the
// relay that runs with the router, and the notification consumer behind
// the at-most-once inbox emails each customer once. SQLite runs with no
// -db at all, the configuration `go run ./examples/orders` has.
func TestOrders_CommittedOrdersFulfilledOnceAnnouncedAndNotified_RejectedLeaveNoRows(t *testing.T) {
	demotest.OnEachDB(t, func(t *testing.T, args []string) {
		stdout := demotest.RunOK(t, prog, run, append(args, "-timeout", "15s")...)
		demotest.WantLines(t, stdout,
			`placed\s+8`,
			`rejected\s+2\s+\(left 0 order rows, 0 outbox rows\)`,
			`published\s+8`,
			`fulfilled\s+8\s+\(each once\)`,
			`announced\s+8\s+\(order\.fulfilled through the outbox\)`,
			`notified\s+8\s+\(at most once\)`,
			`6\s+grinder\s+1\s+89\.00\s+rejected: grinder out of stock`,
			`10\s+grinder\s+1\s+89\.00\s+rejected: grinder out of stock`,
		)
		if n := strings.Count(stdout, "fulfilled once\n"); n != 8 {
			t.Errorf("%d orders fulfilled once, want 8", n)
		}
	})
}

// Without a broker the program says so in one line, with the password
// hidden and the way to start one, and exits 1 before it touches a database.
func TestOrders_NoBroker_OneLineOnStderrExit1(t *testing.T) {
	stdout, stderr, code := demotest.Run(t, prog, run, "-amqp", "amqp://guest:guest@127.0.0.1:1/")
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
