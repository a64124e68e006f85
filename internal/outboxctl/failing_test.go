package outboxctl

import (
	"encoding/json"
	"reflect"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/acemq/watermill-outbox/internal/testdb"
)

// While a record fails and is not stuck yet, the rows behind it wait:
// status showed pending growing and stuck 0, and stuck "no stuck rows" (a
// user review found the record only by show of the oldest pending id).
// status counts the failing rows and names the oldest; stuck --failing
// lists them.
func TestStatusAndStuckFailing_RecordFailingNotYetStuck_Named(t *testing.T) {
	eachKind(t, func(t *testing.T, kind string) {
		f := newFixture(t, kind)
		db := f.db
		execSQL(t, db, "UPDATE acemq_outbox SET attempts = 3, last_error = ? WHERE id = ?", "returned by the broker as unroutable (312 NO_ROUTE)", f.pending[0])
		out := mustCtl(t, "status", "--db", db.DSN)
		if !regexp.MustCompile(`(?m)^failing\s+1 \(tried again by the relay; the oldest, ` + regexp.QuoteMeta(f.pending[0]) + `, at 3 of 10 attempts: returned by the broker as unroutable \(312 NO_ROUTE\); unkeyed: the records behind it wait, keyed ones too, until it goes out or is stuck; see outboxctl stuck --failing\)$`).MatchString(out) {
			t.Errorf("status does not name the failing record and what waits behind it:\n%s", out)
		}
		// A keyed one holds its key's.
		keyed := publishOf(t, db, 1, "payments", "pay-1")[0]
		execSQL(t, db, "UPDATE acemq_outbox SET attempts = 2, last_error = ?, created_at = ? WHERE id = ?", "no route", ts(kind, time.Now().Add(-90*24*time.Hour)), keyed)
		if out := mustCtl(t, "status", "--db", db.DSN); !strings.Contains(out, "the oldest, "+keyed+", at 2 of 10 attempts: no route; key pay-1: that key's later records wait;") {
			t.Errorf("status does not say a keyed failing record holds its key's:\n%s", out)
		}
		execSQL(t, db, "UPDATE acemq_outbox SET attempts = 0 WHERE id = ?", keyed)
		var r statusReport
		if err := json.Unmarshal([]byte(mustCtl(t, "status", "--json", "--db", db.DSN)), &r); err != nil {
			t.Fatal(err)
		}
		if r.Failing != 1 || r.OldestFailing == nil || r.OldestFailing.ID != f.pending[0] || r.OldestFailing.Attempts != 3 || r.Stuck != 2 {
			t.Errorf("status --json: failing %d, oldest %+v, stuck %d; want 1, %s at 3, 2", r.Failing, r.OldestFailing, r.Stuck, f.pending[0])
		}
		out = mustCtl(t, "stuck", "--failing", "--db", db.DSN)
		if lines := strings.Split(strings.TrimSpace(out), "\n"); len(lines) != 3 || !strings.HasPrefix(lines[1], f.pending[0]+" ") || !strings.Contains(lines[1], "NO_ROUTE") {
			t.Errorf("stuck --failing:\n%s", out)
		}
		execSQL(t, db, "UPDATE acemq_outbox SET attempts = 0 WHERE id = ?", f.pending[0])
		if out := mustCtl(t, "stuck", "--failing", "--db", db.DSN); !strings.HasPrefix(out, "no failing rows") {
			t.Errorf("stuck --failing with none failing:\n%s", out)
		}
		if out := mustCtl(t, "status", "--db", db.DSN); !regexp.MustCompile(`(?m)^failing\s+0$`).MatchString(out) {
			t.Errorf("status with none failing:\n%s", out)
		}
	})
}

// retry --json printed only {"retried": N}, where the text says of each id
// left alone why (a user review): it carries them too.
func TestRetryJSON_IDsLeftAlone_EachWithItsStateAndWhy(t *testing.T) {
	f := newFixture(t, testdb.Postgres)
	var r retryReport
	if err := json.Unmarshal([]byte(ctlMissing(t, 1, "retry", "--json", "--db", f.db.DSN, f.stuck[0], f.pending[0], "no-such-id")), &r); err != nil {
		t.Fatal(err)
	}
	want := []retryLeft{{ID: f.pending[0], State: "pending", Why: "pending: the relay publishes it at its next claim"}, {ID: "no-such-id", State: "not_found", Why: "not in acemq_outbox"}}
	if r.Retried != 1 || !reflect.DeepEqual(r.LeftAlone, want) {
		t.Errorf("retry --json: %+v; want 1 retried, left alone %+v", r, want)
	}
	if out := mustCtl(t, "retry", "--json", "--all-stuck", "--db", f.db.DSN); !strings.Contains(out, `"left_alone": []`) {
		t.Errorf("retry --all-stuck --json: %s; want left_alone []", out)
	}
}

// retry of rows that last failed on routing (no queue bound, no such
// exchange) makes them fail again until the broker is mended, each holding
// the unkeyed records behind it: a user review's retry --all-stuck of 12
// rows, 2 unroutable, stalled the shared table 70 s without a word.
func TestRetry_RowsThatFailedUnroutable_Noted(t *testing.T) {
	eachKind(t, func(t *testing.T, kind string) {
		f := newFixture(t, kind)
		execSQL(t, f.db, "UPDATE acemq_outbox SET last_error = ? WHERE id = ?", `exchange "shop" does not exist on the broker`, f.stuck[0])
		out := mustCtl(t, "retry", "--db", f.db.DSN, f.stuck[0])
		if !strings.Contains(out, "note: 1 of them last failed as unroutable or to a missing exchange") {
			t.Errorf("retry of a row to a missing exchange:\n%s", out)
		}
		var r retryReport
		if err := json.Unmarshal([]byte(mustCtl(t, "retry", "--json", "--all-stuck", "--db", f.db.DSN)), &r); err != nil {
			t.Fatal(err)
		}
		if r.Retried != 1 || r.Unroutable != 1 { // stuck[1], "unroutable"
			t.Errorf("retry --all-stuck --json: %+v; want 1 retried, 1 last failed unroutable", r)
		}
		if out := mustCtl(t, "retry", "--db", f.db.DSN, f.pending[0]); strings.Contains(out, "note:") {
			t.Errorf("retry of a row that never failed:\n%s", out)
		}
	})
}
