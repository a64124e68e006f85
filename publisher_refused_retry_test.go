package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// faultTx is a watermill-sql Tx over a *sql.Tx that fails the first
// statement fail picks, without sending it: a statement fault the database
// did not see, so the transaction stays open (on MySQL and SQLite a failed
// statement leaves it open too).
type faultTx struct {
	wsql.Tx
	fail  func(query string) bool
	fired *bool
}

var errInjected = errors.New("injected statement fault")

func (f faultTx) fault(q string) error {
	if !*f.fired && f.fail(q) {
		*f.fired = true
		return errInjected
	}
	return nil
}

func (f faultTx) ExecContext(ctx context.Context, q string, args ...any) (wsql.Result, error) {
	if err := f.fault(q); err != nil {
		return nil, err
	}
	return f.Tx.ExecContext(ctx, q, args...)
}

func (f faultTx) QueryContext(ctx context.Context, q string, args ...any) (wsql.Rows, error) {
	if err := f.fault(q); err != nil {
		return nil, err
	}
	return f.Tx.QueryContext(ctx, q, args...)
}

// keyHasNoHole checks that key holds the numbers 1..n with n rows, and
// that its next message is numbered n+1: the counter is where the rows
// are.
func keyHasNoHole(t *testing.T, db *testdb.DB, key string, n int) {
	t.Helper()
	want := make([]int64, n)
	for i := range want {
		want[i] = int64(i + 1)
	}
	if got := seqsOf(t, db, key); fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("key %s holds numbers %v, want %v", key, got, want)
	}
	next := keyed(key)
	publishInTx(t, db, "orders", []*message.Message{next})
	if _, seq := seqOf(t, db, next.UUID); seq != int64(n+1) {
		t.Errorf("the next message of key %s is numbered %d, want %d", key, seq, n+1)
	}
}

// committedRowAt inserts the row of msg under key at seq, as committed
// earlier, with the key's counter left behind it (its row not there, or
// at 0): a foreign writer's row, or what an earlier release's bug on a
// table of seconds left.
func committedRowAt(t *testing.T, db *testdb.DB, msg *message.Message, key string, seq int64) {
	t.Helper()
	if _, err := db.Exec(db.Rebind("INSERT INTO acemq_outbox (id, exchange_name, routing_key, body, headers, created_at, aggregate_id, seq)"+
		" VALUES (?, '', 'orders', 'body', '{}', ?, ?, ?)"), msg.UUID, time.Now().Add(-time.Minute).UTC(), key, seq); err != nil {
		t.Fatal(err)
	}
}

// rowsOf counts the rows of id.
func rowsOf(t *testing.T, db *testdb.DB, id string) int {
	t.Helper()
	var n int
	if err := db.Get(&n, db.Rebind("SELECT COUNT(*) FROM acemq_outbox WHERE id = ?"), id); err != nil {
		t.Fatal(err)
	}
	return n
}

// The retry of a message committed under its key at a number its key's
// counter is behind: the retry takes that very number for it, and its
// insert skips the id. When the slow path then fails and the caller
// commits after the error, the committed row must stay: taken back by its
// number alone, it was deleted, and the message lost. And the counter is
// not lowered below it.
func TestTxPublisher_RetrySlowPathFails_CounterBehindTheTable_CommittedRowKept(t *testing.T) {
	for _, kind := range testdb.Kinds {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			db := migrated(t, kind)
			retried := keyed("order-x")
			committedRowAt(t, db, retried, "order-x", 1)
			stx, err := db.Begin()
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = stx.Rollback() }()
			fired := false
			readBack := func(q string) bool { return strings.HasPrefix(q, "SELECT") && strings.Contains(q, "WHERE id IN") }
			pub, err := outbox.NewTxPublisher(faultTx{Tx: wsql.TxFromStdSQL(stx), fail: readBack, fired: &fired}, outbox.TxPublisherConfig{Dialect: dialectOf(t, db)})
			if err != nil {
				t.Fatal(err)
			}
			if err := pub.Publish("orders", retried); !fired || !errors.Is(err, errInjected) {
				t.Fatalf("Publish: %v (fault fired: %v), want the injected read-back fault", err, fired)
			}
			if err := stx.Commit(); err != nil {
				t.Fatalf("commit after the fault: %v", err)
			}
			if n := rowsOf(t, db, retried.UUID); n != 1 {
				t.Fatalf("the committed row of the retried message: %d rows, want 1", n)
			}
			keyHasNoHole(t, db, "order-x", 1)
		})
	}
}

// The same on a table whose created_at keeps whole seconds, not migrated:
// the publisher refuses the retry, as it cannot tell its rows there, and
// leaves the committed row as it was.
func TestTxPublisher_SecondsTableRefusedRetry_CounterBehindTheTable_CommittedRowKept(t *testing.T) {
	onSecondsTables(t, func(t *testing.T, db *testdb.DB) {
		toSeconds(t, db) // back to seconds after Migrate
		retried := keyed("order-s")
		publishInTx(t, db, "orders", []*message.Message{retried})
		if _, err := db.Exec(db.Rebind("UPDATE acemq_outbox_sequences SET last_seq = 0 WHERE aggregate_id = ?"), "order-s"); err != nil {
			t.Fatal(err)
		}
		tx, pub := beginPublisher(t, db)
		if err := pub.Publish("orders", retried); err == nil || !strings.Contains(err.Error(), "outbox.Migrate") {
			t.Fatalf("retry on the table of seconds: %v, want the refusal naming outbox.Migrate", err)
		}
		if err := tx.Commit(); err != nil {
			t.Fatal(err)
		}
		if n := rowsOf(t, db, retried.UUID); n != 1 {
			t.Fatalf("the committed row of the retried message: %d rows, want 1", n)
		}
	})
}

// A retried keyed call whose slow path (the read back of the ids already
// there, the delete of its own rows, the give-back of their numbers) meets
// a statement fault, and a caller who commits after the error: nothing of
// the call's keyed rows stays, and the key's counter is where its rows
// are. The read back's fault had left the call's row numbered 3 and the
// counter at 3 over a key holding 1.
func TestTxPublisher_RetrySlowPathStatementFails_CommittedAnyway_KeyHasNoHole(t *testing.T) {
	faults := map[string]func(q string) bool{
		"read back": func(q string) bool { return strings.HasPrefix(q, "SELECT") && strings.Contains(q, "WHERE id IN") },
		"delete":    func(q string) bool { return strings.HasPrefix(q, "DELETE FROM") },
		"give back": func(q string) bool { return strings.HasPrefix(q, "UPDATE") && strings.Contains(q, "last_seq - ") },
	}
	for _, kind := range testdb.Kinds {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			db := migrated(t, kind)
			d := dialectOf(t, db)
			for name, fail := range faults {
				t.Run(name, func(t *testing.T) {
					key := "order-" + strings.ReplaceAll(name, " ", "-")
					first := keyed(key)
					publishInTx(t, db, "orders", []*message.Message{first})

					stx, err := db.Begin()
					if err != nil {
						t.Fatal(err)
					}
					defer func() { _ = stx.Rollback() }()
					fired := false
					pub, err := outbox.NewTxPublisher(faultTx{Tx: wsql.TxFromStdSQL(stx), fail: fail, fired: &fired}, outbox.TxPublisherConfig{Dialect: d})
					if err != nil {
						t.Fatal(err)
					}
					err = pub.Publish("orders", first, keyed(key), keyed(key)) // a retry, with two new messages
					if !fired {
						t.Fatalf("the %s statement never ran (Publish: %v)", name, err)
					}
					if !errors.Is(err, errInjected) {
						t.Fatalf("Publish: %v, want the injected fault", err)
					}
					if err := stx.Commit(); err != nil {
						t.Fatalf("commit after the fault: %v", err)
					}
					keyHasNoHole(t, db, key, 1)
				})
			}
		})
	}
}
