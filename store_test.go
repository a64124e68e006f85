package outbox_test

import (
	"context"
	"strings"
	"testing"
	"time"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

func TestStore_PurgePublished_BoundedBatchesNeverPending(t *testing.T) {
	eachMigrated(t, func(t *testing.T, db *testdb.DB, d outbox.Dialect) {
		ids := publishN(t, db, "", "t", 7)
		mark := db.Rebind("UPDATE acemq_outbox SET published_at = ? WHERE id = ?")
		old := time.Now().Add(-48 * time.Hour).UTC()
		var oldArg any = old
		if db.Kind != testdb.Postgres {
			oldArg = old.Format("2006-01-02 15:04:05.000000")
		}
		for _, id := range ids[:5] {
			if _, err := db.Exec(mark, oldArg, id); err != nil {
				t.Fatal(err)
			}
		}
		var recentArg any = time.Now().UTC()
		if db.Kind != testdb.Postgres {
			recentArg = time.Now().UTC().Format("2006-01-02 15:04:05.000000")
		}
		if _, err := db.Exec(mark, recentArg, ids[5]); err != nil {
			t.Fatal(err)
		}
		store, err := outbox.NewStore(db.DB, outbox.StoreConfig{PurgeBatch: 2})
		if err != nil {
			t.Fatal(err)
		}
		n, err := store.PurgePublished(context.Background(), 24*time.Hour)
		if err != nil || n != 5 {
			t.Fatalf("purged %d (%v), want the 5 published over a day ago", n, err)
		}
		var left []string
		if err := db.Select(&left, "SELECT id FROM acemq_outbox ORDER BY created_at"); err != nil {
			t.Fatal(err)
		}
		if strings.Join(left, ",") != ids[5]+","+ids[6] {
			t.Fatalf("left %v, want the recent published row and the pending one", left)
		}
		st, err := store.Stats(context.Background())
		if err != nil || st.Pending != 1 || st.OldestPending.IsZero() {
			t.Fatalf("stats %+v, %v; want 1 pending with its age", st, err)
		}
	})
}
