package outboxctl

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"
)

// brokenPipe is a stdout that takes nothing: a closed pipe (| head), a full
// disk.
type brokenPipe struct{}

func (brokenPipe) Write([]byte) (int, error) { return 0, errors.New("write /dev/stdout: broken pipe") }

// skip-held deleted the held row, the message's only copy (the broker was
// told it was handled when it was held), and only then printed it: a print
// that failed left it nowhere. It prints first now, and a print that
// fails skips nothing.
func TestSkipHeld_PrintFails_NothingSkippedMessageStillHeld(t *testing.T) {
	eachKind(t, func(t *testing.T, kind string) {
		db := migrated(t, kind)
		holdNext(t, db, kind, "order-7", 1, "the-only-copy", "utf-8", `{"aggregateId":"order-7","seq":"2"}`)
		for _, asJSON := range []bool{true, false} {
			args := []string{"skip-held", "--db", db.DSN, "--consumer", "billing", "--key", "order-7", "--seq", "2"}
			if asJSON {
				args = append(args, "--json")
			}
			var stderr strings.Builder
			code := Run(context.Background(), args, func(string) string { return "" }, brokenPipe{}, &stderr)
			if code != 1 || !strings.Contains(stderr.String(), "nothing skipped") {
				t.Errorf("skip-held (json %v) onto a broken pipe: exit %d, stderr %q; want 1 and nothing skipped", asJSON, code, stderr.String())
			}
			if n := count(t, db, "SELECT COUNT(*) FROM acemq_inbox_held WHERE message_id = 'order-7/2'"); n != 1 {
				t.Fatalf("the held message's row after a print that failed: %d rows, want 1", n)
			}
			if n := count(t, db, "SELECT COUNT(*) FROM acemq_inbox_sequences WHERE consumer_name = 'billing' AND last_seq = 1"); n != 1 {
				t.Fatalf("the key moved past the message whose print failed")
			}
		}
		out := mustCtl(t, "skip-held", "--db", db.DSN, "--consumer", "billing", "--key", "order-7", "--seq", "2")
		if !strings.Contains(out, "dGhlLW9ubHktY29weQ") { // the payload, in base64
			t.Errorf("skip-held printed no payload:\n%s", out)
		}
		if n := count(t, db, "SELECT COUNT(*) FROM acemq_inbox_held"); n != 0 {
			t.Errorf("%d held rows after the skip, want 0", n)
		}
	})
}

// held --json gave the consumer as it is, and --consumer unquotes a name
// that starts with a quote: a script that passed on the consumer of
// `"billing"` (quotes included) skipped the gap of consumer billing. The
// consumer is given as --consumer takes it now, as key is for --key.
func TestHeldJSON_ConsumerNamedWithAQuote_SkipGapOfItSkipsItsOwnGap(t *testing.T) {
	eachKind(t, func(t *testing.T, kind string) {
		db := migrated(t, kind)
		for _, c := range []string{"billing", `"billing"`} {
			execSQL(t, db, "INSERT INTO acemq_inbox_sequences (consumer_name, aggregate_id, last_seq, held) VALUES (?, ?, ?, ?)", c, "order-7", 1, 1)
			execSQL(t, db, "INSERT INTO acemq_inbox_held (consumer_name, aggregate_id, seq, message_id, payload, payload_encoding, metadata, held_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
				c, "order-7", 3, "m3-"+c, "{}", "utf-8", "{}", ts(kind, time.Now().Add(-time.Hour)))
		}
		var rep heldReport
		if err := json.Unmarshal([]byte(mustCtl(t, "held", "--db", db.DSN, "--json")), &rep); err != nil {
			t.Fatal(err)
		}
		found := false
		for _, k := range rep.Keys {
			if k.Consumer == `"\"billing\""` {
				found = true
				mustCtl(t, "skip-gap", "--db", db.DSN, "--consumer", k.Consumer, "--key", k.Key, "--from", "2", "--through", "2")
			}
		}
		if !found {
			t.Fatalf("held --json shows no consumer quoted as \"\\\"billing\\\"\": %+v", rep.Keys)
		}
		if n := count(t, db, `SELECT COUNT(*) FROM acemq_inbox_sequences WHERE consumer_name = 'billing' AND last_seq = 1`); n != 1 {
			t.Errorf("the skip meant for consumer \"billing\" (quotes included) moved consumer billing's key")
		}
		if n := count(t, db, `SELECT COUNT(*) FROM acemq_inbox_sequences WHERE consumer_name = '"billing"' AND last_seq = 1`); n != 0 {
			t.Errorf("consumer \"billing\" (quotes included) still waits for 2 after its skip")
		}
	})
}
