package outbox_test

import (
	"context"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"
	"github.com/prometheus/client_golang/prometheus"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testamqp"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// otherPool opens a pool of its own on db's database, as another process
// would: the relay learns nothing of its commits but through the database.
func otherPool(t testing.TB, db *testdb.DB) *testdb.DB {
	t.Helper()
	other, err := sqlx.Open(db.DriverName(), db.DSN)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = other.Close() })
	return &testdb.DB{DB: other, Kind: db.Kind, DSN: db.DSN, Name: db.Name}
}

// On SQLite the relay watches the database's write-ahead log: a commit on
// another pool (another process, as outboxctl relay runs) wakes it with no
// poll for an hour, also after a checkpoint truncated the log, and with the
// relay's own writes in between.
func TestForwarder_SQLite_CommitElsewhere_WakesRelayWithoutPoll(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	b := testamqp.New(t)
	queue := b.Queue("t")
	// No poll for an hour, adaptive or not: only the watch can wake it.
	f := newForwarder(t, db, outbox.ForwarderConfig{PollInterval: time.Hour, MinPollInterval: time.Hour})
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	go func() { _ = f.Run(ctx) }()
	<-f.Running()
	// Many commits: a wake-up that came before its commit was visible
	// missed about one in 400 (see nothingToClaim).
	other := otherPool(t, db)
	for i := 0; i < 400; i++ {
		if i == 200 {
			if _, err := other.Exec("PRAGMA wal_checkpoint(TRUNCATE)"); err != nil {
				t.Fatal(err)
			}
		}
		publishN(t, other, b.Exchange, "t", 1)
		if got := b.Drain(queue, 1, 10*time.Second); len(got) != 1 {
			t.Fatalf("message %d did not arrive within 10 s: the commit on another pool did not wake the relay", i)
		}
	}
}

// An idle relay costs one statement per PollInterval (a probe; a claim is
// three or four), whatever wakes it or does not: counted by the relay
// itself in outbox_forwarder_statements_total. And with nothing to wake it
// (DisableListen) it still finds a row another pool commits, by its poll.
func TestForwarder_Idle_OneStatementPerPoll_AndThePollFindsRows(t *testing.T) {
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		// The databases' idle relays count side by side, and beside
		// nothing else: the test stays serial.
		t.Parallel()
		for _, disable := range []bool{false, true} {
			b := testamqp.New(t)
			queue := b.Queue("t")
			reg := prometheus.NewRegistry()
			m, err := outbox.NewMetrics(reg)
			if err != nil {
				t.Fatal(err)
			}
			const poll = 100 * time.Millisecond
			f := newForwarder(t, db, outbox.ForwarderConfig{PollInterval: poll, DisableListen: disable, Metrics: m, StatsInterval: time.Hour})
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan struct{})
			go func() { defer close(done); _ = f.Run(ctx) }()
			<-f.Running()
			// Past the adaptive poll's climb from MinPollInterval.
			waitFor(t, 10*time.Second, "the first statements", func() bool {
				return metricValue(t, reg, "outbox_forwarder_statements_total", "") > 0
			})
			time.Sleep(500 * time.Millisecond)
			const window = 2 * time.Second
			before := metricValue(t, reg, "outbox_forwarder_statements_total", "")
			time.Sleep(window)
			idle := metricValue(t, reg, "outbox_forwarder_statements_total", "") - before
			// window/poll probes, and a few for the timers' drift; a claim
			// per poll would be three or four times as many. With LISTEN
			// too: NOTIFY acemq_outbox is the database's, and other tests
			// commit in their schemas all along, but their notifications
			// name their own tables and do not wake this relay.
			if budget := float64(window/poll) * 1.3; idle > budget || idle < float64(window/poll)/2 {
				t.Errorf("DisableListen %v: %.0f statements in %s idle, want about %d (at most %.0f)", disable, idle, window, window/poll, budget)
			}
			publishN(t, otherPool(t, db), b.Exchange, "t", 1)
			if got := b.Drain(queue, 1, 10*time.Second); len(got) != 1 {
				t.Errorf("DisableListen %v: a row committed on another pool was not published", disable)
			}
			cancel()
			<-done
		}
	})
}

// NOTIFY acemq_outbox is the database's: the outbox of every schema notifies
// on it. A relay wakes for its own table's commits, named in the payload,
// and for a payload that names no table (a trigger of another library), but
// not for another schema's outbox, whose commits would otherwise cost it a
// sweep each.
func TestForwarder_Postgres_NotifyOfAnotherSchema_DoesNotWakeRelay(t *testing.T) {
	db := migrated(t, testdb.Postgres)
	reg := prometheus.NewRegistry()
	m, err := outbox.NewMetrics(reg)
	if err != nil {
		t.Fatal(err)
	}
	// No poll for an hour, adaptive or not: only a notification wakes it.
	f := newForwarder(t, db, outbox.ForwarderConfig{PollInterval: time.Hour, MinPollInterval: time.Hour, Metrics: m, StatsInterval: time.Hour})
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	go func() { _ = f.Run(ctx) }()
	<-f.Running()
	waitFor(t, 10*time.Second, "LISTEN", func() bool {
		var n int
		_ = db.Get(&n, "SELECT count(*) FROM pg_stat_activity WHERE query = 'LISTEN acemq_outbox' AND datname = current_database()")
		return n > 0
	})
	statements := func() float64 { return metricValue(t, reg, "outbox_forwarder_statements_total", "") }
	// The sweeps the relay starts with (its first, and the one the start
	// of LISTEN wakes, which may come after LISTEN shows above) are over
	// once the count holds still: for a second, as under two test runs at
	// once on this machine the second came more than 300 ms after the
	// first, and was taken for a wake-up by another schema's notification.
	last, since := -1.0, time.Now()
	waitFor(t, 15*time.Second, "the first sweeps", func() bool {
		if n := statements(); n != last {
			last, since = n, time.Now()
		}
		return last > 0 && time.Since(since) >= time.Second
	})
	notify := func(payload string) {
		t.Helper()
		if _, err := db.Exec("SELECT pg_notify('acemq_outbox', $1)", payload); err != nil {
			t.Fatal(err)
		}
	}
	// Each notification of another table, sent alone, is given time to
	// wake the relay: a woken relay sweeps within a few milliseconds.
	others := []string{"some_other_schema.acemq_outbox", db.Name + ".another_outbox"}
	for i := 0; i < 6; i++ {
		before := statements()
		notify(others[i%len(others)])
		deadline := time.Now().Add(300 * time.Millisecond)
		for time.Now().Before(deadline) && statements() == before {
			time.Sleep(5 * time.Millisecond)
		}
		if after := statements(); after != before {
			t.Fatalf("a notification of %s woke the relay: %.0f statements", others[i%len(others)], after-before)
		}
	}
	before := statements()
	notify("") // no table named: wakes
	waitFor(t, 10*time.Second, "a sweep for a payload naming no table", func() bool { return statements() > before })
	woken := statements()
	before = woken
	notify(db.Name + ".acemq_outbox")
	waitFor(t, 10*time.Second, "a sweep for its own table's notification", func() bool { return statements() > before })
}

// A relay listening on a table whose NOTIFY trigger does not fire (another
// library created the table and this library's migrations never ran, or an
// operator disabled the trigger to spare the services' commits the NOTIFY)
// is never woken by a commit. It says so, and polls adaptively, as on
// MySQL: rows committed one after another arrive within milliseconds
// rather than at PollInterval each. Once the trigger fires again it says
// that too.
func TestForwarder_Postgres_NotifyTriggerDisabled_RelayPollsAdaptively(t *testing.T) {
	db := migrated(t, testdb.Postgres)
	if _, err := db.Exec("ALTER TABLE acemq_outbox DISABLE TRIGGER acemq_outbox_notify"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(outbox.SetTriggerRecheck(200 * time.Millisecond)) // runs after the relay's Close
	b := testamqp.New(t)
	queue := b.Queue("t")
	logs := &recordingLogger{}
	f := newForwarder(t, db, outbox.ForwarderConfig{PollInterval: 3 * time.Second, Logger: logs})
	go func() { _ = f.Run(context.Background()) }()
	<-f.Running()
	logged := func(msg string) func() bool {
		return func() bool { return len(logs.find(msg)) > 0 }
	}
	waitFor(t, 10*time.Second, "the log that no trigger fires", logged("The outbox table has no enabled NOTIFY trigger: commits do not wake the relay, which polls adaptively"))
	if outbox.Woken(f) {
		t.Fatal("the relay counts on a NOTIFY trigger that is disabled")
	}

	publishN(t, db, b.Exchange, "t", 1)
	if got := b.Drain(queue, 1, 10*time.Second); len(got) != 1 {
		t.Fatal("the first row did not arrive")
	}
	// Each row right after the last one arrived: the relay's poll is at
	// its shortest after a sweep that published. Counting on the trigger,
	// it would wait PollInterval (3 s) for each.
	for i := 0; i < 4; i++ {
		start := time.Now()
		publishN(t, db, b.Exchange, "t", 1)
		if got := b.Drain(queue, 1, 10*time.Second); len(got) != 1 {
			t.Fatalf("row %d did not arrive", i)
		}
		if took := time.Since(start); took > time.Second {
			t.Fatalf("row %d took %s from commit to broker: the relay waited for a NOTIFY that never comes", i, took)
		}
	}

	if _, err := db.Exec("ALTER TABLE acemq_outbox ENABLE TRIGGER acemq_outbox_notify"); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "the log that the trigger fires again", logged("The outbox table's NOTIFY trigger fires now: commits wake the relay"))
	waitFor(t, 10*time.Second, "the relay to count on the trigger again", func() bool { return outbox.Woken(f) })
	if n := len(logs.find("The outbox table has no enabled NOTIFY trigger: commits do not wake the relay, which polls adaptively")); n != 1 {
		t.Errorf("the disabled trigger was logged %d times over several looks, want once", n)
	}
}

// On PostgreSQL a row made pending again by an UPDATE in another process
// (outboxctl retry, a Republish at another service's boot) wakes a
// listening relay as an insert does, though the NOTIFY trigger fires on
// INSERT only: the relay, which polls once an hour here, sends it at once.
func TestForwarder_Postgres_RetryAndRepublishElsewhere_WakeTheRelay(t *testing.T) {
	db := migrated(t, testdb.Postgres)
	b := testamqp.New(t)
	queue := b.Queue("t")
	f := newForwarder(t, db, outbox.ForwarderConfig{PollInterval: time.Hour, MinPollInterval: time.Hour})
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	go func() { _ = f.Run(ctx) }()
	<-f.Running()
	other := otherPool(t, db)
	// A first message shows the relay hears the trigger's notification.
	waitFor(t, 10*time.Second, "LISTEN", func() bool {
		var n int
		_ = db.Get(&n, "SELECT count(*) FROM pg_stat_activity WHERE query = 'LISTEN acemq_outbox' AND datname = current_database()")
		return n > 0
	})
	publishN(t, other, b.Exchange, "t", 1)
	if got := b.Drain(queue, 1, 10*time.Second); len(got) != 1 {
		t.Fatal("the first message did not arrive: the relay does not hear the trigger")
	}

	// A row stuck when its transaction commits: the commit's notification
	// wakes the relay, which finds nothing to claim.
	stuckRow := func() string {
		t.Helper()
		tx, err := other.Beginx()
		if err != nil {
			t.Fatal(err)
		}
		pub, err := outbox.NewTxPublisher(tx, outbox.TxPublisherConfig{Exchange: b.Exchange})
		if err != nil {
			t.Fatal(err)
		}
		msg := message.NewMessage(watermill.NewUUID(), []byte("stuck"))
		if err := pub.Publish("t", msg); err != nil {
			t.Fatal(err)
		}
		if _, err := tx.Exec("UPDATE acemq_outbox SET attempts = 10 WHERE id = $1", msg.UUID); err != nil {
			t.Fatal(err)
		}
		if err := tx.Commit(); err != nil {
			t.Fatal(err)
		}
		if got := b.Drain(queue, 1, 300*time.Millisecond); len(got) != 0 {
			t.Fatalf("a stuck row was published")
		}
		return msg.UUID
	}
	store, err := outbox.NewStore(other.DB, outbox.StoreConfig{})
	if err != nil {
		t.Fatal(err)
	}
	var id string // the last row retried
	for _, retry := range []struct {
		name string
		run  func(id string) (int64, error)
	}{
		{"Retry", func(id string) (int64, error) { return store.Retry(context.Background(), id) }},
		{"RetryAllStuck", func(string) (int64, error) { return store.RetryAllStuck(context.Background()) }},
	} {
		id = stuckRow()
		if n, err := retry.run(id); err != nil || n != 1 {
			t.Fatalf("%s: %d, %v", retry.name, n, err)
		}
		if got := b.Drain(queue, 1, 10*time.Second); len(got) != 1 || got[0].MessageId != id {
			t.Fatalf("the row did not arrive within 10 s: %s did not wake the relay", retry.name)
		}
	}
	// Published an hour ago and never processed: Republish makes it
	// pending again.
	waitFor(t, 10*time.Second, "the mark", func() bool {
		var n int
		_ = db.Get(&n, "SELECT count(*) FROM acemq_outbox WHERE id = $1 AND published_at IS NOT NULL", id)
		return n == 1
	})
	if _, err := db.Exec("UPDATE acemq_outbox SET published_at = published_at - interval '1 hour' WHERE id = $1", id); err != nil {
		t.Fatal(err)
	}
	rp, err := outbox.NewRepublisher(other.DB, outbox.RepublisherConfig{TrackedTopics: outbox.NewTrackedTopics("t"), Grace: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	if n, err := rp.Republish(context.Background()); err != nil || n != 1 {
		t.Fatalf("republish: %d, %v", n, err)
	}
	if got := b.Drain(queue, 1, 10*time.Second); len(got) != 1 || got[0].MessageId != id {
		t.Fatal("the republished row did not arrive within 10 s: the republish did not wake the relay")
	}
}

// gatePipe pipelines, and logs each Send and the end of each Wait. Its
// first Send runs onFirstSend before it returns, as a commit that lands
// while the relay's batch is out, and logs its failure.
type gatePipe struct {
	onFirstSend func() error

	mu     sync.Mutex
	events []string // "send <ids>", "confirmed <ids>"
}

type gateSent []outbox.Record

func (s gateSent) Records() []outbox.Record { return s }

func (g *gatePipe) log(what string, records []outbox.Record) int {
	ids := make([]string, len(records))
	for i, r := range records {
		ids[i] = r.ID
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	g.events = append(g.events, what+" "+strings.Join(ids, ","))
	return len(g.events)
}

func (g *gatePipe) Publish(_ context.Context, records []outbox.Record) []error {
	g.log("send", records)
	g.log("confirmed", records)
	return make([]error, len(records))
}
func (g *gatePipe) Pipeline() outbox.Pipeline       { return g }
func (g *gatePipe) Destination() outbox.Destination { return g }
func (g *gatePipe) Capacity() int                   { return 1000 }
func (g *gatePipe) Send(_ context.Context, records []outbox.Record) outbox.Sent {
	if g.log("send", records) == 1 {
		if err := g.onFirstSend(); err != nil {
			g.log("failed: "+err.Error(), nil)
		}
	}
	return gateSent(records)
}
func (g *gatePipe) Wait(_ context.Context, s outbox.Sent) []error {
	time.Sleep(20 * time.Millisecond) // the broker's confirms take a moment
	g.log("confirmed", s.Records())
	return make([]error, len(s.Records()))
}

func (g *gatePipe) eventLog() []string {
	g.mu.Lock()
	defer g.mu.Unlock()
	return slices.Clone(g.events)
}

// A row committed (and the relay woken) while a batch that took every row
// there was is out waits for that batch's confirms, and goes out the
// moment they are in: the wake-up (Notify's here; a commit's NOTIFY or the
// file watch's alike) is kept, not lost, though no poll would come for a
// minute. Claiming at each wake-up with a batch out kept the
// pipeline full of batches of a row or two, and a relay so busy claiming
// and marking them fell behind a flow of 500 commits a second (see
// claimNow). On MySQL, where nothing wakes a relay in another process, a
// claim that found rows claims again at once (claimInFlow): there the row
// may go before the confirms.
func TestForwarder_Run_WokenWhileABatchIsOut_ClaimsOnceItIsSettled(t *testing.T) {
	eachMigrated(t, func(t *testing.T, db *testdb.DB, d outbox.Dialect) {
		insertKeyed(t, db, []keyedRow{{id: "first", exchange: "amq.topic", routingKey: "t", createdAt: time.Now().Add(-time.Minute)}})
		var f *outbox.Forwarder
		pipe := &gatePipe{onFirstSend: func() error {
			// On the relay's goroutine: no t.Fatal here.
			err := writeKeyed(db, []keyedRow{{id: "second", exchange: "amq.topic", routingKey: "t", createdAt: time.Now()}})
			f.Notify()
			return err
		}}
		failed := func(e string) bool { return strings.HasPrefix(e, "failed: ") }
		var err error
		f, err = outbox.NewForwarder(db.DB, pipe, outbox.ForwarderConfig{
			// Only the test's Notify wakes it: no LISTEN, no file watch, and no poll for a minute.
			Dialect: d, DisableListen: true, PollInterval: time.Minute, MinPollInterval: time.Minute,
		})
		if err != nil {
			t.Fatal(err)
		}
		runUntil(t, f, 10*time.Second, "the second row sent", func() bool {
			events := pipe.eventLog()
			return slices.Contains(events, "send second") || slices.ContainsFunc(events, failed)
		})
		events := pipe.eventLog()
		if i := slices.IndexFunc(events, failed); i >= 0 {
			t.Fatal(events[i])
		}
		if db.Kind != testdb.MySQL && slices.Index(events, "send second") < slices.Index(events, "confirmed first") {
			t.Errorf("the second row was claimed and sent while the first was out: %q", events)
		}
	})
}
