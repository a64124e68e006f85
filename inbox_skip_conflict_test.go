package outbox_test

import (
	"context"
	"database/sql"
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// Under REPEATABLE READ (InboxConfig.Isolation), a skip whose key's row a
// delivery changed after the skip's snapshot is refused by PostgreSQL with
// a serialization failure (SQLSTATE 40001). SkipGap and SkipHeld returned
// it to the operator, for a skip nothing stood in the way of; they now run
// the transaction again, as a delivery's is run again, and the skip is
// done. SkipHeldKeeping's look before its keep is run again too, and keep
// runs once.
func TestOrderedInbox_Postgres_RepeatableRead_SkipBehindAConcurrentChange_RunAgain(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name      string
		delivered []int // of key acct-1, in this order; 2 is held and fails when applied
		skip      func(in *outbox.Inbox, kept *int) error
		ran       []string
	}{
		{"SkipGap", []int{1, 3}, func(in *outbox.Inbox, _ *int) error {
			return in.SkipGap(context.Background(), "ledger", "acct-1", 2, 2)
		}, []string{"1", "3"}},
		{"SkipHeld", []int{2, 3, 1}, func(in *outbox.Inbox, _ *int) error {
			_, err := in.SkipHeld(context.Background(), "ledger", "acct-1", 2)
			return err
		}, []string{"1", "3"}},
		{"SkipHeldKeeping", []int{2, 3, 1}, func(in *outbox.Inbox, kept *int) error {
			_, err := in.SkipHeldKeeping(context.Background(), "ledger", "acct-1", 2, func(outbox.SkippedMessage) error {
				*kept++
				return nil
			})
			return err
		}, []string{"1", "3"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			db := migrated(t, testdb.Postgres)
			in := orderedInbox(t, db, outbox.InboxConfig{ConsumerName: "ledger", Isolation: sql.LevelRepeatableRead})
			var ran []string
			h := in.Middleware(func(msg *message.Message) ([]*message.Message, error) {
				seq := msg.Metadata.Get(outbox.HeaderSeq)
				if seq == "2" {
					return nil, errors.New("seq 2 cannot be applied") // held, the key's next: for SkipHeld
				}
				ran = append(ran, seq)
				return nil, nil
			})
			for _, seq := range tc.delivered {
				if _, err := h(keyedMsg("acct-1", seq)); err != nil {
					t.Fatalf("delivery of %d: %v", seq, err)
				}
			}

			// Another transaction changes the key's row and holds it; the
			// skip takes its snapshot and waits for the row; the other
			// commits.
			other, err := db.Beginx()
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = other.Rollback() }()
			var pid int
			if err := other.Get(&pid, "SELECT pg_backend_pid()"); err != nil {
				t.Fatal(err)
			}
			if _, err := other.Exec("UPDATE acemq_inbox_sequences SET held = held WHERE consumer_name = 'ledger' AND aggregate_id = 'acct-1'"); err != nil {
				t.Fatal(err)
			}
			kept := 0
			done := make(chan error, 1)
			go func() { done <- tc.skip(in, &kept) }()
			waitBlockedBy(t, db, pid)
			if err := other.Commit(); err != nil {
				t.Fatal(err)
			}
			if err := <-done; err != nil {
				t.Fatalf("%s: %v, want the skip run again and done", tc.name, err)
			}
			if !slices.Equal(ran, tc.ran) {
				t.Errorf("the handler ran for %q, want %q", ran, tc.ran)
			}
			if n := countHeld(t, db); n != 0 {
				t.Errorf("%d messages still held, want 0", n)
			}
			if tc.name == "SkipHeldKeeping" && kept != 1 {
				t.Errorf("keep ran %d times, want 1", kept)
			}
		})
	}
}

// waitBlockedBy waits until a session of db's server waits for a lock the
// session of pid holds.
func waitBlockedBy(t *testing.T, db *testdb.DB, pid int) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		var n int
		if err := db.Get(&n, "SELECT COUNT(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))", pid); err != nil {
			t.Fatal(err)
		}
		if n > 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("no session waited for the other transaction's lock")
		}
		time.Sleep(5 * time.Millisecond)
	}
}
