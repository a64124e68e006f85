package outboxctl

import (
	"encoding/json"
	"fmt"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// show says where each record is: published (and processed, or not), pending
// (after failed attempts, with the last error), stuck, in flight under a
// relay's live lease, or not in the table.
func TestShow_EachRecordsState(t *testing.T) {
	eachKind(t, func(t *testing.T, kind string) {
		f := newFixture(t, kind)
		db := f.db
		until := time.Now().Add(time.Hour).UTC().Truncate(time.Second)
		execSQL(t, db, "UPDATE acemq_outbox SET locked_by = ?, locked_until = ? WHERE id = ?", "rails-relay-7", ts(kind, until), f.stuck[1])
		execSQL(t, db, "UPDATE acemq_outbox SET attempts = 2, last_error = ? WHERE id = ?", "channel closed", f.pending[1])
		execSQL(t, db, "UPDATE acemq_outbox SET processed_at = ? WHERE id = ?", ts(kind, time.Now()), f.publishedRecent[0])
		out := ctlMissing(t, 1, "show", "--db", db.DSN, f.pending[0], f.pending[1], f.stuck[0], f.stuck[1], f.publishedRecent[0], f.publishedOld[0], "no-such-id", f.pending[0])
		for _, line := range []string{
			// pending[1] fails: pending[0] may wait behind it.
			`(?m)^` + f.pending[0] + `: pending: the relay publishes it at its next claim, unless it waits behind the record failing now \(an unkeyed one holds the records behind it, a keyed one its key's; outboxctl status names the oldest\)\n  to \(default\) / orders, created \S+ \S+Z$`,
			`(?m)^` + f.pending[1] + `: pending after 2 failed attempts of 10: channel closed$`,
			`(?m)^` + f.stuck[0] + `: stuck at 10 attempts \(the relay leaves it alone; retry makes it pending\): connection reset by peer$`,
			`(?m)^` + f.stuck[1] + `: in flight: relay rails-relay-7 holds it under a lease until ` + regexp.QuoteMeta(until.Format("2006-01-02 15:04:05Z")) + `; retry leaves it alone until then$`,
			`(?m)^` + f.publishedRecent[0] + `: published \S+ \S+Z; processed \S+ \S+Z$`,
			`(?m)^` + f.publishedOld[0] + `: published \S+ \S+Z; not marked processed by a consumer of this database$`,
			`(?m)^no-such-id: not in acemq_outbox$`,
		} {
			if !regexp.MustCompile(line).MatchString(out) {
				t.Errorf("show does not match %s:\n%s", line, out)
			}
		}
		if n := strings.Count(out, f.pending[0]+":"); n != 1 {
			t.Errorf("an id given twice shown %d times", n)
		}
		var rows []showRow
		if err := json.Unmarshal([]byte(ctlMissing(t, 1, "show", "--json", "--db", db.DSN, f.stuck[1], "no-such-id")), &rows); err != nil {
			t.Fatal(err)
		}
		if len(rows) != 2 || rows[0].State != "in_flight" || rows[0].LeasedBy == nil || *rows[0].LeasedBy != "rails-relay-7" ||
			rows[0].LeasedUntil == nil || !rows[0].LeasedUntil.Equal(until) || rows[1].Found || rows[1].ID != "no-such-id" {
			t.Errorf("show --json: %+v", rows)
		}
		ctl(t, nil, "show", "--db", db.DSN).wantFailure(t, 2, "give the ids")
	})
}

// retry of ids it leaves alone said only "published already, pending
// already, in flight, or not in the table" of them all, though stuck had
// just shown a lease (an operator's review): it now says of each id why.
func TestRetry_IDsLeftAlone_EachSaysWhy(t *testing.T) {
	eachKind(t, func(t *testing.T, kind string) {
		f := newFixture(t, kind)
		db := f.db
		until := time.Now().Add(time.Hour).UTC()
		execSQL(t, db, "UPDATE acemq_outbox SET locked_by = ?, locked_until = ? WHERE id = ?", "rails-relay-7", ts(kind, until), f.stuck[1])
		// A relay that crashed mid-claim left a lease that ran out: retry
		// clears it, so it is not among those left alone.
		execSQL(t, db, "UPDATE acemq_outbox SET locked_by = ?, locked_until = ? WHERE id = ?", "crashed-relay", ts(kind, time.Now().Add(-time.Hour)), f.pending[1])
		out := ctlMissing(t, 1, "retry", "--db", db.DSN, f.stuck[0], f.stuck[1], f.pending[0], f.publishedOld[0], "no-such-id", f.pending[1])
		want := "2 rows made pending again (attempts reset to 0)\n" +
			"4 of the 6 ids given left as they were:\n" +
			"  " + f.stuck[1] + ": in flight: relay rails-relay-7 holds it under a lease until " + until.Format("2006-01-02 15:04:05Z") + "; retry leaves it alone until then\n" +
			"  " + f.pending[0] + ": pending: the relay publishes it at its next claim\n"
		if !strings.HasPrefix(out, want) || !regexp.MustCompile(`(?m)^  `+f.publishedOld[0]+`: published \S+ \S+Z; not marked processed by a consumer of this database\n  no-such-id: not in acemq_outbox\n$`).MatchString(out) {
			t.Errorf("retry of five ids, one retried:\n%s\nwant it to start:\n%s", out, want)
		}
	})
}

// retry given more ids than its text explains one by one still finds each
// left alone (it looked up the first 100 only, so an id past them not in
// the table went unsaid), and exits 1 for those not in the table.
func TestRetry_ManyIDsNotInTheTable_EachCountedExit1(t *testing.T) {
	f := newFixture(t, testdb.Postgres)
	ids := []string{f.stuck[0]}
	for i := range retryExplained + 5 {
		ids = append(ids, fmt.Sprintf("no-such-id-%d", i))
	}
	out := ctlMissing(t, len(ids)-1, append([]string{"retry", "--db", f.db.DSN}, ids...)...)
	if want := fmt.Sprintf("1 row made pending again (attempts reset to 0)\n%d of the %d ids given left as they were:\n", len(ids)-1, len(ids)); !strings.HasPrefix(out, want) ||
		!strings.HasSuffix(out, "  no-such-id-99: not in acemq_outbox\n  5 more as above (retry --json lists each)\n") {
		t.Errorf("retry of %d ids, one stuck:\n%s", len(ids), out)
	}
	var r retryReport
	if err := json.Unmarshal([]byte(ctlMissing(t, len(ids)-1, append([]string{"retry", "--json", "--db", f.db.DSN}, ids...)...)), &r); err != nil {
		t.Fatal(err)
	}
	if r.Retried != 0 || len(r.LeftAlone) != len(ids) || r.LeftAlone[len(ids)-1].State != "not_found" {
		t.Errorf("retry --json again: retried %d, %d left alone (last %+v); want 0 and %d, the stuck one pending now", r.Retried, len(r.LeftAlone), r.LeftAlone[len(r.LeftAlone)-1], len(ids))
	}
}

// show said "processed" of a record whose message a consumer set aside or
// an ordered inbox holds, neither applied (a user review: "was payment X
// applied?" got yes). It says which, and what to do.
func TestShow_SetAsideOrHeld_SaysNotApplied(t *testing.T) {
	eachKind(t, func(t *testing.T, kind string) {
		db := migrated(t, kind)
		holdRows(t, db, kind) // m3 and m4 held by billing, key order-7
		ids := publish(t, db, 2, "orders")
		aside, held := ids[0], ids[1]
		execSQL(t, db, "UPDATE acemq_outbox SET id = ? WHERE id = ?", "m3", held)
		now := time.Now()
		execSQL(t, db, "UPDATE acemq_outbox SET published_at = ?, processed_at = ?, last_error = ? WHERE id = ?",
			ts(kind, now.Add(-time.Hour)), ts(kind, now), "set aside by billing to orders.poison as c-1: no such warehouse", aside)
		execSQL(t, db, "UPDATE acemq_outbox SET published_at = ?, processed_at = ? WHERE id = ?", ts(kind, now.Add(-time.Hour)), ts(kind, now), "m3")

		out := ctlMissing(t, 1, "show", "--db", db.DSN, aside, "m3", "m4")
		for _, line := range []string{
			`(?m)^` + aside + `: published \S+ \S+Z; set aside by billing to orders.poison as c-1: no such warehouse \(\S+ \S+Z\), not applied: once its cause is fixed, outboxctl resend ID sends it again$`,
			`(?m)^m3: published \S+ \S+Z; marked processed \S+ \S+Z as an ordered inbox held it, not applied yet\n  to \(default\) / orders, created \S+ \S+Z\n  held by billing, key order-7 seq 3, since \S+ \S+Z: its key waits for an earlier number, 2 \(outboxctl held\)$`,
			`(?m)^m4: not in acemq_outbox\n  held by billing, key order-7 seq 4, since `,
		} {
			if !regexp.MustCompile(line).MatchString(out) {
				t.Errorf("show does not match %s:\n%s", line, out)
			}
		}
		var rows []showRow
		if err := json.Unmarshal([]byte(mustCtl(t, "show", "--json", "--db", db.DSN, aside, "m3")), &rows); err != nil {
			t.Fatal(err)
		}
		if !rows[0].SetAside || len(rows[0].Held) != 0 || rows[1].SetAside || len(rows[1].Held) != 1 || rows[1].Held[0].Seq != 3 || rows[1].Held[0].Consumer != "billing" ||
			rows[1].Held[0].LastApplied != 1 {
			t.Errorf("show --json: %+v", rows)
		}
		// Held as the key's next, its handler failing: "waits for an
		// earlier number" was said of it too (an on-call review).
		execSQL(t, db, "UPDATE acemq_inbox_sequences SET last_seq = 2")
		if out := mustCtl(t, "show", "--db", db.DSN, "m3"); !strings.Contains(out, "  held by billing, key order-7 seq 3, since ") ||
			!strings.Contains(out, ": the key's next, its handler failing (outboxctl held shows its error; skip-held gives it up)\n") {
			t.Errorf("show of the key's next, held:\n%s", out)
		}
		// With its handler's failure, as the inbox keeps it in the held
		// row (show --json lacked it, held had it).
		execSQL(t, db, "UPDATE acemq_inbox_held SET metadata = ? WHERE seq = 3", `{"x-acemq-inbox-last-error":"2026-12-06T10:00:00Z the ledger refuses it"}`)
		if out := mustCtl(t, "show", "--db", db.DSN, "m3"); !strings.Contains(out, ": the key's next, its handler failing: 2026-12-06T10:00:00Z the ledger refuses it (skip-held gives it up)\n") {
			t.Errorf("show of the key's next, held, its handler failing:\n%s", out)
		}
		rows = nil
		if err := json.Unmarshal([]byte(mustCtl(t, "show", "--json", "--db", db.DSN, "m3")), &rows); err != nil {
			t.Fatal(err)
		}
		if len(rows) != 1 || len(rows[0].Held) != 1 || rows[0].Held[0].NextError != "2026-12-06T10:00:00Z the ledger refuses it" {
			t.Errorf("show --json of the key's next, its handler failing: %+v", rows)
		}
		// retry said "processed" of it, where show said held.
		if out := mustCtl(t, "retry", "--db", db.DSN, "m3"); !strings.Contains(out, "  m3: published ") || !strings.Contains(out, "as an ordered inbox held it, not applied yet") {
			t.Errorf("retry of a held record:\n%s", out)
		}
	})
}

// held gives a key and the number it waits for, and show took ids only: a
// user review looked each id up in SQL. show takes --key and --seq, as
// resend does.
func TestShow_ByKeyAndSeq(t *testing.T) {
	eachKind(t, func(t *testing.T, kind string) {
		db := migrated(t, kind)
		ids := publishOf(t, db, 2, "payments", "pay-7")
		if out := mustCtl(t, "show", "--db", db.DSN, "--key", "pay-7", "--seq", "2"); !strings.HasPrefix(out, ids[1]+": pending") || !strings.Contains(out, ", key pay-7 seq 2") {
			t.Errorf("show --key pay-7 --seq 2:\n%s", out)
		}
		ctl(t, nil, "show", "--db", db.DSN, "--key", "pay-7", "--seq", "3").wantFailure(t, 1, "holds no record of key pay-7 seq 3")
		ctl(t, nil, "show", "--db", db.DSN, "--key", "pay-7").wantFailure(t, 2, "give --key and --seq")
		ctl(t, nil, "show", "--db", db.DSN, "--key", "pay-7", "--seq", "1", ids[0]).wantFailure(t, 2, "not both")
	})
}

// A message its consumer set aside through PoisonOutbox without
// MarkOutboxProcessed: nothing is noted on its record, and show said "not
// marked processed by a consumer", as of a message lost in a queue (an
// on-call drill). Its poison copy is in the same table: show names it, and
// says the message was not applied. A record whose message no consumer set
// aside still says what it said.
func TestShow_SetAsideWithoutMarkOutboxProcessed_NamesItsPoisonCopy(t *testing.T) {
	eachKind(t, func(t *testing.T, kind string) {
		db := migrated(t, kind)
		ids := publish(t, db, 2, "orders")
		execSQL(t, db, "UPDATE acemq_outbox SET published_at = ?", ts(kind, time.Now().Add(-time.Minute)))
		in, err := outbox.NewInbox(db.DB, outbox.InboxConfig{ConsumerName: "orders", Logger: watermill.NopLogger{}})
		if err != nil {
			t.Fatal(err)
		}
		msg := message.NewMessage(ids[0], []byte(`{}`))
		msg.Metadata.Set(middleware.ReasonForPoisonedKey, "handler always fails")
		if err := in.PoisonOutbox().Publish("orders.poison", msg); err != nil {
			t.Fatal(err)
		}
		out := mustCtl(t, "show", "--db", db.DSN, ids[0], ids[1])
		if !strings.Contains(out, ids[0]+": published") || !strings.Contains(out, "set aside by a consumer, not applied: its poison copy ") {
			t.Errorf("show of a message set aside, its copy in the table:\n%s", out)
		}
		if !strings.Contains(out, "not marked processed by a consumer of this database") || strings.Count(out, "set aside") != 1 {
			t.Errorf("show of a message no consumer set aside:\n%s", out)
		}
		var rows []struct {
			ID           string   `json:"id"`
			PoisonCopies []string `json:"poison_copies"`
		}
		if err := json.Unmarshal([]byte(mustCtl(t, "show", "--json", "--db", db.DSN, ids[0])), &rows); err != nil {
			t.Fatal(err)
		}
		if len(rows) != 1 || len(rows[0].PoisonCopies) != 1 {
			t.Errorf("show --json: %+v, want one poison copy", rows)
		}
	})
}

// A message set aside, resent (as show advises) and applied since: its
// copy stays, and without MarkOutboxProcessed nothing on its record says
// so, but it was published again after the copy was written, and show no
// longer says "not applied" (a code review).
func TestShow_SetAsideThenResentAndApplied_NotSaidNotApplied(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	ids := publish(t, db, 1, "orders")
	execSQL(t, db, "UPDATE acemq_outbox SET published_at = ?", ts(testdb.SQLite, time.Now().Add(-time.Minute)))
	in, err := outbox.NewInbox(db.DB, outbox.InboxConfig{ConsumerName: "orders", Logger: watermill.NopLogger{}})
	if err != nil {
		t.Fatal(err)
	}
	msg := message.NewMessage(ids[0], []byte(`{}`))
	msg.Metadata.Set(middleware.ReasonForPoisonedKey, "handler failed until a fix")
	if err := in.PoisonOutbox().Publish("orders.poison", msg); err != nil {
		t.Fatal(err)
	}
	mustCtl(t, "resend", "--db", db.DSN, ids[0])
	execSQL(t, db, "UPDATE acemq_outbox SET published_at = ? WHERE id = ?", ts(testdb.SQLite, time.Now()), ids[0])
	// The consumer, fixed, applies the redelivery.
	h := in.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, nil })
	if _, err := h(message.NewMessage(ids[0], []byte(`{}`))); err != nil {
		t.Fatal(err)
	}
	var n int
	if err := db.Get(&n, "SELECT COUNT(*) FROM processed_messages WHERE consumer_name = 'orders'"); err != nil || n != 1 {
		t.Fatalf("inbox rows %d (%v), want the message applied", n, err)
	}
	out := mustCtl(t, "show", "--db", db.DSN, ids[0])
	if strings.Contains(out, "not applied") {
		t.Errorf("show of a message set aside, resent and applied since:\n%s", out)
	}
}
