package outboxctl

import (
	"encoding/json"
	"strings"
	"testing"
	"time"
)

// A foreign row to an exchange that will never be stays stuck for good:
// outbox_stuck never went back to 0, and nothing but SQL ended it (a user
// review). discard deletes stuck records, each printed first (its only
// copy), and leaves every other record alone, saying why.
func TestDiscard_StuckRecordsPrintedThenDeleted_OthersLeftAlone(t *testing.T) {
	eachKind(t, func(t *testing.T, kind string) {
		f := newFixture(t, kind)
		db := f.db
		keyed := publishOf(t, db, 2, "payments", "pay-3")
		execSQL(t, db, "UPDATE acemq_outbox SET attempts = 10, last_error = ? WHERE id = ?", "no exchange 'payments'", keyed[0])
		// Under a live lease of another relay: in flight, not discarded.
		execSQL(t, db, "UPDATE acemq_outbox SET locked_by = 'rails-relay', locked_until = ? WHERE id = ?", ts(kind, time.Now().Add(time.Hour)), f.stuck[1])

		out := ctlMissing(t, 1, "discard", "--db", db.DSN, f.stuck[0], keyed[0], f.stuck[1], f.pending[0], "no-such-id")
		for _, want := range []string{
			"discarding 2 stuck records, as they were (keep this: it is their only copy):\n",
			`"id": "` + f.stuck[0] + `"`, `"routing_key": "orders"`, `"last_error": "connection reset\nby peer"`,
			`"id": "` + keyed[0] + `"`, `"aggregate_id": "pay-3"`, `"body_text": "{\"n\":0}"`,
			"2 rows discarded\n",
			"key pay-3 seq 1 discarded: its key's later records go out, and a consumer's ordered inbox waits for the number",
			"3 of the 5 ids given left as they were:\n",
			"  " + f.stuck[1] + ": in flight: relay rails-relay holds it under a lease until ",
			"  " + f.pending[0] + ": pending: the relay publishes it at its next claim (discard deletes stuck records only)\n",
			"  no-such-id: not in acemq_outbox\n",
		} {
			if !strings.Contains(out, want) {
				t.Errorf("discard does not say %q:\n%s", want, out)
			}
		}
		if n := count(t, db, "SELECT COUNT(*) FROM acemq_outbox WHERE id IN (?, ?)", f.stuck[0], keyed[0]); n != 0 {
			t.Errorf("%d of the discarded records still there", n)
		}
		if n := count(t, db, "SELECT COUNT(*) FROM acemq_outbox WHERE id IN (?, ?, ?)", f.stuck[1], f.pending[0], keyed[1]); n != 3 {
			t.Errorf("discard deleted a record it left alone: %d of 3 left", n)
		}

		// --json: the records, as they were, before the delete.
		execSQL(t, db, "UPDATE acemq_outbox SET locked_by = NULL, locked_until = NULL WHERE id = ?", f.stuck[1])
		var r discardReport
		if err := json.Unmarshal([]byte(mustCtl(t, "discard", "--json", "--db", db.DSN, f.stuck[1])), &r); err != nil {
			t.Fatal(err)
		}
		if len(r.Records) != 1 || r.Records[0].ID != f.stuck[1] || r.Records[0].Attempts != 12 || len(r.LeftAlone) != 0 || count(t, db, "SELECT COUNT(*) FROM acemq_outbox WHERE id = ?", f.stuck[1]) != 0 {
			t.Errorf("discard --json: %+v", r)
		}
		ctl(t, nil, "discard", "--db", db.DSN).wantFailure(t, 2, "give the ids of the stuck records")
	})
}
