package outboxctl

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/acemq/watermill-outbox/internal/testdb"
)

// A database whose outbox has no ordered inbox beside it (a table another
// library made, migrated before 0006, or the outbox under --table of a
// service's own): status documents held_messages null "when this database
// has no held messages' table", and show/resend do not need the table.
// hasTable(acemq_inbox_held) checks the outbox table instead, so each of
// them fails with exit 1 and "run outboxctl migrate".
func TestStatusShowResend_NoOrderedInboxTables_StillWork(t *testing.T) {
	eachKind(t, func(t *testing.T, kind string) {
		db := migrated(t, kind)
		ids := publish(t, db, 1, "orders")
		execSQL(t, db, "DROP TABLE acemq_inbox_held")
		execSQL(t, db, "DROP TABLE acemq_inbox_sequences")
		for _, args := range [][]string{
			{"status", "--json"},
			{"status"},
			{"show", ids[0]},
			{"show", "--json", ids[0]},
			{"resend", ids[0]}, // pending: left alone, exit 0
		} {
			r := ctl(t, nil, append(args, "--db", db.DSN)...)
			if r.code != 0 {
				t.Errorf("outboxctl %s: exit %d, want 0\nstdout: %s\nstderr: %s", strings.Join(args, " "), r.code, r.stdout, r.stderr)
			}
		}
		// retry's exit 1 for an id not in the table rests on the same look.
		if r := ctl(t, nil, "retry", "no-such-id", "--db", db.DSN); r.code != 1 {
			t.Errorf("retry no-such-id: exit %d, want 1 (README: an id not in the table exits 1)\nstdout: %s\nstderr: %s", r.code, r.stdout, r.stderr)
		}
		if r := ctl(t, nil, "status", "--json", "--db", db.DSN); r.code == 0 && !strings.Contains(r.stdout, `"held_messages": null`) {
			t.Errorf("status --json: held_messages not null without the table:\n%s", r.stdout)
		}
	})
}

// A stuck row whose created_at no time parser reads (README, "A row the
// relay cannot read": stuck at once, "outboxctl stuck lists it"): the text
// says "-", show --json leaves created_at out, and stuck --json says it
// was created in year 1, which a script's age check reads as 2025 years
// old. It should be null, as leased_until is for a lease it cannot read.
func TestStuckJSON_UnreadableCreatedAt_NullNotYearOne(t *testing.T) {
	db := migrated(t, "sqlite")
	execSQL(t, db, "INSERT INTO acemq_outbox (id, exchange_name, routing_key, body, created_at, attempts, last_error) VALUES (?, ?, ?, ?, ?, ?, ?)",
		"bad-time", "", "orders", "{}", "garbage", 10, "created_at: not a time")
	got := decodeJSON(t, mustCtl(t, "stuck", "--json", "--db", db.DSN))
	rows, _ := got["rows"].([]any)
	if len(rows) != 1 {
		t.Fatalf("stuck --json rows: %v", got["rows"])
	}
	row := rows[0].(map[string]any)
	if v, ok := row["created_at"]; !ok || v != nil {
		t.Errorf("stuck --json created_at = %#v (present %v), want null: the text shows \"-\" and show --json leaves it out", v, ok)
	}
}

// show --json's names "do not change" (showRow), and stuck --json always
// carries "exchange" ("" for the default exchange); show --json leaves the
// key out for a record to the default exchange and has it for any other,
// so a script's .exchange reads null for one and a name for the other.
func TestShowJSON_DefaultExchange_KeepsTheExchangeKey(t *testing.T) {
	db := migrated(t, "sqlite")
	ids := publish(t, db, 1, "orders") // the default exchange, routing key orders
	var got []map[string]any
	out := mustCtl(t, "show", "--json", "--db", db.DSN, ids[0])
	if err := json.Unmarshal([]byte(out), &got); err != nil || len(got) != 1 {
		t.Fatalf("show --json: %v\n%s", err, out)
	}
	if v, ok := got[0]["exchange"]; !ok || v != "" {
		t.Errorf("show --json of a record to the default exchange: exchange = %#v (present %v), want \"\" as stuck --json gives it\n%s", v, ok, out)
	}
}

// skip-held --park into an outbox named with --table whose name needs
// quoting, as an EF Core service's PascalCase table on PostgreSQL
// ("OutboxMessages"): the park writes it (the library quotes the name),
// and when the key moves on before the skip, unpark's DELETE, which
// splices --table in unquoted, names another table (outboxmessages), so
// the copy of a message that was applied stays pending and the relay
// publishes it to the poison topic as one given up on.
func TestSkipHeldPark_KeyMovesOn_TableNameNeedingQuotes_CopyDeleted(t *testing.T) {
	db := migrated(t, testdb.Postgres)
	execSQL(t, db, `CREATE TABLE "OutboxMessages" (LIKE acemq_outbox INCLUDING ALL)`)
	holdRows(t, db, testdb.Postgres)
	execSQL(t, db, "UPDATE acemq_inbox_sequences SET last_seq = 2")
	args := []string{"skip-held", "--db", db.DSN, "--table", "OutboxMessages", "--consumer", "billing", "--key", "order-7", "--seq", "3", "--park", "billing.poison"}
	// Seq 3 applied by a delivery as the operator's terminal prints it.
	applied := &applyingWriter{apply: func() {
		execSQL(t, db, "DELETE FROM acemq_inbox_held WHERE seq = 3")
		execSQL(t, db, "UPDATE acemq_inbox_sequences SET last_seq = 3")
	}}
	var stderr strings.Builder
	code := Run(context.Background(), args, func(string) string { return "" }, applied, &stderr)
	if code != 1 || !strings.Contains(stderr.String(), "nothing skipped") {
		t.Errorf("exit %d, stderr %q; want 1, nothing skipped", code, stderr.String())
	}
	if parked := count(t, db, `SELECT COUNT(*) FROM "OutboxMessages" WHERE routing_key = 'billing.poison' AND published_at IS NULL`); parked != 0 {
		t.Errorf("%d parked copies of an applied message left pending in \"OutboxMessages\"; want it deleted\nstderr: %s", parked, stderr.String())
	}
}

// An outbox whose id column is a PostgreSQL uuid (another library's, as
// lookupRows allows for): an id given that is no uuid (a typo, a truncated
// paste) is an id not in the table. README: show, retry, resend and
// discard "exit 1 when an id given is not in the table (after saying what
// they found of the others and doing the rest)". Instead the statement's
// 22P02 fails the whole command: the stuck row given beside the typo is
// not retried, and show says nothing of the valid id.
func TestUUIDIDColumn_MalformedIDNotFound_OthersStillDone(t *testing.T) {
	db := migrated(t, testdb.Postgres)
	execSQL(t, db, `CREATE TABLE uuid_ids (LIKE acemq_outbox INCLUDING ALL)`)
	execSQL(t, db, `ALTER TABLE uuid_ids ALTER COLUMN id TYPE uuid USING id::uuid`)
	const id = "6f1e2d3c-0000-4000-8000-000000000001"
	execSQL(t, db, "INSERT INTO uuid_ids (id, exchange_name, routing_key, body, attempts, last_error) VALUES (?, ?, ?, ?, ?, ?)", id, "", "orders", "{}", 10, "boom")

	r := ctl(t, nil, "show", "--db", db.DSN, "--table", "uuid_ids", id, "6f1e2d3c-typo")
	if r.code != 1 || !strings.Contains(r.stdout, id+": stuck") {
		t.Errorf("show VALID TYPO: exit %d, want 1 having shown the valid id\nstdout: %s\nstderr: %s", r.code, r.stdout, r.stderr)
	}
	r = ctl(t, nil, "retry", "--db", db.DSN, "--table", "uuid_ids", id, "6f1e2d3c-typo")
	if r.code != 1 {
		t.Errorf("retry VALID TYPO: exit %d, want 1\nstdout: %s\nstderr: %s", r.code, r.stdout, r.stderr)
	}
	if n := count(t, db, "SELECT COUNT(*) FROM uuid_ids WHERE attempts = 0"); n != 1 {
		t.Errorf("retry VALID TYPO left the valid stuck row stuck (the rest not done)\nstdout: %s\nstderr: %s", r.stdout, r.stderr)
	}
}

// The README's purge line, --published-older-than 7d
// --processed-older-than 30d, on a producer's database whose inbox lives
// in the consumers' (status reports that case as normal): the outbox's
// rows were deleted first, then the missing inbox table failed the
// command, exit 1, and --json printed nothing, so a cron job read a
// failed purge that did delete, and lost how many. Both tables are
// checked before either is purged.
func TestPurge_BothAges_NoInboxTable_NothingDeleted(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	ids := publish(t, db, 3, "orders")
	old := ts(testdb.SQLite, time.Now().Add(-10*24*time.Hour))
	for _, id := range ids {
		execSQL(t, db, "UPDATE acemq_outbox SET published_at = ? WHERE id = ?", old, id)
	}
	execSQL(t, db, "DROP TABLE processed_messages")
	r := ctl(t, nil, "purge", "--db", db.DSN, "--published-older-than", "7d", "--processed-older-than", "30d", "--json")
	r.wantFailure(t, 1, "processed_messages")
	if left := count(t, db, "SELECT COUNT(*) FROM acemq_outbox"); left != 3 {
		t.Errorf("purge failed on the missing inbox table yet deleted %d of 3 published rows (count unsaid); want both tables checked first", 3-left)
	}
}

// Every message shows --db with its password hidden (target.shown), and
// --amqp's unparsable URL says "(an unparsable URL)". But a --db URL that
// url.Parse refuses, as one with a password holding a bare % (Pa55%word,
// not written %25), or one missing a slash, comes back on stderr whole,
// password and all, into a terminal's scrollback, a CI log or a pod's log.
func TestDBURLNotParsed_PasswordNotEchoed(t *testing.T) {
	const secret = "Pa55%word"
	for _, dsn := range []string{
		"postgres://app:" + secret + "@127.0.0.1:5432/test",
		"mysql://app:" + secret + "@127.0.0.1:3306/test",
		"postgres:/app:" + secret + "@127.0.0.1:5432/test", // a slash short
	} {
		r := ctl(t, nil, "status", "--db", dsn)
		if r.code != 2 {
			t.Errorf("--db %s: exit %d, want 2", dsn, r.code)
		}
		if strings.Contains(r.stderr, secret) || strings.Contains(r.stderr, "Pa55") {
			t.Errorf("--db with an unparsable URL echoes its password:\n%s", r.stderr)
		}
	}
}

// On MySQL a BIGINT id column reads "17abc" as 17: retry of a mistyped id
// made another stuck row, 17, pending. An id the column cannot hold is
// not in the table.
func TestBigintIDColumn_MySQL_IDWithTrailingLetters_NotAnotherRow(t *testing.T) {
	db := migrated(t, testdb.MySQL)
	execSQL(t, db, "CREATE TABLE int_ids LIKE acemq_outbox")
	execSQL(t, db, "ALTER TABLE int_ids MODIFY id BIGINT NOT NULL")
	execSQL(t, db, "INSERT INTO int_ids (id, exchange_name, routing_key, body, headers, created_at, attempts, last_error) VALUES (?, ?, ?, ?, ?, ?, ?, ?)", 17, "", "orders", "{}", "{}", time.Now().UTC(), 10, "boom")
	ctl(t, nil, "retry", "--db", db.DSN, "--table", "int_ids", "17abc").wantFailure(t, 1, "not in int_ids")
	if n := count(t, db, "SELECT COUNT(*) FROM int_ids WHERE attempts = 10"); n != 1 {
		t.Errorf("retry 17abc made row 17 pending")
	}
	r := ctl(t, nil, "show", "--db", db.DSN, "--table", "int_ids", "17abc", "17")
	r.wantFailure(t, 1, "1 of the 2 ids given is not in int_ids")
	if !strings.Contains(r.stdout, "17: stuck") || strings.Contains(r.stdout, "17abc: stuck") {
		t.Errorf("show 17abc 17: want 17 stuck and 17abc not found:\n%s", r.stdout)
	}
}
