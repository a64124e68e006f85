package outboxctl

import (
	"encoding/json"
	"regexp"
	"strings"
	"testing"
	"time"
)

// A held message's record was marked processed when it was held (so that
// Republish leaves it alone), and after skip-held gave it up show said
// "processed" of a message never applied; so it did of a set-aside record
// whose number skip-gap gave up on, and offered a resend its key drops as
// a duplicate. The skips note the records of this database's outbox they
// give up on; show says so, and resend leaves them alone. So it does a
// poison copy (skip-held --park's here), which would go back to the poison
// topic.
func TestSkips_NoteTheRecordsGivenUp_ShowSaysNeverApplied_ResendLeavesThem(t *testing.T) {
	eachKind(t, func(t *testing.T, kind string) {
		f := newFixture(t, kind)
		db := f.db
		ids := publishOf(t, db, 5, "payments", "pay-9")
		// 1 applied; 2 held and failing; 3 set aside (a poison queue),
		// 4 held behind it; 5 not published yet.
		for i, id := range ids[:4] {
			note := any(nil)
			if i == 2 {
				note = "set aside by billing to payments.poison as p-3: boom"
			}
			execSQL(t, db, "UPDATE acemq_outbox SET published_at = ?, processed_at = ?, last_error = ? WHERE id = ?", ts(kind, time.Now().Add(-time.Hour)), ts(kind, time.Now().Add(-time.Hour)), note, id)
		}
		execSQL(t, db, "INSERT INTO acemq_inbox_sequences (consumer_name, aggregate_id, last_seq, held) VALUES (?, ?, ?, ?)", "billing", "pay-9", 1, 2)
		for _, seq := range []int{2, 4} {
			execSQL(t, db, "INSERT INTO acemq_inbox_held (consumer_name, aggregate_id, seq, message_id, payload, payload_encoding, metadata, held_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
				"billing", "pay-9", seq, ids[seq-1], "{}", "utf-8", `{"aggregateId":"pay-9","seq":"`+string(rune('0'+seq))+`"}`, ts(kind, time.Now().Add(-time.Hour)))
		}

		parked := regexp.MustCompile(`written into acemq_outbox as (\S+), to payments.poison`).FindStringSubmatch(
			mustCtl(t, "skip-held", "--db", db.DSN, "--consumer", "billing", "--key", "pay-9", "--seq", "2", "--park", "payments.poison"))
		if parked == nil {
			t.Fatal("skip-held --park does not say where it wrote the copy")
		}
		mustCtl(t, "skip-gap", "--db", db.DSN, "--consumer", "billing", "--key", "pay-9", "--from", "3", "--through", "3")

		out := mustCtl(t, "show", "--db", db.DSN, ids[0], ids[1], ids[2])
		lines := strings.Split(out, "\n")
		for i, want := range map[int]string{
			0: ids[0] + ": published ",
			2: ids[1] + ": published ",
			4: ids[2] + ": published ",
		} {
			if !strings.HasPrefix(lines[i], want) {
				t.Fatalf("show:\n%s", out)
			}
		}
		if !strings.HasSuffix(lines[0], "; processed "+lines[0][len(lines[0])-20:]) {
			t.Errorf("an applied record does not read processed:\n%s", lines[0])
		}
		for _, l := range []string{lines[2], lines[4]} {
			if !strings.Contains(l, "; skipped by billing, ") || !strings.Contains(l, "never applied; sent again, it is dropped as a duplicate") {
				t.Errorf("a skipped record does not say so:\n%s", out)
			}
		}
		if !strings.Contains(lines[2], "held seq 2 of key pay-9 (SkipHeld)") || !strings.Contains(lines[4], "gap 3 of key pay-9 (SkipGap)") {
			t.Errorf("the notes do not name the skips:\n%s", out)
		}
		var js []showRow
		if err := json.Unmarshal([]byte(mustCtl(t, "show", "--json", "--db", db.DSN, ids[1], ids[2], ids[3])), &js); err != nil {
			t.Fatal(err)
		}
		if len(js) != 3 || !js[0].Skipped || !js[1].Skipped || js[1].SetAside || js[2].Skipped {
			t.Errorf("show --json: %+v", js)
		}
		if n := count(t, db, "SELECT COUNT(*) FROM acemq_outbox WHERE id = ? AND published_at IS NULL", ids[4]); n != 1 {
			t.Errorf("a skip touched a record not published")
		}

		out = mustCtl(t, "resend", "--db", db.DSN, ids[1], ids[2])
		if !strings.HasPrefix(out, "0 rows made pending again") || !strings.Contains(out, "  "+ids[1]+": skipped by billing, ") {
			t.Errorf("resend of skipped records:\n%s", out)
		}

		// The parked copy, once published: resent, it would go to the poison
		// topic again, not to the consumer; its id is easily taken for the
		// message's.
		copyID := parked[1]
		execSQL(t, db, "UPDATE acemq_outbox SET published_at = ? WHERE id = ?", ts(kind, time.Now()), copyID)
		if out := mustCtl(t, "show", "--db", db.DSN, copyID); !strings.Contains(out, "\n  a poison copy of "+ids[1]+" (x-acemq-poisoned-id): outboxctl show "+ids[1]+" tells where the message is") {
			t.Errorf("show of a poison copy:\n%s", out)
		}
		var r resendReport
		if err := json.Unmarshal([]byte(mustCtl(t, "resend", "--json", "--db", db.DSN, copyID)), &r); err != nil {
			t.Fatal(err)
		}
		if r.Resent != 0 || len(r.LeftAlone) != 1 || r.LeftAlone[0].State != "poison_copy" || !strings.Contains(r.LeftAlone[0].Why, "outboxctl resend "+ids[1]+" sends the message to its consumer") {
			t.Errorf("resend of a poison copy: %+v", r)
		}
		// Nor is it restored as its message: the key moved past it.
		ctl(t, nil, "restore", "--db", db.DSN, "--topic", "payments", copyID).wantFailure(t, 1, "a copy skip-held --park wrote")
		if n := count(t, db, "SELECT COUNT(*) FROM acemq_outbox WHERE id IN (?, ?) AND published_at IS NOT NULL AND last_error LIKE 'skipped by %'", ids[1], ids[2]); n != 2 {
			t.Errorf("resend changed a skipped record")
		}
	})
}

// Keys are not unique across services: a skip-gap of a key whose messages
// come from another database's outbox marked this service's own published
// record of the same key and number "processed, skipped by …" (a code
// review), which resend then refused and Republish left alone. The skip
// notes records only where the key's held messages are this outbox's.
func TestSkipGap_KeyOfAnotherServicesMessages_OwnRecordsOfTheKeyUntouched(t *testing.T) {
	eachKind(t, func(t *testing.T, kind string) {
		f := newFixture(t, kind)
		db := f.db
		// This service's own stream of key pay-9 (seq 1..3), published, not processed.
		ids := publishOf(t, db, 3, "shipping", "pay-9")
		for _, id := range ids {
			execSQL(t, db, "UPDATE acemq_outbox SET published_at = ? WHERE id = ?", ts(kind, time.Now().Add(-time.Hour)), id)
		}
		// The inbox consumes another service's pay-9 stream: 1 applied, 3 held, 2 missing.
		execSQL(t, db, "INSERT INTO acemq_inbox_sequences (consumer_name, aggregate_id, last_seq, held) VALUES (?, ?, ?, ?)", "billing", "pay-9", 1, 1)
		execSQL(t, db, "INSERT INTO acemq_inbox_held (consumer_name, aggregate_id, seq, message_id, payload, payload_encoding, metadata, held_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
			"billing", "pay-9", 3, "foreign-msg-3", "{}", "utf-8", `{"aggregateId":"pay-9","seq":"3"}`, ts(kind, time.Now().Add(-time.Hour)))
		mustCtl(t, "skip-gap", "--db", db.DSN, "--consumer", "billing", "--key", "pay-9", "--from", "2", "--through", "2")
		if n := count(t, db, "SELECT COUNT(*) FROM acemq_outbox WHERE id = ? AND (processed_at IS NOT NULL OR last_error IS NOT NULL)", ids[1]); n != 0 {
			t.Errorf("skip-gap of another service's pay-9 stream marked this outbox's unrelated record %s processed/skipped", ids[1])
		}
	})
}
