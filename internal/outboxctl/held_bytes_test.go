package outboxctl

import (
	"encoding/base64"
	"encoding/json"
	"reflect"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/acemq/watermill-outbox/internal/testdb"
)

// heldNotUTF8Metadata holds, as the ordered inbox keeps it, metadata with a
// value and a key that are not UTF-8: an array of base64 [key, value]
// pairs. Written by hand, independently of the code under test.
var heldNotUTF8Metadata = map[string]string{"aggregateId": "order-7", "seq": "2", "sig": "\xff\xfe\x01", "k\xc3": "v"}

// holdNext writes, by hand, billing's key with 1 applied and its next n
// messages, from 2, held an hour ago, each with the row's payload,
// payload_encoding and metadata text given.
func holdNext(t *testing.T, db *testdb.DB, kind, key string, n int, payload, encoding, metadata string) {
	t.Helper()
	execSQL(t, db, "INSERT INTO acemq_inbox_sequences (consumer_name, aggregate_id, last_seq, held) VALUES (?, ?, ?, ?)", "billing", key, 1, n)
	for seq := 2; seq < 2+n; seq++ {
		execSQL(t, db, "INSERT INTO acemq_inbox_held (consumer_name, aggregate_id, seq, message_id, payload, payload_encoding, metadata, held_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
			"billing", key, seq, key+"/"+strconv.Itoa(seq), payload, encoding, metadata, ts(kind, time.Now().Add(-time.Hour)))
	}
}

func heldNotUTF8MetadataRow(md map[string]string) string {
	b := func(s string) string { return base64.StdEncoding.EncodeToString([]byte(s)) }
	var pairs []string
	for k, v := range md {
		pairs = append(pairs, `["`+b(k)+`","`+b(v)+`"]`)
	}
	return "[" + strings.Join(pairs, ",") + `,["` + b("x-acemq-inbox-handler") + `","` + b("on_order") + `"]]`
}

// skip-held deletes the held row, the message's only copy (the broker was
// told it was handled when it was held), and prints the message to resend
// by hand: with --json and without, the metadata that is not UTF-8 comes
// out byte for byte, not with U+FFFD in place of its bytes.
func TestSkipHeld_MetadataNotUTF8_PrintedByteForByte(t *testing.T) {
	eachKind(t, func(t *testing.T, kind string) {
		db := migrated(t, kind)
		holdNext(t, db, kind, "order-7", 2, "event", "utf-8", heldNotUTF8MetadataRow(heldNotUTF8Metadata))
		skip := func(seq string, more ...string) string {
			return mustCtl(t, append([]string{"skip-held", "--db", db.DSN, "--consumer", "billing", "--key", "order-7", "--seq", seq}, more...)...)
		}
		for _, run := range []struct{ name, out string }{
			{"--json", skip("2", "--json")},
			{"without --json", skip("3")},
		} {
			js := run.out[strings.Index(run.out, "{"):]
			var got struct {
				Metadata       map[string]string `json:"metadata"`
				MetadataBase64 [][2][]byte       `json:"metadata_base64"`
			}
			if err := json.Unmarshal([]byte(js), &got); err != nil {
				t.Fatalf("skip-held %s: %v\n%s", run.name, err, run.out)
			}
			md := map[string]string{}
			for _, p := range got.MetadataBase64 {
				md[string(p[0])] = string(p[1])
			}
			if got.Metadata != nil || !reflect.DeepEqual(md, heldNotUTF8Metadata) {
				t.Errorf("skip-held %s: metadata %q, metadata_base64 %q; want null and %q byte for byte\n%s",
					run.name, got.Metadata, md, heldNotUTF8Metadata, run.out)
			}
		}
		if n := count(t, db, "SELECT COUNT(*) FROM acemq_inbox_held"); n != 0 {
			t.Errorf("%d held rows left, want 0: both skipped", n)
		}
	})
}

// A held row of which one part cannot be decoded (the likely poison) is
// skipped all the same, and skip-held prints the other part decoded and
// this one as the row held it, with the reason: the row was the message's
// only copy.
func TestSkipHeld_RowPartlyUndecodable_PrintsEveryPart(t *testing.T) {
	eachKind(t, func(t *testing.T, kind string) {
		db := migrated(t, kind)
		const badMetadata = `{"seq": 2}` // a number: metadata values are strings
		holdNext(t, db, kind, "order-7", 1, "the only copy of the event", "utf-8", badMetadata)
		holdNext(t, db, kind, "order-8", 1, "not base64!", "base64", `{"tenant":"t-1"}`)
		type report struct {
			Payload               []byte            `json:"payload"`
			Metadata              map[string]string `json:"metadata"`
			PayloadError          string            `json:"payload_error"`
			StoredPayload         []byte            `json:"stored_payload"`
			StoredPayloadEncoding []byte            `json:"stored_payload_encoding"`
			MetadataError         string            `json:"metadata_error"`
			StoredMetadata        []byte            `json:"stored_metadata"`
		}
		skip := func(key string, more ...string) (string, report) {
			out := mustCtl(t, append([]string{"skip-held", "--db", db.DSN, "--consumer", "billing", "--key", key, "--seq", "2"}, more...)...)
			var r report
			if err := json.Unmarshal([]byte(out[strings.Index(out, "{"):]), &r); err != nil {
				t.Fatalf("skip-held %s: %v\n%s", key, err, out)
			}
			return out, r
		}

		out, got := skip("order-7", "--json")
		if string(got.Payload) != "the only copy of the event" || got.Metadata != nil ||
			got.MetadataError == "" || string(got.StoredMetadata) != badMetadata || got.PayloadError != "" || got.StoredPayload != nil {
			t.Errorf("skip-held of a row whose metadata cannot be decoded: %+v; want its payload, and its metadata as stored with the reason\n%s", got, out)
		}
		out, got = skip("order-8")
		if got.Payload != nil || !reflect.DeepEqual(got.Metadata, map[string]string{"tenant": "t-1"}) ||
			got.PayloadError == "" || string(got.StoredPayload) != "not base64!" || string(got.StoredPayloadEncoding) != "base64" || got.MetadataError != "" {
			t.Errorf("skip-held of a row whose payload cannot be decoded: %+v; want its metadata, and its payload as stored with the reason\n%s", got, out)
		}
		if !strings.Contains(out, "the payload could not be decoded") {
			t.Errorf("skip-held without --json does not say the payload could not be decoded:\n%s", out)
		}
		if n := count(t, db, "SELECT COUNT(*) FROM acemq_inbox_held"); n != 0 {
			t.Errorf("%d held rows left, want 0: both skipped", n)
		}
	})
}

// held lists the longest-held keys, 1000 unless --limit says otherwise,
// and says how many more there are, in the text and in --json; --limit 0
// lists every one. RefreshStats' log sends the operator to it for the
// keys it does not log.
func TestHeld_MoreKeysThanTheLimit_SaysHowManyMore(t *testing.T) {
	eachKind(t, func(t *testing.T, kind string) {
		db := migrated(t, kind)
		tx := db.MustBegin()
		for i := 0; i < 1005; i++ {
			key := "order-" + strconv.Itoa(i)
			tx.MustExec(db.Rebind("INSERT INTO acemq_inbox_sequences (consumer_name, aggregate_id, last_seq, held) VALUES (?, ?, 1, 1)"), "billing", key)
			tx.MustExec(db.Rebind("INSERT INTO acemq_inbox_held (consumer_name, aggregate_id, seq, message_id, payload, payload_encoding, metadata, held_at) VALUES (?, ?, 3, ?, 'x', 'utf-8', '{}', ?)"),
				"billing", key, "m"+strconv.Itoa(i), ts(kind, time.Now().Add(-time.Hour-time.Duration(i)*time.Second)))
		}
		if err := tx.Commit(); err != nil {
			t.Fatal(err)
		}
		for _, run := range []struct {
			args            []string
			listed, total   int
			truncated       bool
			longest, saying string
		}{
			{nil, 1000, 1005, true, "order-1004", "and 5 more keys, not listed: the 1000 above are the longest-held of 1005 (--limit 0 lists every key)"},
			{[]string{"--limit", "3"}, 3, 1005, true, "order-1004", "and 1002 more keys, not listed"},
			{[]string{"--limit", "0"}, 1005, 1005, false, "order-1004", ""},
		} {
			args := append([]string{"held", "--db", db.DSN}, run.args...)
			js := decodeJSON(t, mustCtl(t, append(args, "--json")...))
			keys, _ := js["keys"].([]any)
			first := ""
			if len(keys) > 0 {
				first, _ = keys[0].(map[string]any)["aggregate_id"].(string)
			}
			if len(keys) != run.listed || js["total"] != float64(run.total) || js["truncated"] != run.truncated || first != run.longest {
				t.Errorf("held %v --json: %d keys from %s, total %v, truncated %v; want %d from %s, total %d, truncated %v",
					run.args, len(keys), first, js["total"], js["truncated"], run.listed, run.longest, run.total, run.truncated)
			}
			out := mustCtl(t, args...)
			if n := len(heldRow.FindAllString(out, -1)); n != run.listed {
				t.Errorf("held %v lists %d keys, want %d", run.args, n, run.listed)
			}
			if run.saying != "" && !strings.Contains(out, run.saying) || run.saying == "" && strings.Contains(out, "more keys") {
				t.Errorf("held %v does not say %q; it ends:\n%s", run.args, run.saying, out[max(0, len(out)-400):])
			}
		}
		ctl(t, nil, "held", "--db", db.DSN, "--limit", "-1").wantFailure(t, 2, "--limit: -1; want 0 (every key) or more")
	})
}

// heldRow is a row of held's table.
var heldRow = regexp.MustCompile(`(?m)^billing\s+\S+\s+\d+\s+\d+\s`)
