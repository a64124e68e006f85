package outboxctl

import (
	"bytes"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// TestMain doubles as the outboxctl binary: with OUTBOXCTL_RUN_MAIN=1 the
// test binary runs Main with its arguments instead of the tests, so that a
// test can start the relay as a process of its own and signal it, without
// building anything.
func TestMain(m *testing.M) {
	if os.Getenv("OUTBOXCTL_RUN_MAIN") == "1" {
		os.Exit(Main(os.Args[1:], os.Getenv, os.Stdout, os.Stderr))
	}
	os.Exit(m.Run())
}

// result is one in-process run of the command line.
type result struct {
	code           int
	stdout, stderr string
}

// ctl runs outboxctl in-process with args and an environment of its own (so
// the developer's OUTBOX_DB never leaks in).
func ctl(t *testing.T, env map[string]string, args ...string) result {
	t.Helper()
	var stdout, stderr bytes.Buffer
	code := Main(args, func(k string) string { return env[k] }, &stdout, &stderr)
	return result{code, stdout.String(), stderr.String()}
}

// mustCtl runs outboxctl and fails the test unless it exits 0.
func mustCtl(t *testing.T, args ...string) string {
	t.Helper()
	r := ctl(t, nil, args...)
	if r.code != 0 {
		t.Fatalf("outboxctl %s: exit %d\nstdout: %s\nstderr: %s", strings.Join(args, " "), r.code, r.stdout, r.stderr)
	}
	return r.stdout
}

// ctlMissing runs outboxctl show or retry given ids of which missing are
// not in acemq_outbox: it must print what it found and exit 1 saying so.
func ctlMissing(t *testing.T, missing int, args ...string) string {
	t.Helper()
	r := ctl(t, nil, args...)
	is := "are"
	if missing == 1 {
		is = "is"
	}
	r.wantFailure(t, 1, fmt.Sprintf(": %d of the ", missing))
	if !strings.Contains(r.stderr, " ids given "+is+" not in acemq_outbox") {
		t.Errorf("stderr does not say the ids are not in acemq_outbox:\n%s", r.stderr)
	}
	return r.stdout
}

// wantFailure checks an exit code and that stderr is one line holding want.
func (r result) wantFailure(t *testing.T, code int, want string) {
	t.Helper()
	if r.code != code {
		t.Errorf("exit code %d, want %d\nstdout: %s\nstderr: %s", r.code, code, r.stdout, r.stderr)
	}
	if !strings.Contains(r.stderr, want) {
		t.Errorf("stderr does not say %q:\n%s", want, r.stderr)
	}
	if n := strings.Count(r.stderr, "\n"); n != 1 {
		t.Errorf("stderr has %d lines, want one:\n%s", n, r.stderr)
	}
}

// migrated is an isolated database of kind with the schema applied by
// outboxctl migrate.
func migrated(t *testing.T, kind string) *testdb.DB {
	t.Helper()
	db := testdb.New(t, kind)
	mustCtl(t, "migrate", "--db", db.DSN)
	return db
}

// publish commits n messages through the library's TxPublisher, to the
// default exchange with routingKey, and returns their ids in order.
func publish(t *testing.T, db *testdb.DB, n int, routingKey string) []string {
	t.Helper()
	return publishOf(t, db, n, routingKey, "")
}

// publishOf is publish of messages with the ordering key key ("" none),
// numbered 1..n where keyed.
func publishOf(t *testing.T, db *testdb.DB, n int, routingKey, key string) []string {
	t.Helper()
	tx, err := db.Beginx()
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback() }()
	pub, err := outbox.NewTxPublisher(tx)
	if err != nil {
		t.Fatal(err)
	}
	ids := make([]string, n)
	msgs := make([]*message.Message, n)
	for i := range msgs {
		ids[i] = watermill.NewUUID()
		msgs[i] = message.NewMessage(ids[i], []byte(fmt.Sprintf(`{"n":%d}`, i)))
		if key != "" {
			msgs[i].Metadata.Set(outbox.MetadataAggregateID, key)
		}
	}
	if err := pub.Publish(routingKey, msgs...); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	return ids
}

// ts is a timestamp as the library stores it, written here independently
// of the code under test.
func ts(kind string, t time.Time) any {
	if kind == testdb.Postgres {
		return t
	}
	return t.UTC().Format("2006-01-02 15:04:05.000000")
}

// execSQL runs a statement written with ? placeholders.
func execSQL(t *testing.T, db *testdb.DB, query string, args ...any) {
	t.Helper()
	if _, err := db.Exec(db.Rebind(query), args...); err != nil {
		t.Fatalf("%s: %v", query, err)
	}
}

// count runs a COUNT(*) query written with ? placeholders.
func count(t *testing.T, db *testdb.DB, query string, args ...any) int {
	t.Helper()
	var n int
	if err := db.QueryRow(db.Rebind(query), args...).Scan(&n); err != nil {
		t.Fatalf("%s: %v", query, err)
	}
	return n
}

// eventually waits for cond, polling, and fails the test at the deadline.
func eventually(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", timeout, what)
		}
		time.Sleep(10 * time.Millisecond) // polling a database or a server, not synchronising goroutines
	}
}

// eachKind runs fn as a parallel subtest per database kind.
func eachKind(t *testing.T, fn func(t *testing.T, kind string)) {
	for _, kind := range testdb.Kinds {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			fn(t, kind)
		})
	}
}
