package outbox_test

import (
	"context"
	"database/sql"
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

// A held row whose metadata is JSON null (another library's row, a hand's)
// decodes to a nil map; its handler failing, noteHeldFailure assigned into
// that nil map and panicked outside the handler's recover (a code review):
// the delivery, or ApplyHeld's goroutine, which crashes the process.
func TestOrderedInbox_HeldRowWithNullMetadata_HandlerFails_NoPanic(t *testing.T) {
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		createEffects(t, db)
		in := newInbox(t, db, outbox.InboxConfig{Ordered: true})
		log := &applyLog{fail: func(msg *message.Message) error {
			if msg.UUID == "pay-1-3" {
				return errors.New("the ledger refuses it")
			}
			return nil
		}}
		h := in.Middleware(log.handler(t, db))
		deliver(t, h, "pay-1", 1, 3)
		db.MustExec("UPDATE acemq_inbox_held SET metadata = 'null'")
		func() {
			defer func() {
				if r := recover(); r != nil {
					t.Fatalf("a failing held message with metadata null panicked: %v", r)
				}
			}()
			deliver(t, h, "pay-1", 2)
		}()
	})
}

// The note's UPDATE was rebound by sqlx's driver-name table, not the
// dialect's: a *sqlx.DB opened as "pgx/v5" (a name this library knows,
// sqlx does not) sent "?" to PostgreSQL, which refused it, and the note
// was never written (a code review).
func TestOrderedInbox_PgxV5DriverName_HeldFailureNoted(t *testing.T) {
	db := migrated(t, testdb.Postgres)
	createEffects(t, db)
	v5, err := sqlx.Open("pgx/v5", db.DSN)
	if err != nil {
		t.Fatal(err)
	}
	defer v5.Close()
	in, err := outbox.NewInbox(v5, outbox.InboxConfig{Ordered: true, ConsumerName: "fulfilment"})
	if err != nil {
		t.Fatal(err)
	}
	log := &applyLog{fail: func(msg *message.Message) error {
		if msg.UUID == "pay-1-3" {
			return errors.New("the ledger refuses it")
		}
		return nil
	}}
	h := in.Middleware(log.handler(t, db))
	deliver(t, h, "pay-1", 1, 3, 2)
	gaps, _, err := in.ListGaps(context.Background(), 0, 10)
	if err != nil || len(gaps) != 1 || !strings.HasSuffix(gaps[0].NextError, " the ledger refuses it") {
		t.Fatalf("gaps %+v (%v); want pay-1's held seq 3 with its error noted", gaps, err)
	}
}

// Under REPEATABLE READ on PostgreSQL, the note's UPDATE of the held row,
// committed after a failed apply, made a concurrent apply of the same key
// (another process, or ApplyHeld beside a delivery's drain) that read the
// row before fail its DELETE with a serialization error after its handler
// succeeded, and the handler ran again (a code review). Under REPEATABLE
// READ or SERIALIZABLE the failure is not noted.
func TestOrderedInbox_RepeatableRead_FailureNotNoted_ConcurrentApplyRunsOnce(t *testing.T) {
	db := migrated(t, testdb.Postgres)
	createEffects(t, db)
	in := newInbox(t, db, outbox.InboxConfig{Ordered: true, Isolation: sql.LevelRepeatableRead})
	var runs atomic.Int32
	inA := make(chan struct{})
	fail := atomic.Bool{}
	fail.Store(true)
	log := &applyLog{fail: func(msg *message.Message) error {
		if msg.UUID != "pay-1-3" {
			return nil
		}
		n := runs.Add(1)
		switch {
		case fail.Load() && n == 1:
			return errors.New("the ledger refuses it") // delivered once: noted
		case n == 2: // A
			close(inA)
			time.Sleep(500 * time.Millisecond) // B begins, blocks on the key's lock
			return errors.New("the ledger refuses it again")
		case n == 3: // B
			t.Logf("B runs")
			time.Sleep(500 * time.Millisecond) // A's note commits meanwhile
			return nil
		}
		return nil
	}}
	h := in.Middleware(log.handler(t, db))
	deliver(t, h, "pay-1", 1, 3, 2)
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { defer wg.Done(); _, _ = in.ApplyHeld(context.Background()) }()
	<-inA
	go func() { defer wg.Done(); _, _ = in.ApplyHeld(context.Background()) }()
	wg.Wait()
	if got := log.of("pay-1"); fmt.Sprint(got) != "[1 2 3]" {
		t.Errorf("handler succeeded for %v; want [1 2 3] (seq 3 once)", got)
	}
	if n := runs.Load(); n != 3 {
		t.Fatalf("seq 3's handler ran %d times; want 3 (delivery fail, A fail, B success): B's success was refused for the note A wrote, and B ran it again", n)
	}
}
