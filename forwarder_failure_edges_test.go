package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// waitersOn counts the statements waiting for a lock that the session
// blocker holds, as PostgreSQL tells (pg_blocking_pids). MariaDB lists a
// statement waiting for a row lock in no INNODB_LOCK_WAITS row before its
// transaction has written: there it counts the sessions of the database
// running an UPDATE of acemq_outbox, which cannot end while blocker holds
// the row it updates.
func waitersOn(t testing.TB, db *testdb.DB, blocker int64) int {
	t.Helper()
	var n int
	var err error
	switch db.Kind {
	case testdb.Postgres:
		err = db.Get(&n, "SELECT COUNT(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))", blocker)
	default:
		err = db.Get(&n, "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE DB = DATABASE() AND ID <> ? AND INFO LIKE 'UPDATE%acemq_outbox%'", blocker)
	}
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// Republish reads the records to resend, then makes them pending by id. A
// consumer may process one of them in between: the update checks
// processed_at again on the row it locks (RepublishIDs), so a record
// processed meanwhile is not sent again. Here the consumer's transaction
// holds the row while Republish's update waits for it, and commits
// processed_at: the update must leave the row published.
func TestRepublish_RecordProcessedWhileTheUpdateWaits_NotMadePending(t *testing.T) {
	for _, kind := range []string{testdb.Postgres, testdb.MySQL} {
		t.Run(kind, func(t *testing.T) {
			db := migrated(t, kind)
			id := publishBatch(t, db, "", "orders", 1)[0].UUID
			publishAllAt(t, db, time.Now().Add(-time.Hour))

			consumer, err := db.Beginx()
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = consumer.Rollback() }()
			var pid int64
			q := "SELECT pg_backend_pid()"
			if kind != testdb.Postgres {
				q = "SELECT CONNECTION_ID()"
			}
			if err := consumer.Get(&pid, q); err != nil {
				t.Fatal(err)
			}
			var got string
			if err := consumer.Get(&got, consumer.Rebind("SELECT id FROM acemq_outbox WHERE id = ? FOR UPDATE"), id); err != nil {
				t.Fatal(err)
			}

			pool := sqlx.MustOpen(db.DriverName(), db.DSN)
			defer pool.Close()
			rp, err := outbox.NewRepublisher(pool, outbox.RepublisherConfig{TrackedTopics: outbox.NewTrackedTopics("orders")})
			if err != nil {
				t.Fatal(err)
			}
			type result struct {
				n   int64
				err error
			}
			done := make(chan result, 1)
			go func() {
				n, err := rp.Republish(context.Background())
				done <- result{n, err}
			}()
			waitFor(t, 30*time.Second, "Republish's update waiting for the consumer's lock", func() bool {
				select {
				case r := <-done:
					t.Fatalf("Republish returned (%d, %v) without waiting for the consumer's lock", r.n, r.err)
				default:
				}
				return waitersOn(t, db, pid) > 0
			})
			if _, err := consumer.Exec(consumer.Rebind("UPDATE acemq_outbox SET processed_at = published_at WHERE id = ?"), id); err != nil {
				t.Fatal(err)
			}
			if err := consumer.Commit(); err != nil {
				t.Fatal(err)
			}
			r := <-done
			if r.err != nil {
				t.Fatal(r.err)
			}
			if s := stateOf(t, db, id); r.n != 0 || !s.Published {
				t.Fatalf("Republish made %d pending, record %+v; want 0 and the record left published: a consumer processed it", r.n, s)
			}
		})
	}
}

// permanentDest refuses the records of poison for good (outbox.Permanent)
// and takes every other one.
type permanentDest struct{ poison map[string]bool }

func (d permanentDest) Publish(_ context.Context, recs []outbox.Record) []error {
	errs := make([]error, len(recs))
	for i, r := range recs {
		if d.poison[r.ID] {
			errs[i] = outbox.Permanent(errors.New("poison: no retry mends it"))
		}
	}
	return errs
}

// A keyed record its destination refuses for good (outbox.Permanent) is
// stuck at once, as an unkeyed one is: at MaxAttempts after its first
// failure, visible to Stuck, holding its key's later records; the unkeyed
// record beside it goes out in the same sweep.
func TestForwarder_KeyedRecordRefusedForGood_StuckAtOnce(t *testing.T) {
	eachMigrated(t, func(t *testing.T, db *testdb.DB, d outbox.Dialect) {
		poison := message.NewMessage(watermill.NewUUID(), []byte("p"))
		poison.Metadata.Set(outbox.MetadataAggregateID, "order-1")
		next := message.NewMessage(watermill.NewUUID(), []byte("n"))
		next.Metadata.Set(outbox.MetadataAggregateID, "order-1")
		plain := message.NewMessage(watermill.NewUUID(), []byte("u"))
		publishInTx(t, db, "t", []*message.Message{poison, next, plain})

		const maxAttempts = 5
		f, err := outbox.NewForwarder(db.DB.DB, permanentDest{poison: map[string]bool{poison.UUID: true}},
			outbox.ForwarderConfig{Dialect: d, MaxAttempts: maxAttempts, OnError: func(error, outbox.ErrorContext) {}})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = f.Close() })
		n, err := f.Sweep(context.Background())
		if n != 1 || !outbox.IsPermanent(err) {
			t.Fatalf("sweep = %d, %v; want the unkeyed record published and the permanent failure", n, err)
		}
		if s := stateOf(t, db, poison.UUID); s.Published || s.Attempts != maxAttempts || !strings.Contains(s.LastError, "poison") {
			t.Fatalf("the keyed record refused for good: %+v; want it stuck at once (%d attempts) with its error", s, maxAttempts)
		}
		if s := stateOf(t, db, next.UUID); s.Published {
			t.Fatalf("the key's next record was published past its stuck predecessor")
		}
		if !stateOf(t, db, plain.UUID).Published {
			t.Fatalf("the unkeyed record was not published")
		}
	})
}

// OnError is given a failed record's attempts, the relay's MaxAttempts,
// and Stuck once the record reached them: an OnError that pages could not
// tell a record giving up from one retrying (an API review), which the
// default log says.
func TestForwarder_OnError_ToldAttemptsAndStuck(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.SQLite)
	poison := message.NewMessage(watermill.NewUUID(), []byte("p"))
	publishInTx(t, db, "t", []*message.Message{poison})
	var (
		mu  sync.Mutex
		got []outbox.ErrorContext
	)
	f, err := outbox.NewForwarder(db.DB.DB, failingDest{}, outbox.ForwarderConfig{Dialect: outbox.SQLite, MaxAttempts: 2, RetryMin: time.Millisecond, RetryMax: time.Millisecond,
		OnError: func(_ error, dest outbox.ErrorContext) {
			mu.Lock()
			defer mu.Unlock()
			got = append(got, dest)
		}})
	if err != nil {
		t.Fatal(err)
	}
	runUntil(t, f, 10*time.Second, "the record stuck", func() bool { return stateOf(t, db, poison.UUID).Attempts == 2 })
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	want := []outbox.ErrorContext{
		{RoutingKey: "t", MessageID: poison.UUID, Attempts: 1, MaxAttempts: 2},
		{RoutingKey: "t", MessageID: poison.UUID, Attempts: 2, MaxAttempts: 2, Stuck: true},
	}
	if len(got) != len(want) || got[0] != want[0] || got[1] != want[1] {
		t.Errorf("OnError was given %+v, want %+v (nothing after it was stuck)", got, want)
	}
}

// failingDest fails every record, for now.
type failingDest struct{}

func (failingDest) Publish(_ context.Context, recs []outbox.Record) []error {
	errs := make([]error, len(recs))
	for i := range recs {
		errs[i] = errors.New("broker refused it, for now")
	}
	return errs
}

// loseEachOnce loses the connection once at each record, the first time it
// reaches it: an outage that moves on from record to record.
type loseEachOnce struct {
	mu   sync.Mutex
	lost map[string]bool
}

func (d *loseEachOnce) Publish(_ context.Context, recs []outbox.Record) []error {
	d.mu.Lock()
	defer d.mu.Unlock()
	errs := make([]error, len(recs))
	for i, r := range recs {
		if !d.lost[r.ID] {
			d.lost[r.ID] = true
			errs[i] = fmt.Errorf("%w: connection reset", outbox.ErrConnectionLost)
			for j := i + 1; j < len(recs); j++ {
				errs[j] = outbox.ErrNotSent
			}
			break
		}
	}
	return errs
}

// A lost connection counts no attempt, unless it is lost at the same record
// more than three times in a row. Lost once at each of six records in turn,
// the relay publishes them all with no attempt counted against any.
func TestForwarder_ConnectionLostOnceAtEachRecord_NoAttemptCounted(t *testing.T) {
	for _, kind := range []string{testdb.SQLite, testdb.Postgres} {
		t.Run(kind, func(t *testing.T) {
			db := migrated(t, kind)
			ids := publishN(t, db, "", "t", 6)
			f, err := outbox.NewForwarder(db.DB.DB, &loseEachOnce{lost: map[string]bool{}},
				outbox.ForwarderConfig{Dialect: dialectOf(t, db), MaxAttempts: 3, OnError: func(error, outbox.ErrorContext) {}})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = f.Close() })
			for i := 0; i < 3*len(ids) && pendingCount(t, f) > 0; i++ {
				_, _ = f.Sweep(context.Background())
			}
			for _, id := range ids {
				if s := stateOf(t, db, id); !s.Published || s.Attempts != 0 {
					t.Errorf("record %s: %+v; want published, no attempt counted for one lost connection", id, s)
				}
			}
		})
	}
}

// waitsForTheCaller publishes nothing until its caller stops waiting, and
// then reports each record's connection lost: a destination whose broker
// had not confirmed when the caller gave up.
type waitsForTheCaller struct{ publishing chan struct{} }

func (d waitsForTheCaller) Publish(ctx context.Context, recs []outbox.Record) []error {
	d.publishing <- struct{}{}
	<-ctx.Done()
	errs := make([]error, len(recs))
	for i := range errs {
		errs[i] = fmt.Errorf("%w: %w", outbox.ErrConnectionLost, context.Cause(ctx))
	}
	return errs
}

// A Sweep whose caller's context ends before the confirm counts no attempt
// against the record, however often it happens at the same one: it says
// nothing of the record, and a caller that bounds every sweep would
// otherwise make it stuck. Here through a Destination of the caller's own,
// whose lost connection is a plain ErrConnectionLost.
func TestForwarder_SweepsCutShortByTheirCaller_CustomDestination_NoAttemptCounted(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	id := publishN(t, db, "", "t", 1)[0]
	dest := waitsForTheCaller{publishing: make(chan struct{})}
	f, err := outbox.NewForwarder(db.DB.DB, dest,
		outbox.ForwarderConfig{Dialect: outbox.SQLite, MaxAttempts: 2, OnError: func(error, outbox.ErrorContext) {}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = f.Close() })
	for i := range 8 { // past lostRepeats (3) and MaxAttempts (2)
		ctx, cancel := context.WithCancel(context.Background())
		go func() { <-dest.publishing; cancel() }() // the caller gives up during the publish
		n, err := f.Sweep(ctx)
		cancel()
		if n == 0 && err == nil {
			t.Fatalf("sweep %d claimed nothing: the record is %+v, stuck by sweeps its caller cut short", i+1, stateOf(t, db, id))
		}
		if n != 0 || !errors.Is(err, outbox.ErrConnectionLost) {
			t.Fatalf("sweep %d = %d, %v; want nothing published and ErrConnectionLost", i+1, n, err)
		}
	}
	if s := stateOf(t, db, id); s.Published || s.Attempts != 0 {
		t.Fatalf("row after 8 sweeps cut short by their caller: %+v; want it pending with no attempt counted", s)
	}
}

// lossPipe is a pipelining destination that loses the connection once, at
// the first confirm of record lose, and confirms everything else. It logs
// each Send and Publish (the ids) and each Wait that reported the loss.
type lossPipe struct {
	mu   sync.Mutex
	lose string
	lost bool
	log  []string
}

type lossSent []outbox.Record

func (s lossSent) Records() []outbox.Record { return s }

func ids(recs []outbox.Record) string {
	var s []string
	for _, r := range recs {
		s = append(s, r.ID)
	}
	return strings.Join(s, ",")
}

func (p *lossPipe) Pipeline() outbox.Pipeline       { return p }
func (p *lossPipe) Destination() outbox.Destination { return p }
func (p *lossPipe) Capacity() int                   { return 100 }
func (p *lossPipe) Send(_ context.Context, recs []outbox.Record) outbox.Sent {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.log = append(p.log, "send "+ids(recs))
	return lossSent(slices.Clone(recs))
}

func (p *lossPipe) Wait(_ context.Context, s outbox.Sent) []error { return p.results(s.Records()) }

func (p *lossPipe) Publish(_ context.Context, recs []outbox.Record) []error {
	p.mu.Lock()
	p.log = append(p.log, "publish "+ids(recs))
	p.mu.Unlock()
	return p.results(recs)
}

func (p *lossPipe) results(recs []outbox.Record) []error {
	p.mu.Lock()
	defer p.mu.Unlock()
	errs := make([]error, len(recs))
	for i, r := range recs {
		if r.ID == p.lose && !p.lost {
			p.lost = true
			p.log = append(p.log, "lost")
			errs[i] = fmt.Errorf("%w: connection reset", outbox.ErrConnectionLost)
			for j := i + 1; j < len(recs); j++ {
				errs[j] = outbox.ErrNotSent
			}
			break
		}
	}
	return errs
}

// Under Run's pipeline, once the confirms of a batch say the connection
// was lost at one of its records (here a keyed one), nothing more goes out
// before that record: the batches already in flight are held back, and
// the next send is the record itself, after the backoff. A lost
// connection is the broker's failure, not the record's: it holds back
// everything, keyed record or not (keyedFailure).
func TestForwarder_Run_ConnectionLostAtAKeyedRecord_NothingMoreSentBeforeIt(t *testing.T) {
	for _, kind := range []string{testdb.Postgres, testdb.SQLite} {
		t.Run(kind, func(t *testing.T) {
			db := migrated(t, kind)
			keyed := message.NewMessage(watermill.NewUUID(), []byte("k"))
			keyed.Metadata.Set(outbox.MetadataAggregateID, "order-1")
			publishInTx(t, db, "t", []*message.Message{keyed})
			publishN(t, db, "", "t", 6)

			dest := &lossPipe{lose: keyed.UUID}
			f, err := outbox.NewForwarder(db.DB.DB, dest, outbox.ForwarderConfig{
				Dialect: dialectOf(t, db), BatchSize: 1, MaxBatchSize: 1,
				RetryMin: 10 * time.Millisecond, RetryMax: 10 * time.Millisecond,
				OnError: func(error, outbox.ErrorContext) {},
			})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = f.Close() })
			runUntil(t, f, 30*time.Second, "every record published", func() bool { return pendingCount(t, f) == 0 })

			dest.mu.Lock()
			log := slices.Clone(dest.log)
			dest.mu.Unlock()
			i := slices.Index(log, "lost")
			if i < 0 {
				t.Fatalf("the connection was never lost: %v", log)
			}
			if i+1 >= len(log) || !strings.HasPrefix(strings.TrimPrefix(strings.TrimPrefix(log[i+1], "send "), "publish "), keyed.UUID) {
				t.Fatalf("after the connection was lost at %s the relay sent %q before it; want it first (log %v)", keyed.UUID, log[min(i+1, len(log)-1)], log)
			}
		})
	}
}
