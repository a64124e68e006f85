package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"

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

// A table of whole seconds that Migrate has not raised: a retried keyed
// call is refused (the publisher cannot tell its rows by created_at), and
// the caller commits anyway, as a handler that logs errors may. The key
// must keep no hole: the call's new message had kept its row, numbered
// past the number its already-committed message took and did not use
// (numbers 1 and 3, counter at 3), and the ordered inbox waited for 2 for
// ever. Now the call's keyed rows and numbers are taken back before the
// error returns, by their numbers.
func TestTxPublisher_SecondsTableRefusedRetry_CommittedAnyway_KeyHasNoHole(t *testing.T) {
	onSecondsTables(t, func(t *testing.T, db *testdb.DB) {
		toSeconds(t, db) // back to seconds after Migrate
		first, second := keyed("order-7"), keyed("order-7")
		publishInTx(t, db, "orders", []*message.Message{first})

		tx, pub := beginPublisher(t, db)
		err := pub.Publish("orders", first, second) // a retried transaction, with a new message
		if err == nil || !strings.Contains(err.Error(), "outbox.Migrate") {
			t.Fatalf("retried call on the table of seconds: %v, want an error naming outbox.Migrate", err)
		}
		if err := tx.Commit(); err != nil {
			t.Fatalf("commit after the refusal: %v", err)
		}
		keyHasNoHole(t, db, "order-7", 1)
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
