// Package demotest runs an example program in its tests, on the local
// services, once per database.
package demotest

import (
	"bytes"
	"context"
	"regexp"
	"strings"
	"testing"

	"github.com/acemq/watermill-outbox/examples/internal/demo"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// Run runs program, named name, with args; logs what it wrote and how it
// exited, for the test's failure; and returns that.
func Run(t *testing.T, name string, program demo.Program, args ...string) (stdout, stderr string, code int) {
	t.Helper()
	var out, errOut bytes.Buffer
	code = program(context.Background(), args, &out, &errOut)
	t.Logf("%s %s → exit %d\n%s%s", name, strings.Join(args, " "), code, out.String(), errOut.String())
	return out.String(), errOut.String(), code
}

// RunOK is Run for a run that is to succeed: the test fails unless the
// program exits 0 with nothing on stderr. It returns the program's stdout.
func RunOK(t *testing.T, name string, program demo.Program, args ...string) (stdout string) {
	t.Helper()
	stdout, stderr, code := Run(t, name, program, args...)
	if code != 0 {
		t.Fatalf("exit %d, want 0", code)
	}
	if stderr != "" {
		t.Errorf("stderr = %q, want nothing", stderr)
	}
	return stdout
}

// OnEachDB runs test once per kind of database, each a subtest that needs
// RabbitMQ, with the program's arguments for the broker and the database.
// SQLite gets no -db at all: the configuration `go run` has.
func OnEachDB(t *testing.T, test func(t *testing.T, args []string)) {
	for _, kind := range testdb.Kinds {
		t.Run(kind, func(t *testing.T) {
			testdb.Require(t, "amqp")
			args := []string{"-amqp", testdb.AMQPURL()}
			if kind != testdb.SQLite {
				args = append(args, "-db", testdb.New(t, kind).DSN)
			}
			test(t, args)
		})
	}
}

// WantLines fails the test for each of lines, a regular expression, that
// matches no whole line of stdout.
func WantLines(t *testing.T, stdout string, lines ...string) {
	t.Helper()
	for _, line := range lines {
		if !regexp.MustCompile(`(?m)^` + line + `$`).MatchString(stdout) {
			t.Errorf("no line %q in the output", line)
		}
	}
}
