package outbox_test

import (
	"context"
	"testing"
	"time"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// A PostgreSQL outbox whose id column is a bigint (another library's): the
// column holds "017", "+17" and " 17" (bigint's input reads each as 17),
// and row 17 is the row each names. Dropping the ids a column cannot hold
// (a mistyped one failed the whole statement) must not drop these: a
// first cut, taking only the relay's canonical digits, said "not in the
// table" of them (a code review).
func TestStore_PostgresBigintIDs_IDsTheColumnReads_NotDropped(t *testing.T) {
	db := outboxWithIDType(t, testdb.Postgres, "BIGINT")
	insertForeignID(t, db, 17, "x", time.Now().Add(-time.Minute))
	if _, err := db.Exec("UPDATE acemq_outbox SET attempts = 10, last_error = 'boom'"); err != nil {
		t.Fatal(err)
	}
	s, err := outbox.NewStore(db.DB, outbox.StoreConfig{Dialect: outbox.Postgres})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	for _, id := range []string{"017", "+17", " 17"} {
		var n int
		if err := db.Get(&n, "SELECT COUNT(*) FROM acemq_outbox WHERE id = $1", id); err != nil || n != 1 {
			t.Fatalf("PostgreSQL: WHERE id = %q found %d rows (err %v); the column holds it as 17", id, n, err)
		}
		recs, err := s.Lookup(ctx, id)
		if err != nil || len(recs) != 1 {
			t.Errorf("Lookup(%q): %d records, err %v; want row 17 (the column holds %q: it names row 17)", id, len(recs), err, id)
		}
	}
	n, err := s.Retry(ctx, "017")
	if err != nil || n != 1 {
		t.Errorf("Retry(\"017\") = %d, %v; want 1: row 17 stuck, and bigint holds \"017\" as 17 (before holdable it was retried)", n, err)
	}
}
