package outboxctl

import (
	"context"
	"database/sql"
	"encoding/json"
	"io"
	"math"
	"net"
	"net/url"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/acemq/watermill-outbox/internal/testdb"
	"github.com/acemq/watermill-outbox/internal/testutil"
)

// fixture is an outbox in every state an operator meets, ages relative to
// the moment it was made.
type fixture struct {
	db                 *testdb.DB
	pending            []string // pending[0] was created 40 days ago
	stuck              []string // at 10 attempts; stuck[0] was created 50 days ago
	publishedRecent    []string // published 10 minutes ago
	publishedYesterday []string // published 2 days ago
	publishedOld       []string // published 10 days ago
}

const (
	fixtureOldInbox    = 3 // processed 40 days ago
	fixtureRecentInbox = 2 // processed a day ago
)

func newFixture(t *testing.T, kind string) *fixture {
	t.Helper()
	db := migrated(t, kind)
	ids := publish(t, db, 12, "orders")
	f := &fixture{db: db, pending: ids[0:3], stuck: ids[3:5], publishedRecent: ids[5:7],
		publishedYesterday: ids[7:8], publishedOld: ids[8:12]}
	now := time.Now()
	day := 24 * time.Hour
	execSQL(t, db, "UPDATE acemq_outbox SET created_at = ? WHERE id = ?", ts(kind, now.Add(-40*day)), f.pending[0])
	execSQL(t, db, "UPDATE acemq_outbox SET attempts = 10, last_error = ?, created_at = ? WHERE id = ?",
		"connection reset\nby peer", ts(kind, now.Add(-50*day)), f.stuck[0])
	execSQL(t, db, "UPDATE acemq_outbox SET attempts = 12, last_error = ? WHERE id = ?", "unroutable", f.stuck[1])
	for _, set := range []struct {
		ids []string
		at  time.Time
	}{{f.publishedRecent, now.Add(-10 * time.Minute)}, {f.publishedYesterday, now.Add(-2 * day)}, {f.publishedOld, now.Add(-10 * day)}} {
		for _, id := range set.ids {
			execSQL(t, db, "UPDATE acemq_outbox SET published_at = ? WHERE id = ?", ts(kind, set.at), id)
		}
	}
	for i := 0; i < fixtureOldInbox+fixtureRecentInbox; i++ {
		at := now.Add(-day)
		if i < fixtureOldInbox {
			at = now.Add(-40 * day)
		}
		execSQL(t, db, "INSERT INTO processed_messages (consumer_name, message_id, processed_at) VALUES (?, ?, ?)",
			"billing", ids[i], ts(kind, at))
	}
	return f
}

func decodeJSON(t *testing.T, s string) map[string]any {
	t.Helper()
	var m map[string]any
	if err := json.Unmarshal([]byte(s), &m); err != nil {
		t.Fatalf("not JSON: %v\n%s", err, s)
	}
	return m
}

func keys(m map[string]any) []string {
	var k []string
	for key := range m {
		k = append(k, key)
	}
	sort.Strings(k)
	return k
}

func TestStatus_CountsEveryState_HumanAndJSON(t *testing.T) {
	eachKind(t, func(t *testing.T, kind string) {
		f := newFixture(t, kind)

		got := decodeJSON(t, mustCtl(t, "status", "--db", f.db.DSN, "--json"))
		wantKeys := []string{"also_on_search_path", "database", "failing", "held_keys", "held_messages", "inbox_table", "max_attempts", "narrow_columns", "notify_quiet_ms", "notify_trigger", "oldest_failing", "oldest_held_at", "oldest_pending_age_seconds", "oldest_pending_at",
			"pending", "processed_messages", "published_last_hour", "stuck", "table"}
		if !slices.Equal(keys(got), wantKeys) {
			t.Errorf("JSON fields %v, want %v", keys(got), wantKeys)
		}
		for field, want := range map[string]any{
			"database": kind, "table": "acemq_outbox", "inbox_table": "processed_messages", "max_attempts": 10.0,
			"pending": 3.0, "stuck": 2.0, "published_last_hour": 2.0, "processed_messages": 5.0,
			"held_messages": 0.0, "held_keys": 0.0, "oldest_held_at": nil,
		} {
			if got[field] != want {
				t.Errorf("%s = %v, want %v", field, got[field], want)
			}
		}
		age, _ := got["oldest_pending_age_seconds"].(float64)
		if want := (40 * 24 * time.Hour).Seconds(); math.Abs(age-want) > 120 {
			t.Errorf("oldest_pending_age_seconds = %v, want about %v (the 40-day-old pending row; stuck rows do not count)", age, want)
		}
		if at, err := time.Parse(time.RFC3339Nano, got["oldest_pending_at"].(string)); err != nil || time.Since(at) < 39*24*time.Hour {
			t.Errorf("oldest_pending_at = %v (%v), want 40 days ago", got["oldest_pending_at"], err)
		}

		human := mustCtl(t, "status", "--db", f.db.DSN)
		for _, line := range []string{
			`^table\s+acemq_outbox \(` + kind + `\)$`,
			`^pending\s+3$`,
			`^oldest pending age\s+40d0h \(created \S+Z\)$`,
			`^stuck\s+2 \(at 10 attempts; see outboxctl stuck\)$`,
			`^published in the last hour\s+2$`,
			`^processed_messages\s+5 rows$`,
			`^held \(ordered inbox\)\s+0$`,
		} {
			if !regexp.MustCompile(`(?m)` + line).MatchString(human) {
				t.Errorf("status output has no line matching %s:\n%s", line, human)
			}
		}

		// The wake-up, on PostgreSQL: the trigger fires after migrate, and
		// status says so when it is disabled; null elsewhere.
		if v, ok := got["narrow_columns"].([]any); kind == "mysql" && (!ok || len(v) != 0) || kind != "mysql" && got["narrow_columns"] != nil {
			t.Errorf("narrow_columns = %v on %s, want [] on mysql (utf8mb4 after migrate), null elsewhere", got["narrow_columns"], kind)
		}
		if kind != "postgres" {
			if got["notify_trigger"] != nil || got["also_on_search_path"] != nil || got["notify_quiet_ms"] != nil {
				t.Errorf("notify_trigger = %v, also_on_search_path = %v, notify_quiet_ms = %v on %s, want null",
					got["notify_trigger"], got["also_on_search_path"], got["notify_quiet_ms"], kind)
			}
		} else {
			if got["notify_trigger"] != true {
				t.Errorf("notify_trigger = %v after migrate, want true", got["notify_trigger"])
			}
			if v, ok := got["also_on_search_path"].([]any); !ok || len(v) != 0 {
				t.Errorf("also_on_search_path = %v, want []", got["also_on_search_path"])
			}
			if !regexp.MustCompile(`(?m)^wake-up\s+NOTIFY at commit \(trigger acemq_outbox_notify\)$`).MatchString(human) {
				t.Errorf("status output has no wake-up line:\n%s", human)
			}
			if got["notify_quiet_ms"] != 0.0 {
				t.Errorf("notify_quiet_ms = %v after migrate, want 0", got["notify_quiet_ms"])
			}
			// A relay in a flow keeps the trigger quiet (migration 0010).
			execSQL(t, f.db, "SELECT setval('acemq_outbox_quiet', (extract(epoch FROM clock_timestamp()) * 1000)::bigint + 60000)")
			if got := decodeJSON(t, mustCtl(t, "status", "--db", f.db.DSN, "--json")); got["notify_quiet_ms"] == nil || got["notify_quiet_ms"].(float64) < 50_000 {
				t.Errorf("notify_quiet_ms = %v with the trigger quiet for a minute, want about 60000", got["notify_quiet_ms"])
			}
			if human := mustCtl(t, "status", "--db", f.db.DSN); !regexp.MustCompile(`(?m)^wake-up\s+none for another \d+ ms: a relay in a flow keeps trigger acemq_outbox_notify quiet and polls$`).MatchString(human) {
				t.Errorf("status does not say the trigger is quiet:\n%s", human)
			}
			execSQL(t, f.db, "SELECT setval('acemq_outbox_quiet', 0)")
			execSQL(t, f.db, "ALTER TABLE acemq_outbox DISABLE TRIGGER acemq_outbox_notify")
			if got := decodeJSON(t, mustCtl(t, "status", "--db", f.db.DSN, "--json")); got["notify_trigger"] != false {
				t.Errorf("notify_trigger = %v with the trigger disabled, want false", got["notify_trigger"])
			}
			if human := mustCtl(t, "status", "--db", f.db.DSN); !strings.Contains(human, "missing or disabled, relays poll adaptively") {
				t.Errorf("status does not say the trigger is disabled:\n%s", human)
			}
		}

		// The ceiling is the operator's: at 20 attempts nothing is stuck yet.
		got = decodeJSON(t, mustCtl(t, "status", "--db", f.db.DSN, "--json", "--max-attempts", "20"))
		if got["pending"] != 5.0 || got["stuck"] != 0.0 {
			t.Errorf("with --max-attempts 20: pending %v stuck %v, want 5 and 0", got["pending"], got["stuck"])
		}
	})
}

func TestStatus_InboxElsewhere_ReportsNoTableRatherThanFailing(t *testing.T) {
	eachKind(t, func(t *testing.T, kind string) {
		db := migrated(t, kind)
		execSQL(t, db, "DROP TABLE processed_messages")
		got := decodeJSON(t, mustCtl(t, "status", "--db", db.DSN, "--json"))
		if v, ok := got["processed_messages"]; !ok || v != nil {
			t.Errorf("processed_messages = %v (present %v), want null", v, ok)
		}
		if human := mustCtl(t, "status", "--db", db.DSN); !strings.Contains(human, "no such table") {
			t.Errorf("status does not say the inbox table is absent:\n%s", human)
		}
	})
}

// A table of the outbox's name in a later schema of the search path is what
// a process with another search_path uses under the same name (a database
// an earlier Migrate split): status names it. Not one off the path, not the
// one the name resolves to, and nothing for a schema-qualified --table.
func TestStatus_Postgres_NamesTheOutboxElsewhereOnTheSearchPath(t *testing.T) {
	db := migrated(t, "postgres")
	later, off := db.Name+"_later", db.Name+"_off"
	for _, schema := range []string{later, off} {
		execSQL(t, db, "CREATE SCHEMA "+schema)
		t.Cleanup(func() { execSQL(t, db, "DROP SCHEMA "+schema+" CASCADE") })
		execSQL(t, db, "CREATE TABLE "+schema+".acemq_outbox (id text PRIMARY KEY)")
	}
	u, err := url.Parse(db.DSN)
	if err != nil {
		t.Fatal(err)
	}
	q := u.Query()
	q.Set("search_path", db.Name+","+later)
	u.RawQuery = q.Encode()
	dsn := u.String()

	got := decodeJSON(t, mustCtl(t, "status", "--db", dsn, "--json"))
	if v, _ := got["also_on_search_path"].([]any); len(v) != 1 || v[0] != later+".acemq_outbox" {
		t.Errorf("also_on_search_path = %v, want [%s.acemq_outbox]", got["also_on_search_path"], later)
	}
	human := mustCtl(t, "status", "--db", dsn)
	if !regexp.MustCompile(`(?m)^also on the search path\s+` + later + `\.acemq_outbox: `).MatchString(human) {
		t.Errorf("status does not name %s.acemq_outbox:\n%s", later, human)
	}
	got = decodeJSON(t, mustCtl(t, "status", "--db", dsn, "--json", "--table", db.Name+".acemq_outbox"))
	if v, ok := got["also_on_search_path"].([]any); !ok || len(v) != 0 {
		t.Errorf("with a schema-qualified --table: also_on_search_path = %v, want []", got["also_on_search_path"])
	}
}

// An outbox another library created in utf8mb3 (MySQL's old "utf8"): a
// Publish with an emoji fails there (stored as "?" outside strict mode).
// status names the columns, so that an operator converts them.
func TestStatus_MySQL_NamesColumnsThatCannotHoldEveryCharacter(t *testing.T) {
	db := migrated(t, "mysql")
	execSQL(t, db, "ALTER TABLE acemq_outbox MODIFY body text CHARACTER SET utf8mb3 NOT NULL, MODIFY headers text CHARACTER SET latin1 NOT NULL")
	got := decodeJSON(t, mustCtl(t, "status", "--db", db.DSN, "--json"))
	want := []any{"body (utf8mb3)", "headers (latin1)"}
	if v, _ := got["narrow_columns"].([]any); !reflect.DeepEqual(v, want) {
		t.Errorf("narrow_columns = %v, want %v", got["narrow_columns"], want)
	}
	if human := mustCtl(t, "status", "--db", db.DSN); !regexp.MustCompile(`(?m)^narrow columns\s+body \(utf8mb3\), headers \(latin1\): `).MatchString(human) {
		t.Errorf("status does not name the narrow columns:\n%s", human)
	}
}

func TestStuck_ListsRowsAtTheCeilingWithDestinationAndError(t *testing.T) {
	eachKind(t, func(t *testing.T, kind string) {
		f := newFixture(t, kind)

		var got stuckReport
		if err := json.Unmarshal([]byte(mustCtl(t, "stuck", "--db", f.db.DSN, "--json")), &got); err != nil {
			t.Fatal(err)
		}
		if got.Total != 2 || got.MaxAttempts != 10 || len(got.Rows) != 2 {
			t.Fatalf("stuck --json: %+v, want total 2 of max 10 with both rows", got)
		}
		first := got.Rows[0] // oldest first
		if first.ID != f.stuck[0] || first.Exchange != "" || first.RoutingKey != "orders" || first.Attempts != 10 ||
			first.LastError != "connection reset\nby peer" {
			t.Errorf("first stuck row %+v, want %s to (default) / orders at 10 attempts with its error", first, f.stuck[0])
		}
		if got.Rows[1].ID != f.stuck[1] || got.Rows[1].Attempts != 12 {
			t.Errorf("second stuck row %+v, want %s at 12 attempts", got.Rows[1], f.stuck[1])
		}
		raw := decodeJSON(t, mustCtl(t, "stuck", "--db", f.db.DSN, "--json", "--limit", "1"))
		if want := []string{"max_attempts", "rows", "total"}; !slices.Equal(keys(raw), want) {
			t.Errorf("JSON fields %v, want %v", keys(raw), want)
		}
		row := raw["rows"].([]any)[0].(map[string]any)
		if want := []string{"attempts", "created_at", "exchange", "id", "last_error", "leased_by", "leased_until", "routing_key"}; !slices.Equal(keys(row), want) {
			t.Errorf("row fields %v, want %v", keys(row), want)
		}
		if row["leased_by"] != nil || row["leased_until"] != nil {
			t.Errorf("leased_by %v, leased_until %v for a row no relay holds, want null", row["leased_by"], row["leased_until"])
		}

		human := mustCtl(t, "stuck", "--db", f.db.DSN)
		line := regexp.MustCompile(`(?m)^` + f.stuck[0] + `\s+\(default\) / orders\s+10\s+\S+ \S+Z\s+connection reset by peer$`)
		if !line.MatchString(human) {
			t.Errorf("stuck output has no line for %s with destination, attempts and the error on one line:\n%s", f.stuck[0], human)
		}
		if strings.Contains(human, f.pending[0]) {
			t.Errorf("stuck lists a pending row:\n%s", human)
		}

		limited := mustCtl(t, "stuck", "--db", f.db.DSN, "--limit", "1")
		if !strings.Contains(limited, "1 of 2 stuck rows shown") || strings.Contains(limited, f.stuck[1]) {
			t.Errorf("stuck --limit 1 should show one row and say there are two:\n%s", limited)
		}
		ctl(t, nil, "stuck", "--db", f.db.DSN, "--limit", "0").wantFailure(t, 2, "--limit: 0")

		// A relay with a higher ceiling (another library's) holds the
		// second under a live lease: stuck says by whom and until when,
		// which is why retry leaves it alone. An expired lease is none, and
		// neither is a failed keyed record's backoff (retry-after), which
		// retry ends.
		until := time.Now().Add(time.Hour).UTC().Truncate(time.Second)
		execSQL(t, f.db, "UPDATE acemq_outbox SET locked_by = ?, locked_until = ? WHERE id = ?", "rails-relay-7", ts(kind, until), f.stuck[1])
		execSQL(t, f.db, "UPDATE acemq_outbox SET locked_by = ?, locked_until = ? WHERE id = ?", "gone-relay", ts(kind, until.Add(-2*time.Hour)), f.stuck[0])
		if err := json.Unmarshal([]byte(mustCtl(t, "stuck", "--db", f.db.DSN, "--json")), &got); err != nil {
			t.Fatal(err)
		}
		if r := got.Rows[0]; r.LeasedBy != nil || r.LeasedUntil != nil {
			t.Errorf("%s under an expired lease: leased_by %v, leased_until %v, want null", r.ID, r.LeasedBy, r.LeasedUntil)
		}
		if r := got.Rows[1]; r.LeasedBy == nil || *r.LeasedBy != "rails-relay-7" || r.LeasedUntil == nil || !r.LeasedUntil.Equal(until) {
			t.Errorf("%s under a live lease: leased_by %v, leased_until %v, want rails-relay-7 until %s", r.ID, r.LeasedBy, r.LeasedUntil, until)
		}
		human = mustCtl(t, "stuck", "--db", f.db.DSN)
		for _, line := range []*regexp.Regexp{
			regexp.MustCompile(`(?m)^ID\s+DESTINATION \(EXCHANGE / ROUTING KEY\)\s+ATTEMPTS\s+CREATED\s+LEASED BY \(UNTIL\)\s+LAST ERROR$`),
			regexp.MustCompile(`(?m)^` + f.stuck[1] + `\s+\(default\) / orders\s+12\s+\S+ \S+Z\s+rails-relay-7 \(` + regexp.QuoteMeta(until.Format("2006-01-02 15:04:05Z")) + `\)\s+unroutable$`),
			regexp.MustCompile(`(?m)^` + f.stuck[0] + `\s+\(default\) / orders\s+10\s+\S+ \S+Z\s+-\s+connection reset by peer$`),
		} {
			if !line.MatchString(human) {
				t.Errorf("stuck output does not match %s:\n%s", line, human)
			}
		}
		execSQL(t, f.db, "UPDATE acemq_outbox SET locked_by = ?, locked_until = ? WHERE id = ?", "retry-after", ts(kind, until), f.stuck[0])
		if err := json.Unmarshal([]byte(mustCtl(t, "stuck", "--db", f.db.DSN, "--json")), &got); err != nil {
			t.Fatal(err)
		}
		if r := got.Rows[0]; r.LeasedBy != nil || r.LeasedUntil != nil {
			t.Errorf("%s in a keyed record's backoff: leased_by %v, leased_until %v, want null (no lease: retry ends it)", r.ID, r.LeasedBy, r.LeasedUntil)
		}
		if out := mustCtl(t, "retry", "--all-stuck", "--db", f.db.DSN); !strings.HasPrefix(out, "1 row made pending again") || !strings.Contains(out, "1 row still stuck") {
			t.Errorf("retry --all-stuck with one row under a live lease and one in a backoff: %q", out)
		}
	})
}

func TestStuck_NoneStuck_SaysSo(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	if out := mustCtl(t, "stuck", "--db", db.DSN); !strings.HasPrefix(out, "no stuck rows") {
		t.Errorf("stuck on an empty outbox: %q", out)
	}
}

func TestRetry_ByIDAndAllStuck_ResetsAttempts(t *testing.T) {
	eachKind(t, func(t *testing.T, kind string) {
		f := newFixture(t, kind)
		db := f.db

		// Flags after the ids work as well as before.
		out := mustCtl(t, "retry", f.stuck[0], "--db", db.DSN)
		if out != "1 row made pending again (attempts reset to 0)\n" {
			t.Errorf("retry one id: %q", out)
		}
		if n := count(t, db, "SELECT COUNT(*) FROM acemq_outbox WHERE id = ? AND attempts = 0 AND published_at IS NULL", f.stuck[0]); n != 1 {
			t.Errorf("%s not pending at 0 attempts after retry", f.stuck[0])
		}

		out = ctlMissing(t, 1, "--db", db.DSN, "retry", f.publishedOld[0], "no-such-id")
		// Published already is no failure: the retry's aim is met.
		if out := mustCtl(t, "--db", db.DSN, "retry", f.publishedOld[0]); !strings.Contains(out, "1 of the 1 ids given left as they were") {
			t.Errorf("retry of a published id: %q", out)
		}
		if !strings.HasPrefix(out, "0 rows made pending again") || !strings.Contains(out, "2 of the 2 ids given") {
			t.Errorf("retry of a published and an unknown id: %q", out)
		}
		if n := count(t, db, "SELECT COUNT(*) FROM acemq_outbox WHERE id = ? AND published_at IS NOT NULL", f.publishedOld[0]); n != 1 {
			t.Errorf("retry made a published row pending again")
		}

		got := decodeJSON(t, mustCtl(t, "retry", "--all-stuck", "--db", db.DSN, "--json"))
		if got["retried"] != 1.0 {
			t.Errorf("retry --all-stuck --json: %v, want retried 1 (the other one was retried already)", got)
		}
		if n := count(t, db, "SELECT COUNT(*) FROM acemq_outbox WHERE attempts >= 10"); n != 0 {
			t.Errorf("%d rows still at the ceiling after retry --all-stuck", n)
		}
		if out := mustCtl(t, "retry", "--all-stuck", "--db", db.DSN); out != "0 rows made pending again (attempts reset to 0)\n" {
			t.Errorf("retry --all-stuck with nothing stuck: %q", out)
		}
	})
}

func TestRetry_WithoutIDsOrWithBoth_IsAUsageError(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	ctl(t, nil, "retry", "--db", db.DSN).wantFailure(t, 2, "give the ids to retry")
	ctl(t, nil, "retry", "--db", db.DSN, "--all-stuck", "some-id").wantFailure(t, 2, "not both")
}

func TestPurge_DeletesOldPublishedAndProcessedInBatches_NeverPending(t *testing.T) {
	eachKind(t, func(t *testing.T, kind string) {
		f := newFixture(t, kind)
		db := f.db

		out := mustCtl(t, "purge", "--db", db.DSN, "--published-older-than", "7d", "--processed-older-than", "30d", "--batch-size", "3")
		want := "acemq_outbox: deleted 4 rows published more than 7d ago\n" +
			"processed_messages: deleted 3 rows processed more than 30d ago\n"
		if out != want {
			t.Errorf("purge printed\n%s\nwant\n%s", out, want)
		}
		for _, id := range append(append(append([]string{}, f.pending...), f.stuck...), append(f.publishedRecent, f.publishedYesterday...)...) {
			if n := count(t, db, "SELECT COUNT(*) FROM acemq_outbox WHERE id = ?", id); n != 1 {
				t.Errorf("purge deleted %s, which is pending, stuck or published recently", id)
			}
		}
		if n := count(t, db, "SELECT COUNT(*) FROM acemq_outbox"); n != 8 {
			t.Errorf("%d rows left, want 8", n)
		}
		if n := count(t, db, "SELECT COUNT(*) FROM processed_messages"); n != fixtureRecentInbox {
			t.Errorf("%d inbox rows left, want %d", n, fixtureRecentInbox)
		}

		// Hours and days combined; --json for cron jobs; only one purge asked.
		got := decodeJSON(t, mustCtl(t, "purge", "--db", db.DSN, "--published-older-than", "1d12h", "--json"))
		if got["published_deleted"] != 1.0 || got["processed_deleted"] != nil {
			t.Errorf("purge --published-older-than 1d12h --json: %v, want 1 deleted and processed null", got)
		}
		// A Go duration too, as held's --older-than takes one.
		got = decodeJSON(t, mustCtl(t, "purge", "--db", db.DSN, "--processed-older-than", "1.5h", "--json"))
		if got["processed_deleted"] != 2.0 || got["published_deleted"] != nil {
			t.Errorf("purge --processed-older-than 1.5h --json: %v, want 2 deleted", got)
		}
		if n := count(t, db, "SELECT COUNT(*) FROM acemq_outbox WHERE published_at IS NULL"); n != 5 {
			t.Errorf("%d unpublished rows left, want all 5", n)
		}
	})
}

func TestPurge_BadInput_IsAUsageErrorNamingTheFlag(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--published-older-than", "7x"}, `--published-older-than: "7x" is not a duration like 7d, 36h, 90m or 1.5h`},
		{[]string{"--processed-older-than", "30"}, `--processed-older-than: "30" is not a duration like 7d, 36h, 90m or 1.5h`},
		{[]string{"--published-older-than", "-7d"}, `--published-older-than: "-7d" is not a duration`},
		// Go's durations, as held's --older-than takes them, but not one
		// below 0, which would take every published row.
		{[]string{"--published-older-than", "-7h"}, `--published-older-than: -7h; want 0 or more`},
		{[]string{"--processed-older-than", "-1s"}, `--processed-older-than: -1s; want 0 or more`},
		{[]string{"--published-older-than", "7d", "--batch-size", "0"}, "--batch-size: 0"},
		{nil, "give --published-older-than, --processed-older-than, or both"},
		{[]string{"--published-older-than", "7d", "extra"}, `unexpected argument "extra"`},
	} {
		ctl(t, nil, append([]string{"purge", "--db", db.DSN}, tc.args...)...).wantFailure(t, 2, tc.want)
	}
}

func TestPurge_InboxOnlyDatabase_PurgesProcessedWithoutAnOutbox(t *testing.T) {
	db := migrated(t, testdb.MySQL)
	execSQL(t, db, "DROP TABLE acemq_outbox")
	execSQL(t, db, "INSERT INTO processed_messages (consumer_name, message_id, processed_at) VALUES (?, ?, ?)",
		"billing", "m1", ts(db.Kind, time.Now().Add(-40*24*time.Hour)))
	if out := mustCtl(t, "purge", "--db", db.DSN, "--processed-older-than", "30d"); out != "processed_messages: deleted 1 row processed more than 30d ago\n" {
		t.Errorf("purge of an inbox-only database: %q", out)
	}
	ctl(t, nil, "purge", "--db", db.DSN, "--processed-older-than", "30d", "--published-older-than", "7d").
		wantFailure(t, 1, "acemq_outbox does not exist: run `outboxctl migrate`")
}

func TestPurge_InboxTableMissing_GivesTheMigrateHint(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	execSQL(t, db, "DROP TABLE processed_messages")
	ctl(t, nil, "purge", "--db", db.DSN, "--processed-older-than", "30d").
		wantFailure(t, 1, "processed_messages does not exist: run `outboxctl migrate`")
}

func TestMigrate_CreatesTheSchemaAndIsIdempotent(t *testing.T) {
	eachKind(t, func(t *testing.T, kind string) {
		db := testdb.New(t, kind)
		for i := 0; i < 2; i++ {
			out := mustCtl(t, "migrate", "--db", db.DSN)
			if !strings.HasPrefix(out, "acemq_outbox and processed_messages are up to date in the "+kind+" database") {
				t.Errorf("migrate #%d: %q", i+1, out)
			}
		}
		if n := count(t, db, "SELECT COUNT(*) FROM acemq_outbox"); n != 0 {
			t.Errorf("fresh outbox has %d rows", n)
		}
		if n := count(t, db, "SELECT COUNT(*) FROM processed_messages"); n != 0 {
			t.Errorf("fresh inbox has %d rows", n)
		}
		ctl(t, nil, "migrate", "--db", db.DSN, "--table", "other_outbox").wantFailure(t, 2, "migrate creates acemq_outbox and processed_messages only")
	})
}

// A --db in a directory that is not there (a volume not mounted, a
// mistyped path): status told to run migrate, which then failed with
// "unable to open database file" (a review). Both name the directory.
func TestSQLitePath_DirectoryMissing_SaidByEveryCommand(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "not-mounted")
	path := filepath.Join(dir, "shop.db")
	for _, cmd := range []string{"status", "migrate", "stuck"} {
		ctl(t, nil, cmd, "--db", path).wantFailure(t, 1, "the directory "+dir+" of the sqlite database "+path+" does not exist (a volume not mounted? a mistyped path?)")
	}
}

// A command that meets SQLite's write lock held past the busy timeout by
// another process says so, and that it can be run again: "database is
// locked" alone said neither (a review).
func TestSQLite_WriteLockHeldElsewhere_SaysWhyAndToRunAgain(t *testing.T) {
	path := lockedElsewhere(t)
	ctl(t, nil, "retry", "--all-stuck", "--db", "file:"+path+"?_busy_timeout=100").wantFailure(t, 1,
		"database is locked (another connection held the SQLite database's write lock past the busy timeout")
}

func TestMigrate_SQLitePath_CreatesTheFile(t *testing.T) {
	path := t.TempDir() + "/new.db"
	ctl(t, nil, "status", "--db", path).wantFailure(t, 1, "the sqlite database "+path+" does not exist (outboxctl migrate creates it)")
	mustCtl(t, "migrate", "--db", path)
	if out := mustCtl(t, "status", "--db", path); !strings.Contains(out, "pending") {
		t.Errorf("status after migrate: %q", out)
	}
}

// journalMode reads an SQLite file's journal mode over a read-only
// connection, which cannot change it.
func journalMode(t *testing.T, path string) string {
	t.Helper()
	db, err := sql.Open("sqlite3", "file:"+path+"?mode=ro")
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	var mode string
	if err := db.QueryRow("PRAGMA journal_mode").Scan(&mode); err != nil {
		t.Fatal(err)
	}
	return mode
}

// WAL stays in the file: an operator's look (status, stuck, held) leaves a
// rollback-journal database as it is, and works on a file opened
// read-only, which a switch to WAL would fail; migrate, which sets the
// database up for the relay and the services, puts it in WAL unless its
// DSN chose a journal mode.
func TestSQLite_ReadingCommands_KeepTheJournalMode_AndWorkReadOnly(t *testing.T) {
	path := t.TempDir() + "/shop.db"
	mustCtl(t, "migrate", "--db", "file:"+path+"?_journal_mode=DELETE")
	if mode := journalMode(t, path); mode != "delete" {
		t.Fatalf("journal mode %q after migrate with _journal_mode=DELETE, want delete: the DSN's choice", mode)
	}
	for _, args := range [][]string{{"status"}, {"status", "--json"}, {"stuck"}, {"held"}} {
		mustCtl(t, append(args, "--db", path)...)
		if mode := journalMode(t, path); mode != "delete" {
			t.Fatalf("journal mode %q after outboxctl %s, want delete as it was", mode, strings.Join(args, " "))
		}
		mustCtl(t, append(args, "--db", "file:"+path+"?mode=ro")...)
	}
	if out := mustCtl(t, "status", "--db", "file:"+path+"?mode=ro"); !strings.Contains(out, "pending") {
		t.Errorf("status read-only: %q", out)
	}
	mustCtl(t, "migrate", "--db", path)
	if mode := journalMode(t, path); mode != "wal" {
		t.Errorf("journal mode %q after migrate, want wal", mode)
	}
}

func TestEveryCommand_MissingTable_SaysRunMigrate(t *testing.T) {
	eachKind(t, func(t *testing.T, kind string) {
		db := testdb.New(t, kind)
		execSQL(t, db, "CREATE TABLE unrelated (x INTEGER)") // the database exists, the outbox does not
		for _, args := range [][]string{
			{"status"}, {"status", "--json"}, {"stuck"}, {"retry", "--all-stuck"}, {"retry", "some-id"},
			{"purge", "--published-older-than", "7d"}, {"relay", "--amqp", "amqp://guest:guest@127.0.0.1:5672/"},
		} {
			r := ctl(t, nil, append(args, "--db", db.DSN)...)
			r.wantFailure(t, 1, "outboxctl: acemq_outbox does not exist: run `outboxctl migrate`")
		}
		ctl(t, nil, "status", "--db", db.DSN, "--table", "myschema.other").
			wantFailure(t, 1, "myschema.other does not exist in the database")
	})
}

func TestUnreachableDatabase_OneLineNamingItWithoutThePassword(t *testing.T) {
	for _, tc := range []struct{ dsn, want string }{
		{"postgres://postgres@127.0.0.1:1/x", "cannot connect to the postgres database at postgres://postgres@127.0.0.1:1/x: dial tcp 127.0.0.1:1"},
		{"postgres://app:s3cret@127.0.0.1:1/x?sslmode=disable", "cannot connect to the postgres database at postgres://app:xxxxx@127.0.0.1:1/x?sslmode=disable: dial tcp"},
		{"app:s3cret@tcp(127.0.0.1:1)/x", "cannot connect to the mysql database at app:xxxxx@tcp(127.0.0.1:1)/x: dial tcp 127.0.0.1:1"},
		{"mysql://app:s3cret@127.0.0.1:1/x", "cannot connect to the mysql database at mysql://app:xxxxx@127.0.0.1:1/x: dial tcp"},
	} {
		t.Run(tc.dsn, func(t *testing.T) {
			t.Parallel()
			for _, cmd := range [][]string{{"status"}, {"migrate"}, {"purge", "--processed-older-than", "1d"}} {
				r := ctl(t, nil, append(cmd, "--db", tc.dsn)...)
				r.wantFailure(t, 1, tc.want)
				if strings.Contains(r.stderr, "s3cret") {
					t.Errorf("the password is in the message: %s", r.stderr)
				}
			}
		})
	}
}

func TestCommandLine_Mistakes_AreUsageErrors(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		args []string
		env  map[string]string
		want string
	}{
		{[]string{"frobnicate"}, nil, `unknown command "frobnicate"; want one of status, stuck, retry, resend, discard, restore, show, purge, held, skip-gap, skip-held, relay, migrate`},
		{[]string{"status"}, nil, "no database: pass --db or set OUTBOX_DB"},
		{[]string{"status", "--bogus"}, nil, "flag provided but not defined: -bogus"},
		{[]string{"status", "--db", "redis://x"}, nil, "redis:// is not a database outboxctl knows"},
		{[]string{"status", "--db", "x.db", "--table", "drop table;"}, nil, `--table: "drop table;"`},
		{[]string{"status", "--db", "x.db", "--max-attempts", "0"}, nil, "--max-attempts: 0"},
		{[]string{"relay", "--db", "x.db"}, nil, "no broker: pass --amqp or set OUTBOX_AMQP_URL"},
		{[]string{"relay", "--db", "x.db", "--amqp", "amqp://x/", "--batch-size", "5000"}, nil, "--batch-size: 5000; want 1 to 1000"},
		{[]string{"relay", "--db", "x.db", "--amqp", "amqp://x/", "--batch-size", "200", "--max-batch-size", "100"}, nil, "--max-batch-size: 100; want --batch-size (200) to 1000"},
		{[]string{"relay", "--amqp", "amqp://x/"}, map[string]string{"OUTBOX_DB": "x.db"}, "the sqlite database x.db does not exist"},
	} {
		r := ctl(t, tc.env, tc.args...)
		code := 2
		if strings.Contains(tc.want, "does not exist") {
			code = 1 // the environment was read: a database was named
		}
		r.wantFailure(t, code, tc.want)
	}
	if r := ctl(t, nil); r.code != 2 || !strings.Contains(r.stderr, "Commands:") {
		t.Errorf("no command: exit %d, stderr %q; want 2 and the usage", r.code, r.stderr)
	}
	if r := ctl(t, nil, "--db", "postgres://app:s3cret@db/x", "status", "-h"); r.code != 0 || strings.Contains(r.stdout, "s3cret") {
		t.Errorf("status -h after --db: exit %d, and the password must not be shown as a default:\n%s", r.code, r.stdout)
	}
	for _, args := range [][]string{{"-h"}, {"help"}, {"purge", "-h"}} {
		if r := ctl(t, nil, args...); r.code != 0 || !strings.Contains(r.stdout, "Usage:") {
			t.Errorf("%v: exit %d, stdout %q; want 0 and the usage", args, r.code, r.stdout)
		}
	}
	// A flag whose usage says what its zero stands for is not given a
	// second default: "(default 2 × … + 30 s) (default 0s)".
	if r := ctl(t, nil, "relay", "-h"); r.code != 0 || !strings.Contains(r.stdout, "+ 30 s)\n") || strings.Contains(r.stdout, "30 s) (default 0s)") {
		t.Errorf("relay -h: exit %d; want --stall-after's own default alone:\n%s", r.code, r.stdout)
	}
}

func TestEnvironment_NamesTheDatabase_FlagWins(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	if r := ctl(t, map[string]string{"OUTBOX_DB": db.DSN}, "status", "--json"); r.code != 0 {
		t.Errorf("OUTBOX_DB: exit %d: %s", r.code, r.stderr)
	}
	r := ctl(t, map[string]string{"OUTBOX_DB": "postgres://postgres@127.0.0.1:1/x"}, "status", "--db", db.DSN)
	if r.code != 0 {
		t.Errorf("--db should win over OUTBOX_DB: exit %d: %s", r.code, r.stderr)
	}
}

func TestRelay_UnreachableBroker_ExitsOneNamingIt(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	r := ctl(t, nil, "relay", "--db", db.DSN, "--amqp", "amqp://guest:s3cret@127.0.0.1:1/", "--listen", "", "--broker-wait", "0")
	r.wantFailure(t, 1, "cannot connect to RabbitMQ at amqp://guest:xxxxx@127.0.0.1:1/: dial tcp 127.0.0.1:1")
}

// A --listen address another process holds stops the relay before it
// dials the broker: it connected to the database and RabbitMQ first, then
// stopped on the port (a README review's second relay on one host).
func TestRelay_ListenAddressTaken_StopsBeforeDialling(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	held, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer held.Close()
	r := ctl(t, nil, "relay", "--db", db.DSN, "--amqp", "amqp://guest:s3cret@127.0.0.1:1/", "--listen", held.Addr().String())
	r.wantFailure(t, 1, "--listen "+held.Addr().String()+": listen tcp "+held.Addr().String()+": bind: address already in use (a second relay on this host needs a --listen of its own")
}

// The relay's --max-attempts, exported once as OUTBOX_MAX_ATTEMPTS, is
// every command's: given to the relay alone, a row stuck at 3 attempts
// was "no stuck rows (none unpublished at 10 attempts)" to stuck, and
// retry --all-stuck retried nothing (a review's finding). A flag given
// wins over the environment; OUTBOX_TABLE and OUTBOX_INBOX_TABLE are
// read the same way.
func TestEnvironment_MaxAttemptsAndTables_EveryCommandsFlagWins(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	execSQL(t, db, "INSERT INTO acemq_outbox (id, exchange_name, routing_key, body, headers, created_at, attempts, last_error) VALUES ('ord-3', '', 'orders', '{}', '{}', ?, 3, 'boom')",
		ts(testdb.SQLite, time.Now().Add(-time.Hour)))
	env := map[string]string{"OUTBOX_DB": db.DSN, "OUTBOX_MAX_ATTEMPTS": "3"}
	if r := ctl(t, env, "stuck"); r.code != 0 || !strings.Contains(r.stdout, "ord-3") {
		t.Errorf("stuck with OUTBOX_MAX_ATTEMPTS=3: exit %d, %q %q; want ord-3 listed", r.code, r.stdout, r.stderr)
	}
	if r := ctl(t, env, "stuck", "--max-attempts", "10"); r.code != 0 || strings.Contains(r.stdout, "ord-3") {
		t.Errorf("stuck --max-attempts 10 over OUTBOX_MAX_ATTEMPTS=3: exit %d, %q; want the flag to win, nothing stuck", r.code, r.stdout)
	}
	if r := ctl(t, env, "--max-attempts", "10", "stuck"); r.code != 0 || strings.Contains(r.stdout, "ord-3") {
		t.Errorf("--max-attempts 10 before the command over OUTBOX_MAX_ATTEMPTS=3: exit %d, %q; want the flag to win", r.code, r.stdout)
	}
	if r := ctl(t, env, "retry", "--all-stuck"); r.code != 0 || !strings.HasPrefix(r.stdout, "1 row made pending again") {
		t.Errorf("retry --all-stuck with OUTBOX_MAX_ATTEMPTS=3: exit %d, %q %q; want ord-3 retried", r.code, r.stdout, r.stderr)
	}
	for _, bad := range []string{"three", "0"} {
		r := ctl(t, map[string]string{"OUTBOX_DB": db.DSN, "OUTBOX_MAX_ATTEMPTS": bad}, "stuck")
		r.wantFailure(t, 2, "OUTBOX_MAX_ATTEMPTS")
	}
	r := ctl(t, map[string]string{"OUTBOX_DB": db.DSN, "OUTBOX_TABLE": "no_such_outbox"}, "status")
	r.wantFailure(t, 1, "no_such_outbox")
	if r := ctl(t, map[string]string{"OUTBOX_DB": db.DSN, "OUTBOX_TABLE": "no_such_outbox"}, "status", "--table", "acemq_outbox"); r.code != 0 {
		t.Errorf("status --table over OUTBOX_TABLE: exit %d: %s", r.code, r.stderr)
	}
}

// Tables' names exported for the other commands (OUTBOX_TABLE,
// OUTBOX_INBOX_TABLE) are not migrate's: it makes its own tables, as it
// did before it read them, where it refused, naming flags nobody gave (a
// review's catch). Given as flags, it still refuses them.
func TestEnvironment_TablesExported_MigrateMakesItsOwn(t *testing.T) {
	db := testdb.New(t, testdb.SQLite)
	env := map[string]string{"OUTBOX_DB": db.DSN, "OUTBOX_TABLE": "orders_outbox", "OUTBOX_INBOX_TABLE": "orders_inbox"}
	if r := ctl(t, env, "migrate"); r.code != 0 || !strings.Contains(r.stdout, "acemq_outbox and processed_messages are up to date") {
		t.Errorf("migrate with the tables' names exported: exit %d, %q %q; want acemq_outbox and processed_messages made", r.code, r.stdout, r.stderr)
	}
	ctl(t, env, "migrate", "--table", "orders_outbox").wantFailure(t, 2, "--table and --inbox-table name tables you created yourself")
}

// A purge age under an hour is legal (a drained staging table) but was
// silent about what it risks (a user review: --published-older-than 0s
// deleted rows no consumer had yet): it says so on stderr and purges.
func TestPurge_AgeUnderAnHour_SaysWhatItRisks(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	execSQL(t, db, "INSERT INTO acemq_outbox (id, exchange_name, routing_key, body, headers, created_at, published_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
		"just-sent", "", "orders", "{}", "{}", ts(db.Kind, time.Now().Add(-time.Minute)), ts(db.Kind, time.Now().Add(-time.Minute)))
	r := ctl(t, nil, "purge", "--db", db.DSN, "--published-older-than", "0s", "--processed-older-than", "30m")
	if r.code != 0 || !strings.Contains(r.stdout, "acemq_outbox: deleted 1 row published more than 0s ago") {
		t.Fatalf("purge 0s: exit %d\nstdout: %s\nstderr: %s", r.code, r.stdout, r.stderr)
	}
	for _, want := range []string{"--published-older-than 0s deletes rows published so lately", "--processed-older-than 30m forgets keys so young"} {
		if !strings.Contains(r.stderr, want) {
			t.Errorf("stderr does not say %q:\n%s", want, r.stderr)
		}
	}
	if r := ctl(t, nil, "purge", "--db", db.DSN, "--published-older-than", "7d"); r.code != 0 || r.stderr != "" {
		t.Errorf("purge 7d: exit %d, stderr %q; want 0 and nothing", r.code, r.stderr)
	}
}

// skip-gap under a write lock another process holds fails at once with
// the busy hint, rather than wait, silent, for as long as the lock lasts
// (a code review: the inbox waited the lock out as it does a delivery's).
func TestSkipGap_WriteLockHeldElsewhere_SaysSoRatherThanWait(t *testing.T) {
	path := lockedElsewhere(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	stderr := &testutil.LockedBuffer{}
	start := time.Now()
	code := Run(ctx, []string{"skip-gap", "--db", "file:" + path + "?_busy_timeout=100", "--consumer", "c", "--key", "k", "--from", "1", "--through", "1"},
		func(string) string { return "" }, io.Discard, stderr)
	took := time.Since(start)
	if took > 3*time.Second || !strings.Contains(stderr.String(), "run the command again once it ends") {
		t.Errorf("skip-gap under a lock held elsewhere: exit %d after %s:\n%s", code, took.Round(time.Millisecond), stderr.String())
	}
}

// lockedElsewhere is the path of a migrated SQLite database whose write
// lock another connection holds until the test ends: another process's
// long write.
func lockedElsewhere(t *testing.T) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "locked.db")
	mustCtl(t, "migrate", "--db", path)
	other, err := sql.Open("sqlite3", testdb.SQLiteDSN(path))
	if err != nil {
		t.Fatal(err)
	}
	lock, err := other.Begin() // BEGIN IMMEDIATE: the write lock
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = lock.Rollback()
		_ = other.Close()
	})
	return path
}
