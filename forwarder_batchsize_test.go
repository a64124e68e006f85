package outbox_test

import (
	"context"
	"database/sql"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// batchLog is a destination that publishes nothing and confirms every
// record, keeping the size of each batch and the records in the order they
// came. With capacity > 0 it is a Pipeliner whose pipeline takes that many
// records in flight; without, Run hands it one claim at a time.
type batchLog struct {
	capacity int
	wait     time.Duration // each Wait of the pipeline takes this long

	mu      sync.Mutex
	sizes   []int
	records []outbox.Record
}

func (d *batchLog) Publish(_ context.Context, records []outbox.Record) []error {
	d.log(records)
	return make([]error, len(records))
}

func (d *batchLog) log(records []outbox.Record) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.sizes = append(d.sizes, len(records))
	d.records = append(d.records, records...)
}

func (d *batchLog) Pipeline() outbox.Pipeline {
	if d.capacity == 0 {
		return nil
	}
	return logPipe{d}
}

// logPipe is a batchLog's pipeline: a batch is logged when it is sent, and
// confirmed when it is waited for.
type logPipe struct{ d *batchLog }

type logSent []outbox.Record

func (s logSent) Records() []outbox.Record { return s }

func (p logPipe) Destination() outbox.Destination { return p.d }
func (p logPipe) Capacity() int                   { return p.d.capacity }
func (p logPipe) Send(_ context.Context, records []outbox.Record) outbox.Sent {
	p.d.log(records)
	return logSent(records)
}
func (p logPipe) Wait(_ context.Context, s outbox.Sent) []error {
	time.Sleep(p.d.wait)
	return make([]error, len(s.Records()))
}

// got returns the batch sizes so far, and how many times each id came.
func (d *batchLog) got() (sizes []int, ids map[string]int) {
	d.mu.Lock()
	defer d.mu.Unlock()
	ids = make(map[string]int, len(d.records))
	for _, r := range d.records {
		ids[r.ID]++
	}
	return slices.Clone(d.sizes), ids
}

// runBatchLog runs a Forwarder over db into a batchLog until the test ends.
func runBatchLog(t *testing.T, db *testdb.DB, d outbox.Dialect, cfg outbox.ForwarderConfig, dest *batchLog, growBytes int) *batchLog {
	t.Helper()
	cfg.Dialect = d
	f, err := outbox.NewForwarder(db.DB, dest, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if growBytes > 0 {
		outbox.SetGrowBytes(f, growBytes)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- f.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
		_ = f.Close()
	})
	return dest
}

// steadyPublishTimeout is the PublishTimeout of the tests that expect a
// drain's claims to grow as they come back full: batches in flight over an
// eighth of it keep their size, over a quarter halve it, and a loaded
// machine (CI's packages building and testing beside each other) kept one
// of 15 s's 200-row batches in flight for that long ("[… 200 200 100 50
// 50 100 …]").
const steadyPublishTimeout = 10 * time.Minute

// waitDelivered waits until dest got n distinct records, and fails the test
// if one came twice.
func waitDelivered(t *testing.T, dest *batchLog, n int) []int {
	t.Helper()
	var sizes []int
	waitFor(t, 60*time.Second, fmt.Sprintf("%d records", n), func() bool {
		var ids map[string]int
		sizes, ids = dest.got()
		return len(ids) >= n
	})
	_, ids := dest.got()
	for id, c := range ids {
		if c > 1 {
			t.Errorf("record %s published %d times", id, c)
		}
	}
	return sizes
}

// A drain's claims start at BatchSize and, once the first batch is
// confirmed (the fourth claim: three are in flight before), double while
// they come back full, up to MaxBatchSize and no further
// than the pipeline holds three of them; the next drain starts again at
// BatchSize. Batches
// that go one at a time through Publish stay at BatchSize.
func TestForwarder_Run_DrainClaimsGrowFromBatchSizeToMaxBatchSize(t *testing.T) {
	eachMigrated(t, func(t *testing.T, db *testdb.DB, d outbox.Dialect) {
		for _, c := range []struct {
			name     string
			capacity int
			first    []int
		}{
			{"pipelined", 3000, []int{50, 50, 50, 50, 100, 200, 400, 400, 200}},
			{"pipeline of 600", 600, []int{50, 50, 50, 50, 100, 200, 200, 200, 200, 200, 200}},
			{"one batch at a time", 0, slices.Repeat([]int{50}, 30)},
		} {
			t.Run(c.name, func(t *testing.T) {
				publishBatch(t, db, "amq.topic", "grow", 1500)
				dest := runBatchLog(t, db, d, outbox.ForwarderConfig{BatchSize: 50, MaxBatchSize: 400, PublishTimeout: steadyPublishTimeout}, &batchLog{capacity: c.capacity}, 0)
				sizes := waitDelivered(t, dest, 1500)
				if !slices.Equal(sizes, c.first) {
					t.Errorf("first drain: batches %v, want %v", sizes, c.first)
				}
				// The next drain starts at BatchSize again. How soon it
				// grows depends on whether the sweep of its first claim
				// also settled the last drain's last batch, a confirm
				// that says how fast the broker is: [50 50 50 50 100 200]
				// or [50 100 200 150].
				// The first drain is over once its last claim found nothing:
				// a claim that came back full claims again at once, and it
				// would take rows committed before then at its grown size.
				// No batch for a second says it has: under load a gap
				// between a drain's last sweeps can pass 300 ms, as one
				// did in the wake-up test under two test runs at once.
				last, since := len(sizes), time.Now()
				waitFor(t, 10*time.Second, "the first drain to end", func() bool {
					if n, _ := dest.got(); len(n) != last {
						last, since = len(n), time.Now()
					}
					return time.Since(since) >= time.Second
				})
				sizes, _ = dest.got()
				publishBatch(t, db, "amq.topic", "grow", 500)
				sizes = waitDelivered(t, dest, 2000)[len(sizes):]
				if len(sizes) == 0 || sizes[0] != 50 {
					t.Fatalf("second drain: batches %v, want them to start at BatchSize 50 again", sizes)
				}
				for i := 1; i < len(sizes); i++ {
					if sizes[i] > 2*sizes[i-1] || (c.capacity == 0 && sizes[i] != 50) {
						t.Errorf("second drain: batches %v, want each at most twice the one before (all 50 one batch at a time)", sizes)
						break
					}
				}
			})
		}
	})
}

// A drain of keyed records grows its claims as an unkeyed one does: a
// key's next record is claimable while its predecessor is in flight in the
// same relay, so a larger claim finds records rather than searching further
// for keys with nothing in flight. Each key still arrives in order.
func TestForwarder_Run_KeyedDrain_ClaimsGrow_EachKeyInOrder(t *testing.T) {
	eachMigrated(t, func(t *testing.T, db *testdb.DB, d outbox.Dialect) {
		rows := interleavedKeys(200, 3)
		insertKeyed(t, db, rows)
		dest := runBatchLog(t, db, d, outbox.ForwarderConfig{BatchSize: 50, MaxBatchSize: 400, PublishTimeout: steadyPublishTimeout}, &batchLog{capacity: 3000}, 0)
		sizes := waitDelivered(t, dest, len(rows))
		if slices.Max(sizes) <= 50 {
			t.Errorf("batches %v: no keyed claim grew past BatchSize 50", sizes)
		}
		dest.mu.Lock()
		defer dest.mu.Unlock()
		last := map[string]int64{}
		for _, r := range dest.records {
			if r.Seq != last[r.AggregateID]+1 {
				t.Fatalf("%s seq %d came after seq %d", r.AggregateID, r.Seq, last[r.AggregateID])
			}
			last[r.AggregateID] = r.Seq
		}
	})
}

// A drain's claims take no more rows than growBytes holds at the mean body
// of the claim before: they grow to it, and shrink to it when the bodies
// grow larger.
func TestForwarder_Run_ClaimsFitGrowBytes(t *testing.T) {
	eachMigrated(t, func(t *testing.T, db *testdb.DB, d outbox.Dialect) {
		commit := func(n, size int) {
			msgs := make([]*message.Message, n)
			for j := range msgs {
				msgs[j] = message.NewMessage(watermill.NewUUID(), []byte(strings.Repeat("x", size)))
			}
			publishInTx(t, db, "large", msgs, outbox.TxPublisherConfig{Exchange: "amq.topic"})
		}
		for _, c := range []struct {
			name   string
			batch  int
			limit  int
			commit func()
			n      int
			want   []int
		}{
			{"40 bodies fit", 20, 40 * 1024, func() { commit(300, 1024) }, 300, []int{20, 20, 20, 20, 40, 40, 40, 40, 40, 20}},
			{"30 bodies fit", 20, 30 * 1024, func() { commit(300, 1024) }, 300, []int{20, 20, 20, 20, 30, 30, 30, 30, 30, 30, 30, 10}},
			// 64 of 1 KiB fit; the claim of 64 is all of 8 KiB, so the
			// next takes BatchSize, 8 of 8 KiB being all that fit.
			{"bodies grow", 10, 64 * 1024, func() { commit(100, 1024); commit(100, 8192) }, 200, []int{10, 10, 10, 10, 20, 40, 64, 10, 10, 10, 6}},
		} {
			t.Run(c.name, func(t *testing.T) {
				c.commit()
				dest := runBatchLog(t, db, d, outbox.ForwarderConfig{BatchSize: c.batch, MaxBatchSize: 400, PublishTimeout: steadyPublishTimeout}, &batchLog{capacity: 3000}, c.limit)
				if sizes := waitDelivered(t, dest, c.n); !slices.Equal(sizes, c.want) {
					t.Errorf("batches %v, want %v", sizes, c.want)
				}
			})
		}
	})
}

// Batches that stay in flight over a quarter of PublishTimeout halve the
// claims (to BatchSize at least): a slow broker gets smaller batches, not
// timeouts.
func TestForwarder_Run_SlowConfirms_ClaimsDoNotGrow(t *testing.T) {
	eachMigrated(t, func(t *testing.T, db *testdb.DB, d outbox.Dialect) {
		publishBatch(t, db, "amq.topic", "slow", 150)
		dest := runBatchLog(t, db, d, outbox.ForwarderConfig{BatchSize: 25, MaxBatchSize: 400, PublishTimeout: 1200 * time.Millisecond}, &batchLog{capacity: 3000, wait: 350 * time.Millisecond}, 0)
		if sizes := waitDelivered(t, dest, 150); !slices.Equal(sizes, slices.Repeat([]int{25}, 6)) {
			t.Errorf("confirms of 0.35 s under a PublishTimeout of 1.2 s: batches %v, want 6 of 25", sizes)
		}
	})
}

// MaxBatchSize below BatchSize, or above 1000, is refused.
func TestNewForwarder_MaxBatchSizeOutOfRange_Refused(t *testing.T) {
	for _, cfg := range []outbox.ForwarderConfig{{BatchSize: 200, MaxBatchSize: 100}, {MaxBatchSize: 1001}} {
		cfg.Dialect = outbox.SQLite
		_, err := outbox.NewForwarder(testdb.New(t, testdb.SQLite).DB, &batchLog{}, cfg)
		if err == nil || !strings.Contains(err.Error(), "MaxBatchSize") {
			t.Errorf("BatchSize %d, MaxBatchSize %d: %v, want a MaxBatchSize error", cfg.BatchSize, cfg.MaxBatchSize, err)
		}
	}
}

// On MySQL a claim keeps the rows it passed over locked until its batch is
// marked, and a keyed drain's claim that passed over many (here another
// transaction's locked rows, half of the keys, as another relay's would
// be) does not grow: a larger one would pass over, and lock, more. (With
// nothing in its way it grows: TestForwarder_Run_KeyedDrain_ClaimsGrow_EachKeyInOrder.)
func TestForwarder_Run_MySQL_KeyedClaimPassingOverManyRows_DoesNotGrow(t *testing.T) {
	db := migrated(t, testdb.MySQL)
	rows := interleavedKeys(400, 3)
	insertKeyed(t, db, rows)
	// By primary key, under READ COMMITTED: the rows alone, no gaps, which
	// would hold the relay's marks back.
	other, err := db.BeginTxx(context.Background(), &sql.TxOptions{Isolation: sql.LevelReadCommitted})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = other.Rollback() }()
	var odd []string
	for seq := int64(1); seq <= 3; seq++ {
		for k := 1; k < 400; k += 2 {
			odd = append(odd, "'"+keyedID(fmt.Sprintf("order-%03d", k), seq)+"'")
		}
	}
	if _, err := other.Exec("SELECT id FROM acemq_outbox WHERE id IN (" + strings.Join(odd, ", ") + ") FOR UPDATE"); err != nil {
		t.Fatal(err)
	}
	dest := runBatchLog(t, db, dialectOf(t, db), outbox.ForwarderConfig{BatchSize: 50, MaxBatchSize: 400, PublishTimeout: steadyPublishTimeout}, &batchLog{capacity: 3000}, 0)
	sizes := waitDelivered(t, dest, len(rows)/2)
	if slices.Max(sizes) > 50 {
		t.Errorf("batches %v: a claim that passed over as many rows as it took grew past BatchSize 50", sizes)
	}
	if err := other.Rollback(); err != nil {
		t.Fatal(err)
	}
	waitDelivered(t, dest, len(rows)) // the rest, once nothing is in the way
}
