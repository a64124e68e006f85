package outbox

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math"
	"path/filepath"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	_ "github.com/go-sql-driver/mysql"
	_ "github.com/jackc/pgx/v5/stdlib"
	_ "github.com/mattn/go-sqlite3"

	"github.com/acemq/watermill-outbox/internal/sqldialect"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// Only a database that cannot wake the relay at all (MySQL) claims again at
// once while its claims find rows: on PostgreSQL without its trigger that
// measured worse, and SQLite's claims take the services' write lock (see
// claimNow).
func TestNewRelayLoop_ClaimsInAFlowOnMySQLOnly(t *testing.T) {
	for _, c := range []struct {
		dialect Dialect
		driver  string
		want    bool
	}{{MySQL, "mysql", true}, {Postgres, "pgx", false}, {SQLite, "sqlite3", false}} {
		db, err := sql.Open(c.driver, "") // no connection is made
		if err != nil {
			t.Fatal(err)
		}
		store, err := NewStore(db, StoreConfig{Dialect: c.dialect})
		if err != nil {
			t.Fatal(err)
		}
		l := (&Forwarder{store: store}).newRelayLoop(0, false)
		if l.claimInFlow != c.want {
			t.Errorf("%s: claimInFlow %v, want %v", c.driver, l.claimInFlow, c.want)
		}
		_ = db.Close()
	}
}

// With a batch's confirms out and the last claim short of a batch, the
// next sweep claims only if something says rows may be waiting: the
// wake-up that started it, or, where nothing can wake the relay, a last
// claim that found rows. A wake-up that came since waits, pending, for
// the sweep after the batches are settled.
func TestClaimNow_BatchesOut_ClaimsOnAWakeUpOrInAFlowWithoutOne(t *testing.T) {
	loop := func(found, inFlow bool) *relayLoop {
		return &relayLoop{f: &Forwarder{wake: make(chan struct{}, 1)}, queue: []*batch{{}}, drained: true, found: found, claimInFlow: inFlow}
	}
	if loop(true, false).claimNow() {
		t.Error("claimed with nothing pending where a commit wakes the relay")
	}
	if loop(false, true).claimNow() {
		t.Error("claimed after a claim that found nothing")
	}
	if !loop(true, true).claimNow() {
		t.Error("did not claim in a flow where nothing wakes the relay")
	}
	pending := loop(true, false)
	pending.f.Notify()
	if pending.claimNow() {
		t.Error("claimed with batches out on a wake-up that came since")
	}
	select {
	case <-pending.f.wake:
	default:
		t.Error("the wake-up that came since was taken: the sweep after the settling would wait for the poll")
	}
	woken := loop(false, false)
	woken.woke = true
	if !woken.claimNow() {
		t.Error("did not claim on the wake-up that started the sweep")
	}
}

// A wake-up's probe on SQLite waits for the writer of the moment: the file
// watch reports a commit's write to the log before the commit is visible,
// and a plain probe then missed it (about once in 400 commits,
// TestForwarder_SQLite_CommitElsewhere_WakesRelayWithoutPoll). Here a
// writer holds the lock with its row written and not yet committed, as at
// that moment: the plain probe (a poll's) finds nothing; the woken one
// waits for the commit and finds the row. A writer that holds the lock past
// busy_timeout may yet roll back, which writes nothing to the log and wakes
// nobody: the woken probe then lets the claim run (which fails on the lock
// still held and backs off, or finds the row), rather than leave the row
// to the poll. The pool's BEGIN is deferred here, the driver's default,
// which the probe must not depend on.
func TestNothingToClaim_SQLiteWokenProbeWaitsForTheWriter(t *testing.T) {
	path := filepath.Join(t.TempDir(), "outbox.db")
	open := func(busyMs int) *sql.DB {
		db, err := sql.Open("sqlite3", fmt.Sprintf("file:%s?_journal_mode=WAL&_busy_timeout=%d", path, busyMs))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = db.Close() })
		return db
	}
	// The first probe waits for a commit 100 ms away, which a loaded
	// machine can stretch: its pool waits 5 s. The last one's 300 ms is
	// what it measures.
	writer := open(300)
	if err := Migrate(context.Background(), writer, SQLite); err != nil {
		t.Fatal(err)
	}
	storeOf := func(db *sql.DB) *Store {
		store, err := NewStore(db, StoreConfig{Dialect: SQLite})
		if err != nil {
			t.Fatal(err)
		}
		return store
	}
	patient, short := storeOf(open(5000)), storeOf(open(300))
	ctx := context.Background()
	loop := func(store *Store, woke bool) *relayLoop {
		return &relayLoop{f: &Forwarder{store: store}, idle: true, woke: woke}
	}
	write := func(id string) *sql.Tx {
		tx, err := writer.Begin()
		if err != nil {
			t.Fatal(err)
		}
		if _, err := tx.Exec("INSERT INTO acemq_outbox (id, exchange_name, routing_key, body) VALUES (?, 'ex', 'rk', 'b')", id); err != nil {
			t.Fatal(err)
		}
		return tx
	}

	tx := write("committed-while-probing")
	if !loop(patient, false).nothingToClaim(ctx) {
		t.Fatal("a plain probe saw a row its writer has not committed")
	}
	go func() {
		time.Sleep(100 * time.Millisecond)
		_ = tx.Commit()
	}()
	if loop(patient, true).nothingToClaim(ctx) {
		t.Fatal("a woken probe found nothing: it read before the writer that woke it had committed")
	}

	if _, err := writer.Exec("UPDATE acemq_outbox SET published_at = CURRENT_TIMESTAMP"); err != nil {
		t.Fatal(err)
	}
	tx = write("held-past-busy-timeout")
	defer func() { _ = tx.Rollback() }()
	start := time.Now()
	if loop(short, true).nothingToClaim(ctx) {
		t.Fatal("a woken probe that could not get the lock within busy_timeout found nothing: a writer that rolls back would leave the row that woke it to the poll")
	}
	if waited := time.Since(start); waited < 250*time.Millisecond {
		t.Fatalf("the woken probe gave up after %s, want busy_timeout (300 ms)", waited)
	}
}

// On SQLite a relay whose lease ran out before it marked (busy waits, a
// slow broker) may find the row claimed by another relay meanwhile. Its
// failure mark must leave that relay's live lease alone: clearing it freed
// the row for a third relay while the second was publishing it. Its own
// rows it marks as before.
func TestStoreFinish_SQLiteLeaseTakenOver_FailureMarkLeavesTheOtherLease(t *testing.T) {
	db, err := sql.Open("sqlite3", "file:"+filepath.Join(t.TempDir(), "outbox.db")+"?_journal_mode=WAL&_busy_timeout=5000&_txlock=immediate")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	ctx := context.Background()
	if err := Migrate(ctx, db, SQLite); err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{"taken", "kept"} {
		if _, err := db.Exec("INSERT INTO acemq_outbox (id, exchange_name, routing_key, body) VALUES (?, 'ex', 'rk', 'b')", id); err != nil {
			t.Fatal(err)
		}
	}
	store, err := NewStore(db, StoreConfig{Dialect: SQLite})
	if err != nil {
		t.Fatal(err)
	}
	c, err := store.claimBatch(ctx, 10, "relay-a", time.Minute, nil, nil)
	if err != nil || len(c.rows) != 2 {
		t.Fatalf("claim: %v rows, %v", c, err)
	}
	// relay-a's lease on "taken" ran out, and relay-b claimed it.
	until := time.Now().Add(time.Minute).UTC().Format("2006-01-02 15:04:05.000000")
	if _, err := db.Exec("UPDATE acemq_outbox SET locked_by = 'relay-b', locked_until = ? WHERE id = 'taken'", until); err != nil {
		t.Fatal(err)
	}
	failures := []failure{{id: "taken", attempts: 1, reason: "nacked"}, {id: "kept", attempts: 1, reason: "nacked"}}
	if err := store.finish(ctx, c, nil, failures); err != nil {
		t.Fatal(err)
	}
	var by sql.NullString
	var attempts int
	if err := db.QueryRow("SELECT locked_by, attempts FROM acemq_outbox WHERE id = 'taken'").Scan(&by, &attempts); err != nil {
		t.Fatal(err)
	}
	if by.String != "relay-b" || attempts != 0 {
		t.Errorf("taken over: locked_by %q, attempts %d; want relay-b's lease untouched, 0 attempts", by.String, attempts)
	}
	if err := db.QueryRow("SELECT locked_by, attempts FROM acemq_outbox WHERE id = 'kept'").Scan(&by, &attempts); err != nil {
		t.Fatal(err)
	}
	if by.Valid || attempts != 1 {
		t.Errorf("its own row: locked_by %v, attempts %d; want no lease and 1 attempt", by, attempts)
	}
}

// A batch waits only for the batches in flight that hold a predecessor of
// one of its keyed records, and holds back only the records whose
// predecessor there was not published: a later record of the key in
// flight (an earlier one made pending again by a Retry or a Republish and
// claimed behind it) holds nothing back, nor does another key's failure.
func TestHoldBackBehindKeys_OnlyBehindAnUnpublishedPredecessor(t *testing.T) {
	rec := func(key string, seq int64) Record {
		return Record{ID: fmt.Sprintf("%s#%d", key, seq), AggregateID: key, Seq: seq}
	}
	refused := errors.New("refused")
	older := &batch{records: []Record{rec("k", 5), rec("j", 1), rec("u", 0)}, results: []error{refused, nil, refused}}
	older.records[2].AggregateID = ""                            // unkeyed
	later := &batch{records: []Record{rec("y", 4), rec("x", 1)}} // y#4 follows b's y#1
	l := &relayLoop{queue: []*batch{older, later}}
	b := &batch{records: []Record{rec("k", 3), rec("k", 6), rec("j", 2), rec("y", 1), {ID: "plain"}}}
	// k#3 and k#6 are one claim's here only to see each judged alone.
	l.dependOn(b)
	if len(b.waitsFor) != 1 || b.waitsFor[0] != older {
		t.Fatalf("waits for %d batches, want the one holding k#5 and j#1 only", len(b.waitsFor))
	}
	b.holdBackBehindKeys()
	for i, want := range []bool{false, true, false, false, false} {
		if got := b.preset != nil && errors.Is(b.preset[i], errBehindKey); got != want {
			t.Errorf("%s held back: %v, want %v", b.records[i].ID, got, want)
		}
	}
	if out := b.outgoing(); len(out) != 4 {
		t.Errorf("%d records go out, want 4", len(out))
	}
	// The destination's answer is placed around the preset result, and one
	// of another length leaves no results, for settle to refuse: five for
	// the four sent would otherwise line up with the five records and mark
	// the one held back.
	b.setResults([]error{nil, nil, refused, nil})
	if len(b.results) != 5 || b.results[0] != nil || !errors.Is(b.results[1], errBehindKey) || b.results[3] != refused {
		t.Errorf("results %v", b.results)
	}
	for _, res := range [][]error{{nil}, {nil, nil, nil, nil, nil}} {
		b.setResults(res)
		if b.results != nil || b.answered != len(res) {
			t.Errorf("an answer of %d results for 4: results %v, answered %d", len(res), b.results, b.answered)
		}
	}
}

// On MySQL a full keyed claim from the head passes over the relay's own
// batches in flight, which it does not lock (they are the relay's already)
// and which hold nobody back: they do not make the claim crowded, and the
// rows another transaction holds do.
func TestCrowded_MySQL_OwnRowsInFlightDoNotCount(t *testing.T) {
	db := testdb.New(t, testdb.MySQL)
	ctx := context.Background()
	if err := Migrate(ctx, db.DB.DB, MySQL); err != nil {
		t.Fatal(err)
	}
	tx, err := db.Begin()
	if err != nil {
		t.Fatal(err)
	}
	for seq := 1; seq <= 2; seq++ {
		for k := range 200 {
			_, err := tx.Exec("INSERT INTO acemq_outbox (id, exchange_name, routing_key, body, headers, created_at, aggregate_id, seq)"+
				" VALUES (?, 'ex', 'rk', 'b', '{}', ?, ?, ?)", fmt.Sprintf("k%03d#%d", k, seq),
				time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC).Add(time.Duration(seq*1000+k)*time.Millisecond).Format("2006-01-02 15:04:05.000000"),
				fmt.Sprintf("k%03d", k), seq)
			if err != nil {
				t.Fatal(err)
			}
		}
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	store, err := NewStore(db.DB.DB, StoreConfig{Dialect: MySQL})
	if err != nil {
		t.Fatal(err)
	}
	f := &Forwarder{store: store, log: watermill.NopLogger{}}
	claim := func(inFlight []string) *batch {
		t.Helper()
		c, err := store.claimBatch(ctx, 50, "r", time.Minute, nil, inFlight)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = store.abandon(ctx, c) })
		b := &batch{claim: c}
		for _, row := range c.rows {
			rec, err := readRecord(row)
			if err != nil {
				t.Fatal(err)
			}
			b.records = append(b.records, rec)
		}
		return b
	}
	ids := func(b *batch) (out []string) {
		for _, r := range b.records {
			out = append(out, r.ID)
		}
		return out
	}
	first := claim(nil)
	second := claim(ids(first)) // from the head again, past first's rows
	if second.records[0].ID != "k050#1" {
		t.Fatalf("the second claim starts at %s, want k050#1", second.records[0].ID)
	}
	l := &relayLoop{f: f, queue: []*batch{first}}
	if l.crowded(ctx, swept{claimed: second, size: 50}) {
		t.Error("a claim that passed over the relay's own batch in flight is crowded")
	}
	l = &relayLoop{f: f} // first held by another relay
	if !l.crowded(ctx, swept{claimed: second, size: 50}) {
		t.Error("a claim that passed over as many rows of another relay as it took is not crowded")
	}
}

// A duration past half of time.Duration's range doubled into a negative
// one: a RetryMax that large made the backoff after a failed sweep no wait
// at all (and a keyed record's retry-after none), a PollInterval that
// large made an idle relay poll every MinPollInterval, and a batch in
// flight never ran short of a lease that large.
func TestDoubledDurations_PastHalfTheRange_NeverNegative(t *testing.T) {
	const huge = time.Duration(math.MaxInt64)
	f := &Forwarder{cfg: ForwarderConfig{RetryMin: time.Millisecond, RetryMax: huge}}
	if d := f.nextDelay(huge/2 + 1); d != huge {
		t.Errorf("backoff after %s: %s, want RetryMax", huge/2+1, d)
	}
	if d := f.retryDelay(100); d != huge {
		t.Errorf("retry-after of a 100th failure: %s, want RetryMax", d)
	}
	l := &relayLoop{f: &Forwarder{cfg: ForwarderConfig{PollInterval: huge, MinPollInterval: time.Millisecond}}, poll: huge/2 + 1}
	if d := l.idleWait(swept{}); d != huge {
		t.Errorf("idle wait after %s: %s, want PollInterval", huge/2+1, d)
	}
	db, err := sql.Open("sqlite3", "file:"+filepath.Join(t.TempDir(), "outbox.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	store, err := NewStore(db, StoreConfig{Dialect: SQLite})
	if err != nil {
		t.Fatal(err)
	}
	store.busyWait, store.busyKnown = 5*time.Second, true
	f = &Forwarder{store: store, cfg: ForwarderConfig{Lease: huge, PublishTimeout: huge / 2}}
	l = &relayLoop{f: f, queue: []*batch{{claimedAt: time.Now()}}}
	if !l.leaseRunningOut() {
		t.Error("a batch with less lease left than 2 × (PublishTimeout + busy wait) is not running out of it")
	}
}

// The statements the relay sends on the pool while batches are in flight
// (a claim, the quiet trigger's time and look, a drain's look for the next
// records of its keys) wait only briefly for a connection of a capped pool
// that others hold: a service's transaction there may wait for the rows of
// those batches, which the relay marks only after the statement (an inbox
// marking processed_at; TestForwarder_RelayAndInboxShareACappedPool_…
// runs the whole deadlock). Without batches in flight they wait as long
// as their context allows.
func TestStore_PoolStatementsWithBatchesInFlight_CappedPoolTaken_GiveUpSoon(t *testing.T) {
	db := testdb.New(t, testdb.Postgres)
	if err := Migrate(context.Background(), db.DB.DB, Postgres); err != nil {
		t.Fatal(err)
	}
	store, err := NewStore(db.DB.DB, StoreConfig{Dialect: Postgres})
	if err != nil {
		t.Fatal(err)
	}
	db.SetMaxOpenConns(1)
	held, err := db.DB.DB.Conn(context.Background()) // the service's transaction, waiting
	if err != nil {
		t.Fatal(err)
	}
	defer held.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	statements := map[string]func() error{
		"claim":      func() error { _, err := store.claimBatch(ctx, 10, "r", time.Minute, nil, nil); return err },
		"quiet for":  func() error { return store.quietFor(ctx, "acemq_outbox_quiet", time.Second) },
		"quiet off":  func() error { return store.quietOff(ctx, "acemq_outbox_quiet") },
		"quiet over": func() error { _, err := store.quietOver(ctx); return err },
		"first next": func() error {
			_, err := store.firstNext(ctx, []sqldialect.KeySeq{{Key: "k", Seq: 1}})
			return err
		},
	}
	store.holding.Store(true) // Run's batches in flight
	for name, run := range statements {
		start := time.Now()
		if err := run(); !errors.Is(err, errNoConnection) {
			t.Errorf("%s with batches in flight on a pool taken: %v, want errNoConnection", name, err)
		}
		if took := time.Since(start); took > time.Second {
			t.Errorf("%s took %v to give up", name, took)
		}
	}
	store.holding.Store(false)
	short, stop := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer stop()
	if _, err := store.claimBatch(short, 10, "r", time.Minute, nil, nil); errors.Is(err, errNoConnection) || !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("claim with nothing in flight: %v, want it to wait out its context", err)
	}
}

// A Sweep (a request that wants its message out now) beside Run, whose
// batches in flight hold their rows: on a capped pool whose last
// connection a transaction waiting for those rows holds, the Sweep's
// claim waited for it without a bound, under the lock the loop needs to
// mark them. It gives up soon now, with errNoConnection, and reports
// nothing.
func TestSweep_BesideRunHoldingBatches_CappedPoolTaken_GivesUpSoon(t *testing.T) {
	db := testdb.New(t, testdb.Postgres)
	if err := Migrate(context.Background(), db.DB.DB, Postgres); err != nil {
		t.Fatal(err)
	}
	dest, err := NewAMQPDestination(AMQPConfig{URLs: []string{testdb.AMQPURL()}})
	if err != nil {
		t.Fatal(err)
	}
	var reported []error
	f, err := NewForwarder(db.DB.DB, dest, ForwarderConfig{Dialect: Postgres, OnError: func(err error, _ ErrorContext) { reported = append(reported, err) }})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	db.SetMaxOpenConns(1)
	held, err := db.DB.DB.Conn(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	defer held.Close()
	f.store.holding.Store(true) // Run's loop has batches in flight
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	start := time.Now()
	if _, err := f.Sweep(ctx); !errors.Is(err, errNoConnection) {
		t.Errorf("Sweep beside Run's batches on a pool taken: %v, want errNoConnection", err)
	}
	if took := time.Since(start); took > time.Second {
		t.Errorf("Sweep took %v to give up", took)
	}
	if len(reported) > 0 {
		t.Errorf("reported to OnError: %v", reported)
	}
}
