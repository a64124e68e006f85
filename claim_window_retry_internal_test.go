package outbox

import (
	"context"
	"database/sql"
	"fmt"
	"path/filepath"
	"testing"
	"time"
)

// A SQLite claim retried after "database is locked" (writeTx runs it
// again) reuses the ClaimParams p its first try filled. A first try
// windowed and a second one not left the first's KeysRead (a review found
// sliceKeys returning before it reset it), and slicedKeys asked where an
// unwindowed claim's slice stopped (OFFSET Window-1 = -1) and moved the
// cursor past keys no claim read. Only with _txlock=deferred (README:
// immediate is required beside a relay) is the claim itself retried.
func TestClaim_SQLiteRetriedUnwindowed_LeavesTheKeysCursor(t *testing.T) {
	path := filepath.Join(t.TempDir(), "o.db")
	dsn := "file:" + path + "?_journal_mode=WAL&_busy_timeout=2000&_txlock=deferred"
	db, err := sql.Open("sqlite3", dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	other, err := sql.Open("sqlite3", dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = other.Close() })
	ctx := context.Background()
	if err := Migrate(ctx, db, SQLite); err != nil {
		t.Fatal(err)
	}
	base := time.Now().Add(-time.Hour).UTC()
	for i := 0; i < 20; i++ {
		if _, err := db.Exec(keyedRowInsert, fmt.Sprintf("k%02d#1", i), base.Add(time.Duration(i)*time.Millisecond).Format("2006-01-02 15:04:05.000000"), fmt.Sprintf("k%02d", i), 1, 0); err != nil {
			t.Fatal(err)
		}
	}
	s, err := NewStore(db, StoreConfig{Dialect: SQLite})
	if err != nil {
		t.Fatal(err)
	}
	tries := 0
	s.window = func(int) int {
		tries++
		if tries == 1 {
			return 4 // windowed
		}
		return 1000 // the index holds fewer: unwindowed
	}
	slices := 0
	s.slice = func(int) int {
		slices++
		if slices == 1 { // another writer commits under the first try's read snapshot
			if _, err := other.Exec("INSERT INTO acemq_outbox (id, exchange_name, routing_key, body) VALUES ('w', 'x', 'k', 'b')"); err != nil {
				t.Error(err)
			}
		}
		return 3
	}
	cl, err := s.claimBatch(ctx, 5, "r", time.Minute, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("tries %d, claimed %d, keysMoves %d, keysAfter %v", tries, len(cl.rows), s.keysMoves, s.keysAfter)
	if tries < 2 {
		t.Skip("the claim was not retried")
	}
	if s.keysMoves != 0 {
		t.Errorf("an unwindowed claim (its second try) moved the keys' cursor to %q (keysMoves %d): it read no key", s.keysAfter, s.keysMoves)
	}
}
