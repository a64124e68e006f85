package outbox_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testamqp"
	"github.com/acemq/watermill-outbox/internal/testdb"
	"github.com/acemq/watermill-outbox/sqlschema"
)

// keyed returns a new message on aggregate key (none for "").
func keyed(key string) *message.Message {
	msg := message.NewMessage(watermill.NewUUID(), []byte("body"))
	if key != "" {
		msg.Metadata.Set(outbox.MetadataAggregateID, key)
	}
	return msg
}

// seqOf is the (aggregate_id, seq) of the row id, NULL as "" and 0.
func seqOf(t testing.TB, db *testdb.DB, id string) (string, int64) {
	t.Helper()
	var (
		key sql.NullString
		seq sql.NullInt64
	)
	if err := db.QueryRow(db.Rebind("SELECT aggregate_id, seq FROM acemq_outbox WHERE id = ?"), id).Scan(&key, &seq); err != nil {
		t.Fatalf("reading the sequence of %s: %v", id, err)
	}
	return key.String, seq.Int64
}

// seqsOf lists the committed numbers of key, in order.
func seqsOf(t testing.TB, db *testdb.DB, key string) []int64 {
	t.Helper()
	var seqs []int64
	if err := db.Select(&seqs, db.Rebind("SELECT seq FROM acemq_outbox WHERE aggregate_id = ? ORDER BY seq"), key); err != nil {
		t.Fatalf("reading the numbers of %s: %v", key, err)
	}
	return seqs
}

// inTx publishes msgs on db in one transaction, committed or rolled back.
func inTx(t testing.TB, db *testdb.DB, commit bool, calls ...[]*message.Message) {
	t.Helper()
	tx, err := db.Beginx()
	if err != nil {
		t.Fatal(err)
	}
	pub, err := outbox.NewTxPublisher(tx)
	if err != nil {
		t.Fatal(err)
	}
	for _, msgs := range calls {
		if err := pub.Publish("orders", msgs...); err != nil {
			_ = tx.Rollback()
			t.Fatalf("publish: %v", err)
		}
	}
	if !commit {
		if err := tx.Rollback(); err != nil {
			t.Fatal(err)
		}
		return
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
}

func wantSeq(t testing.TB, db *testdb.DB, msg *message.Message, key string, seq int64) {
	t.Helper()
	if k, s := seqOf(t, db, msg.UUID); k != key || s != seq {
		t.Errorf("message %s: aggregate %q seq %d, want %q %d", msg.UUID, k, s, key, seq)
	}
}

func TestTxPublisher_Keyed_NumbersFromOneConsecutiveAcrossCallsAndTransactions(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		a1, a2, u, b1, a3 := keyed("order-a"), keyed("order-a"), keyed(""), keyed("order-b"), keyed("order-a")
		a4, a5 := keyed("order-a"), keyed("order-a")
		inTx(t, db, true, []*message.Message{a1, a2, u, b1, a3}, []*message.Message{a4})
		inTx(t, db, true, []*message.Message{a5})

		for i, m := range []*message.Message{a1, a2, a3, a4, a5} {
			wantSeq(t, db, m, "order-a", int64(i+1))
		}
		wantSeq(t, db, b1, "order-b", 1)
		wantSeq(t, db, u, "", 0)
		// The key is the row's column, not a header (a consumer's copy of
		// the message would take it), and the message keeps it.
		if h := readRowsByID(t, db)[a1.UUID].Headers; strings.Contains(h, "outbox_aggregate_id") {
			t.Errorf("headers %s hold the key", h)
		}
		if a1.Metadata.Get(outbox.MetadataAggregateID) != "order-a" {
			t.Errorf("the message lost its key: %v", a1.Metadata)
		}
	})
}

func readRowsByID(t testing.TB, db *testdb.DB) map[string]row {
	t.Helper()
	m := map[string]row{}
	for _, r := range readRows(t, db) {
		m[r.ID] = r
	}
	return m
}

func TestTxPublisher_Keyed_RolledBackTransactionGivesItsNumbersBack(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		first := keyed("order-a")
		inTx(t, db, true, []*message.Message{first})
		inTx(t, db, false, []*message.Message{keyed("order-a"), keyed("order-a")})
		next := keyed("order-a")
		inTx(t, db, true, []*message.Message{next})
		wantSeq(t, db, next, "order-a", 2)
	})
}

// Many transactions on one key: the committed numbers are 1..N, and each
// transaction, holding its numbers, sees every lower number committed by
// others already (read on another connection): numbers increase in commit
// order, because the key's row serialises the transactions to their end.
func TestTxPublisher_Keyed_ConcurrentTransactionsOnOneKey_GaplessAndInCommitOrder(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		const workers, txs, perTx = 20, 5, 2
		var (
			wg   sync.WaitGroup
			mu   sync.Mutex
			errs []error
		)
		fail := func(err error) {
			mu.Lock()
			errs = append(errs, err)
			mu.Unlock()
		}
		committedMax := db.Rebind("SELECT COALESCE(MAX(seq), 0) FROM acemq_outbox WHERE aggregate_id = ?")
		for range workers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for range txs {
					ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
					err := func() error {
						tx, err := db.BeginTxx(ctx, nil)
						if err != nil {
							return err
						}
						defer func() { _ = tx.Rollback() }()
						pub, err := outbox.NewTxPublisher(tx)
						if err != nil {
							return err
						}
						msgs := []*message.Message{keyed("hot"), keyed("hot")}
						if err := pub.Publish("orders", msgs...); err != nil {
							return err
						}
						var mine int64
						if err := tx.QueryRowxContext(ctx, db.Rebind("SELECT seq FROM acemq_outbox WHERE id = ?"), msgs[0].UUID).Scan(&mine); err != nil {
							return err
						}
						var before int64
						if err := db.QueryRowContext(ctx, committedMax, "hot").Scan(&before); err != nil {
							return err
						}
						if before != mine-1 {
							return fmt.Errorf("holding %d..%d, the committed numbers end at %d, want %d", mine, mine+perTx-1, before, mine-1)
						}
						return tx.Commit()
					}()
					cancel()
					if err != nil {
						fail(err)
						return
					}
				}
			}()
		}
		wg.Wait()
		if err := errors.Join(errs...); err != nil {
			t.Fatal(err)
		}
		seqs := seqsOf(t, db, "hot")
		if len(seqs) != workers*txs*perTx {
			t.Fatalf("%d rows on the key, want %d", len(seqs), workers*txs*perTx)
		}
		for i, s := range seqs {
			if s != int64(i+1) {
				t.Fatalf("numbers %v…, want 1..%d without a gap", seqs[:min(len(seqs), i+3)], len(seqs))
			}
		}
	})
}

func TestTxPublisher_Keyed_DifferentKeysDoNotWaitForEachOther(t *testing.T) {
	for _, kind := range []string{testdb.Postgres, testdb.MySQL} { // SQLite has one writer for the whole database
		t.Run(kind, func(t *testing.T) {
			db := migrated(t, kind)
			holder, err := db.Beginx()
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = holder.Rollback() }()
			pub, _ := outbox.NewTxPublisher(holder)
			if err := pub.Publish("orders", keyed("order-a")); err != nil {
				t.Fatal(err)
			}

			// Another key commits while order-a's transaction is open.
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			tx, err := db.BeginTxx(ctx, nil)
			if err != nil {
				t.Fatal(err)
			}
			other, _ := outbox.NewTxPublisher(tx)
			b := keyed("order-b")
			if err := other.Publish("orders", b); err != nil {
				_ = tx.Rollback()
				t.Fatalf("publishing on another key while order-a is held: %v", err)
			}
			if err := tx.Commit(); err != nil {
				t.Fatal(err)
			}
			wantSeq(t, db, b, "order-b", 1)

			// The same key does wait: the contrast that makes the above a test.
			short, cancelShort := context.WithTimeout(context.Background(), 300*time.Millisecond)
			defer cancelShort()
			same, err := db.BeginTxx(short, nil)
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = same.Rollback() }()
			sp, _ := outbox.NewTxPublisher(same)
			m := keyed("order-a")
			m.SetContext(short)
			if err := sp.Publish("orders", m); err == nil {
				t.Fatal("a second transaction on order-a got its number while the first held the key")
			}
		})
	}
}

func TestTxPublisher_Keyed_PurgeOfPublishedRows_SequenceContinues(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		inTx(t, db, true, []*message.Message{keyed("order-a"), keyed("order-a")})
		publishAllAt(t, db, time.Now().Add(-48*time.Hour))
		store, err := outbox.NewStore(db.DB, outbox.StoreConfig{})
		if err != nil {
			t.Fatal(err)
		}
		if n, err := store.PurgePublished(context.Background(), 24*time.Hour); err != nil || n != 2 {
			t.Fatalf("purged %d (%v), want 2", n, err)
		}
		next := keyed("order-a")
		inTx(t, db, true, []*message.Message{next})
		wantSeq(t, db, next, "order-a", 3)
	})
}

// Unkeyed messages write both columns NULL and run no statement on the
// sequences: they publish with the table gone.
func TestTxPublisher_Unkeyed_NullColumnsAndNoSequenceStatement(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		db.MustExec("DROP TABLE acemq_outbox_sequences")
		m1, m2 := keyed(""), keyed("")
		inTx(t, db, true, []*message.Message{m1, m2})
		wantSeq(t, db, m1, "", 0)
		wantSeq(t, db, m2, "", 0)

		// And a keyed one does need the table: the drop above is real.
		tx, _ := db.Beginx()
		defer func() { _ = tx.Rollback() }()
		pub, _ := outbox.NewTxPublisher(tx)
		if err := pub.Publish("orders", keyed("order-a")); err == nil || !strings.Contains(err.Error(), "acemq_outbox_sequences") {
			t.Fatalf("keyed publish without the sequences table: %v, want an error naming it", err)
		}
	})
}

func TestTxPublisher_BadAggregateID_InvalidMessageErrorNothingWritten(t *testing.T) {
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		for name, key := range map[string]string{
			"empty": "", "256 bytes": strings.Repeat("k", 256), "not UTF-8": "a\xffb", "NUL": "a\x00b",
		} {
			t.Run(name, func(t *testing.T) {
				tx, _ := db.Beginx()
				defer func() { _ = tx.Rollback() }()
				pub, _ := outbox.NewTxPublisher(tx)
				bad := message.NewMessage(watermill.NewUUID(), nil)
				bad.Metadata.Set(outbox.MetadataAggregateID, key)
				err := pub.Publish("orders", keyed("order-a"), bad)
				var invalid *outbox.InvalidMessageError
				if !errors.As(err, &invalid) || invalid.Field != "aggregate id" || invalid.Index != 1 {
					t.Fatalf("err = %v, want an InvalidMessageError on message 1's aggregate id", err)
				}
				var rows, keys int
				_ = tx.Get(&rows, "SELECT COUNT(*) FROM acemq_outbox")
				_ = tx.Get(&keys, "SELECT COUNT(*) FROM acemq_outbox_sequences")
				if rows != 0 || keys != 0 {
					t.Fatalf("%d rows and %d keys written, want none", rows, keys)
				}
			})
		}
	})
}

// A key ending in a space is refused on MySQL, whose _bin collations ignore
// trailing spaces: "k " would take "k"'s numbers, and a consumer of "k "
// would wait for ever for the ones "k" took. Elsewhere it is a key of its
// own, numbered from 1.
func TestTxPublisher_KeyEndingInSpace_RefusedOnMySQLAKeyOfItsOwnElsewhere(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, d outbox.Dialect) {
		inTx(t, db, true, []*message.Message{keyed("k")})
		spaced := keyed("k ")
		tx, _ := db.Beginx()
		defer func() { _ = tx.Rollback() }()
		pub, _ := outbox.NewTxPublisher(tx)
		err := pub.Publish("orders", spaced)
		if d == outbox.MySQL {
			var invalid *outbox.InvalidMessageError
			if !errors.As(err, &invalid) || invalid.Field != "aggregate id" || !strings.Contains(err.Error(), "trim") {
				t.Fatalf("err = %v, want an InvalidMessageError on the aggregate id", err)
			}
			return
		}
		if err != nil {
			t.Fatal(err)
		}
		if err := tx.Commit(); err != nil {
			t.Fatal(err)
		}
		if got := seqsOf(t, db, "k "); fmt.Sprint(got) != "[1]" {
			t.Errorf(`"k " numbered %v, want [1]: a key of its own`, got)
		}
		if got := seqsOf(t, db, "k"); fmt.Sprint(got) != "[1]" {
			t.Errorf(`"k" numbered %v, want [1]`, got)
		}
	})
}

// A message already in the table takes no number: the ordered inbox would
// wait for ever for one that never arrives.
func TestTxPublisher_Keyed_DuplicateIDs_TakeNoNumber(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		// Twice in one call: one row.
		a1 := keyed("order-a")
		inTx(t, db, true, []*message.Message{a1, a1})
		wantSeq(t, db, a1, "order-a", 1)

		// In two calls of one transaction, with others around it.
		a2, a3 := keyed("order-a"), keyed("order-a")
		inTx(t, db, true, []*message.Message{a2}, []*message.Message{keyed("order-b"), a2, a3})
		wantSeq(t, db, a2, "order-a", 2)
		wantSeq(t, db, a3, "order-a", 3)

		// A transaction retried after it did commit: the old message keeps
		// its number, the new one takes the next.
		a4 := keyed("order-a")
		inTx(t, db, true, []*message.Message{a1, a4, a3})
		wantSeq(t, db, a1, "order-a", 1)
		wantSeq(t, db, a4, "order-a", 4)

		a5 := keyed("order-a")
		inTx(t, db, true, []*message.Message{a5})
		wantSeq(t, db, a5, "order-a", 5)
		if got := seqsOf(t, db, "order-a"); fmt.Sprint(got) != "[1 2 3 4 5]" {
			t.Fatalf("numbers %v, want [1 2 3 4 5]", got)
		}
	})
}

func TestTxPublisher_Keyed_SameIDUnderTwoKeysInOneCall_InvalidMessageError(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		a := keyed("order-a")
		b := message.NewMessage(a.UUID, nil)
		b.Metadata.Set(outbox.MetadataAggregateID, "order-b")
		tx, _ := db.Beginx()
		defer func() { _ = tx.Rollback() }()
		pub, _ := outbox.NewTxPublisher(tx)
		var invalid *outbox.InvalidMessageError
		if err := pub.Publish("orders", a, b); !errors.As(err, &invalid) || invalid.Field != "aggregate id" {
			t.Fatalf("err = %v, want an InvalidMessageError on the aggregate id", err)
		}
	})
}

// A keyed message to another destination under an id already taken fails
// the call as before, and gives its numbers back.
func TestTxPublisher_Keyed_DuplicateIDToAnotherDestination_ErrorAndNumbersGivenBack(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		taken := keyed("order-a")
		inTx(t, db, true, []*message.Message{taken})

		tx, _ := db.Beginx()
		pub, _ := outbox.NewTxPublisher(tx)
		clash := message.NewMessage(taken.UUID, nil)
		clash.Metadata.Set(outbox.MetadataAggregateID, "order-a")
		err := pub.Publish("elsewhere", keyed("order-a"), clash)
		var dup *outbox.DuplicateIDError
		if !errors.As(err, &dup) {
			_ = tx.Rollback()
			t.Fatalf("err = %v, want a DuplicateIDError", err)
		}
		// A caller who commits anyway leaves no row of the call, and no gap.
		if err := tx.Commit(); err != nil && db.Kind != testdb.Postgres {
			t.Fatal(err)
		}
		next := keyed("order-a")
		inTx(t, db, true, []*message.Message{next})
		wantSeq(t, db, next, "order-a", 2)
	})
}

// A key whose counter is behind the table (another library wrote a keyed
// row without raising it, or the counters came back from an older backup):
// the number Publish takes is another row's. Every database refuses the
// call, MySQL too, whose insert skips such a row without an error;
// the call writes nothing, and a caller who commits anyway finds the
// counter as it was.
func TestTxPublisher_Keyed_SeqHeldByAnotherRow_ErrorNothingWrittenNumberGivenBack(t *testing.T) {
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		if _, err := db.Exec(db.Rebind("INSERT INTO acemq_outbox (id, exchange_name, routing_key, body, headers, created_at, aggregate_id, seq)"+
			" VALUES (?, 'shop', 'k', 'x', '{}', ?, 'order-a', 1)"), "foreign-1", time.Now().UTC()); err != nil {
			t.Fatal(err)
		}
		tx, err := db.Beginx()
		if err != nil {
			t.Fatal(err)
		}
		pub, _ := outbox.NewTxPublisher(tx)
		msg := keyed("order-a")
		if err := pub.Publish("orders", msg); err == nil {
			_ = tx.Rollback()
			t.Fatal("Publish took seq 1 of order-a, which another row holds, without an error")
		}
		if err := tx.Commit(); err != nil && db.Kind != testdb.Postgres {
			t.Fatal(err)
		}
		if _, s := seqOf(t, db, "foreign-1"); s != 1 {
			t.Fatalf("the other row's seq is %d", s)
		}
		var n int
		if err := db.Get(&n, db.Rebind("SELECT COUNT(*) FROM acemq_outbox WHERE id = ?"), msg.UUID); err != nil || n != 0 {
			t.Fatalf("the refused message has %d rows (%v)", n, err)
		}
		var last sql.NullInt64
		err = db.Get(&last, db.Rebind("SELECT last_seq FROM acemq_outbox_sequences WHERE aggregate_id = ?"), "order-a")
		if err != nil && !errors.Is(err, sql.ErrNoRows) {
			t.Fatal(err)
		}
		if last.Int64 != 0 {
			t.Fatalf("order-a's counter is %d after the refused call, want 0: a number went to no row", last.Int64)
		}
	})
}

// Over 1,000 keyed messages take several statements: still consecutive, and
// still all or nothing.
func TestTxPublisher_Keyed_ManyMessagesInOneCall_Consecutive(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		msgs := make([]*message.Message, 2500)
		for i := range msgs {
			msgs[i] = keyed(fmt.Sprintf("k%d", i%2))
		}
		inTx(t, db, true, msgs)
		for i, m := range msgs {
			if i%500 == 0 || i >= 2498 {
				wantSeq(t, db, m, fmt.Sprintf("k%d", i%2), int64(i/2+1))
			}
		}
		if n := len(seqsOf(t, db, "k1")); n != 1250 {
			t.Fatalf("%d rows on k1, want 1250", n)
		}
	})
}

// A call too big for one statement whose keyed rows all fall in one of
// its statements: the others have nothing to number, and go as plain
// inserts (a raise of no keys was a syntax error).
func TestTxPublisher_Keyed_StatementWithoutAKeyedRow_Inserted(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		msgs := []*message.Message{keyed("k")}
		for range 1500 {
			msgs = append(msgs, keyed(""))
		}
		msgs = append(msgs, keyed("k"))
		inTx(t, db, true, msgs[:1501], msgs[1501:])
		wantSeq(t, db, msgs[0], "k", 1)
		wantSeq(t, db, msgs[1501], "k", 2)
		var n int
		if err := db.Get(&n, "SELECT COUNT(*) FROM acemq_outbox"); err != nil || n != 1502 {
			t.Errorf("%d rows (%v), want 1502", n, err)
		}
	})
}

func TestForwarder_KeyedRow_ArrivesWithAggregateIDStringAndSeqInteger(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		b := testamqp.New(t)
		queue := b.Queue("order.placed")
		msgs := []*message.Message{keyed("pay-1"), keyed("pay-1"), keyed("pay-1")}
		// A row header of the same name loses to the columns.
		msgs[2].Metadata.Set(outbox.HeaderSeq, "forged")
		publishInTx(t, db, "order.placed", msgs, outbox.TxPublisherConfig{Exchange: b.Exchange})

		f := newForwarder(t, db, outbox.ForwarderConfig{})
		if n := sweepAll(t, f); n != 3 {
			t.Fatalf("published %d, want 3", n)
		}
		got := b.Drain(queue, 3, 5*time.Second)
		if len(got) != 3 {
			t.Fatalf("queue received %d messages, want 3", len(got))
		}
		bySeq := map[int64]string{}
		var third amqp.Delivery
		for _, d := range got {
			key, ok := d.Headers[outbox.HeaderAggregateID].(string)
			seq, isInt := d.Headers[outbox.HeaderSeq].(int64)
			if !ok || key != "pay-1" || !isInt {
				t.Fatalf("headers %v: want aggregateId the string pay-1 and seq an int64", d.Headers)
			}
			bySeq[seq] = d.MessageId
			if seq == 3 {
				third = d
			}
		}
		for i, m := range msgs {
			if bySeq[int64(i+1)] != m.UUID {
				t.Errorf("seq %d went with %q, want message %d (%s)", i+1, bySeq[int64(i+1)], i, m.UUID)
			}
		}
		// Through the AMQPMarshaler, as a Watermill consumer reads it.
		wm, err := outbox.AMQPMarshaler{}.Unmarshal(third)
		if err != nil {
			t.Fatal(err)
		}
		if wm.Metadata.Get(outbox.HeaderAggregateID) != "pay-1" || wm.Metadata.Get(outbox.HeaderSeq) != "3" {
			t.Fatalf("metadata %v, want aggregateId pay-1 and seq 3", wm.Metadata)
		}
	})
}

// capture is a Watermill publisher that keeps what it is given.
type capture struct{ msgs []*message.Message }

func (c *capture) Publish(_ string, msgs ...*message.Message) error {
	c.msgs = append(c.msgs, msgs...)
	return nil
}
func (c *capture) Close() error { return nil }

func TestPublisherDestination_KeyedRecord_MetadataAggregateIDAndDecimalSeq(t *testing.T) {
	var c capture
	d := outbox.NewPublisherDestination(&c, nil)
	res := d.Publish(context.Background(), []outbox.Record{
		{ID: "k", RoutingKey: "t", AggregateID: "pay-1", Seq: 3, Headers: map[string]any{"seq": "forged"}},
		{ID: "u", RoutingKey: "t"},
	})
	if errors.Join(res...) != nil {
		t.Fatal(res)
	}
	if md := c.msgs[0].Metadata; md.Get(outbox.HeaderAggregateID) != "pay-1" || md.Get(outbox.HeaderSeq) != "3" {
		t.Errorf("keyed metadata %v, want aggregateId pay-1 and seq 3", md)
	}
	if _, ok := c.msgs[1].Metadata[outbox.HeaderSeq]; ok {
		t.Errorf("unkeyed metadata %v has a seq", c.msgs[1].Metadata)
	}
}

// A keyed Publish on SQLite whose context ends while its insert runs: the
// driver interrupts the statement, and SQLite rolls the caller's whole
// transaction back (its rule for a write interrupted inside a transaction),
// leaving the connection outside any. The numbers the call took went with
// it. Given back then, they were taken back in a statement committed on its
// own: the key's counter fell below numbers already committed, and every
// later Publish of the key failed on (aggregate_id, seq).
func TestTxPublisher_SQLiteInsertInterrupted_KeyKeepsItsCounter(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	inTx(t, db, true, []*message.Message{keyed("ik"), keyed("ik"), keyed("ik")}) // ik: 1..3
	// The insert runs long, not the raise before it: a trigger on the outbox
	// counts the pairs of a table of 20,000 rows.
	for _, q := range []string{
		"CREATE TABLE slow_rows (x INTEGER)",
		"WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 20000) INSERT INTO slow_rows SELECT x FROM c",
		"CREATE TRIGGER slow_insert BEFORE INSERT ON acemq_outbox BEGIN SELECT COUNT(*) FROM slow_rows a, slow_rows b; END",
	} {
		if _, err := db.Exec(q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	tx, err := db.Beginx()
	if err != nil {
		t.Fatal(err)
	}
	pub, err := outbox.NewTxPublisher(tx)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	late := keyed("ik")
	late.SetContext(ctx)
	perr := pub.Publish("orders", late)
	t.Logf("Publish: %v; Rollback: %v", perr, tx.Rollback())
	if !errors.Is(perr, context.DeadlineExceeded) {
		t.Fatalf("Publish: %v, want the context's deadline (the insert interrupted)", perr)
	}
	if _, err := db.Exec("DROP TRIGGER slow_insert"); err != nil {
		t.Fatal(err)
	}
	var last int64
	if err := db.Get(&last, "SELECT last_seq FROM acemq_outbox_sequences WHERE aggregate_id = 'ik'"); err != nil {
		t.Fatal(err)
	}
	if last != 3 {
		t.Errorf("the key's counter is %d after the interrupted call, want 3, its committed rows'", last)
	}
	next := keyed("ik")
	inTx(t, db, true, []*message.Message{next})
	if _, seq := seqOf(t, db, next.UUID); seq != 4 {
		t.Errorf("the next message of the key got seq %d, want 4", seq)
	}
}

// The relay's ordering headers, aggregateId and seq, are left out of a
// row's headers when a message holds both (a copy of a keyed delivery: it
// would go out as its original's key and number); seq alone is the
// application's own metadata and stays (aggregateId alone is refused:
// TestTxPublisher_AggregateIDHeaderWithoutSeq_RefusedNamingMetadataAggregateID).
func TestTxPublisher_RelayOrderingHeaders_LeftOutOnlyAsAPair(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.SQLite)
	both := message.NewMessage("both", nil)
	both.Metadata.Set(outbox.HeaderAggregateID, "order-1")
	both.Metadata.Set(outbox.HeaderSeq, "3")
	both.Metadata.Set("tenant", "acme")
	seqOnly := message.NewMessage("seq-only", nil)
	seqOnly.Metadata.Set(outbox.HeaderSeq, "7")
	publishInTx(t, db, "t", []*message.Message{both, seqOnly})
	headers := func(id string) string {
		var h string
		if err := db.Get(&h, "SELECT headers FROM acemq_outbox WHERE id = ?", id); err != nil {
			t.Fatal(err)
		}
		return h
	}
	if h := headers("both"); strings.Contains(h, `"aggregateId"`) || strings.Contains(h, `"seq"`) || !strings.Contains(h, `"tenant"`) {
		t.Errorf("headers of the message holding both: %s, want tenant and neither ordering header", h)
	}
	if h := headers("seq-only"); !strings.Contains(h, `"seq":"7"`) {
		t.Errorf("headers of the message holding seq alone: %s, want its seq kept", h)
	}
	if both.Metadata.Get(outbox.HeaderSeq) != "3" {
		t.Error("Publish changed the caller's message")
	}
}

// A message whose metadata holds aggregateId (HeaderAggregateID, the name
// consumers see) and no seq, set where MetadataAggregateID was meant, went
// out unkeyed with that header, and an ordered inbox refused it at every
// delivery (ErrInvalidSeq): a poison message (an API review). Publish
// refuses it, naming MetadataAggregateID, and writes nothing of the call.
// A void aggregateId ("null", as AMQPMarshaler renders a void header) is
// no key, and a keyed message's own aggregateId header is the relay's to
// set: both are written.
func TestTxPublisher_AggregateIDHeaderWithoutSeq_RefusedNamingMetadataAggregateID(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.SQLite)
	fine := message.NewMessage("fine", nil)
	wrong := message.NewMessage("wrong", nil)
	wrong.Metadata.Set(outbox.HeaderAggregateID, "order-1")
	err := republish(t, db, fine, wrong) // the transaction committed all the same
	var invalid *outbox.InvalidMessageError
	if !errors.As(err, &invalid) || invalid.Index != 1 || invalid.Field != "metadata" || !strings.Contains(err.Error(), outbox.MetadataAggregateID) {
		t.Fatalf("Publish: %v, want an InvalidMessageError of message 1's metadata naming %s", err, outbox.MetadataAggregateID)
	}
	if n := countRows(t, db); n != 0 {
		t.Errorf("%d rows written by the refused call and committed, want none", n)
	}

	void := message.NewMessage("void", nil)
	void.Metadata.Set(outbox.HeaderAggregateID, "null")
	own := keyed("order-2")
	own.Metadata.Set(outbox.HeaderAggregateID, "order-2")
	publishInTx(t, db, "t", []*message.Message{void, own})
	if key, seq := seqOf(t, db, own.UUID); key != "order-2" || seq != 1 {
		t.Errorf("the keyed message with its own aggregateId header: key %q seq %d, want order-2 and 1", key, seq)
	}
}

// republish publishes msgs in one transaction and commits it whatever
// Publish returned (a caller may), returning Publish's error.
func republish(t *testing.T, db *testdb.DB, msgs ...*message.Message) error {
	t.Helper()
	tx, pub := beginPublisher(t, db)
	perr := pub.Publish("orders", msgs...)
	if err := tx.Commit(); err != nil && (perr == nil || db.Kind != testdb.Postgres) {
		t.Fatal(err) // PostgreSQL's transaction may be aborted by the refused call
	}
	return perr
}

// underKey is a new message of id on ordering key key (none for "").
func underKey(id, key string) *message.Message {
	msg := keyed(key)
	msg.UUID = id
	return msg
}

// A message whose id is already in the table under another ordering key
// (or keyed where the row is not) was skipped as a retry,
// and the call returned nil: the caller believed it ordered under its key
// while the relay sent the row under the other. It is a DuplicateIDError
// naming both keys; nothing of the call is written, and the new key's
// counter is as it was. The same message under the same key is still a
// retry.
func TestTxPublisher_SameIDUnderAnotherOrderingKey_DuplicateIDErrorNothingWritten(t *testing.T) {
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		onA, unkeyed := keyed("order-a"), keyed("")
		inTx(t, db, true, []*message.Message{onA, unkeyed})

		for _, c := range []struct {
			name          string
			id, have, key string
		}{
			{"keyed-under-another-key", onA.UUID, "order-a", "order-b"},
			{"unkeyed-row-republished-keyed", unkeyed.UUID, "", "order-b"},
			{"key-differing-in-case", onA.UUID, "order-a", "ORDER-A"},
		} {
			fresh := keyed("order-b")
			err := republish(t, db, fresh, underKey(c.id, c.key))
			var dup *outbox.DuplicateIDError
			if !errors.As(err, &dup) || !errors.Is(err, outbox.ErrDuplicateID) || dup.ID != c.id ||
				dup.AggregateID != c.have || dup.WantAggregateID != c.key || dup.RoutingKey != "orders" || dup.WantRoutingKey != "orders" {
				t.Errorf("%s: err = %v (%+v), want a *DuplicateIDError naming aggregate %q and %q", c.name, err, dup, c.have, c.key)
				continue
			}
			if n := countRows(t, db); n != 2 {
				t.Errorf("%s: %d rows, want 2: nothing of the refused call", c.name, n)
			}
		}
		wantSeq(t, db, onA, "order-a", 1)
		wantSeq(t, db, unkeyed, "", 0)
		next := keyed("order-b")
		inTx(t, db, true, []*message.Message{next})
		wantSeq(t, db, next, "order-b", 1) // no number of a refused call kept

		// The same messages again, under their own keys, and the keyed one
		// unkeyed (it keeps the row's key): retries.
		if err := republish(t, db, underKey(onA.UUID, "order-a"), underKey(unkeyed.UUID, "")); err != nil {
			t.Fatalf("the same messages under the same keys again: %v", err)
		}
		if err := republish(t, db, underKey(onA.UUID, "")); err != nil {
			t.Fatalf("the keyed message again, unkeyed: %v", err)
		}
		wantSeq(t, db, onA, "order-a", 1)
		if n := countRows(t, db); n != 3 {
			t.Fatalf("%d rows, want 3", n)
		}
	})
}

// Rows another library wrote: an unkeyed one may hold ” rather than NULL
// (the relay sends either unkeyed), and a key is compared as the database
// stores it, byte for byte, not by the column's collation: "order-1 "
// equals "order-1" under MySQL's PAD SPACE, but the relay sends the
// row's bytes, to another key of the ordered inbox.
func TestTxPublisher_SameIDOverForeignRows_KeyComparedByteForByte(t *testing.T) {
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		created := any(time.Now().UTC())
		if db.Kind != testdb.Postgres {
			created = time.Now().UTC().Format("2006-01-02 15:04:05.000000")
		}
		q := db.Rebind("INSERT INTO acemq_outbox (id, exchange_name, routing_key, body, body_encoding, content_type, headers, created_at, aggregate_id, seq)" +
			" VALUES (?, '', 'orders', 'x', 'utf-8', 'text/plain', '{}', ?, ?, ?)")
		for _, r := range []struct {
			id  string
			key any
			seq any
		}{{"empty-key", "", nil}, {"padded-key", "order-1 ", 1}} {
			if _, err := db.Exec(q, r.id, created, r.key, r.seq); err != nil {
				t.Fatal(err)
			}
		}

		if err := republish(t, db, underKey("empty-key", "")); err != nil {
			t.Errorf("unkeyed, over a row whose aggregate_id is '': %v, want a retry", err)
		}
		var dup *outbox.DuplicateIDError
		if err := republish(t, db, underKey("empty-key", "order-1")); !errors.As(err, &dup) || dup.AggregateID != "" || dup.WantAggregateID != "order-1" {
			t.Errorf("keyed, over a row whose aggregate_id is '': %v, want a *DuplicateIDError", err)
		}
		if err := republish(t, db, underKey("padded-key", "order-1")); !errors.As(err, &dup) || dup.AggregateID != "order-1 " || dup.WantAggregateID != "order-1" {
			t.Errorf(`"order-1" over a row of "order-1 ": %v, want a *DuplicateIDError`, err)
		}
		if n := countRows(t, db); n != 2 {
			t.Errorf("%d rows, want the 2 foreign ones", n)
		}
	})
}

// A service that publishes only unkeyed messages into a table another
// library made, without 0005's aggregate_id and seq: its retried
// transaction (the same id again) reads the row back without the
// ordering key's column, and is a retry, as before keys were compared.
func TestTxPublisher_UnkeyedRetryOnTableWithoutKeyColumns_IsARetry(t *testing.T) {
	for _, kind := range []string{testdb.Postgres, testdb.MySQL} {
		t.Run(kind, func(t *testing.T) {
			db := testdb.New(t, kind)
			migs, err := sqlschema.Migrations(dialectOf(t, db).Name())
			if err != nil {
				t.Fatal(err)
			}
			for _, stmt := range sqlschema.Statements(migs[0].Up) { // 0001 alone
				db.MustExec(stmt)
			}
			msg := message.NewMessage(watermill.NewUUID(), []byte("x"))
			for try := 1; try <= 2; try++ {
				if err := republish(t, db, msg); err != nil {
					t.Fatalf("publish %d of the same message: %v", try, err)
				}
			}
			if n := countRows(t, db); n != 1 {
				t.Errorf("%d rows, want 1", n)
			}
		})
	}
}
