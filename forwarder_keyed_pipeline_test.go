package outbox_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// orderBroker is a destination that pipelines and stands for the broker
// every relay of a test publishes to. At every send it checks that each
// keyed record's predecessor in its key is confirmed already: the broker
// must never get a key's record before the one before it. It refuses each
// record of refuse that many times (a keyed record's failure: it holds back
// its key only), and counts each record's confirms.
type orderBroker struct {
	capacity int

	mu         sync.Mutex
	confirmed  map[string]int64 // by key: the last seq confirmed
	refuse     map[string]int   // by id: refusals left
	confirms   map[string]int   // by id
	violations []string
}

func newOrderBroker(capacity int, refuse map[string]int) *orderBroker {
	return &orderBroker{capacity: capacity, confirmed: map[string]int64{}, refuse: refuse, confirms: map[string]int{}}
}

// orderPipe is one relay's pipeline into the broker.
type orderPipe struct {
	b    *orderBroker
	dest *orderDest
}

// orderDest is one relay's destination: Pipeline's Destination must be the
// Forwarder's own.
type orderDest struct{ b *orderBroker }

type orderSent []outbox.Record

func (s orderSent) Records() []outbox.Record { return s }

func (d *orderDest) Publish(_ context.Context, records []outbox.Record) []error {
	d.b.checkSent(records)
	return d.b.confirm(records)
}

func (d *orderDest) Pipeline() outbox.Pipeline { return orderPipe{b: d.b, dest: d} }

func (p orderPipe) Destination() outbox.Destination { return p.dest }
func (p orderPipe) Capacity() int                   { return p.b.capacity }
func (p orderPipe) Send(_ context.Context, records []outbox.Record) outbox.Sent {
	p.b.checkSent(records)
	return orderSent(records)
}
func (p orderPipe) Wait(_ context.Context, s outbox.Sent) []error {
	time.Sleep(time.Millisecond) // the broker's confirm takes a moment
	return p.b.confirm(s.Records())
}

// checkSent checks that each keyed record's predecessor is confirmed.
func (b *orderBroker) checkSent(records []outbox.Record) {
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, r := range records {
		if r.AggregateID != "" && b.confirmed[r.AggregateID] != r.Seq-1 {
			b.violations = append(b.violations, fmt.Sprintf("%s seq %d sent when seq %d was the last confirmed", r.AggregateID, r.Seq, b.confirmed[r.AggregateID]))
		}
	}
}

// confirm confirms records, but for those it refuses.
func (b *orderBroker) confirm(records []outbox.Record) []error {
	b.mu.Lock()
	defer b.mu.Unlock()
	res := make([]error, len(records))
	for i, r := range records {
		if b.refuse[r.ID] > 0 {
			b.refuse[r.ID]--
			res[i] = errors.New("refused by the test's broker")
			continue
		}
		b.confirms[r.ID]++
		if r.AggregateID != "" {
			b.confirmed[r.AggregateID] = r.Seq
		}
	}
	return res
}

// checkInOrderOnce fails t for each record sent before its predecessor
// was confirmed and each confirmed more than once.
func (b *orderBroker) checkInOrderOnce(t *testing.T) {
	t.Helper()
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, v := range b.violations {
		t.Error(v)
	}
	for id, n := range b.confirms {
		if n != 1 {
			t.Errorf("%s confirmed %d times", id, n)
		}
	}
}

// A key's next record is claimed while its predecessor is in flight in the
// same relay, and goes out only once the predecessor is confirmed; when the
// predecessor is refused, it is not sent, and goes out after the
// predecessor's retry. With two relays over the same table, a few records
// of some keys refused, and keys interleaved more tightly than the batches
// in flight: every key's records reach the broker in sequence order, each
// confirmed once, and (but on MySQL, where a locked row says nothing) some
// key's next record was claimed before its predecessor was marked.
func TestForwarder_Run_KeysNextRecordsClaimedInFlight_SentInOrderAfterTheirPredecessors(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, d outbox.Dialect) {
		const keys, perKey = 6, 40
		rows := interleavedKeys(keys, perKey)
		insertKeyed(t, db, rows)
		broker := newOrderBroker(1000, map[string]int{
			keyedID("order-000", 1):  2,
			keyedID("order-003", 2):  3,
			keyedID("order-005", 17): 1,
			keyedID("order-001", 40): 2,
		})
		ctx, cancel := context.WithCancel(context.Background())
		var wg sync.WaitGroup
		var early atomic.Int32 // records claimed before their predecessor was marked
		for i := range 2 {
			f, err := outbox.NewForwarder(db.DB, &orderDest{b: broker}, outbox.ForwarderConfig{
				Dialect: d, RelayID: fmt.Sprintf("relay-%d", i), BatchSize: 4, MaxBatchSize: 64,
				RetryMin: 5 * time.Millisecond, RetryMax: 20 * time.Millisecond, PollInterval: 50 * time.Millisecond,
			})
			if err != nil {
				t.Fatal(err)
			}
			outbox.SetAfterPublishHook(f, func(published []string) error {
				for _, id := range published {
					if claimedAlready(t, db, successorID(t, id)) {
						early.Add(1)
					}
				}
				return nil
			})
			wg.Add(1)
			go func() {
				defer wg.Done()
				if err := f.Run(ctx); err != nil {
					t.Error(err)
				}
				_ = f.Close()
			}()
		}
		defer func() { cancel(); wg.Wait() }()
		waitFor(t, 60*time.Second, "every record confirmed", func() bool {
			broker.mu.Lock()
			defer broker.mu.Unlock()
			return len(broker.confirms) == len(rows)
		})
		cancel()
		wg.Wait()
		broker.checkInOrderOnce(t)
		broker.mu.Lock()
		defer broker.mu.Unlock()
		for k := 0; k < keys; k++ {
			if got := broker.confirmed[fmt.Sprintf("order-%03d", k)]; got != perKey {
				t.Errorf("order-%03d: last confirmed seq %d, want %d", k, got, perKey)
			}
		}
		// On MySQL a claim keeps the rows it passed over locked (see
		// TestClaim_KeysNextRecord_ClaimableWhileItsPredecessorsAreInFlightHere):
		// a locked row there says nothing.
		if db.Kind != testdb.MySQL && early.Load() == 0 {
			t.Errorf("no key's next record was claimed before its predecessor was marked: each key has one record in flight")
		}
	})
}

// A batch that goes out through Publish, not the pipeline (it holds a
// record being retried), claimed while a pipelined batch holding its key's
// earlier record was in flight: that record is refused, so the batch goes
// without its record of the key, which waits for the refused one's retry,
// and with the rest.
func TestForwarder_Run_BatchSentAloneBehindARefusedPredecessor_HoldsBackOnlyItsKey(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, d outbox.Dialect) {
		start := time.Now().Add(-time.Hour)
		row := func(i int, id, key string, seq int64) keyedRow {
			return keyedRow{id: id, exchange: "amq.topic", routingKey: "keyed", aggregate: key, seq: seq, createdAt: start.Add(time.Duration(i) * time.Millisecond)}
		}
		first, second := keyedID("order-a", 1), keyedID("order-a", 2)
		// Claims of two: {first, plain} is pipelined; {retried, second}
		// is claimed while it is in flight, and goes alone.
		insertKeyed(t, db, []keyedRow{row(0, first, "order-a", 1), row(1, "plain", "", 0), row(2, "retried", "", 0), row(3, second, "order-a", 2)})
		if _, err := db.Exec("UPDATE acemq_outbox SET attempts = 1, last_error = 'failed before' WHERE id = 'retried'"); err != nil {
			t.Fatal(err)
		}
		broker := newOrderBroker(1000, map[string]int{first: 1})
		f, err := outbox.NewForwarder(db.DB, &orderDest{b: broker}, outbox.ForwarderConfig{
			Dialect: d, BatchSize: 2, MaxBatchSize: 2,
			RetryMin: 5 * time.Millisecond, RetryMax: 20 * time.Millisecond, PollInterval: 50 * time.Millisecond,
		})
		if err != nil {
			t.Fatal(err)
		}
		runUntil(t, f, 30*time.Second, "every record confirmed", func() bool {
			broker.mu.Lock()
			defer broker.mu.Unlock()
			return len(broker.confirms) == 4
		})
		broker.checkInOrderOnce(t)
		var attempts int
		if err := db.Get(&attempts, db.Rebind("SELECT attempts FROM acemq_outbox WHERE id = ?"), second); err != nil {
			t.Fatal(err)
		}
		if attempts != 0 {
			t.Errorf("%s: %d attempts, want 0: held back behind its key is no failure of its own", second, attempts)
		}
	})
}

// successorID is the id of the record after keyedID's id in its key.
func successorID(t *testing.T, id string) string {
	t.Helper()
	key, seq, ok := strings.Cut(id, "#")
	n, err := strconv.Atoi(seq)
	if !ok || err != nil {
		t.Fatalf("id %q is no keyedID", id)
	}
	return keyedID(key, int64(n+1))
}

// claimedAlready reports whether a relay has claimed the pending row id:
// leased on SQLite, locked elsewhere (a row the test can lock is nobody's).
func claimedAlready(t *testing.T, db *testdb.DB, id string) bool {
	t.Helper()
	if db.Kind == testdb.SQLite {
		var n int
		if err := db.Get(&n, "SELECT COUNT(*) FROM acemq_outbox WHERE id = ? AND published_at IS NULL AND locked_by IS NOT NULL", id); err != nil {
			t.Error(err)
		}
		return n > 0
	}
	tx, err := db.BeginTxx(context.Background(), &sql.TxOptions{Isolation: sql.LevelReadCommitted})
	if err != nil {
		t.Error(err)
		return false
	}
	defer func() { _ = tx.Rollback() }()
	var pending, free int
	if err := tx.Get(&pending, db.Rebind("SELECT COUNT(*) FROM acemq_outbox WHERE id = ? AND published_at IS NULL"), id); err != nil {
		t.Error(err)
	}
	rows, err := tx.Query(db.Rebind("SELECT id FROM acemq_outbox WHERE id = ? FOR UPDATE SKIP LOCKED"), id)
	if err != nil {
		t.Error(err)
		return false
	}
	for rows.Next() {
		free++
	}
	_ = rows.Close()
	return pending > 0 && free == 0
}

// interleavedKeys is keys keys of perKey records each, written an hour ago
// in sequence-number rounds (every key's seq 1, then every key's seq 2, …),
// as the events of many aggregates interleave.
func interleavedKeys(keys int, perKey int64) []keyedRow {
	start := time.Now().Add(-time.Hour)
	var rows []keyedRow
	for seq := int64(1); seq <= perKey; seq++ {
		for k := range keys {
			key := fmt.Sprintf("order-%03d", k)
			rows = append(rows, keyedRow{id: keyedID(key, seq), exchange: "amq.topic", routingKey: "keyed", aggregate: key, seq: seq, createdAt: start.Add(time.Duration(len(rows)) * time.Millisecond)})
		}
	}
	return rows
}
