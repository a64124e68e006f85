package outboxctl

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"reflect"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/acemq/watermill-outbox/internal/testdb"
)

// holdRows writes what the ordered inbox leaves for a key whose seq 2 never
// came: 1 applied, 3 and 4 held an hour ago. Written by hand, independently
// of the code under test.
func holdRows(t *testing.T, db *testdb.DB, kind string) {
	t.Helper()
	execSQL(t, db, "INSERT INTO acemq_inbox_sequences (consumer_name, aggregate_id, last_seq) VALUES (?, ?, ?)", "billing", "order-7", 1)
	for _, seq := range []int{3, 4} {
		execSQL(t, db, "INSERT INTO acemq_inbox_held (consumer_name, aggregate_id, seq, message_id, payload, payload_encoding, metadata, held_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
			"billing", "order-7", seq, "m"+string(rune('0'+seq)), "{}", "utf-8", "{}", ts(kind, time.Now().Add(-time.Hour)))
	}
}

func TestHeld_ListsKeysWaitingAndSince_SkipGapMovesTheKeyOn(t *testing.T) {
	eachKind(t, func(t *testing.T, kind string) {
		db := migrated(t, kind)
		if out := mustCtl(t, "held", "--db", db.DSN); !strings.Contains(out, "no held messages") {
			t.Errorf("held on an empty inbox:\n%s", out)
		}
		holdRows(t, db, kind)
		out := mustCtl(t, "held", "--db", db.DSN)
		for _, want := range []string{"billing", "order-7", "WAITING FOR", " 2 ", "1h0m0s", "skip-gap", "set aside by a poison queue", "outboxctl resend --key K --seq N"} {
			if !strings.Contains(out, want) {
				t.Errorf("held does not say %q:\n%s", want, out)
			}
		}
		// status counts them: it looked healthy with 42 keys stopped (a
		// user review).
		if out := mustCtl(t, "status", "--db", db.DSN); !regexp.MustCompile(`(?m)^held \(ordered inbox\)\s+2 on 1 key, the longest for 1h0m: their keys wait \(see outboxctl held\)$`).MatchString(out) {
			t.Errorf("status with two messages held on one key for an hour:\n%s", out)
		}
		if st := decodeJSON(t, mustCtl(t, "status", "--db", db.DSN, "--json")); st["held_messages"] != 2.0 || st["held_keys"] != 1.0 || st["oldest_held_at"] == nil {
			t.Errorf("status --json: held_messages %v, held_keys %v, oldest_held_at %v; want 2, 1 and an hour ago", st["held_messages"], st["held_keys"], st["oldest_held_at"])
		}
		// Keys held for less than --older-than are not listed, and not
		// taken for none: "no held messages" read as an inbox holding
		// nothing.
		if out := mustCtl(t, "held", "--db", db.DSN, "--older-than", "2h"); strings.Contains(out, "order-7") || !strings.Contains(out, "no key has a message held longer than 2h0m0s (keys holding messages for less: 1;") {
			t.Errorf("held --older-than 2h, a key held for 1h:\n%s", out)
		}
		// Ages as purge takes them, days too.
		if out := mustCtl(t, "held", "--db", db.DSN, "--older-than", "1d"); strings.Contains(out, "order-7") || !strings.Contains(out, "no key has a message held longer than 24h0m0s") {
			t.Errorf("held --older-than 1d, a key held for 1h:\n%s", out)
		}
		if out := mustCtl(t, "held", "--db", db.DSN, "--older-than", "0d30m"); strings.Contains(out, "no held messages") {
			t.Errorf("held --older-than 0d30m leaves out a key held for 1h:\n%s", out)
		}
		js := decodeJSON(t, mustCtl(t, "held", "--db", db.DSN, "--json"))
		keys, _ := js["keys"].([]any)
		if len(keys) != 1 {
			t.Fatalf("held --json: %v, want one key", js)
		}
		k := keys[0].(map[string]any)
		if k["last_applied"] != 1.0 || k["held"] != 2.0 || k["lowest_held"] != 3.0 || k["missing"] != 1.0 {
			t.Errorf("held --json key %v, want last 1, 2 held from 3, 1 missing", k)
		}

		if !strings.Contains(out, "--from A --through B") {
			t.Errorf("held does not say how to skip:\n%s", out)
		}

		// Through a held number: 3 is not missing, and nothing changes.
		skip := func(from, through string) []string {
			return []string{"skip-gap", "--db", db.DSN, "--consumer", "billing", "--key", "order-7", "--from", from, "--through", through}
		}
		ctl(t, nil, skip("2", "3")...).wantFailure(t, 1, "nothing skipped")
		if n := count(t, db, "SELECT COUNT(*) FROM acemq_inbox_sequences WHERE last_seq = 1"); n != 1 {
			t.Errorf("a refused skip-gap moved last_seq")
		}
		out = mustCtl(t, skip("2", "2")...)
		if !strings.Contains(out, "skipped 2;") || !strings.Contains(out, "last applied is now 2") {
			t.Errorf("skip-gap:\n%s", out)
		}
		if n := count(t, db, "SELECT COUNT(*) FROM acemq_inbox_sequences WHERE last_seq = 2"); n != 1 {
			t.Errorf("last_seq not moved to 2")
		}
		if n := count(t, db, "SELECT COUNT(*) FROM acemq_inbox_held"); n != 2 {
			t.Errorf("%d held after skip-gap, want 2: they are the service's to apply, with its handler", n)
		}
		// The same skip again, as from a stale screen: 2 is gone already.
		ctl(t, nil, skip("2", "2")...).wantFailure(t, 1, "last applied is now 2")
		ctl(t, nil, "skip-gap", "--db", db.DSN, "--consumer", "billing", "--key", "order-8", "--from", "2", "--through", "2").wantFailure(t, 1, "no gap to skip")
	})
}

// skip-gap takes the gap by both ends, as held shows it: without either
// end, or with ends that name no numbers, it is a usage error naming the
// flag, and it changes nothing.
func TestSkipGap_FromAndThroughRequired_UsageErrorNamingTheFlag(t *testing.T) {
	eachKind(t, func(t *testing.T, kind string) {
		db := migrated(t, kind)
		holdRows(t, db, kind)
		base := []string{"skip-gap", "--db", db.DSN}
		for _, c := range []struct {
			args []string
			want string
		}{
			{[]string{"--consumer", "billing", "--from", "2", "--through", "2"}, "--key"},
			{[]string{"--key", "order-7", "--from", "2", "--through", "2"}, "--consumer"},
			{[]string{"--consumer", "billing", "--key", "order-7", "--through", "2"}, "--from"},
			{[]string{"--consumer", "billing", "--key", "order-7", "--from", "2"}, "--through"},
			{[]string{"--consumer", "billing", "--key", "order-7", "--from", "0", "--through", "2"}, "--from"},
			{[]string{"--consumer", "billing", "--key", "order-7", "--from", "-1", "--through", "2"}, "--from"},
			{[]string{"--consumer", "billing", "--key", "order-7", "--from", "3", "--through", "2"}, "--through"},
		} {
			ctl(t, nil, append(base, c.args...)...).wantFailure(t, 2, c.want)
		}
		if n := count(t, db, "SELECT COUNT(*) FROM acemq_inbox_sequences WHERE last_seq = 1"); n != 1 {
			t.Errorf("a skip-gap refused for its flags moved last_seq")
		}
	})
}

// held --json says what skip-gap takes: from and through, the ends of
// WAITING FOR; and a gap whose start moved on since it was shown (2
// arrived) is refused, not skipped from its end.
func TestHeld_JSONNamesFromAndThrough_SkipOfAMovedGapRefused(t *testing.T) {
	eachKind(t, func(t *testing.T, kind string) {
		db := migrated(t, kind)
		execSQL(t, db, "INSERT INTO acemq_inbox_sequences (consumer_name, aggregate_id, last_seq, held) VALUES (?, ?, ?, ?)", "billing", "order-5", 1, 1)
		execSQL(t, db, "INSERT INTO acemq_inbox_held (consumer_name, aggregate_id, seq, message_id, payload, payload_encoding, metadata, held_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
			"billing", "order-5", 5, "m5", "{}", "utf-8", "{}", ts(kind, time.Now().Add(-time.Hour)))
		js := decodeJSON(t, mustCtl(t, "held", "--db", db.DSN, "--json"))
		keys, _ := js["keys"].([]any)
		if len(keys) != 1 {
			t.Fatalf("held --json: %v, want one key", js)
		}
		k := keys[0].(map[string]any)
		if k["from"] != 2.0 || k["through"] != 4.0 || k["last_applied"] != 1.0 || k["lowest_held"] != 5.0 {
			t.Fatalf("held --json key %v, want from 2 through 4 (last 1, 5 held)", k)
		}
		// 2 arrives and is applied, as the service would do it.
		execSQL(t, db, "UPDATE acemq_inbox_sequences SET last_seq = 2 WHERE aggregate_id = ?", "order-5")
		ctl(t, nil, "skip-gap", "--db", db.DSN, "--consumer", "billing", "--key", "order-5", "--from", "2", "--through", "4").wantFailure(t, 1, "nothing skipped")
		if n := count(t, db, "SELECT COUNT(*) FROM acemq_inbox_sequences WHERE last_seq = 2"); n != 1 {
			t.Errorf("a refused skip-gap moved last_seq")
		}
		// A key whose next message is held waits for nothing: no ends.
		execSQL(t, db, "UPDATE acemq_inbox_sequences SET last_seq = 4 WHERE aggregate_id = ?", "order-5")
		js = decodeJSON(t, mustCtl(t, "held", "--db", db.DSN, "--json"))
		k = js["keys"].([]any)[0].(map[string]any)
		if f, ok := k["from"]; !ok || f != nil || k["through"] != nil {
			t.Errorf("held --json key waiting for nothing %v, want from and through null", k)
		}
	})
}

// Keys that differ only in trailing spaces (two keys on every database,
// MySQL's since 0009) are told apart in the table: the one whose text does
// not say which key it is is quoted, and skip-gap takes it as --key.
func TestHeld_KeysDifferingInTrailingSpaces_Quoted(t *testing.T) {
	eachKind(t, func(t *testing.T, kind string) {
		db := migrated(t, kind)
		for _, key := range []string{"order-7", "order-7 "} {
			execSQL(t, db, "INSERT INTO acemq_inbox_sequences (consumer_name, aggregate_id, last_seq, held) VALUES (?, ?, ?, ?)", "billing", key, 1, 1)
			execSQL(t, db, "INSERT INTO acemq_inbox_held (consumer_name, aggregate_id, seq, message_id, payload, payload_encoding, metadata, held_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
				"billing", key, 3, "m-"+strings.TrimSpace(key)+string(rune('a'+len(key))), "{}", "utf-8", "{}", ts(kind, time.Now().Add(-time.Hour)))
		}
		out := mustCtl(t, "held", "--db", db.DSN)
		if !strings.Contains(out, ` "order-7 " `) || !strings.Contains(out, " order-7 ") {
			t.Errorf("held does not tell the two keys apart:\n%s", out)
		}
		js := decodeJSON(t, mustCtl(t, "held", "--db", db.DSN, "--json"))
		keys, _ := js["keys"].([]any)
		var forSkip []string
		for _, k := range keys {
			forSkip = append(forSkip, k.(map[string]any)["key"].(string))
		}
		if strings.Join(forSkip, "|") != `order-7|"order-7 "` {
			t.Errorf("held --json keys for skip-gap %q, want order-7 and \"order-7 \"", forSkip)
		}
		// As held shows it, quoted.
		mustCtl(t, "skip-gap", "--db", db.DSN, "--consumer", "billing", "--key", `"order-7 "`, "--from", "2", "--through", "2")
		if n := count(t, db, "SELECT COUNT(*) FROM acemq_inbox_sequences WHERE last_seq = 2 AND aggregate_id = 'order-7 '"); n != 1 {
			t.Errorf("%d keys moved to 2, want 1: only \"order-7 \"", n)
		}
		if n := count(t, db, "SELECT COUNT(*) FROM acemq_inbox_sequences WHERE last_seq = 1 AND aggregate_id = 'order-7'"); n != 1 {
			t.Errorf("\"order-7\" moved too")
		}
	})
}

// A gap of several numbers skipped through the middle: the output names
// the range skipped, and the key waits for the rest.
func TestSkipGap_ThroughInsideTheGap_SkipsThatFarAndSaysSo(t *testing.T) {
	eachKind(t, func(t *testing.T, kind string) {
		db := migrated(t, kind)
		execSQL(t, db, "INSERT INTO acemq_inbox_sequences (consumer_name, aggregate_id, last_seq, held) VALUES (?, ?, ?, ?)", "billing", "order-9", 1, 1)
		execSQL(t, db, "INSERT INTO acemq_inbox_held (consumer_name, aggregate_id, seq, message_id, payload, payload_encoding, metadata, held_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
			"billing", "order-9", 6, "m6", "{}", "utf-8", "{}", ts(kind, time.Now().Add(-time.Hour)))
		if out := mustCtl(t, "held", "--db", db.DSN); !strings.Contains(out, " 2..5 ") {
			t.Errorf("held does not say 2..5:\n%s", out)
		}
		out := mustCtl(t, "skip-gap", "--db", db.DSN, "--consumer", "billing", "--key", "order-9", "--from", "2", "--through", "4")
		if !strings.Contains(out, "skipped 2..4;") || !strings.Contains(out, "last applied is now 4") {
			t.Errorf("skip-gap:\n%s", out)
		}
		if out := mustCtl(t, "held", "--db", db.DSN); !strings.Contains(out, "billing") || !strings.Contains(out, " 5 ") {
			t.Errorf("held after skipping 2..4 does not say the key waits for 5:\n%s", out)
		}
	})
}

// retry --all-stuck leaves a stuck row another library's relay holds under
// a live lease alone, and says so rather than report only the rows it
// retried.
func TestRetryAllStuck_RowUnderALiveLease_LeftAloneAndSaid(t *testing.T) {
	eachKind(t, func(t *testing.T, kind string) {
		f := newFixture(t, kind)
		db := f.db
		execSQL(t, db, "UPDATE acemq_outbox SET locked_by = ?, locked_until = ? WHERE id = ?",
			"rails-relay-1", ts(kind, time.Now().Add(time.Hour)), f.stuck[0])
		out := mustCtl(t, "retry", "--all-stuck", "--db", db.DSN)
		if n := count(t, db, "SELECT COUNT(*) FROM acemq_outbox WHERE id = ? AND attempts >= 10", f.stuck[0]); n != 1 {
			t.Fatalf("the leased stuck row was retried")
		}
		if !strings.Contains(out, "1 row still stuck: a relay holds them under a live lease") {
			t.Errorf("retry --all-stuck did not say it left the leased row alone:\n%s", out)
		}
	})
}

// A key's next message is held and its handler keeps failing (1 applied, 2
// held and failing, 4 held behind a missing 3): skip-held gives up on 2,
// hands it back with --json, and moves the key on to wait for 3; it skips
// only the key's next, only a held one, and takes a key as held shows it.
func TestSkipHeld_GivesUpOnTheKeysNextHeldMessage_HandsItBack(t *testing.T) {
	eachKind(t, func(t *testing.T, kind string) {
		db := migrated(t, kind)
		execSQL(t, db, "INSERT INTO acemq_inbox_sequences (consumer_name, aggregate_id, last_seq, held) VALUES (?, ?, ?, ?)", "billing", "order-7 ", 1, 2)
		for _, seq := range []int{2, 4} {
			failed := ""
			if seq == 2 { // as the inbox writes a failed apply (noteHeldFailure)
				failed = `,"x-acemq-inbox-last-error":"2026-12-06T10:00:00Z the ledger refuses it"`
			}
			execSQL(t, db, "INSERT INTO acemq_inbox_held (consumer_name, aggregate_id, seq, message_id, payload, payload_encoding, metadata, held_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
				"billing", "order-7 ", seq, "m"+string(rune('0'+seq)), "event", "utf-8", `{"aggregateId":"order-7 ","seq":"`+string(rune('0'+seq))+`","x-acemq-inbox-handler":"on_order"`+failed+`}`, ts(kind, time.Now().Add(-time.Hour)))
		}
		// Why the key waits: its next message's handler failed so.
		if out := mustCtl(t, "held", "--db", db.DSN); !strings.Contains(out, "billing \"order-7 \" seq 2: its handler failed 2026-12-06T10:00:00Z the ledger refuses it\n") {
			t.Errorf("held does not say why the key waits:\n%s", out)
		}
		if js := decodeJSON(t, mustCtl(t, "held", "--db", db.DSN, "--json")); js["keys"].([]any)[0].(map[string]any)["next_error"] != "2026-12-06T10:00:00Z the ledger refuses it" {
			t.Errorf("held --json: %v; want next_error", js)
		}
		if out := mustCtl(t, "held", "--db", db.DSN); !strings.Contains(out, "nothing: next held (*)") || !strings.Contains(out, `logs "Held message could not be applied" with its error`) || !strings.Contains(out, "skip-held --consumer C --key K --seq LAST+1 gives up on it") {
			t.Errorf("held does not say how to give up on a failing next message:\n%s", out)
		}
		skip := func(seq string, more ...string) []string {
			return append([]string{"skip-held", "--db", db.DSN, "--consumer", "billing", "--key", `"order-7 "`, "--seq", seq}, more...)
		}
		ctl(t, nil, skip("4")...).wantFailure(t, 1, "nothing skipped")
		ctl(t, nil, skip("3")...).wantFailure(t, 1, "nothing skipped")
		ctl(t, nil, "skip-held", "--db", db.DSN, "--consumer", "billing", "--key", "order-7").wantFailure(t, 2, "give --consumer, --key and --seq")
		if n := count(t, db, "SELECT COUNT(*) FROM acemq_inbox_held"); n != 2 {
			t.Fatalf("a refused skip-held changed the held rows: %d left", n)
		}
		var got skippedReport
		if err := json.Unmarshal([]byte(mustCtl(t, skip("2", "--json")...)), &got); err != nil {
			t.Fatal(err)
		}
		if got.MessageID != "m2" || string(got.Payload) != "event" || got.PayloadText == nil || *got.PayloadText != "event" ||
			got.LastError != "2026-12-06T10:00:00Z the ledger refuses it" || got.Key != `"order-7 "` || got.Seq != 2 ||
			!reflect.DeepEqual(got.Metadata, map[string]string{"aggregateId": "order-7 ", "seq": "2"}) {
			t.Errorf("skip-held --json: %+v, want m2 with its payload and metadata, without the inbox's own", got)
		}
		if n := count(t, db, "SELECT COUNT(*) FROM acemq_inbox_sequences WHERE last_seq = 2 AND held = 1"); n != 1 {
			t.Errorf("after skip-held: last_seq not 2 with 1 held")
		}
		if out := mustCtl(t, "held", "--db", db.DSN); !regexp.MustCompile(`(?m)^billing\s+"order-7 "\s+2\s+1\s+3\s`).MatchString(out) {
			t.Errorf("held after skip-held does not show the key waiting for 3:\n%s", out)
		}

		// Without --json the message is printed too: its row was its only
		// copy (the broker was told it was handled when it was held).
		execSQL(t, db, "INSERT INTO acemq_inbox_held (consumer_name, aggregate_id, seq, message_id, payload, payload_encoding, metadata, held_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
			"billing", "order-7 ", 3, "m3", "event three", "utf-8", `{"aggregateId":"order-7 ","seq":"3","tenant":"t-1"}`, ts(kind, time.Now()))
		execSQL(t, db, "UPDATE acemq_inbox_sequences SET held = 2 WHERE consumer_name = ? AND aggregate_id = ?", "billing", "order-7 ")
		out := mustCtl(t, skip("3")...)
		for _, want := range []string{"skipping held message m3", `"message_id": "m3"`, base64.StdEncoding.EncodeToString([]byte("event three")), `"tenant": "t-1"`} {
			if !strings.Contains(out, want) {
				t.Errorf("skip-held without --json does not print %s:\n%s", want, out)
			}
		}
	})
}

// held, skip-gap and skip-held on a database without the ordered inbox's
// tables (migrated before 0006, or by a tool stopped short) say to run
// migrate, which makes them; not to check --table or --inbox-table, which
// do not name them.
func TestHeldAndSkips_OrderedInboxTablesMissing_SayMigrateCreatesThem(t *testing.T) {
	eachKind(t, func(t *testing.T, kind string) {
		db := migrated(t, kind)
		execSQL(t, db, "DROP TABLE acemq_inbox_held")
		execSQL(t, db, "DROP TABLE acemq_inbox_sequences")
		const want = "acemq_inbox_sequences or acemq_inbox_held does not exist: run `outboxctl migrate`, which creates the ordered inbox's tables in migration 0006"
		for _, args := range [][]string{
			{"held"}, {"held", "--json"},
			{"skip-gap", "--consumer", "billing", "--key", "order-7", "--from", "2", "--through", "2"},
			{"skip-held", "--consumer", "billing", "--key", "order-7", "--seq", "2"},
		} {
			r := ctl(t, nil, append(args, "--db", db.DSN)...)
			r.wantFailure(t, 1, want)
			if strings.Contains(r.stderr, "--table") {
				t.Errorf("outboxctl %s points at --table/--inbox-table, which do not name the ordered inbox's tables:\n%s", args[0], r.stderr)
			}
		}
	})
}

// Consumers whose names differ in trailing spaces are two consumers: held
// shows one that is not plain quoted, as it shows keys, and skip-gap and
// skip-held take it as shown. Before, "billing " printed as billing, and
// skip-gap --consumer billing found no gap to skip.
func TestHeld_ConsumerEndingInASpace_ShownQuotedAndSkippedAsShown(t *testing.T) {
	eachKind(t, func(t *testing.T, kind string) {
		db := migrated(t, kind)
		execSQL(t, db, "INSERT INTO acemq_inbox_sequences (consumer_name, aggregate_id, last_seq, held) VALUES (?, ?, ?, ?)", "billing ", "order-7", 1, 1)
		execSQL(t, db, "INSERT INTO acemq_inbox_held (consumer_name, aggregate_id, seq, message_id, payload, payload_encoding, metadata, held_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
			"billing ", "order-7", 3, "m3", "event", "utf-8", `{"aggregateId":"order-7","seq":"3"}`, ts(kind, time.Now().Add(-time.Hour)))
		out := mustCtl(t, "held", "--db", db.DSN)
		if !regexp.MustCompile(`(?m)^"billing "\s+order-7\s+1\s+1\s+2\s`).MatchString(out) {
			t.Fatalf("held does not show the consumer quoted:\n%s", out)
		}
		out = mustCtl(t, "skip-gap", "--db", db.DSN, "--consumer", `"billing "`, "--key", "order-7", "--from", "2", "--through", "2")
		if !strings.Contains(out, `"billing ", key order-7: skipped 2;`) {
			t.Errorf("skip-gap:\n%s", out)
		}
		if n := count(t, db, "SELECT COUNT(*) FROM acemq_inbox_sequences WHERE last_seq = 2"); n != 1 {
			t.Errorf("last_seq not moved to 2")
		}
		ctl(t, nil, "skip-held", "--db", db.DSN, "--consumer", `"billing`, "--key", "order-7", "--seq", "3").wantFailure(t, 2, `--consumer "billing: starts with a quote but is not quoted as outboxctl shows it`)
		ctl(t, nil, "skip-gap", "--db", db.DSN, "--consumer", `""`, "--key", "order-7", "--from", "3", "--through", "3").wantFailure(t, 2, "must not be empty")
		ctl(t, nil, "skip-held", "--db", db.DSN, "--consumer", "billing ", "--key", `""`, "--seq", "3").wantFailure(t, 2, "give --consumer, --key and --seq")
	})
}

// skip-held printed the message it gave up on, its only copy: a user
// review's on-call did not save the output, and the message was gone.
// --park writes it into the outbox first, to a topic of the operator's,
// for the relay to publish there.
func TestSkipHeld_Park_WritesTheMessageIntoTheOutboxFirst(t *testing.T) {
	eachKind(t, func(t *testing.T, kind string) {
		db := migrated(t, kind)
		holdRows(t, db, kind)
		execSQL(t, db, "UPDATE acemq_inbox_held SET metadata = ? WHERE seq = 3", `{"aggregateId":"order-7","seq":"3","tenant":"eu"}`)
		execSQL(t, db, "UPDATE acemq_inbox_sequences SET last_seq = 2")
		out := mustCtl(t, "skip-held", "--db", db.DSN, "--consumer", "billing", "--key", "order-7", "--seq", "3", "--park", "billing.poison", "--exchange", "shop")
		if !regexp.MustCompile(`(?m)^written into acemq_outbox as \S+, to billing.poison: the relay publishes it there$`).MatchString(out) {
			t.Errorf("skip-held --park:\n%s", out)
		}
		var row struct {
			Exchange string `db:"exchange_name"`
			Body     string `db:"body"`
			Headers  string `db:"headers"`
		}
		if err := db.Get(&row, db.Rebind("SELECT exchange_name, body, headers FROM acemq_outbox WHERE routing_key = ?"), "billing.poison"); err != nil {
			t.Fatal(err)
		}
		var h map[string]any
		if err := json.Unmarshal([]byte(row.Headers), &h); err != nil {
			t.Fatal(err)
		}
		if row.Exchange != "shop" || row.Body != "{}" || h["x-acemq-poisoned-id"] != "m3" || h["x-acemq-poisoned-aggregate-id"] != "order-7" ||
			h["x-acemq-poisoned-seq"] != "3" || h["tenant"] != "eu" || h["aggregateId"] != nil {
			t.Errorf("parked row %+v, headers %v; want m3's payload and metadata to shop, its key and seq renamed", row, h)
		}
		if n := count(t, db, "SELECT COUNT(*) FROM acemq_inbox_held WHERE seq = 3"); n != 0 {
			t.Errorf("seq 3 still held after the skip")
		}
		ctl(t, nil, "skip-held", "--db", db.DSN, "--consumer", "billing", "--key", "order-7", "--seq", "4", "--exchange", "shop").wantFailure(t, 2, "--exchange goes with --park")
	})
}

// skip-held --park commits the copy before the print and the skip (a code
// review): a print that then failed said "nothing skipped" while the relay
// published the copy of a message still held, and a skip that found the
// message applied meanwhile left a copy of a message never given up on.
// The parked copy is the kept one, and the skip goes on; a skip that
// finds the key moved on deletes it.
func TestSkipHeld_Park_PrintFailsOrKeyMovesOn(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	holdRows(t, db, testdb.SQLite)
	execSQL(t, db, "UPDATE acemq_inbox_sequences SET last_seq = 2")
	args := []string{"skip-held", "--db", db.DSN, "--consumer", "billing", "--key", "order-7", "--seq", "3", "--park", "billing.poison"}
	var stderr strings.Builder
	code := Run(context.Background(), args, func(string) string { return "" }, brokenPipe{}, &stderr)
	if code != 0 || !strings.Contains(stderr.String(), "its copy is kept in acemq_outbox as ") {
		t.Errorf("print failed after the park: exit %d, stderr %q; want 0, the copy named", code, stderr.String())
	}
	if held, parked := count(t, db, "SELECT COUNT(*) FROM acemq_inbox_held WHERE seq = 3"), count(t, db, "SELECT COUNT(*) FROM acemq_outbox WHERE routing_key = 'billing.poison'"); held != 0 || parked != 1 {
		t.Errorf("%d held, %d parked; want seq 3 skipped and parked", held, parked)
	}

	// Seq 4 applied by a delivery as the operator's terminal prints it.
	stderr.Reset()
	applied := &applyingWriter{apply: func() {
		execSQL(t, db, "DELETE FROM acemq_inbox_held WHERE seq = 4")
		execSQL(t, db, "UPDATE acemq_inbox_sequences SET last_seq = 4")
	}}
	args[len(args)-3] = "4"
	code = Run(context.Background(), args, func(string) string { return "" }, applied, &stderr)
	if code != 1 || !strings.Contains(stderr.String(), "nothing skipped") || !strings.Contains(stderr.String(), "is deleted") {
		t.Errorf("key moved on after the park: exit %d, stderr %q; want 1, nothing skipped, the copy deleted", code, stderr.String())
	}
	if parked := count(t, db, "SELECT COUNT(*) FROM acemq_outbox WHERE routing_key = 'billing.poison'"); parked != 1 {
		t.Errorf("%d parked copies; want seq 3's alone", parked)
	}
}

// applyingWriter runs apply at its first write, then writes nowhere.
type applyingWriter struct {
	apply func()
	done  bool
}

func (w *applyingWriter) Write(p []byte) (int, error) {
	if !w.done {
		w.done = true
		w.apply()
	}
	return len(p), nil
}

// held said "not arrived yet, or set aside" of every missing number, and
// an on-call looked in the poison topic for a message stuck at the sender.
// Where the outbox is in the same database, it says where the first
// missing number's record is and what sends it.
func TestHeld_SaysWhereTheRecordAKeyWaitsForIs(t *testing.T) {
	eachKind(t, func(t *testing.T, kind string) {
		f := newFixture(t, kind)
		db := f.db
		aside := publishOf(t, db, 3, "payments", "pay-aside")
		stuck := publishOf(t, db, 3, "payments", "pay-stuck")
		lost := publishOf(t, db, 3, "payments", "pay-lost")
		purged := publishOf(t, db, 3, "payments", "pay-purged")
		execSQL(t, db, "DELETE FROM acemq_outbox WHERE id = ?", purged[1])
		// pay-elsewhere's messages come from another database's outbox;
		// this one has a key of that name too (keys are not unique across
		// services), whose seq 2 is not the one the consumer waits for.
		publishOf(t, db, 3, "orders", "pay-elsewhere")
		heldIDs := map[string]string{"pay-aside": aside[2], "pay-stuck": stuck[2], "pay-lost": lost[2], "pay-purged": purged[2], "pay-elsewhere": "other-db-3"}
		old := ts(kind, time.Now().Add(-time.Hour))
		execSQL(t, db, "UPDATE acemq_outbox SET published_at = ?, processed_at = ?, last_error = ? WHERE id = ?", old, old, "set aside by billing to payments.poison as p-2: boom", aside[1])
		execSQL(t, db, "UPDATE acemq_outbox SET attempts = 10, last_error = ? WHERE id = ?", "NOT_FOUND - no exchange 'payments'", stuck[1])
		execSQL(t, db, "UPDATE acemq_outbox SET published_at = ? WHERE id = ?", old, lost[1])
		for key, id := range heldIDs {
			execSQL(t, db, "INSERT INTO acemq_inbox_sequences (consumer_name, aggregate_id, last_seq, held) VALUES (?, ?, ?, ?)", "billing", key, 1, 1)
			execSQL(t, db, "INSERT INTO acemq_inbox_held (consumer_name, aggregate_id, seq, message_id, payload, payload_encoding, metadata, held_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
				"billing", key, 3, id, "{}", "utf-8", "{}", old)
		}

		out := mustCtl(t, "held", "--db", db.DSN)
		for _, want := range []string{
			"billing pay-aside waits for seq 2: " + aside[1] + ": published ",
			"; set aside by billing to payments.poison as p-2: boom (",
			"not applied: once its cause is fixed, outboxctl resend ID sends it again (outboxctl resend --key pay-aside --seq 2)\n",
			"billing pay-stuck waits for seq 2: " + stuck[1] + ": stuck at 10 attempts (the relay leaves it alone; retry makes it pending): NOT_FOUND - no exchange 'payments' (outboxctl retry " + stuck[1] + ")\n",
			"billing pay-lost waits for seq 2: " + lost[1] + ": published ",
			"; not marked processed by a consumer of this database; not applied by billing: in a queue still, or lost, or set aside by a consumer that notes nothing (outboxctl resend --key pay-lost --seq 2 sends it again)\n",
			"billing pay-purged waits for seq 2: no record of it in acemq_outbox (purged?)\n",
			"billing pay-elsewhere waits for seq 2: its held seq 3 is no record of acemq_outbox: the key's messages come from another database's outbox (or were purged here); look there (outboxctl show, resend --key pay-elsewhere --seq 2)\n",
		} {
			if !strings.Contains(out, want) {
				t.Errorf("held does not say %q:\n%s", want, out)
			}
		}
		var r heldReport
		if err := json.Unmarshal([]byte(mustCtl(t, "held", "--db", db.DSN, "--json")), &r); err != nil {
			t.Fatal(err)
		}
		states := map[string]string{}
		for _, k := range r.Keys {
			if k.Waiting == nil || k.Waiting.Seq != 2 {
				t.Fatalf("held --json: %+v", k)
			}
			states[k.Key] = k.Waiting.State
		}
		if want := map[string]string{"pay-aside": "set_aside", "pay-stuck": "stuck", "pay-lost": "published", "pay-purged": "not_found", "pay-elsewhere": "elsewhere"}; !reflect.DeepEqual(states, want) {
			t.Errorf("held --json waiting states: %v, want %v", states, want)
		}
	})
}
