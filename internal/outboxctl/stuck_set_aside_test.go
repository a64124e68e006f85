package outboxctl

import (
	"encoding/json"
	"strings"
	"testing"
	"time"
)

// A payment's last event set aside by the ledger's poison queue holds no
// key back, so held does not list it, and stuck lists only unpublished
// rows: a review's on-call read 18 of 48 set-aside ids off the poison
// queue. stuck --set-aside lists them, with the note and what to do.
func TestStuck_SetAside_ListsRecordsAConsumerSetAside(t *testing.T) {
	eachKind(t, func(t *testing.T, kind string) {
		f := newFixture(t, kind)
		db := f.db
		ids := publishOf(t, db, 2, "payment.captured", "pay-7")
		const note = "set aside by ledger to ledger.poison as 8ef93d4f-88f4-575b-86de-c5cc6419e5f2: card network rejected (2026-12-06 16:46:17Z)"
		execSQL(t, db, "UPDATE acemq_outbox SET published_at = ?, processed_at = ?, last_error = ? WHERE id = ?",
			ts(kind, time.Now().Add(-time.Minute)), ts(kind, time.Now()), note, ids[1])
		execSQL(t, db, "UPDATE acemq_outbox SET published_at = ?, processed_at = ? WHERE id = ?",
			ts(kind, time.Now().Add(-time.Minute)), ts(kind, time.Now()), ids[0])

		out := mustCtl(t, "stuck", "--set-aside", "--db", db.DSN)
		for _, want := range []string{ids[1], note, "outboxctl resend ID... sends them again"} {
			if !strings.Contains(out, want) {
				t.Errorf("stuck --set-aside does not say %q:\n%s", want, out)
			}
		}
		if strings.Contains(out, ids[0]) {
			t.Errorf("stuck --set-aside lists %s, applied:\n%s", ids[0], out)
		}
		if out := mustCtl(t, "stuck", "--db", db.DSN); strings.Contains(out, ids[1]) {
			t.Errorf("stuck lists the set-aside record, published:\n%s", out)
		}
		var r stuckReport
		if err := json.Unmarshal([]byte(mustCtl(t, "stuck", "--set-aside", "--json", "--db", db.DSN)), &r); err != nil {
			t.Fatal(err)
		}
		if r.Total != 1 || len(r.Rows) != 1 || r.Rows[0].ID != ids[1] || r.Rows[0].LastError != note {
			t.Errorf("stuck --set-aside --json: %+v, want the one record set aside", r)
		}
		ctl(t, nil, "stuck", "--set-aside", "--failing", "--db", db.DSN).wantFailure(t, 2, "give --failing or --set-aside, not both")
	})
}

// A stuck keyed record holds its key's later records back, and stuck did
// not say which key (an API review of StuckRecord, which had no key): the
// key and its number are in a KEY (SEQ) column, shown when a row is keyed,
// and in --json; an unkeyed row beside it shows none.
func TestStuck_KeyedRecord_KeyAndSeqShown(t *testing.T) {
	eachKind(t, func(t *testing.T, kind string) {
		f := newFixture(t, kind)
		db := f.db
		keyed := publishOf(t, db, 2, "payment.captured", "pay-9")
		plain := publishOf(t, db, 1, "payment.captured", "")
		execSQL(t, db, "UPDATE acemq_outbox SET attempts = 10, last_error = 'refused' WHERE id = ? OR id = ?", keyed[1], plain[0])

		out := mustCtl(t, "stuck", "--db", db.DSN)
		for _, want := range []string{"KEY (SEQ)", "pay-9 (2)"} {
			if !strings.Contains(out, want) {
				t.Errorf("stuck does not say %q:\n%s", want, out)
			}
		}
		var r stuckReport
		if err := json.Unmarshal([]byte(mustCtl(t, "stuck", "--json", "--db", db.DSN)), &r); err != nil {
			t.Fatal(err)
		}
		got := map[string]stuckRow{}
		for _, row := range r.Rows {
			got[row.ID] = row
		}
		if row := got[keyed[1]]; row.AggregateID != "pay-9" || row.Seq == nil || *row.Seq != 2 {
			t.Errorf("stuck --json, the keyed record: %+v, want key pay-9 seq 2", row)
		}
		if row, ok := got[plain[0]]; !ok || row.AggregateID != "" || row.Seq != nil {
			t.Errorf("stuck --json, the unkeyed record: %+v (listed %v), want no key", row, ok)
		}
	})
}

// A keyed row written without a number (seq NULL: not by a publisher; the
// relay sticks it at once, "seq NULL") was shown by stuck as "pay-4 (0)"
// and by show as "seq 0", a number no row has: NULL is said as NULL, and
// --json leaves seq out.
func TestStuckAndShow_KeyedRowSeqNULL_SaidAsNULL(t *testing.T) {
	eachKind(t, func(t *testing.T, kind string) {
		f := newFixture(t, kind)
		db := f.db
		ids := publishOf(t, db, 1, "payment.captured", "pay-4")
		execSQL(t, db, "UPDATE acemq_outbox SET seq = NULL, attempts = 10, last_error = 'aggregate_id with seq NULL' WHERE id = ?", ids[0])

		out := mustCtl(t, "stuck", "--db", db.DSN)
		if !strings.Contains(out, "pay-4 (NULL)") || strings.Contains(out, "(0)") {
			t.Errorf("stuck, a keyed row with seq NULL: want pay-4 (NULL):\n%s", out)
		}
		var r stuckReport
		if err := json.Unmarshal([]byte(mustCtl(t, "stuck", "--json", "--db", db.DSN)), &r); err != nil {
			t.Fatal(err)
		}
		for _, row := range r.Rows {
			if row.ID == ids[0] && (row.AggregateID != "pay-4" || row.Seq != nil) {
				t.Errorf("stuck --json: %+v, want key pay-4 and no seq", row)
			}
		}
		if out := mustCtl(t, "show", "--db", db.DSN, ids[0]); !strings.Contains(out, "key pay-4 seq NULL") {
			t.Errorf("show, a keyed row with seq NULL: want key pay-4 seq NULL:\n%s", out)
		}
		if out := mustCtl(t, "show", "--json", "--db", db.DSN, ids[0]); strings.Contains(out, `"seq"`) {
			t.Errorf("show --json, a keyed row with seq NULL, carries a seq:\n%s", out)
		}
	})
}
