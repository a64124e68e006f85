package outbox_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

func TestStore_PurgePublished_BoundedBatchesNeverPending(t *testing.T) {
	t.Parallel()
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

// An operator's retry leaves alone a row a relay holds under a live lease:
// one in flight on SQLite, or one another library's relay claimed. Clearing
// that lease let a second relay claim the row and publish it too. (And a
// row pending already, with nothing to reset, is not counted: PostgreSQL
// and SQLite counted it, MySQL did not, and outboxctl's "made pending
// again" named a row it had not touched.) A failed
// keyed record's backoff is a lease of another kind, which a retry ends (see
// TestForwarder_KeyedRecordRefused_HoldsOnlyItsKey_OthersFlowWithoutBackoff), and an expired lease
// is no claim.
func TestStore_Retry_LeavesRowsUnderALiveLeaseAlone(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, d outbox.Dialect) {
		s, err := outbox.NewStore(db.DB, outbox.StoreConfig{Dialect: d, MaxAttempts: 3})
		if err != nil {
			t.Fatal(err)
		}
		insertRaw(t, db, "foreign-live", "ex", "k", "{}", "utf-8")
		insertRaw(t, db, "foreign-expired", "ex", "k", "{}", "utf-8")
		lease := db.Rebind("UPDATE acemq_outbox SET attempts = 3, locked_by = 'rails-relay-1', locked_until = ? WHERE id = ?")
		for id, until := range map[string]time.Time{"foreign-live": time.Now().Add(time.Hour), "foreign-expired": time.Now().Add(-time.Hour)} {
			var at any = until.UTC()
			if db.Kind != testdb.Postgres {
				at = until.UTC().Format("2006-01-02 15:04:05.000000")
			}
			if _, err := db.Exec(lease, at, id); err != nil {
				t.Fatal(err)
			}
		}
		ctx := context.Background()
		insertRaw(t, db, "pending-already", "ex", "k", "{}", "utf-8")
		if n, err := s.Retry(ctx, "pending-already"); n != 0 || err != nil {
			t.Errorf("retry of a row pending already: %d, %v; want 0, nil (nothing changed)", n, err)
		}
		if _, err := db.Exec("DELETE FROM acemq_outbox WHERE id = 'pending-already'"); err != nil {
			t.Fatal(err)
		}
		if n, err := s.Retry(ctx, "foreign-live"); n != 0 || err != nil {
			t.Errorf("retry of a row under another relay's live lease: %d, %v; want 0, nil", n, err)
		}
		if n, err := s.RetryAllStuck(ctx); n != 1 || err != nil {
			t.Errorf("retry of every stuck row: %d, %v; want 1, the one whose lease expired", n, err)
		}
		if st := stateOf(t, db, "foreign-live"); st.Attempts != 3 {
			t.Errorf("the leased row: %+v, want left as it was", st)
		}

		if db.Kind != testdb.SQLite {
			return
		}
		// Ours in flight: on SQLite a claim is a lease.
		publishN(t, db, "ex", "k", 1)
		a, heldA, err := outbox.Claim(s, 10, "relay-a") // and the row retried above
		if err != nil || len(a) != 2 {
			t.Fatalf("relay-a claim: %v, %v", a, err)
		}
		defer func() { _ = heldA.Publish() }()
		if n, err := s.Retry(ctx, a...); n != 0 || err != nil {
			t.Errorf("retry of a row in flight: %d, %v; want 0, nil", n, err)
		}
		if b, heldB, err := outbox.Claim(s, 10, "relay-b"); err != nil || len(b) != 0 {
			t.Errorf("relay-b claimed %v (%v) while relay-a holds it in flight: both would publish it", b, err)
			if heldB != nil {
				_ = heldB.Publish()
			}
		}
	})
}

// PurgePublished never deletes a pending row. On PostgreSQL a row published
// long ago that another session made pending again (Republish's UPDATE, an
// operator's) while the purge waited for its lock was deleted all the
// same: the purge's DELETE … WHERE id IN (…) re-checked the row on its id
// alone. (From an audit.)
func TestStore_PurgePublished_RowMadePendingWhileItRuns_Kept(t *testing.T) {
	eachMigrated(t, func(t *testing.T, db *testdb.DB, d outbox.Dialect) {
		ctx := context.Background()
		insertRaw(t, db, "old-1", "", "rk", "{}", "utf-8")
		insertRaw(t, db, "old-2", "", "rk", "{}", "utf-8")
		publishAllAt(t, db, time.Now().Add(-10*24*time.Hour))

		tx, err := db.Beginx() // another session: Republish's statement, uncommitted
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = tx.Rollback() }()
		if _, err := tx.Exec(db.Rebind("UPDATE acemq_outbox SET published_at = NULL, attempts = 0 WHERE id = ?"), "old-1"); err != nil {
			t.Fatal(err)
		}
		store, err := outbox.NewStore(db.DB, outbox.StoreConfig{Dialect: d, PurgeBatch: 10})
		if err != nil {
			t.Fatal(err)
		}
		done := make(chan error, 1)
		go func() {
			_, err := store.PurgePublished(ctx, 24*time.Hour)
			done <- err
		}()
		time.Sleep(700 * time.Millisecond) // the purge has its snapshot, and meets old-1's lock
		if err := tx.Commit(); err != nil {
			t.Fatal(err)
		}
		if err := <-done; err != nil {
			t.Fatal(err)
		}
		var n int
		if err := db.Get(&n, db.Rebind("SELECT COUNT(*) FROM acemq_outbox WHERE id = ? AND published_at IS NULL"), "old-1"); err != nil {
			t.Fatal(err)
		}
		if n != 1 {
			t.Errorf("the row made pending again while the purge ran is gone")
		}
		if got := countRows(t, db); got != 1 {
			t.Errorf("%d rows after the purge, want 1 (old-2 purged, old-1 kept)", got)
		}
	})
}

// Retry takes as many ids as an operator passes: they went in one
// statement, which every database refused past its limit on arguments
// (65,535 on PostgreSQL and MySQL, 32,766 on SQLite), retrying none.
func TestStore_RetryMoreIDsThanAStatementTakes_EveryStuckRowPending(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, d outbox.Dialect) {
		stuck := publishN(t, db, "", "t", 3)
		if _, err := db.Exec("UPDATE acemq_outbox SET attempts = 10"); err != nil {
			t.Fatal(err)
		}
		st, err := outbox.NewStore(db.DB, outbox.StoreConfig{Dialect: d})
		if err != nil {
			t.Fatal(err)
		}
		ids := make([]string, 0, 70003)
		for i := range 70000 {
			ids = append(ids, fmt.Sprintf("gone-%d", i))
			if i%30000 == 0 {
				ids = append(ids, stuck[i/30000])
			}
		}
		n, err := st.Retry(context.Background(), ids...)
		if err != nil || n != 3 {
			t.Fatalf("Retry of %d ids, 3 of them stuck rows: %d made pending, err %v", len(ids), n, err)
		}
		var left int
		if err := db.Get(&left, "SELECT COUNT(*) FROM acemq_outbox WHERE attempts > 0"); err != nil {
			t.Fatal(err)
		}
		if left != 0 {
			t.Errorf("%d rows still with attempts after Retry", left)
		}
	})
}

// On SQLite, a pending row whose created_at another writer stored in
// another text form counts for the oldest pending age as the instant it
// is: mattn/go-sqlite3's own form of a time.Time read as none pending (the
// gauge 0, outboxctl status "-" beside pending 1), and RFC 3339 with an
// offset, two hours old, sorted above a row written now (age 0 s).
func TestStore_SQLiteStats_CreatedAtInOtherTextForms_OldestPendingAsTheInstant(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	t.Run("mattn time.Time text", func(t *testing.T) {
		db := migrated(t, testdb.SQLite)
		insertRaw(t, db, "go-mattn", "ex", "k", "{}", "utf-8")
		hourAgo := time.Now().Add(-time.Hour).UTC()
		// what mattn/go-sqlite3 stores for a time.Time argument
		if _, err := db.Exec("UPDATE acemq_outbox SET created_at = ? WHERE id = 'go-mattn'", hourAgo); err != nil {
			t.Fatal(err)
		}
		var raw string
		_ = db.Get(&raw, "SELECT created_at || '' FROM acemq_outbox")
		s, _ := outbox.NewStore(db.DB, outbox.StoreConfig{Dialect: outbox.SQLite})
		st, err := s.Stats(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if age := time.Since(st.OldestPending); st.Pending != 1 || age < 59*time.Minute || age > 61*time.Minute {
			t.Errorf("stored %q: pending %d, oldest pending %v (age %s); want 1 row pending for an hour", raw, st.Pending, st.OldestPending, time.Since(st.OldestPending).Round(time.Second))
		}
	})
	t.Run("RFC 3339 with offset beside a fresh row", func(t *testing.T) {
		db := migrated(t, testdb.SQLite)
		insertRaw(t, db, "fresh", "ex", "k", "{}", "utf-8") // this library's text, now
		insertRaw(t, db, "rust", "ex", "k", "{}", "utf-8")
		// two hours ago, written at +02:00: the same date and wall clock as now in UTC
		twoHoursAgo := time.Now().Add(-2 * time.Hour).In(time.FixedZone("", 2*3600)).Format("2006-01-02T15:04:05.000000-07:00")
		if _, err := db.Exec("UPDATE acemq_outbox SET created_at = ? WHERE id = 'rust'", twoHoursAgo); err != nil {
			t.Fatal(err)
		}
		s, _ := outbox.NewStore(db.DB, outbox.StoreConfig{Dialect: outbox.SQLite})
		st, err := s.Stats(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if age := time.Since(st.OldestPending); age < 119*time.Minute || age > 121*time.Minute {
			t.Errorf("oldest pending age %s; want 2h (row 'rust' created_at %q)", age.Round(time.Second), twoHoursAgo)
		}
	})
}

// A purge's batches go on from where the last one ended (each read the
// index from its head before, past the entries of the rows deleted before
// it, which stay while an older transaction is open): with times all
// apart, ties at a batch's end, and on SQLite times another library wrote
// as numbers and as ISO 8601 text, it deletes exactly the rows published
// before the cutoff, whatever the batch.
func TestStore_PurgePublished_BatchesGoOnFromTheLastOnesEnd_ExactlyTheOldRows(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, d outbox.Dialect) {
		ids := publishN(t, db, "", "t", 40)
		mark := db.Rebind("UPDATE acemq_outbox SET published_at = ? WHERE id = ?")
		base := time.Now().Add(-72 * time.Hour).UTC()
		at := func(i int) time.Time {
			if i%7 == 3 {
				i-- // a tie with the row before
			}
			return base.Add(time.Duration(i) * time.Hour)
		}
		var old []string
		for i, id := range ids {
			t0 := at(i)
			var arg any = t0
			switch {
			case db.Kind == testdb.Postgres:
			case db.Kind == testdb.SQLite && i%5 == 1:
				arg = t0.UnixMilli() // sqlite-jdbc's Unix milliseconds
			case db.Kind == testdb.SQLite && i%5 == 2:
				arg = t0.Format("2006-01-02T15:04:05.000Z") // JavaScript's toISOString
			default:
				arg = t0.Format("2006-01-02 15:04:05.000000")
			}
			if _, err := db.Exec(mark, arg, id); err != nil {
				t.Fatal(err)
			}
			if t0.Before(time.Now().Add(-24 * time.Hour)) {
				old = append(old, id)
			}
		}
		store, err := outbox.NewStore(db.DB, outbox.StoreConfig{Dialect: d, PurgeBatch: 3})
		if err != nil {
			t.Fatal(err)
		}
		n, err := store.PurgePublished(context.Background(), 24*time.Hour)
		if err != nil || n != int64(len(old)) {
			t.Fatalf("purged %d (%v), want the %d published over a day ago", n, err, len(old))
		}
		var left int
		if err := db.Get(&left, "SELECT COUNT(*) FROM acemq_outbox"); err != nil || left != len(ids)-len(old) {
			t.Fatalf("%d rows left (%v), want %d", left, err, len(ids)-len(old))
		}
	})
}
