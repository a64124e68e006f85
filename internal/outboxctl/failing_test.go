package outboxctl

import (
	"encoding/json"
	"regexp"
	"strings"
	"testing"
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
		if !regexp.MustCompile(`(?m)^failing\s+1 \(tried again by the relay; the oldest, ` + regexp.QuoteMeta(f.pending[0]) + `, at 3 of 10 attempts: returned by the broker as unroutable \(312 NO_ROUTE\); see outboxctl stuck --failing\)$`).MatchString(out) {
			t.Errorf("status does not name the failing record:\n%s", out)
		}
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
