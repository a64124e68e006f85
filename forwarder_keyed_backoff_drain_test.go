package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// refuseOnceDest publishes everything, but refuses each record of refuse
// as many times as it says; it logs the ids it published, in order.
type refuseOnceDest struct {
	mu        sync.Mutex
	refuse    map[string]int
	published []string
	failedAt  map[string]time.Time
	pubAt     map[string]time.Time
	delay     time.Duration
}

func (d *refuseOnceDest) Publish(_ context.Context, recs []outbox.Record) []error {
	time.Sleep(d.delay)
	d.mu.Lock()
	defer d.mu.Unlock()
	res := make([]error, len(recs))
	for i, r := range recs {
		if d.refuse[r.ID] > 0 {
			d.refuse[r.ID]--
			d.failedAt[r.ID] = time.Now()
			res[i] = errors.New("refused by the test")
			continue
		}
		d.published = append(d.published, r.ID)
		d.pubAt[r.ID] = time.Now()
	}
	return res
}

func (d *refuseOnceDest) snapshot() []string {
	d.mu.Lock()
	defer d.mu.Unlock()
	return slices.Clone(d.published)
}

// keyBeforeBacklog writes K#1 and K#2, the oldest rows, and n unkeyed rows
// behind them.
func keyBeforeBacklog(t *testing.T, db *testdb.DB, n int) {
	t.Helper()
	base := time.Now().Add(-time.Hour).UTC().Truncate(time.Second)
	rows := []keyedRow{
		{id: keyedID("K", 1), exchange: "x", routingKey: "k", aggregate: "K", seq: 1, createdAt: base},
		{id: keyedID("K", 2), exchange: "x", routingKey: "k", aggregate: "K", seq: 2, createdAt: base.Add(time.Millisecond)},
	}
	for i := 0; i < n; i++ {
		rows = append(rows, keyedRow{id: fmt.Sprintf("u-%05d", i), exchange: "x", routingKey: "k", createdAt: base.Add(time.Duration(2+i) * time.Millisecond)})
	}
	insertKeyed(t, db, rows)
}

// newRefuseOnceDest refuses each of refused once, and takes delay over
// each send.
func newRefuseOnceDest(delay time.Duration, refused ...string) *refuseOnceDest {
	d := &refuseOnceDest{refuse: map[string]int{}, failedAt: map[string]time.Time{}, pubAt: map[string]time.Time{}, delay: delay}
	for _, id := range refused {
		d.refuse[id] = 1
	}
	return d
}

// relayInTens runs a relay over db into dest until the test ends: claims
// of 10, backoffs of 5 ms.
func relayInTens(t *testing.T, db *testdb.DB, dest outbox.Destination) *outbox.Forwarder {
	t.Helper()
	f, err := outbox.NewForwarder(db.DB, dest, outbox.ForwarderConfig{
		Dialect: dialectOf(t, db), BatchSize: 10, MaxBatchSize: 10, RetryMin: 5 * time.Millisecond, RetryMax: 5 * time.Millisecond,
		PollInterval: 50 * time.Millisecond, OnError: func(error, outbox.ErrorContext) {},
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- f.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done; _ = f.Close() })
	return f
}

// A keyed record refused once waits out a backoff of 5 ms. Behind it, a
// backlog of unkeyed rows is drained in full claims. Its retry (and so its
// whole key) should come about one backoff later, not after the whole
// backlog: an unkeyed failure sends the drain back to the head, and a
// keyed one's backoff end did nothing of the sort.
func TestForwarder_KeyedRecordsBackoffEnds_DrainGoesBackForIt(t *testing.T) {
	for _, kind := range testdb.Kinds {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			db := migrated(t, kind)
			const n = 3000
			keyBeforeBacklog(t, db, n)
			dest := newRefuseOnceDest(time.Millisecond, keyedID("K", 1))
			relayInTens(t, db, dest)
			waitFor(t, 120*time.Second, "everything published", func() bool { return len(dest.snapshot()) == n+2 })
			pub := dest.snapshot()
			at := slices.Index(pub, keyedID("K", 1))
			dest.mu.Lock()
			wait := dest.pubAt[keyedID("K", 1)].Sub(dest.failedAt[keyedID("K", 1)])
			dest.mu.Unlock()
			t.Logf("K#1 published as %d of %d, %s after its failure (backoff 5ms)", at+1, len(pub), wait)
			if at > n/10 {
				t.Errorf("K#1, whose 5 ms backoff ended at once, went out as %d of %d records, %s after its failure: its key waited for the whole drain behind the cursor", at+1, len(pub), wait)
			}
		})
	}
}

// A stuck keyed record retried by an operator (Store.Retry over the relay's
// own pool) while the relay drains a backlog: the retry's wake and
// lowerFloors did not bring the drain back to the head, and the retried
// record (and its key) waited for the rest of the backlog.
func TestForwarder_RetryOfAStuckKeyedRecordDuringADrain_DrainGoesBackForIt(t *testing.T) {
	for _, kind := range testdb.Kinds {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			retryDuringADrain(t, migrated(t, kind), func(f *outbox.Forwarder) *outbox.Store { return f.Store() })
		})
	}
}

// retryDuringADrain retries the stuck K#1, through the Store that ops
// gives, while a relay drains 3,000 rows behind it, and checks that K#1
// goes out within a tenth of the backlog of the retry.
func retryDuringADrain(t *testing.T, db *testdb.DB, ops func(*outbox.Forwarder) *outbox.Store) {
	retryDuringADrainBy(t, db, backlogOf/10, time.Millisecond, func(f *outbox.Forwarder) func(id string) error {
		s := ops(f)
		return func(id string) error {
			if m, err := s.Retry(context.Background(), id); m != 1 || err != nil {
				return fmt.Errorf("retry: %d %v", m, err)
			}
			return nil
		}
	})
}

// backlogOf is how many rows retryDuringADrainBy's relay drains.
const backlogOf = 3000

// retryDuringADrainBy is retryDuringADrain with the stuck K#1 made pending
// again by what retry gives, and checked to go out within that many
// records of it, the destination taking delay over each send.
func retryDuringADrainBy(t *testing.T, db *testdb.DB, within int, delay time.Duration, retry func(*outbox.Forwarder) func(id string) error) {
	const n = backlogOf
	keyBeforeBacklog(t, db, n)
	if _, err := db.Exec(db.Rebind("UPDATE acemq_outbox SET attempts = 10, last_error = 'stuck' WHERE id = ?"), keyedID("K", 1)); err != nil {
		t.Fatal(err)
	}
	dest := newRefuseOnceDest(delay)
	f := relayInTens(t, db, dest)
	again := retry(f)
	waitFor(t, 60*time.Second, "the drain under way", func() bool { return len(dest.snapshot()) >= 100 })
	retried := time.Now()
	if err := again(keyedID("K", 1)); err != nil {
		t.Fatal(err)
	}
	before := len(dest.snapshot())
	waitFor(t, 120*time.Second, "everything published", func() bool { return len(dest.snapshot()) == n+2 })
	pub := dest.snapshot()
	at := slices.Index(pub, keyedID("K", 1))
	dest.mu.Lock()
	wait := dest.pubAt[keyedID("K", 1)].Sub(retried)
	dest.mu.Unlock()
	t.Logf("retried when %d were out; K#1 published as %d of %d, %s after the retry", before, at+1, len(pub), wait)
	if at > before+within {
		t.Errorf("K#1 retried when %d records were out went out as %d of %d, %s after the retry: it waited for the drain", before, at+1, len(pub), wait)
	}
}

// The same under a flow the relay cannot quite keep up with: every claim
// comes back full, the drain never ends, and the key whose record failed
// once (backoff 5 ms) was held for as long as the flow lasted.
func TestForwarder_KeyedRecordsBackoffEndsUnderAFlow_RetriedDuringIt(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.SQLite)
	keyBeforeBacklog(t, db, 200)
	dest := newRefuseOnceDest(5*time.Millisecond, keyedID("K", 1))
	relayInTens(t, db, dest)
	// The flow: 40 rows every 10 ms (4,000/s), the relay takes 10 per 5 ms at most.
	stop := time.Now().Add(4 * time.Second)
	for i := 0; time.Now().Before(stop); i++ {
		var batch []keyedRow
		for j := 0; j < 40; j++ {
			batch = append(batch, keyedRow{id: fmt.Sprintf("f-%d-%d", i, j), exchange: "x", routingKey: "k", createdAt: time.Now().UTC()})
		}
		insertKeyed(t, db, batch)
		time.Sleep(10 * time.Millisecond)
	}
	dest.mu.Lock()
	failed := dest.failedAt[keyedID("K", 1)]
	pubAt, ok := dest.pubAt[keyedID("K", 1)]
	out := len(dest.published)
	dest.mu.Unlock()
	t.Logf("after 4 s of flow: %d records out; K#1 failed at %v, published: %v %v", out, failed.Format("15:04:05.000"), ok, pubAt.Format("15:04:05.000"))
	if !ok {
		t.Errorf("K#1 (backoff 5 ms) still not retried %s after its failure, while %d later records went out", time.Since(failed).Round(time.Millisecond), out)
	}
}
