package outboxctl

import (
	"encoding/base64"
	"encoding/json"
	"reflect"
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

// holdNext writes, by hand, billing's key order-7 with 1 applied and its
// next n messages, from 2, held an hour ago, each with the row's payload,
// payload_encoding and metadata text given.
func holdNext(t *testing.T, db *testdb.DB, kind string, n int, payload, encoding, metadata string) {
	t.Helper()
	execSQL(t, db, "INSERT INTO acemq_inbox_sequences (consumer_name, aggregate_id, last_seq, held) VALUES (?, ?, ?, ?)", "billing", "order-7", 1, n)
	for seq := 2; seq < 2+n; seq++ {
		execSQL(t, db, "INSERT INTO acemq_inbox_held (consumer_name, aggregate_id, seq, message_id, payload, payload_encoding, metadata, held_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
			"billing", "order-7", seq, "m"+strconv.Itoa(seq), payload, encoding, metadata, ts(kind, time.Now().Add(-time.Hour)))
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
		holdNext(t, db, kind, 2, "event", "utf-8", heldNotUTF8MetadataRow(heldNotUTF8Metadata))
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
