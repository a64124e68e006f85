package outboxctl

import (
	"strings"
	"testing"
	"time"

	"github.com/acemq/watermill-outbox/internal/testdb"
)

// Another library's acemq_outbox with character(64) ids (which the
// library supports: see sharedtable_test's fixed-width test): the lookup
// read the id back padded, no id given matched it, and show and resend
// said "not in acemq_outbox" and exited 1 (resend after resending it). A
// uuid id column reads back in lower case: an id given in upper case is
// found too.
func TestShowResend_FixedWidthIDs_FoundExit0(t *testing.T) {
	db := migrated(t, testdb.Postgres)
	ids := publish(t, db, 1, "orders")
	execSQL(t, db, "ALTER TABLE acemq_outbox ALTER id TYPE character(64)")
	execSQL(t, db, "UPDATE acemq_outbox SET published_at = ? WHERE id = ?", ts(testdb.Postgres, time.Now().Add(-time.Hour)), ids[0])

	if r := ctl(t, nil, "show", "--db", db.DSN, ids[0]); r.code != 0 {
		t.Errorf("show of a row that is there: exit %d\nstdout: %s\nstderr: %s", r.code, r.stdout, r.stderr)
	}
	r := ctl(t, nil, "resend", "--db", db.DSN, ids[0])
	if r.code != 0 {
		t.Errorf("resend of a published row: exit %d\nstdout: %s\nstderr: %s", r.code, r.stdout, r.stderr)
	}
	if n := count(t, db, "SELECT COUNT(*) FROM acemq_outbox WHERE id = ? AND published_at IS NULL", ids[0]); n != 1 {
		t.Errorf("resend made %d rows pending", n)
	}
	// A uuid column: an id given in upper case is the row's.
	execSQL(t, db, "ALTER TABLE acemq_outbox ALTER id TYPE uuid USING trim(id)::uuid")
	if r := ctl(t, nil, "show", "--db", db.DSN, strings.ToUpper(ids[0])); r.code != 0 || !strings.Contains(r.stdout, ": pending") {
		t.Errorf("show of a uuid id in upper case: exit %d\nstdout: %s\nstderr: %s", r.code, r.stdout, r.stderr)
	}
}
