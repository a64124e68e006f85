package outboxctl

import (
	"bytes"
	"context"
	"encoding/json"
	"net"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/acemq/watermill-outbox/internal/testamqp"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// stuckRowOf inserts a stuck row of id, as another library wrote it.
func stuckRowOf(t *testing.T, db *testdb.DB, kind, id string, created time.Time) {
	t.Helper()
	execSQL(t, db, "INSERT INTO acemq_outbox (id, exchange_name, routing_key, body, headers, created_at, attempts, last_error) VALUES (?, '', 'orders', '{}', '{}', ?, 10, 'boom')",
		id, ts(kind, created))
}

// Ids that differ in a trailing space, or hold a tab: stuck showed them
// through printable, "ord-1" and "ord-1 " alike and "ord\t2" as "ord 2",
// and retry of an id as shown found no row. They show quoted now, as held
// shows such keys, and retry takes them as shown.
func TestStuck_IDsATerminalDoesNotShow_ShownQuotedRetryTakesThemAsShown(t *testing.T) {
	for _, kind := range []string{testdb.Postgres, testdb.SQLite} { // MySQL's PAD SPACE key takes "ord-1 " for "ord-1"
		t.Run(kind, func(t *testing.T) {
			db := migrated(t, kind)
			now := time.Now().Add(-time.Hour)
			stored := []string{"ord-1", "ord-1 ", "ord\t2"}
			for i, id := range stored {
				stuckRowOf(t, db, kind, id, now.Add(time.Duration(i)*time.Second))
			}
			out := mustCtl(t, "stuck", "--db", db.DSN)
			lines := strings.Split(out, "\n")
			var shown []string
			for _, line := range lines[1 : 1+len(stored)] {
				shown = append(shown, strings.SplitN(line, "  ", 2)[0])
			}
			if want := []string{"ord-1", `"ord-1 "`, `"ord\t2"`}; strings.Join(shown, "|") != strings.Join(want, "|") {
				t.Fatalf("stuck shows the ids %q, want %q:\n%s", shown, want, out)
			}
			for i, id := range shown {
				if got := mustCtl(t, "retry", "--db", db.DSN, id); !strings.HasPrefix(got, "1 row made pending again") {
					t.Errorf("retry %s (stored %q): %s", id, stored[i], got)
				}
			}
		})
	}
}

// On SQLite a TEXT id may hold bytes that are not UTF-8 (another
// library's), which JSON carries as U+FFFD; and an id may start with a
// quote, which retry takes for a quoted id: given to retry as stuck --json
// gave them, `"abc"` retried the row abc, and the other found nothing.
// stuck --json gives each id as retry takes it.
func TestStuckJSON_IDsAsRetryTakesThem(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	execSQL(t, db, "INSERT INTO acemq_outbox (id, exchange_name, routing_key, body, headers, created_at, attempts, last_error) VALUES (CAST(X'6f72642dff' AS TEXT), '', 'orders', '{}', '{}', ?, 10, 'boom')",
		ts(testdb.SQLite, time.Now().Add(-time.Hour)))
	for i, id := range []string{"abc", `"abc"`} {
		stuckRowOf(t, db, testdb.SQLite, id, time.Now().Add(time.Duration(i)*time.Second-time.Hour))
	}
	var got stuckReport
	if err := json.Unmarshal([]byte(mustCtl(t, "stuck", "--db", db.DSN, "--json")), &got); err != nil {
		t.Fatal(err)
	}
	var ids []string
	for _, r := range got.Rows {
		ids = append(ids, r.ID)
	}
	if want := []string{`"ord-\xff"`, "abc", `"\"abc\""`}; strings.Join(ids, "|") != strings.Join(want, "|") {
		t.Fatalf("stuck --json ids %q, want %q", ids, want)
	}
	for _, id := range ids {
		if out := mustCtl(t, "retry", "--db", db.DSN, id); !strings.HasPrefix(out, "1 row made pending again") {
			t.Errorf("retry %s: %s", id, out)
		}
	}
}

// Told to stop (SIGTERM, the context's end) while its first connect to the
// broker waits: the relay exits 0, as a stop does, rather than 1 with a
// connect error that says the broker timed out.
func TestRelay_StoppedDuringItsFirstConnect_ExitsZero(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	stalls := testamqp.HungNode(t)
	ctx, cancel := context.WithCancel(context.Background())
	time.AfterFunc(300*time.Millisecond, cancel)
	var stdout, stderr bytes.Buffer
	code := Run(ctx, []string{"relay", "--db", db.DSN, "--listen", "", "--amqp", stalls}, func(string) string { return "" }, &stdout, &stderr)
	if code != 0 {
		t.Errorf("relay stopped while it connected: exit %d, want 0; stderr: %s", code, stderr.String())
	}
}

// Stopped while it connects, with one node refusing it at once and the
// other taking the connection and never answering: it exits 0, and says
// on stderr which node refused it, which a bare exit 0 dropped.
func TestRelay_StoppedDuringItsFirstConnect_SaysWhichNodeRefusedIt(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	closed, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	refused := closed.Addr().String()
	_ = closed.Close()
	stalls := testamqp.HungNode(t)
	ctx, cancel := context.WithCancel(context.Background())
	time.AfterFunc(500*time.Millisecond, cancel)
	var stdout, stderr bytes.Buffer
	code := Run(ctx, []string{"relay", "--db", db.DSN, "--listen", "", "--amqp", "amqp://guest:guest@" + refused + "/," + stalls},
		func(string) string { return "" }, &stdout, &stderr)
	if code != 0 || !strings.Contains(stderr.String(), refused) {
		t.Errorf("relay stopped while it connected: exit %d, stderr %q; want 0, naming the node %s that refused it", code, stderr.String(), refused)
	}
}

// A command line that is wrong exits 2, stopped or not.
func TestRelay_UsageErrorWhileStopped_ExitsTwo(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	var stdout, stderr bytes.Buffer
	code := Run(ctx, []string{"relay", "--db", db.DSN, "--table", "bad name;", "--listen", "", "--amqp", "amqp://guest:guest@127.0.0.1:1/"},
		func(string) string { return "" }, &stdout, &stderr)
	if code != 2 {
		t.Errorf("relay --table 'bad name;' with its context ended: exit %d, want 2; stderr %q", code, stderr.String())
	}
}

// Another library's BLOB id on SQLite (a UUID's 16 bytes), which the
// relay sets aside stuck, naming it: stuck shows it quoted, and show and
// retry of it as shown said "not in acemq_outbox" (the id bound as TEXT,
// which never equals a BLOB).
func TestShowRetry_SQLiteBlobID_FoundAsStuckShowsIt(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	execSQL(t, db, `INSERT INTO acemq_outbox (id, exchange_name, routing_key, body, headers, created_at, attempts, last_error)
		VALUES (X'0123456789ABCDEF0123456789ABCDEF', '', 'orders', '{}', '{}', ?, 10, 'column id: a BLOB of 16 bytes')`, ts(testdb.SQLite, time.Now().Add(-time.Hour)))
	out := mustCtl(t, "stuck", "--db", db.DSN)
	shown := strings.SplitN(strings.Split(out, "\n")[1], "  ", 2)[0]
	if !strings.HasPrefix(shown, `"\x01#Eg`) {
		t.Fatalf("stuck shows the BLOB id as %s:\n%s", shown, out)
	}
	if got := mustCtl(t, "show", "--db", db.DSN, shown); !strings.HasPrefix(got, shown+": stuck at 10 attempts") {
		t.Errorf("show %s: %s", shown, got)
	}
	if got := mustCtl(t, "retry", "--db", db.DSN, shown); !strings.HasPrefix(got, "1 row made pending again") {
		t.Errorf("retry %s: %s", shown, got)
	}
	if n := count(t, db, "SELECT COUNT(*) FROM acemq_outbox WHERE typeof(id) = 'blob' AND attempts = 0"); n != 1 {
		t.Errorf("%d BLOB-id rows pending again, want 1", n)
	}
}

// A stuck row whose created_at no driver reads (another library's: NULL
// in its table, or text that is no time) was listed as created
// 0001-01-01 00:00:00Z (a user review): "-".
func TestStuck_CreatedAtUnreadable_ShownAsDash(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	id := publish(t, db, 1, "orders")[0]
	execSQL(t, db, "UPDATE acemq_outbox SET attempts = 10, last_error = 'boom', created_at = 'no time at all' WHERE id = ?", id)
	out := mustCtl(t, "stuck", "--db", db.DSN)
	if strings.Contains(out, "0001-01-01") || !regexp.MustCompile(`(?m)^`+id+`\s+\(default\) / orders\s+10\s+-\s+boom$`).MatchString(out) {
		t.Errorf("stuck with an unreadable created_at:\n%s", out)
	}
}

// An id that starts with "-" (a negative snowflake a Java library wrote):
// stuck showed it as it is, and retry parsed it as a flag ("flag provided
// but not defined", exit 2, no word of --). It shows quoted now, and retry
// takes it as shown; given bare, the usage error says to put it after --,
// which works.
func TestStuck_IDStartingWithADash_ShownQuotedRetryTakesItAsShownOrAfterDashes(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	stored := "-4611686018427387904"
	stuckRowOf(t, db, testdb.SQLite, stored, time.Now().Add(-time.Hour))
	var got stuckReport
	if err := json.Unmarshal([]byte(mustCtl(t, "stuck", "--db", db.DSN, "--json")), &got); err != nil {
		t.Fatal(err)
	}
	if len(got.Rows) != 1 || got.Rows[0].ID != `"`+stored+`"` {
		t.Fatalf("stuck --json rows %+v, want the one row, its id quoted", got.Rows)
	}
	if r := ctl(t, nil, "retry", "--db", db.DSN, got.Rows[0].ID); r.code != 0 || !strings.HasPrefix(r.stdout, "1 row made pending again") {
		t.Errorf("retry %s (as stuck --json gives it): exit %d\nstdout: %s\nstderr: %s", got.Rows[0].ID, r.code, r.stdout, r.stderr)
	}
	execSQL(t, db, "UPDATE acemq_outbox SET attempts = 10 WHERE id = ?", stored)
	r := ctl(t, nil, "retry", "--db", db.DSN, stored)
	if r.code != 2 || !strings.Contains(r.stderr, "goes after --") {
		t.Errorf("retry %s, bare: exit %d, stderr %q; want a usage error saying it goes after --", stored, r.code, r.stderr)
	}
	if r := ctl(t, nil, "retry", "--db", db.DSN, "--", stored); r.code != 0 || !strings.HasPrefix(r.stdout, "1 row made pending again") {
		t.Errorf("retry -- %s: exit %d\nstdout: %s\nstderr: %s", stored, r.code, r.stdout, r.stderr)
	}
}

// A mistyped flag is told so, not that an id goes after --, which would
// have made retry -- --all-stuk retry an id of that name.
func TestRetry_MistypedFlag_NotToldItIsAnID(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	r := ctl(t, nil, "retry", "--db", db.DSN, "--all-stuk")
	if r.code != 2 || strings.Contains(r.stderr, "goes after --") || !strings.Contains(r.stderr, "all-stuk") {
		t.Errorf("retry --all-stuk: exit %d, stderr %q; want a usage error naming the flag, without the hint for ids", r.code, r.stderr)
	}
}
