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
		// Held by an ordered inbox of this database: applied from the
		// hold; resent while its handler fails, it was set aside a second
		// time, still held (an on-call review). Left alone.
		execSQL(t, db, "INSERT INTO acemq_inbox_sequences (consumer_name, aggregate_id, last_seq) VALUES (?, ?, ?)", "billing", "pay-1", 2)
		execSQL(t, db, "INSERT INTO acemq_inbox_held (consumer_name, aggregate_id, seq, message_id, payload, payload_encoding, metadata, held_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
			"billing", "pay-1", 3, keyed[2], "{}", "utf-8", "{}", ts(kind, time.Now()))
		if out := mustCtl(t, "resend", "--db", db.DSN, keyed[2]); !strings.HasPrefix(out, "0 rows made pending again") ||
			!strings.Contains(out, "  "+keyed[2]+": held by billing, key pay-1 seq 3: the ordered inbox applies it from the hold") {
			t.Errorf("resend of a held record:\n%s", out)
		}
		if count(t, db, pendingAgain, keyed[2]) != 0 {
			t.Errorf("resend made a held record pending")
		}
		ctl(t, nil, "resend", "--db", db.DSN, "--key", "pay-1", "--seq", "9").wantFailure(t, 1, "holds no record of key pay-1 seq 9")
		ctl(t, nil, "resend", "--db", db.DSN, "--key", "pay-1").wantFailure(t, 2, "give --key and --seq")
		ctl(t, nil, "resend", "--db", db.DSN, "--key", "pay-1", "--seq", "1", keyed[0]).wantFailure(t, 2, "not both")
		ctl(t, nil, "resend", "--db", db.DSN).wantFailure(t, 2, "give the ids")
	})
}
