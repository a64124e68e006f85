package outbox_test

// From an audit of the publisher's calls: each test's comment tells what
// went wrong before its fix, and the test fails if it comes back.

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

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// hookTx is a watermill-sql Tx over a *sql.Tx (what wsql.TxFromStdSQL
// gives) that calls before ahead of every statement: the moment a test
// wants something to happen mid-Publish (a context cancelled).
type hookTx struct {
	wsql.Tx
	before func(query string)
}

func (h hookTx) ExecContext(ctx context.Context, q string, args ...any) (wsql.Result, error) {
	h.before(q)
	return h.Tx.ExecContext(ctx, q, args...)
}

func (h hookTx) QueryContext(ctx context.Context, q string, args ...any) (wsql.Rows, error) {
	h.before(q)
	return h.Tx.QueryContext(ctx, q, args...)
}

func lastSeq(t testing.TB, db *testdb.DB, key string) int64 {
	t.Helper()
	var n int64
	if err := db.Get(&n, db.Rebind("SELECT last_seq FROM acemq_outbox_sequences WHERE aggregate_id = ?"), key); err != nil {
		t.Fatalf("last_seq of %s: %v", key, err)
	}
	return n
}

func msgTo(id, exchange string) *message.Message {
	m := message.NewMessage(id, []byte("x"))
	if exchange != "" {
		m.Metadata.Set(outbox.MetadataExchange, exchange)
	}
	return m
}

// A keyed Publish whose insert waits out innodb_lock_wait_timeout (1205) on
// MySQL/MariaDB: with innodb_rollback_on_timeout OFF (the default) only the
// insert is undone, the raise of the key's counter stays, and the library
// (EndsTransaction counts 1205 as ending the transaction) does not give the
// number back. A caller that goes on and commits leaves a number without a
// row: the ordered inbox waits for it for ever.
func TestTxPublisher_MySQLLockWaitTimeoutOnKeyedInsert_NumberGivenBack(t *testing.T) {
	db := migrated(t, testdb.MySQL)
	var rollbackOnTimeout int
	if err := db.Get(&rollbackOnTimeout, "SELECT @@innodb_rollback_on_timeout"); err != nil {
		t.Fatal(err)
	}
	t.Logf("innodb_rollback_on_timeout = %d", rollbackOnTimeout)
	inTx(t, db, true, []*message.Message{keyed("k")}) // k: seq 1

	// Another transaction is writing message X (not committed yet).
	blocker, err := db.Beginx()
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = blocker.Rollback() }()
	bp, _ := outbox.NewTxPublisher(blocker)
	x := message.NewMessage("msg-x", []byte("x"))
	if err := bp.Publish("orders", x); err != nil {
		t.Fatal(err)
	}

	tx, err := db.Beginx()
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback() }()
	if _, err := tx.Exec("SET SESSION innodb_lock_wait_timeout = 1"); err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec("CREATE TABLE IF NOT EXISTS orders_biz (id int)"); err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec("INSERT INTO orders_biz VALUES (1)"); err != nil {
		t.Fatal(err)
	}
	pub, _ := outbox.NewTxPublisher(tx)
	kx := message.NewMessage("msg-x", []byte("x")) // the same id, keyed
	kx.Metadata.Set(outbox.MetadataAggregateID, "k")
	perr := pub.Publish("orders", kx)
	t.Logf("Publish: %v", perr)
	if perr == nil {
		t.Fatal("publish succeeded; want the lock wait timeout")
	}
	// The caller logs the error and commits its business change (MySQL lets it).
	if err := tx.Commit(); err != nil {
		t.Fatalf("commit: %v", err)
	}
	_ = blocker.Rollback()
	inTx(t, db, true, []*message.Message{keyed("k")})
	seqs := seqsOf(t, db, "k")
	t.Logf("committed seqs of k: %v, last_seq %d", seqs, lastSeq(t, db, "k"))
	if len(seqs) != 2 || seqs[1] != 2 {
		t.Fatalf("seqs of k = %v, want [1 2]: the failed publish took number 2 and no row holds it (a gap the ordered inbox waits on for ever)", seqs)
	}
}

// Two goroutines publish into one transaction, which the TxPublisher's
// doc says is safe "as far as the transaction itself is" (a *sql.Tx is).
// A call of several statements that fails rolls back to its savepoint, and
// takes with it the rows another goroutine's successful Publish wrote in
// the meantime.
func TestTxPublisher_ConcurrentPublishOnOneTx_NoCallUndoesAnothers(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		publishInTx(t, db, "t", []*message.Message{msgTo("taken", "ex-a")})
		for attempt := 0; attempt < 5; attempt++ {
			tx, err := db.Beginx()
			if err != nil {
				t.Fatal(err)
			}
			pub, _ := outbox.NewTxPublisher(tx)
			var big []*message.Message
			for i := 0; i < 3000; i++ {
				big = append(big, message.NewMessage(watermill.NewUUID(), []byte("x")))
			}
			big = append(big, msgTo("taken", "ex-b")) // refused: ErrDuplicateID, whole call undone
			done := make(chan error, 1)
			var (
				mu sync.Mutex
				ok []string
			)
			var wg sync.WaitGroup
			wg.Add(1)
			go func() {
				defer wg.Done()
				for {
					select {
					case <-done:
						return
					default:
					}
					m := message.NewMessage(watermill.NewUUID(), []byte("small"))
					if err := pub.Publish("t", m); err != nil {
						t.Errorf("small publish: %v", err)
						return
					}
					mu.Lock()
					ok = append(ok, m.UUID)
					mu.Unlock()
				}
			}()
			bigErr := pub.Publish("t", big...)
			close(done)
			wg.Wait()
			if !errors.Is(bigErr, outbox.ErrDuplicateID) {
				t.Fatalf("big publish: %v, want ErrDuplicateID", bigErr)
			}
			if err := tx.Commit(); err != nil {
				t.Fatalf("commit: %v", err)
			}
			missing := 0
			for _, id := range ok {
				var n int
				if err := db.Get(&n, db.Rebind("SELECT COUNT(*) FROM acemq_outbox WHERE id = ?"), id); err != nil {
					t.Fatal(err)
				}
				if n == 0 {
					missing++
				}
			}
			t.Logf("attempt %d: %d small publishes returned nil, %d of them have no row after commit", attempt, len(ok), missing)
			if missing > 0 {
				t.Fatalf("%d messages whose Publish returned nil are not in the committed outbox", missing)
			}
		}
	})
}

// The same with keyed messages on one key: one call's give-back (after it
// found one of its ids already present) lowers the counter below a number
// another goroutine's call took in between.
func TestTxPublisher_ConcurrentKeyedPublishOnOneTx_NumbersGapless(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		present := keyed("k")
		inTx(t, db, true, []*message.Message{present}) // k: 1
		for attempt := 0; attempt < 20; attempt++ {
			tx, err := db.Beginx()
			if err != nil {
				t.Fatal(err)
			}
			pub, _ := outbox.NewTxPublisher(tx)
			stop := make(chan struct{})
			var wg sync.WaitGroup
			var errsB atomic.Int32
			wg.Add(1)
			go func() {
				defer wg.Done()
				for {
					select {
					case <-stop:
						return
					default:
					}
					if err := safePublish(pub, "orders", keyed("k")); err != nil {
						t.Logf("attempt %d: B: %v", attempt, err)
						errsB.Add(1)
						return
					}
				}
			}()
			var errA error
			for i := 0; i < 20 && errA == nil; i++ {
				again := message.NewMessage(present.UUID, present.Payload)
				again.Metadata.Set(outbox.MetadataAggregateID, "k")
				// a retried message (present already) and a new one: the slow path
				errA = safePublish(pub, "orders", again, keyed("k"))
			}
			close(stop)
			wg.Wait()
			if errA != nil || errsB.Load() > 0 {
				t.Logf("attempt %d: publish errors A=%v B=%d", attempt, errA, errsB.Load())
				_ = tx.Rollback()
			} else if err := tx.Commit(); err != nil {
				t.Logf("attempt %d: commit: %v", attempt, err)
			}
			seqs := seqsOf(t, db, "k")
			last := lastSeq(t, db, "k")
			for i, s := range seqs {
				if s != int64(i+1) || last != int64(len(seqs)) {
					t.Fatalf("attempt %d: committed seqs of k %v (last_seq %d); want 1..n with last_seq n", attempt, seqs, last)
				}
			}
			if errA != nil || errsB.Load() > 0 {
				t.Fatalf("attempt %d: a publish on one transaction failed: A=%v", attempt, errA)
			}
		}
	})
}

// readBack (publisher.go) looks each row it reads up by the id the database
// returned, want[id], and dereferences it. Where the id column compares ids
// equal that are not byte-equal (a table another AceMQ library created in
// the database's default case-insensitive collation; or 0001's utf8mb4_bin,
// which is PAD SPACE, and a row of another library whose id ends in a
// space), the returned id is not a key of want: nil pointer, panic inside
// the caller's transaction.
func TestTxPublisher_MySQLIDEqualUnderCollation_ClearErrorNoPanic(t *testing.T) {
	for _, c := range []struct {
		name, setup, existing, publish string
	}{
		{"pad-space-own-schema", "", "order-1 ", "order-1"},
		{"case-insensitive-foreign-table", "ALTER TABLE acemq_outbox MODIFY id varchar(64) CHARACTER SET utf8mb4 COLLATE utf8mb4_general_ci NOT NULL", "ORDER-2", "order-2"},
	} {
		t.Run(c.name, func(t *testing.T) {
			db := migrated(t, testdb.MySQL)
			if c.setup != "" {
				if _, err := db.Exec(c.setup); err != nil {
					t.Fatal(err)
				}
			}
			insertRaw(t, db, c.existing, "", "orders", "{}", "utf-8")
			tx, err := db.Beginx()
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = tx.Rollback() }()
			pub, _ := outbox.NewTxPublisher(tx)
			var perr error
			panicked := func() (p any) {
				defer func() { p = recover() }()
				perr = pub.Publish("orders", message.NewMessage(c.publish, []byte("x")))
				return nil
			}()
			if panicked != nil {
				t.Fatalf("Publish(%q) with %q in the table panicked: %v", c.publish, c.existing, panicked)
			}
			if perr == nil || !strings.Contains(perr.Error(), "takes a message's id for the row") {
				t.Errorf("Publish(%q) with %q in the table: %v, want the id column's verdict", c.publish, c.existing, perr)
			}
		})
	}
}

// The message's context is cancelled while Publish cleans up after finding
// one of its ids taken. The cleanup statements (delete of the call's rows,
// give-back of numbers) run under that context: they fail, and the rows or
// the numbers stay. MySQL and SQLite keep the transaction open after the
// error, and so does PostgreSQL, as the cancelled statement never reached
// the server.
func TestTxPublisher_ContextCancelledDuringCleanup_NothingLeftBehind(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, d outbox.Dialect) {
		t.Run("unkeyed-duplicate-id-error-keeps-rows", func(t *testing.T) {
			publishInTx(t, db, "t", []*message.Message{msgTo("dup-1", "ex-a")})
			// The request ends just before the call takes its rows back.
			stx, ctx, pub := cancellingPublisher(t, db, d, func(q string) bool { return strings.HasPrefix(q, "DELETE FROM") })
			fresh := message.NewMessage("fresh-1", []byte("x"))
			fresh.SetContext(ctx)
			perr := pub.Publish("t", fresh, msgTo("dup-1", "ex-b"))
			t.Logf("Publish: %v", perr)
			if !errors.Is(perr, outbox.ErrDuplicateID) {
				t.Fatalf("err %v, want ErrDuplicateID", perr)
			}
			if err := stx.Commit(); err != nil {
				t.Fatalf("commit: %v", err)
			}
			var n int
			if err := db.Get(&n, "SELECT COUNT(*) FROM acemq_outbox WHERE id = 'fresh-1'"); err != nil {
				t.Fatal(err)
			}
			if n != 0 {
				t.Fatalf("Publish failed with ErrDuplicateID (\"nothing of the call is written\"), yet its message fresh-1 committed")
			}
		})
		t.Run("several-statements-release-cancelled-rows-stay", func(t *testing.T) {
			stx, ctx, pub := cancellingPublisher(t, db, d, func(q string) bool { return strings.HasPrefix(q, "RELEASE SAVEPOINT") })
			var many []*message.Message
			for i := 0; i < 1500; i++ {
				m := message.NewMessage(fmt.Sprintf("rel-%04d", i), []byte("x"))
				m.SetContext(ctx)
				many = append(many, m)
			}
			perr := pub.Publish("t", many...)
			t.Logf("Publish: %v", perr)
			if err := stx.Commit(); err != nil {
				t.Fatalf("commit: %v", err)
			}
			var n int
			if err := db.Get(&n, "SELECT COUNT(*) FROM acemq_outbox WHERE id LIKE 'rel-%'"); err != nil {
				t.Fatal(err)
			}
			t.Logf("rows of the failed call committed: %d", n)
			if perr != nil && n != 0 {
				t.Errorf("Publish failed, yet its %d rows committed", n)
			}
		})
		t.Run("keyed-retried-id-keeps-numbers", func(t *testing.T) {
			present := keyed("ck")
			inTx(t, db, true, []*message.Message{present}) // ck: 1
			stx, ctx, pub := cancellingPublisher(t, db, d, func(q string) bool { return strings.Contains(q, "SET last_seq = last_seq -") })
			again := message.NewMessage(present.UUID, present.Payload)
			again.Metadata.Set(outbox.MetadataAggregateID, "ck")
			again.SetContext(ctx)
			perr := pub.Publish("orders", again, keyed("ck"))
			t.Logf("Publish: %v", perr)
			if perr == nil {
				t.Fatal("publish succeeded")
			}
			if err := stx.Commit(); err != nil {
				t.Fatalf("commit: %v", err)
			}
			inTx(t, db, true, []*message.Message{keyed("ck")})
			seqs := seqsOf(t, db, "ck")
			t.Logf("committed seqs of ck: %v, last_seq %d", seqs, lastSeq(t, db, "ck"))
			if len(seqs) != 2 || seqs[1] != 2 {
				t.Fatalf("seqs of ck = %v, want [1 2]: numbers taken without rows", seqs)
			}
		})
	})
}

// safePublish is Publish with a panic turned into an error.
func safePublish(pub *outbox.TxPublisher, topic string, msgs ...*message.Message) (err error) {
	defer func() {
		if p := recover(); p != nil {
			err = fmt.Errorf("PANIC in Publish: %v", p)
		}
	}()
	return pub.Publish(topic, msgs...)
}

var _ = sql.ErrNoRows
var _ = fmt.Sprint
var _ = time.Second

// cancellingPublisher begins a transaction and a publisher on it whose
// messages' context (ctx) is cancelled just before the first statement
// that cancelAt matches: the moment a request ends mid-Publish.
func cancellingPublisher(t *testing.T, db *testdb.DB, d outbox.Dialect, cancelAt func(query string) bool) (*sql.Tx, context.Context, *outbox.TxPublisher) {
	t.Helper()
	stx, err := db.Begin()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = stx.Rollback() })
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	tx := hookTx{Tx: wsql.TxFromStdSQL(stx), before: func(q string) {
		if cancelAt(q) {
			cancel()
		}
	}}
	pub, err := outbox.NewTxPublisher(tx, outbox.TxPublisherConfig{Dialect: d})
	if err != nil {
		t.Fatal(err)
	}
	return stx, ctx, pub
}
