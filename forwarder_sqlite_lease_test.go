package outbox_test

import (
	"context"
	"errors"
	"maps"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
	"github.com/acemq/watermill-outbox/internal/testutil"
)

// slowCapture is a Watermill publisher that takes delay per Publish and
// records what it got, safe across goroutines.
type slowCapture struct {
	delay time.Duration
	mu    sync.Mutex
	ids   []string
}

func (c *slowCapture) Publish(_ string, msgs ...*message.Message) error {
	time.Sleep(c.delay)
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, m := range msgs {
		c.ids = append(c.ids, m.UUID)
	}
	return nil
}
func (c *slowCapture) Close() error { return nil }
func (c *slowCapture) got() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]string(nil), c.ids...)
}

// claimBatch computed locked_until = time.Now() + Lease before writeTx
// waited for the write lock: a claim that waited W for the lock committed
// a lease of Lease - W. With Lease at its documented minimum
// (2 × PublishTimeout) and a publish well inside PublishTimeout, a second
// live relay claims and publishes the same row while the first still has it
// in flight. The lease is now timed inside the claim's transaction. (From
// an audit of the relay on SQLite.)
func TestForwarder_SQLiteClaimAfterABusyWait_LeaseWholeNoSecondRelayOnIt(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	msgs := publishBatch(t, db, "", "t", 1)
	id := msgs[0].UUID

	const (
		publishTimeout = 2 * time.Second
		lease          = 2 * publishTimeout // the minimum validate() allows
		lockHeld       = 3 * time.Second    // < the pool's busy_timeout (10 s)
	)
	// A service holds the write lock (BEGIN IMMEDIATE under _txlock=immediate).
	services, err := sqlx.Open("sqlite3", db.DSN)
	if err != nil {
		t.Fatal(err)
	}
	defer services.Close()
	tx, err := services.Begin()
	if err != nil {
		t.Fatal(err)
	}
	go func() { time.Sleep(lockHeld); _ = tx.Commit() }()

	slowA := &slowCapture{delay: 1500 * time.Millisecond} // inside PublishTimeout
	poolA := otherPool(t, db)
	fa, err := outbox.NewForwarder(poolA.DB, outbox.NewPublisherDestination(slowA, nil), outbox.ForwarderConfig{
		PublishTimeout: publishTimeout, Lease: lease, RelayID: "relay-a",
	})
	if err != nil {
		t.Fatal(err)
	}
	defer fa.Close()
	fastB := &slowCapture{}
	poolB := otherPool(t, db)
	fb, err := outbox.NewForwarder(poolB.DB, outbox.NewPublisherDestination(fastB, nil), outbox.ForwarderConfig{
		PublishTimeout: publishTimeout, Lease: lease, RelayID: "relay-b",
	})
	if err != nil {
		t.Fatal(err)
	}
	defer fb.Close()

	start := time.Now()
	aDone := make(chan struct{})
	go func() {
		defer close(aDone)
		n, err := fa.Sweep(context.Background())
		t.Logf("relay A: swept %d, err %v, after %s", n, err, time.Since(start).Round(time.Millisecond))
	}()
	// Wait until A's claim committed, then read the lease it wrote.
	var lockedBy, lockedUntil string
	for {
		_ = db.QueryRow("SELECT COALESCE(locked_by,''), COALESCE(locked_until,'') FROM acemq_outbox WHERE id = ?", id).Scan(&lockedBy, &lockedUntil)
		if lockedBy == "relay-a" {
			break
		}
		if time.Since(start) > 8*time.Second {
			t.Fatal("relay A never claimed")
		}
		time.Sleep(5 * time.Millisecond)
	}
	claimedAt := time.Now()
	until, _ := time.Parse("2006-01-02 15:04:05.000000", lockedUntil[:26])
	t.Logf("relay A's claim committed %s after its sweep began; lease until %s = %s after the commit (Lease %s)",
		claimedAt.Sub(start).Round(time.Millisecond), lockedUntil, until.Sub(claimedAt.UTC()).Round(time.Millisecond), lease)

	// B sweeps as soon as A's lease ran out: A is still publishing.
	time.Sleep(time.Until(until) + 50*time.Millisecond)
	n, err := fb.Sweep(context.Background())
	t.Logf("relay B: swept %d, err %v, at %s after A's claim", n, err, time.Since(claimedAt).Round(time.Millisecond))
	<-aDone
	a, b := slowA.got(), fastB.got()
	t.Logf("relay A published %v; relay B published %v", a, b)
	if len(a) == 1 && len(b) == 1 && a[0] == id && b[0] == id {
		t.Errorf("row %s published by both live relays, neither failed, within PublishTimeout and Lease = 2×PublishTimeout: the lease ran out %s after A's claim committed because it was timed from before the claim's busy wait",
			id, until.Sub(claimedAt.UTC()).Round(time.Millisecond))
	}
}

// A Sweep whose context ended while writeTx set busy_timeout to 0 could
// leave the connection in the pool at 0: the PRAGMA takes effect when
// SQLite compiles it, mattn/go-sqlite3 then interrupts the step and returns
// ctx.Err(), and suspendBusyTimeout returned that error before any restore
// was set up. (From an audit of the relay on SQLite, where it failed after
// 410 and 603 sweeps; on a quiet machine it may not: it guards the fix.)
func TestForwarder_SQLiteSweepsCancelledMidPragma_BusyTimeoutKept(t *testing.T) {
	t.Run("no statement cache", func(t *testing.T) { cancelledSweeps(t, false) })
}

func cancelledSweeps(t *testing.T, cache bool) {
	db := migrated(t, testdb.SQLite)
	// Without mattn's statement cache: with it, a cancellable context's
	// PRAGMA is compiled once per connection and then reused, and a reused
	// PRAGMA busy_timeout = N sets nothing (SQLite applies it at compile
	// time), so only the first try on each connection can leave 0 behind.
	dsn := db.DSN
	if !cache {
		dsn = strings.Replace(db.DSN, "&_stmt_cache_size=32", "", 1)
	}
	sq, err := sqlx.Open("sqlite3", dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer sq.Close()
	pool := &testdb.DB{DB: sq, Kind: db.Kind, DSN: dsn, Name: db.Name}
	pool.SetMaxOpenConns(1)
	if cache {
		// As a pool that recycles connections (SetConnMaxLifetime) does:
		// each connection's first cancellable PRAGMA is compiled afresh.
		pool.SetMaxIdleConns(0)
	}
	f, err := outbox.NewForwarder(pool.DB, outbox.NewPublisherDestination(&slowCapture{}, nil), outbox.ForwarderConfig{})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	// Read the pool's busy_timeout once (busyPatience) with a context that lives.
	if _, err := f.Sweep(context.Background()); err != nil {
		t.Fatal(err)
	}
	errs := map[string]int{}
	const maxWait = 400
	for i := 0; i < 5000; i++ {
		ctx, cancel := context.WithTimeout(context.Background(), time.Duration(rand.N(maxWait))*time.Microsecond)
		_, err := f.Sweep(ctx)
		cancel()
		if err != nil {
			errs[err.Error()]++
		}
		var ms int
		if err := pool.Get(&ms, "PRAGMA busy_timeout"); err != nil {
			t.Fatal(err)
		}
		if ms != 10000 {
			t.Logf("errors: %v", errs)
			t.Fatalf("after %d sweeps with contexts ending early, the pool's connection has busy_timeout %d, want 10000: a service's transaction on it fails at once with SQLITE_BUSY", i+1, ms)
		}
	}
	t.Logf("errors: %v", errs)

}

// slowPipeDest is a pipelining destination whose sends take send, well
// inside PublishTimeout, and which confirms every record; it counts the
// sends of each id.
type slowPipeDest struct {
	send time.Duration
	mu   sync.Mutex
	sent map[string]int
}

type slowSent []outbox.Record

func (s slowSent) Records() []outbox.Record { return s }

func (d *slowPipeDest) Publish(_ context.Context, records []outbox.Record) []error {
	d.count(records)
	return make([]error, len(records))
}

func (d *slowPipeDest) count(records []outbox.Record) {
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, r := range records {
		d.sent[r.ID]++
	}
}

func (d *slowPipeDest) Pipeline() outbox.Pipeline { return slowPipe{d} }

type slowPipe struct{ d *slowPipeDest }

func (p slowPipe) Destination() outbox.Destination { return p.d }
func (p slowPipe) Capacity() int                   { return 10000 }
func (p slowPipe) Send(_ context.Context, records []outbox.Record) outbox.Sent {
	time.Sleep(p.d.send) // a slow link to the broker
	p.d.count(records)
	return slowSent(records)
}
func (p slowPipe) Wait(_ context.Context, s outbox.Sent) []error {
	return make([]error, len(s.Records()))
}

// SQLite, two relays, a pipelining destination whose sends are slow but
// within PublishTimeout: a batch stays in flight while the batches behind
// it are claimed and sent, and its lease, written once at its claim, ran
// out while it was still unmarked: the second relay claimed and published
// its rows too. A batch whose lease would run out before it could be
// marked is now settled before the relay claims more.
func TestForwarder_SQLitePipelinedBatchOutlivingItsLease_NoSecondRelayOnIt(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	publishN(t, db, "x", "t", 80)
	d := &slowPipeDest{send: 350 * time.Millisecond, sent: map[string]int{}}
	cfg := outbox.ForwarderConfig{BatchSize: 10, MaxBatchSize: 10, PublishTimeout: 500 * time.Millisecond, Lease: time.Second}
	var relays []*outbox.Forwarder
	for range 2 {
		f, err := outbox.NewForwarder(db.DB, d, cfg)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		relays = append(relays, f)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() { _ = relays[0].Run(ctx) }()
	time.Sleep(1200 * time.Millisecond) // the first relay's batches are in flight
	go func() { _ = relays[1].Run(ctx) }()
	waitFor(t, 60*time.Second, "every row to be published", func() bool { return pendingCount(t, relays[0]) == 0 })
	cancel()
	d.mu.Lock()
	defer d.mu.Unlock()
	twice := 0
	for _, n := range d.sent {
		if n > 1 {
			twice++
		}
	}
	if twice > 0 {
		t.Errorf("%d of %d rows sent more than once: a second relay claimed rows whose lease ran out in flight", twice, len(d.sent))
	}
}

// foreignLeases are locked_until values another library's relay might write
// on SQLite, by row id: text no date parser reads is no lease at all; a live
// lease, written in a form julianday() reads or (Go's time.String(), as
// modernc.org/sqlite stores a time) starting with a date, is one.
func foreignLeases(now time.Time) (noTime map[string]any, live map[string]any) {
	return map[string]any{
			"garbage":  "garbage",
			"empty":    "",
			"month-13": "2026-13-45 00:00:00",
			"blob":     []byte{0xff, 0x00},
		}, map[string]any{
			"live-iso":     now.Add(time.Hour).UTC().Format(time.RFC3339Nano),
			"live-modernc": now.Add(time.Hour).UTC().Format("2006-01-02 15:04:05.999999999 -0700 MST"),
		}
}

// SQLite: a lease another library's relay wrote as text that is no time
// ('garbage', a month 13, a BLOB) compared through julianday() as NULL,
// then as text, which sorted above every time: the row looked leased for
// ever, and was never published, with nothing to say so (pending, never
// stuck). Such a lease is now over, and the row is published.
func TestForwarder_SQLiteLeaseNoDateReads_RowPublished(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	noTime, live := foreignLeases(time.Now())
	for id, until := range mapsJoin(noTime, live) {
		insertRaw(t, db, id, "ex", "k", "{}", "utf-8")
		if _, err := db.Exec("UPDATE acemq_outbox SET locked_by = 'ruby-relay-1', locked_until = ? WHERE id = ?", until, id); err != nil {
			t.Fatal(err)
		}
	}
	dest := &slowCapture{}
	f, err := outbox.NewForwarder(db.DB, outbox.NewPublisherDestination(dest, nil), outbox.ForwarderConfig{})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.Sweep(context.Background()); err != nil {
		t.Fatal(err)
	}
	got := map[string]bool{}
	for _, id := range dest.got() {
		got[id] = true
	}
	for id, until := range noTime {
		if !got[id] || !stateOf(t, db, id).Published {
			t.Errorf("row %s, its lease %q no time at all: not published (sent: %v); it is leased for ever", id, until, got[id])
		}
	}
	for id, until := range live {
		if got[id] {
			t.Errorf("row %s published under the Ruby relay's live lease %q", id, until)
		}
	}
}

// The operator's side of the same: a stuck row whose lease is no time was
// listed as leased, until a time that never came, and Retry and
// RetryAllStuck left it alone for ever ("retry once it runs out").
func TestStore_SQLiteLeaseNoDateReads_NotLeasedRetried(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	s, err := outbox.NewStore(db.DB, outbox.StoreConfig{Dialect: outbox.SQLite, MaxAttempts: 3})
	if err != nil {
		t.Fatal(err)
	}
	noTime, live := foreignLeases(time.Now())
	for id, until := range mapsJoin(noTime, live) {
		insertRaw(t, db, id, "ex", "k", "{}", "utf-8")
		if _, err := db.Exec("UPDATE acemq_outbox SET attempts = 3, locked_by = 'ruby-relay-1', locked_until = ? WHERE id = ?", until, id); err != nil {
			t.Fatal(err)
		}
	}
	ctx := context.Background()
	stuck, err := s.Stuck(ctx, 10)
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range stuck {
		if _, ok := live[r.ID]; r.Leased != ok {
			t.Errorf("stuck row %s: leased %v, want %v (lease %q)", r.ID, r.Leased, ok, mapsJoin(noTime, live)[r.ID])
		}
	}
	if n, err := s.Retry(ctx, "garbage"); n != 1 || err != nil {
		t.Errorf("retry of the row whose lease is 'garbage': %d, %v; want 1, nil", n, err)
	}
	if n, err := s.RetryAllStuck(ctx); n != int64(len(noTime)-1) || err != nil {
		t.Errorf("retry of every stuck row: %d, %v; want %d, those whose lease is no time", n, err, len(noTime)-1)
	}
	for id := range live {
		if st := stateOf(t, db, id); st.Attempts != 3 {
			t.Errorf("row %s under a live lease: %+v, want left alone", id, st)
		}
	}
}

func mapsJoin(a, b map[string]any) map[string]any {
	m := make(map[string]any, len(a)+len(b))
	maps.Copy(m, a)
	maps.Copy(m, b)
	return m
}

// SQLite: a batch's mark may wait the pool's busy timeout for the write
// lock after a publish of up to PublishTimeout, and a lease that ran out
// meanwhile lets a second relay, waiting for the same lock, claim the
// batch's rows and publish them too. NewForwarder took a Lease of 2 ×
// PublishTimeout (2 s) beside a busy timeout of 10 s without a word; the
// first claim, which learns the busy timeout, now logs it as an error,
// once.
func TestForwarder_SQLiteLeaseShorterThanPublishAndBusyWait_Reported(t *testing.T) {
	db := migrated(t, testdb.SQLite) // busy_timeout 10 s
	cases := []struct {
		name   string
		cfg    outbox.ForwarderConfig
		report bool
	}{
		{"PublishTimeout 1 s, Lease 2 s", outbox.ForwarderConfig{PublishTimeout: time.Second, Lease: 2 * time.Second}, true},
		{"the defaults", outbox.ForwarderConfig{}, false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			logged := &testutil.ErrorLog{}
			c.cfg.Logger = logged
			f, err := outbox.NewForwarder(db.DB, outbox.NewPublisherDestination(&slowCapture{}, nil), c.cfg)
			if err != nil {
				t.Fatalf("NewForwarder: %v", err)
			}
			defer f.Close()
			for range 2 { // logged once, not per claim
				publishN(t, db, "x", "t", 1)
				if n, err := f.Sweep(context.Background()); n != 1 || err != nil {
					t.Fatalf("sweep: %d, %v; want 1, nil", n, err)
				}
			}
			reported := logged.Errs()
			var leaseErrs []error
			for _, err := range reported {
				var cerr *outbox.ConfigError
				if errors.As(err, &cerr) && cerr.Field == "Lease" {
					leaseErrs = append(leaseErrs, err)
				}
			}
			switch {
			case c.report && len(leaseErrs) != 1:
				t.Errorf("logged %v; want one *ConfigError naming Lease: a batch can stay unmarked for PublishTimeout and the busy timeout, 11 s, past its 2 s lease", reported)
			case !c.report && len(leaseErrs) != 0:
				t.Errorf("logged %v; want nothing: Lease 60 s outlasts PublishTimeout 15 s and the busy timeout 10 s", leaseErrs)
			}
			if len(leaseErrs) > 0 {
				t.Logf("logged: %v", leaseErrs[0])
			}
		})
	}
}

// A user review opened the file with _busy_timeout=0: the relay's claims
// and marks failed with "database is locked" beside every writer, and
// nothing said why. The relay says so at its first claim.
func TestForwarder_SQLiteBusyTimeoutZero_Reported(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	pool, err := sqlx.Open("sqlite3", strings.Replace(db.DSN, "_busy_timeout=10000", "_busy_timeout=0", 1))
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	logged := &testutil.ErrorLog{}
	f, err := outbox.NewForwarder(pool.DB, outbox.NewPublisherDestination(&slowCapture{}, nil), outbox.ForwarderConfig{Dialect: outbox.SQLite, Logger: logged})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	publishN(t, db, "x", "t", 1)
	if n, err := f.Sweep(context.Background()); n != 1 || err != nil {
		t.Fatalf("sweep: %d, %v; want 1, nil", n, err)
	}
	said := false
	for _, err := range logged.Errs() {
		said = said || strings.Contains(err.Error(), "busy_timeout is 0") && strings.Contains(err.Error(), "_busy_timeout=5000")
	}
	if !said {
		t.Errorf("logged %v; want the busy timeout of 0 named, and what to open the database with", logged.Errs())
	}
}
