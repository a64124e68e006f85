package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// The README: a held message's last failure is "not written under
// REPEATABLE READ or SERIALIZABLE, where the write would make a concurrent
// apply of the key fail its serialization check and run its handler
// again". The inbox's Isolation defaults to "the database's": a
// PostgreSQL database (or role) whose default_transaction_isolation is
// 'repeatable read' runs every inbox transaction under REPEATABLE READ,
// yet noteHeldFailure only looks at InboxConfig.Isolation (LevelDefault)
// and writes the note. A concurrent apply B that read the held row before
// A's note then fails its DELETE after its handler succeeded, and runs the
// handler again.
func TestOrderedInbox_PostgresDefaultRepeatableRead_FailureNotNoted_ConcurrentApplyRunsOnce(t *testing.T) {
	base := migrated(t, testdb.Postgres)
	createEffects(t, base)
	// The same database, its sessions defaulting to REPEATABLE READ (as an
	// ALTER DATABASE/ROLE ... SET default_transaction_isolation would).
	rr, err := sqlx.Open("pgx", base.DSN+"&default_transaction_isolation="+strings.ReplaceAll("repeatable read", " ", "%20"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = rr.Close() })
	var iso string
	if err := rr.Get(&iso, "SHOW transaction_isolation"); err != nil || iso != "repeatable read" {
		t.Fatalf("session isolation %q (%v), want repeatable read", iso, err)
	}
	db := &testdb.DB{DB: rr, Kind: base.Kind, DSN: base.DSN, Name: base.Name}
	in, err := outbox.NewInbox(rr, outbox.InboxConfig{ConsumerName: "ledger", Ordered: true}) // Isolation: the database's
	if err != nil {
		t.Fatal(err)
	}

	var runs atomic.Int32
	var aPID atomic.Int64
	blocked := func() bool {
		var n int
		_ = base.Get(&n, "SELECT COUNT(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))", aPID.Load())
		return n > 0
	}
	noted := func() bool {
		var md string
		_ = base.Get(&md, "SELECT metadata FROM acemq_inbox_held WHERE consumer_name = 'ledger' AND aggregate_id = 'pay' AND seq = 3")
		return strings.Contains(md, "x-acemq-inbox-last-error")
	}
	inA := make(chan struct{})
	log := &applyLog{fail: func(msg *message.Message) error {
		if msg.UUID != "pay-3" {
			return nil
		}
		n := runs.Add(1)
		switch n {
		case 1: // A: fails once B waits on the key's lock
			tx, _ := outbox.TxFromContext(msg.Context())
			var pid int64
			if err := tx.Get(&pid, "SELECT pg_backend_pid()"); err != nil {
				return err
			}
			aPID.Store(pid)
			close(inA)
			deadline := time.Now().Add(20 * time.Second)
			for !blocked() && time.Now().Before(deadline) {
				time.Sleep(10 * time.Millisecond)
			}
			return errors.New("the ledger refuses it")
		case 2: // B: succeeds, once A's note is committed (none is, now: a bounded wait)
			deadline := time.Now().Add(3 * time.Second)
			for !noted() && time.Now().Before(deadline) {
				time.Sleep(10 * time.Millisecond)
			}
			return nil
		}
		return nil
	}}
	h := in.Middleware(log.handler(t, db))
	deliver(t, h, "pay", 1, 3) // 3 held, 2 missing

	var wg sync.WaitGroup
	wg.Add(2)
	go func() { defer wg.Done(); deliver(t, h, "pay", 2) }() // A: 2 applied, its drain runs 3
	<-inA
	go func() { defer wg.Done(); _, _ = in.ApplyHeld(context.Background()) }() // B
	wg.Wait()
	waitFor(t, 20*time.Second, "3 applied", func() bool { return countHeld(t, db) == 0 })
	if got := log.of("pay"); fmt.Sprint(got) != "[1 2 3]" {
		t.Errorf("handler succeeded for %v; want [1 2 3]", got)
	}
	if got := countEffects(t, base, "pay-3"); got != 1 {
		t.Errorf("seq 3: %d effects in the database, want 1", got)
	}
	if n := runs.Load(); n != 2 {
		t.Fatalf("seq 3's handler ran %d times; want 2 (A failed, B succeeded): under the database's default REPEATABLE READ A's failure was noted, B's success was refused for it, and B ran the handler again", n)
	}
}
