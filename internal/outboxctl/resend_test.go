package outboxctl

import (
	"encoding/json"
	"strings"
	"testing"
	"time"
)

// A keyed message a consumer set aside (PoisonOutbox marks its record
// processed) left its key's later messages held by an ordered inbox, and
// no command sent it again: retry refused a published row, and a user
// review cleared published_at and processed_at by hand (a review: 42 of
// 150 keys stopped). resend makes a published record pending again, by id
// or by key and seq, processed mark cleared, and leaves the rest alone.
func TestResend_PublishedRecordPendingAgain_ByIDOrKeyAndSeq(t *testing.T) {
	eachKind(t, func(t *testing.T, kind string) {
		f := newFixture(t, kind)
		db := f.db
		keyed := publishOf(t, db, 3, "payments", "pay-1")
		for _, id := range append([]string{f.publishedOld[0]}, keyed...) {
			execSQL(t, db, "UPDATE acemq_outbox SET published_at = ?, processed_at = ?, last_error = ? WHERE id = ?", ts(kind, time.Now().Add(-time.Hour)), ts(kind, time.Now()), "x", id)
		}

		out := ctlMissing(t, 1, "resend", "--db", db.DSN, f.publishedOld[0], f.pending[0], f.stuck[0], "no-such-id")
		if !strings.HasPrefix(out, "1 row made pending again") ||
			!strings.Contains(out, "  "+f.pending[0]+": pending: the relay publishes it at its next claim (not published yet: the relay sends it)\n") ||
			!strings.Contains(out, "  "+f.stuck[0]+": stuck at 10 attempts") || !strings.Contains(out, "(not published: outboxctl retry ID)\n") ||
			!strings.Contains(out, "  no-such-id: not in acemq_outbox\n") {
			t.Errorf("resend of a published, a pending, a stuck and an unknown id:\n%s", out)
		}
		pendingAgain := "SELECT COUNT(*) FROM acemq_outbox WHERE id = ? AND published_at IS NULL AND processed_at IS NULL AND attempts = 0"
		if count(t, db, pendingAgain, f.publishedOld[0]) != 1 {
			t.Errorf("%s not pending again with its processed mark cleared", f.publishedOld[0])
		}
		if count(t, db, "SELECT COUNT(*) FROM acemq_outbox WHERE id = ? AND attempts = 10", f.stuck[0]) != 1 {
			t.Errorf("resend changed a stuck row")
		}

		var r resendReport
		if err := json.Unmarshal([]byte(mustCtl(t, "resend", "--json", "--db", db.DSN, "--key", "pay-1", "--seq", "2")), &r); err != nil {
			t.Fatal(err)
		}
		if r.Resent != 1 || len(r.LeftAlone) != 0 {
			t.Errorf("resend --key pay-1 --seq 2: %+v", r)
		}
		for i, id := range keyed {
			if got, want := count(t, db, pendingAgain, id), map[bool]int{true: 1, false: 0}[i == 1]; got != want {
				t.Errorf("seq %d: %d rows pending again, want %d", i+1, got, want)
			}
		}
		ctl(t, nil, "resend", "--db", db.DSN, "--key", "pay-1", "--seq", "9").wantFailure(t, 1, "holds no record of key pay-1 seq 9")
		ctl(t, nil, "resend", "--db", db.DSN, "--key", "pay-1").wantFailure(t, 2, "give --key and --seq")
		ctl(t, nil, "resend", "--db", db.DSN, "--key", "pay-1", "--seq", "1", keyed[0]).wantFailure(t, 2, "not both")
		ctl(t, nil, "resend", "--db", db.DSN).wantFailure(t, 2, "give the ids")
	})
}
