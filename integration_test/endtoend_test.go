// Package integration_test is the end-to-end proof of the outbox and the
// inbox together, under chaos, on real servers: orders committed (or rolled
// back) with their order.placed message in one transaction, a relay running
// as a separate process that is killed and restarted, broker connections
// closed, database connections terminated, and a Watermill consumer whose
// inbox must turn every committed order into exactly one effect. Beside
// the orders, the same run proves per-aggregate order (keyed_test.go):
// orders as aggregates with several events each, published keyed by the
// order id, relayed by two relays at once and consumed by three instances
// with prefetch 50 and random nacks behind an ordered inbox; for every key
// the handler must see 1..n exactly once, in order.
//
// The default run is part of `go test ./...`: about 12 s of chaos on each of
// PostgreSQL and MariaDB and 8 s on SQLite (longer, up to three times that, until
// every kind of chaos has hit something), a few hundred orders each, under a
// minute in all with -race. A longer soak keeps the same rate of orders and
// chaos for as long as OUTBOX_SOAK says, per database:
//
//	OUTBOX_SOAK=5m go test -race -count=1 -timeout 60m -run TestEndToEnd -v ./integration_test/
//
// The chaos schedule comes from a seeded generator; the log prints the seed,
// and OUTBOX_E2E_SEED=<seed> replays the same schedule (the interleavings of
// the processes around it differ from run to run). OUTBOX_TEST_DEBUG=1 makes
// the relay and the consumers log in detail. OUTBOX_E2E_CLOSE_CONSUMER=1
// has the broker close the consumers' connections under -race too (see
// closeConsumerConnection). The result table goes to the test log and to
// stdout, which `go test` shows with -v (or -json).
package integration_test

import (
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net/url"
	"os"
	"os/exec"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/go-sql-driver/mysql"
	"github.com/jmoiron/sqlx"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testamqp"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

const (
	topic        = "order.placed"
	consumerName = "e2e-fulfilment"
	// maxLatency bounds the time from an order to its effect. The chaos
	// delays some by seconds (a relay down for up to 2.5 s, a publish
	// timeout of 3 s, backoff); 30 s leaves room for a loaded machine, and a
	// relay that stalls (a lock wait of innodb_lock_wait_timeout, 50 s) fails
	// it. On SQLite each relay killed holding a claim keeps its rows for the
	// 6 s lease, and the next one may die holding the same rows: twice as
	// long there.
	maxLatency       = 30 * time.Second
	maxLatencySQLite = 60 * time.Second
	// inventoryFailureRate is the share of orders whose transaction
	// publishes order.placed and then rolls back (the stock reservation
	// failed): neither a message nor an effect may ever exist for them.
	inventoryFailureRate = 0.2
	// opTimeout bounds one order's transaction, so that a placer never
	// hangs on a database that went away under it.
	opTimeout = 20 * time.Second
)

// scenario is the scale of one database's run.
type scenario struct {
	kind string
	// chaos is how long orders are placed and chaos reigns, at least: it
	// goes on, up to three times as long, until every kind has hit something.
	chaos   time.Duration
	placers int     // goroutines placing orders at once
	rate    float64 // orders per second, all placers together
	// keyedRate is the keyed events per second, all keyed placers
	// together (see keyed_test.go).
	keyedRate float64
}

func scenarioFor(kind string, soak time.Duration) scenario {
	sc := scenario{kind: kind, chaos: 12 * time.Second, placers: 4, rate: 25, keyedRate: 25}
	if kind == testdb.SQLite {
		// One writer at a time, shared by four processes: fewer orders.
		sc.chaos, sc.placers, sc.rate, sc.keyedRate = 8*time.Second, 3, 15, 15
	}
	if soak > 0 {
		sc.chaos = soak
	}
	return sc
}

func TestEndToEnd_ChaosOnRelayBrokerAndDatabase_EveryCommittedOrderExactlyOneEffect(t *testing.T) {
	testdb.Require(t, "amqp")
	if _, err := exec.LookPath("rabbitmqctl"); err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("rabbitmqctl is needed to close the broker's connections: %v", err)
		}
		t.Skipf("skipping: rabbitmqctl is needed to close the broker's connections: %v", err)
	}
	var soak time.Duration
	if v := os.Getenv("OUTBOX_SOAK"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil || d <= 0 {
			t.Fatalf("OUTBOX_SOAK=%q: want a positive duration such as 5m", v)
		}
		soak = d
	}
	seed := uint64(time.Now().UnixNano())
	if v := os.Getenv("OUTBOX_E2E_SEED"); v != "" {
		s, err := strconv.ParseUint(v, 10, 64)
		if err != nil {
			t.Fatalf("OUTBOX_E2E_SEED=%q: %v", v, err)
		}
		seed = s
	}
	say(t, "end-to-end chaos seed %d (OUTBOX_E2E_SEED=%d replays this schedule)", seed, seed)
	if !closeConsumerConnection() {
		t.Log("under -race the broker closes the relay's connections only: watermill-amqp v3's reconnect has a data race " +
			"(ThreeDotsLabs/watermill#693); consumers are restarted instead. OUTBOX_E2E_CLOSE_CONSUMER=1 closes theirs anyway.")
	}
	for i, kind := range testdb.Kinds {
		t.Run(kind, func(t *testing.T) {
			runEndToEnd(t, scenarioFor(kind, soak), seed+uint64(i))
		})
	}
}

// say logs to the test log and to stdout, so that the numbers show in CI
// output run with -v, and appends to the file OUTBOX_E2E_REPORT names, which
// .ci/run prints after the README's test command (without -v, go test shows
// nothing of a passing package).
func say(t *testing.T, format string, args ...any) {
	t.Helper()
	t.Logf(format, args...)
	fmt.Printf(format+"\n", args...)
	if path := os.Getenv("OUTBOX_E2E_REPORT"); path != "" {
		reportMu.Lock()
		defer reportMu.Unlock()
		f, err := os.OpenFile(path, os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o644)
		if err != nil {
			t.Errorf("OUTBOX_E2E_REPORT: %v", err)
			return
		}
		defer f.Close()
		fmt.Fprintf(f, format+"\n", args...)
	}
}

var reportMu sync.Mutex

// run is one database's end-to-end run.
type run struct {
	t        *testing.T
	sc       scenario
	db       *testdb.DB // the test's own pool: setup, the killer, counting
	app      *sqlx.DB   // the service: placers and consumer
	exchange string
	queue    string
	runID    string

	appName   string // PostgreSQL application_name of the service's pool
	relayName string // PostgreSQL application_name of the relay's pool
	relayUser string // MySQL user of the relay process ("" if it could not be made)
	killer    *sql.Conn

	relay    *relaySupervisor
	consumer *consumer
	keyed    *keyedRun
	placed   placements
	chaos    chaosLog
}

func runEndToEnd(t *testing.T, sc scenario, seed uint64) {
	began := time.Now()
	ctx := context.Background()
	r := &run{t: t, sc: sc, runID: testdb.RandomName()}
	r.db = testdb.New(t, sc.kind)
	var err error
	d, ok := map[string]outbox.Dialect{testdb.Postgres: outbox.Postgres, testdb.MySQL: outbox.MySQL, testdb.SQLite: outbox.SQLite}[r.db.Kind]
	if !ok {
		t.Fatalf("no dialect for database kind %q", r.db.Kind)
	}
	if err := outbox.Migrate(ctx, r.db.DB.DB, d); err != nil {
		t.Fatal(err)
	}
	// No unique key on effects: a second effect of one order shows as a
	// second row instead of an error the handler could hide.
	// The times are the test process's clock (placers and consumers both
	// run in it), in microseconds: the latency from order to effect.
	r.db.MustExec("CREATE TABLE orders (id varchar(64) PRIMARY KEY, message_id varchar(64) NOT NULL, total integer NOT NULL, placed_us bigint NOT NULL)")
	r.db.MustExec("CREATE TABLE effects (order_id varchar(64) NOT NULL, message_id varchar(64) NOT NULL, applied_us bigint NOT NULL)")

	b := testamqp.New(t)
	r.exchange = b.Exchange
	r.queue = b.Queue(topic) // bound before the first publish, so nothing is unroutable
	keyedQueue := b.Queue(keyedTopic)

	appDSN, relayDSN := r.dsns()
	r.app = sqlx.MustOpen(r.db.DriverName(), appDSN)
	r.app.SetMaxOpenConns(10)
	t.Cleanup(func() { _ = r.app.Close() })
	if sc.kind != testdb.SQLite {
		r.killer, err = r.db.Conn(ctx)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = r.killer.Close() })
	}

	// Two relays at once, as a service with two replicas runs them: the
	// keyed events must keep their order across both.
	r.relay = newRelaySupervisor(t, relays, r.db.DriverName(), relayDSN, r.connName("relay"))
	for slot := range relays {
		r.relay.start(slot, dieSpec{})
	}
	r.consumer = startOrderConsumer(t, r)
	r.keyed = startKeyed(t, r, keyedQueue)

	// Orders, and chaos, until the chaos is over.
	rng := rand.New(rand.NewPCG(seed, seed^0x5eed))
	chaosCtx, stopChaos := context.WithCancel(ctx)
	defer stopChaos()
	placeCtx, stopPlacing := context.WithCancel(chaosCtx)
	var wg sync.WaitGroup
	for p := 0; p < sc.placers; p++ {
		prng := rand.New(rand.NewPCG(seed, uint64(p)+1))
		wg.Add(1)
		go func() {
			defer wg.Done()
			r.placer(placeCtx, prng, p)
		}()
	}
	for p := 0; p < keyedPlacers; p++ {
		prng := rand.New(rand.NewPCG(seed, uint64(p)+1000))
		wg.Add(1)
		go func() {
			defer wg.Done()
			r.keyed.placer(placeCtx, prng, p, sc.keyedRate/keyedPlacers)
		}()
	}
	chaosDone := make(chan struct{})
	go func() {
		defer close(chaosDone)
		defer stopPlacing()
		r.runChaos(chaosCtx, rng, began)
	}()
	t.Cleanup(func() { stopChaos(); <-chaosDone }) // before the relay's and consumer's cleanups
	<-chaosDone
	wg.Wait()
	chaosEnd := time.Now()

	// Clean relays drain what is left.
	r.relay.killAll()
	for slot := range relays {
		r.relay.start(slot, dieSpec{})
	}
	store, err := outbox.NewStore(r.db.DB, outbox.StoreConfig{})
	if err != nil {
		t.Fatal(err)
	}
	var st outbox.Stats
	drained := waitUntil(90*time.Second, func() bool {
		s, err := store.Stats(ctx)
		st = s
		return err == nil && s.Pending == 0
	})
	if !drained {
		t.Errorf("the outbox did not drain within 90 s after the chaos: %+v", st)
	}
	for slot := range relays {
		if err := r.relay.stop(slot, 30*time.Second); err != nil {
			t.Errorf("a final relay did not stop cleanly on SIGTERM: %v", err)
		}
	}
	drainEnd := time.Now()

	// The consumers catch up: every committed order has its effect, and no
	// copy of any message is left on the broker or in a handler. With the
	// outbox drained, the queue empty and the handlers idle nothing more can
	// arrive, so an effect still missing 5 s later is lost: waiting out the
	// minute would prove nothing more.
	// The keyed events count alike, with the messages held in the inbox
	// as not yet handled.
	var (
		committed, effects, onBroker int64
		settled                      time.Time
	)
	caughtUp := waitUntil(60*time.Second, func() bool {
		var orders, n int64
		if err := r.db.Get(&orders, "SELECT COUNT(*) FROM orders"); err != nil {
			return false
		}
		if err := r.db.Get(&n, "SELECT COUNT(*) FROM effects"); err != nil {
			return false
		}
		keyedRows, keyedEffects, held, err := r.keyed.progress()
		if err != nil {
			return false
		}
		committed, n = orders+keyedRows, n+keyedEffects
		depth, err := queueDepth(r.queue)
		if err != nil {
			return false
		}
		keyedDepth, err := queueDepth(r.keyed.queue)
		if err != nil {
			return false
		}
		depth += keyedDepth
		idle := depth == 0 && held == 0 && r.consumer.inflight.Load() == 0 && r.keyed.consumer.inflight.Load() == 0
		switch {
		case !idle || n != effects || settled.IsZero():
			settled = time.Now()
		case time.Since(settled) > 5*time.Second:
			return true // settled short: the verdict below says what is missing
		}
		effects, onBroker = n, depth
		return effects >= committed && idle
	})
	if !caughtUp || effects < committed {
		t.Errorf("the consumers did not catch up: %d effects for %d committed orders and keyed events, %d messages still on the broker", effects, committed, onBroker)
	}
	for _, c := range r.consumerGroups() {
		c.close()
		if n, err := queueDepth(c.queue); err != nil || n != 0 {
			t.Errorf("after the %s consumers stopped their queue holds %d messages (%v): deliveries left unhandled", c.name, n, err)
		}
	}
	r.verify(store, began, chaosEnd, drainEnd)
}

// relays is how many relay processes run at once.
const relays = 2

// consumerGroups are the run's consumers: the chaos restarts and
// disconnects any of them.
func (r *run) consumerGroups() []*consumer { return []*consumer{r.consumer, r.keyed.consumer} }

// connName is the RabbitMQ connection name of one of this run's clients:
// the chaos closes these and nobody else's (other packages' tests run
// against the same broker at the same time).
func (r *run) connName(who string) string { return "e2e-" + r.runID + "-" + who }

// dsns returns the DSN of the service's pool and of the relay process. On
// PostgreSQL each gets an application_name, so that the chaos terminates
// exactly the relay's backends (or the service's as well); on MySQL the
// relay logs in as a user of its own, made for this run.
func (r *run) dsns() (app, relay string) {
	t := r.t
	switch r.sc.kind {
	case testdb.Postgres:
		r.appName, r.relayName = "e2e-"+r.runID+"-app", "e2e-"+r.runID+"-relay"
		return withAppName(t, r.db.DSN, r.appName), withAppName(t, r.db.DSN, r.relayName)
	case testdb.MySQL:
		user, pass := "e2e_relay_"+r.runID, testdb.RandomName()
		_, err := r.db.Exec(fmt.Sprintf("CREATE USER '%s'@'%%' IDENTIFIED BY '%s'", user, pass))
		if err == nil {
			t.Cleanup(func() { _, _ = r.db.Exec(fmt.Sprintf("DROP USER IF EXISTS '%s'@'%%'", user)) })
			_, err = r.db.Exec(fmt.Sprintf("GRANT ALL PRIVILEGES ON `%s`.* TO '%s'@'%%'", r.db.Name, user))
		}
		if err != nil {
			// A server where the test may not make users: the relay shares
			// the service's user, and killing "the relay's" connections
			// kills every connection of the test database.
			t.Logf("no MySQL user of its own for the relay (%v): the relay's connections are killed with everyone's", err)
			return r.db.DSN, r.db.DSN
		}
		cfg, err := mysql.ParseDSN(r.db.DSN)
		if err != nil {
			t.Fatal(err)
		}
		r.relayUser = user
		cfg.User, cfg.Passwd = user, pass
		return r.db.DSN, cfg.FormatDSN()
	}
	return r.db.DSN, r.db.DSN
}

func withAppName(t *testing.T, dsn, name string) string {
	u, err := url.Parse(dsn)
	if err != nil {
		t.Fatal(err)
	}
	q := u.Query()
	q.Set("application_name", name)
	u.RawQuery = q.Encode()
	return u.String()
}

// placements is what the placers know from the client's side. It is never
// the truth about what committed: a commit whose connection died has an
// unknown outcome, and the database answers that at the end.
type placements struct {
	mu        sync.Mutex
	attempted int
	rolled    map[string]string // order id → message id, rolled back on purpose
	failed    map[string]string // order id → message id, failed before the commit
	ambiguous map[string]string // order id → message id, the commit itself failed
	commitOK  int
	errs      map[string]int // why transactions failed, with how often
}

// take numbers the next order.
func (p *placements) take() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.attempted++
	return p.attempted
}

func (p *placements) record(m *map[string]string, orderID, msgID string, err error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if *m == nil {
		*m = map[string]string{}
	}
	(*m)[orderID] = msgID
	if err != nil {
		if p.errs == nil {
			p.errs = map[string]int{}
		}
		p.errs[err.Error()]++
	}
}

type orderPlaced struct {
	OrderID string `json:"order_id"`
	Total   int    `json:"total"`
}

// placer places orders at the scenario's rate until ctx ends.
func (r *run) placer(ctx context.Context, rng *rand.Rand, p int) {
	meanGap := time.Duration(float64(time.Second) * float64(r.sc.placers) / r.sc.rate)
	insertOrder := r.app.Rebind("INSERT INTO orders (id, message_id, total, placed_us) VALUES (?, ?, ?, ?)")
	for {
		n := r.placed.take()
		orderID := fmt.Sprintf("order-%d-%05d", p, n)
		msgID := watermill.NewUUID()
		total := 100 + rng.IntN(10000)
		outOfStock := rng.Float64() < inventoryFailureRate
		r.place(insertOrder, orderID, msgID, total, outOfStock)
		// Pacing, not synchronisation: the orders spread over the chaos.
		if !sleepCtx(ctx, time.Duration(rng.Int64N(int64(2*meanGap)+1))) {
			return
		}
	}
}

// place is one business transaction: the order row and its order.placed
// message, committed together, or rolled back together when the stock
// reservation fails after the message was published into the transaction.
func (r *run) place(insertOrder, orderID, msgID string, total int, outOfStock bool) {
	ctx, cancel := context.WithTimeout(context.Background(), opTimeout)
	defer cancel()
	fail := func(err error) { r.placed.record(&r.placed.failed, orderID, msgID, err) }
	tx, err := r.app.BeginTxx(ctx, nil)
	if err != nil {
		fail(fmt.Errorf("begin: %w", err))
		return
	}
	defer func() { _ = tx.Rollback() }()
	if _, err := tx.ExecContext(ctx, insertOrder, orderID, msgID, total, time.Now().UnixMicro()); err != nil {
		fail(fmt.Errorf("insert order: %w", err))
		return
	}
	pub, err := outbox.NewTxPublisher(tx, outbox.TxPublisherConfig{Exchange: r.exchange})
	if err != nil {
		r.t.Errorf("NewTxPublisher: %v", err)
		fail(err)
		return
	}
	payload, _ := json.Marshal(orderPlaced{OrderID: orderID, Total: total})
	msg := message.NewMessage(msgID, payload)
	msg.Metadata.Set("order_id", orderID)
	msg.SetContext(ctx)
	if err := pub.Publish(topic, msg); err != nil {
		fail(fmt.Errorf("publish: %w", err))
		return
	}
	if outOfStock {
		_ = tx.Rollback()
		r.placed.record(&r.placed.rolled, orderID, msgID, nil)
		return
	}
	if err := tx.Commit(); err != nil {
		r.placed.record(&r.placed.ambiguous, orderID, msgID, fmt.Errorf("commit: %w", err))
		return
	}
	r.placed.mu.Lock()
	r.placed.commitOK++
	r.placed.mu.Unlock()
}

// verify counts, from the database, what became of every order, prints the
// table, and asserts the contract.
func (r *run) verify(store *outbox.Store, began, chaosEnd, drainEnd time.Time) {
	t := r.t
	ctx := context.Background()

	orders := map[string]string{} // order id → message id
	placedAt := map[string]int64{}
	var orderRows []struct {
		ID     string `db:"id"`
		MsgID  string `db:"message_id"`
		Placed int64  `db:"placed_us"`
	}
	if err := r.db.Select(&orderRows, "SELECT id, message_id, placed_us FROM orders"); err != nil {
		t.Fatal(err)
	}
	for _, o := range orderRows {
		orders[o.ID] = o.MsgID
		placedAt[o.ID] = o.Placed
	}
	type outboxRow struct {
		ID        string `db:"id"`
		Published int    `db:"published"`
		Processed int    `db:"processed"`
		Attempts  int    `db:"attempts"`
	}
	var outboxRows []outboxRow
	if err := r.db.Select(&outboxRows, "SELECT id, CASE WHEN published_at IS NULL THEN 0 ELSE 1 END AS published, "+
		"CASE WHEN processed_at IS NULL THEN 0 ELSE 1 END AS processed, attempts FROM acemq_outbox WHERE aggregate_id IS NULL"); err != nil {
		t.Fatal(err)
	}
	outboxByID := map[string]outboxRow{}
	for _, o := range outboxRows {
		outboxByID[o.ID] = o
	}
	var effectRows []struct {
		OrderID string `db:"order_id"`
		MsgID   string `db:"message_id"`
		Applied int64  `db:"applied_us"`
	}
	if err := r.db.Select(&effectRows, "SELECT order_id, message_id, applied_us FROM effects"); err != nil {
		t.Fatal(err)
	}
	effectsOf := map[string]int{}
	effectsByMsg := map[string]int{}
	var latencies []time.Duration
	for _, e := range effectRows {
		effectsOf[e.OrderID]++
		effectsByMsg[e.MsgID]++
		if placed, ok := placedAt[e.OrderID]; ok {
			latencies = append(latencies, time.Duration(e.Applied-placed)*time.Microsecond)
		}
	}
	sort.Slice(latencies, func(i, j int) bool { return latencies[i] < latencies[j] })
	pct := func(p float64) time.Duration {
		if len(latencies) == 0 {
			return 0
		}
		return latencies[min(len(latencies)-1, int(p*float64(len(latencies))))].Round(time.Millisecond)
	}
	var keys int64
	if err := r.db.Get(&keys, r.db.Rebind("SELECT COUNT(*) FROM processed_messages WHERE consumer_name = ?"), consumerName); err != nil {
		t.Fatal(err)
	}
	st, err := store.Stats(ctx)
	if err != nil {
		t.Fatal(err)
	}

	var (
		lost, multi, phantom, mismatched       []string
		noRow, orphanRows, unpublished         []string
		unprocessed                            []string
		retried, maxAttempts                   int
		rolledLeaks, failedLeaks, ambCommitted int
	)
	msgToOrder := map[string]string{}
	for id, msgID := range orders {
		msgToOrder[msgID] = id
		switch n := effectsOf[id]; {
		case n == 0:
			lost = append(lost, id)
		case n > 1:
			multi = append(multi, fmt.Sprintf("%s×%d", id, n))
		}
		if _, ok := outboxByID[msgID]; !ok {
			noRow = append(noRow, id)
		}
	}
	for _, e := range effectRows {
		msgID, ok := orders[e.OrderID]
		if !ok {
			phantom = append(phantom, e.OrderID)
		} else if msgID != e.MsgID {
			mismatched = append(mismatched, e.OrderID)
		}
	}
	published := 0
	for _, o := range outboxRows {
		if _, ok := msgToOrder[o.ID]; !ok {
			orphanRows = append(orphanRows, o.ID)
		}
		if o.Published == 1 {
			published++
		} else {
			unpublished = append(unpublished, o.ID)
		}
		if o.Processed == 0 {
			unprocessed = append(unprocessed, o.ID)
		}
		if o.Attempts > 0 {
			retried++
		}
		maxAttempts = max(maxAttempts, o.Attempts)
	}
	// Orders the client knows did not commit must have left nothing at all.
	leaked := func(orderID, msgID string) bool {
		_, order := orders[orderID]
		_, row := outboxByID[msgID]
		return order || row || effectsOf[orderID] > 0 || effectsByMsg[msgID] > 0
	}
	for id, msgID := range r.placed.rolled {
		if leaked(id, msgID) {
			rolledLeaks++
			t.Errorf("order %s (message %s) rolled back, yet: order row %v, outbox row %v, effects %d",
				id, msgID, orders[id] != "", outboxByID[msgID].ID != "", effectsOf[id]+effectsByMsg[msgID])
		}
	}
	for id, msgID := range r.placed.failed {
		if leaked(id, msgID) {
			failedLeaks++
			t.Errorf("order %s (message %s) failed before its commit, yet something of it exists", id, msgID)
		}
	}
	for id := range r.placed.ambiguous {
		if _, ok := orders[id]; ok {
			ambCommitted++
		}
	}

	r.countDeaths()
	c := r.consumer
	deliveries, effects := c.deliveries.Load(), int64(len(effectRows))
	committed := len(orders)
	lines := []string{
		fmt.Sprintf("end-to-end %s: %.1fs of chaos, drained %.1fs later, %.1fs in all", r.sc.kind,
			chaosEnd.Sub(began).Seconds(), drainEnd.Sub(chaosEnd).Seconds(), time.Since(began).Seconds()),
		row("orders attempted", r.placed.attempted, ""),
		row("orders committed (database)", committed, fmt.Sprintf("commit returned ok %d; %d of %d ambiguous commits committed", r.placed.commitOK, ambCommitted, len(r.placed.ambiguous))),
		row("orders rolled back", r.placed.attempted-committed, fmt.Sprintf("inventory failures %d, failed before commit %d, ambiguous not committed %d",
			len(r.placed.rolled), len(r.placed.failed), len(r.placed.ambiguous)-ambCommitted)),
		row("messages published", published, fmt.Sprintf("outbox rows %d; %d needed more than one attempt, at most %d", len(outboxRows), retried, maxAttempts)),
		row("deliveries", int(deliveries), fmt.Sprintf("handler runs %d, of which committed %d; nacked and redelivered %d", c.handlerRuns.Load(), c.applied.Load(), c.nacked.Load())),
		row("duplicates absorbed by inbox", int(c.duplicates.Load()), fmt.Sprintf("deliveries − effects = %d", deliveries-effects)),
		row("effects applied", int(effects), fmt.Sprintf("inbox keys %d", keys)),
		row("lost", len(lost), "committed orders without an effect"),
		row("orders with 2+ effects", len(multi), ""),
		row("not committed, yet a trace", rolledLeaks+failedLeaks, "an order, outbox row or effect of an order that never committed"),
		row("stuck / pending", int(st.Stuck), fmt.Sprintf("pending %d", st.Pending)),
		fmt.Sprintf("  order → effect latency         p50 %s, p99 %s, max %s", pct(0.5), pct(0.99), pct(1)),
		fmt.Sprintf("  chaos: %s", r.chaos.summary()),
		fmt.Sprintf("         %d relay processes, %d at once; %d consumer restarts; %d broker connections closed (consumers reconnected %d times); %d database connections terminated",
			r.relay.started, r.relay.slots(), c.restarts+r.keyed.consumer.restarts, r.chaos.brokerConns, c.reconnects.Load()+r.keyed.consumer.reconnects.Load(), r.chaos.dbConns),
	}
	lines = append(lines, r.keyed.verify()...)
	say(t, "%s", strings.Join(lines, "\n"))
	for msg, n := range r.placed.errs {
		t.Logf("an order's transaction failed %d× with: %s", n, msg)
	}

	// The contract.
	check := func(what string, ids []string) {
		t.Helper()
		if len(ids) > 0 {
			sort.Strings(ids)
			t.Errorf("%s: %d, e.g. %v", what, len(ids), ids[:min(len(ids), 10)])
		}
	}
	check("LOST: committed orders without an effect", lost)
	check("DUPLICATED: orders with more than one effect", multi)
	check("effects of orders that never committed", phantom)
	check("effects carrying another message's id", mismatched)
	check("committed orders without their outbox row", noRow)
	check("outbox rows of orders that never committed", orphanRows)
	check("outbox rows never published", unpublished)
	check("outbox rows no consumer marked processed", unprocessed)
	if st.Stuck != 0 || st.Pending != 0 {
		t.Errorf("outbox stats at the end: %+v; want nothing pending and nothing stuck", st)
	}
	bound := maxLatency
	if r.sc.kind == testdb.SQLite {
		bound = maxLatencySQLite
	}
	if worst := pct(1); worst > bound {
		t.Errorf("an order waited %s for its effect, more than %s: something stalled (p99 %s)", worst, bound, pct(0.99))
	}
	if keys != effects {
		t.Errorf("%d inbox keys for %d effects: the key and the effect must commit together", keys, effects)
	}

	// A run that broke nothing proves nothing.
	for _, k := range r.kinds() {
		if r.chaos.hits[k] == 0 {
			t.Errorf("chaos %q never hit anything (%d tries): the run did not prove what it claims", chaosNames[k], r.chaos.events[k])
		}
	}
	// The relay that died after its confirms may have held keyed records
	// only: either inbox counts.
	if c.duplicates.Load()+int64(r.keyed.absorbed) == 0 {
		t.Error("no inbox absorbed a duplicate, though relays died between confirm and mark")
	}
	if closeConsumerConnection() && c.reconnects.Load() == 0 {
		t.Error("no consumer ever lost its broker connection")
	}
	if r.sc.kind == testdb.SQLite && len(r.placed.errs) > 0 {
		t.Errorf("on SQLite no chaos touches the database, yet %d order transactions failed", len(r.placed.failed)+len(r.placed.ambiguous))
	}
	if committed < r.placed.attempted/3 || len(r.placed.rolled) == 0 {
		t.Errorf("%d of %d orders committed, %d rolled back on purpose: too few to prove anything", committed, r.placed.attempted, len(r.placed.rolled))
	}
}

func row(name string, n int, note string) string {
	if note != "" {
		note = "  (" + note + ")"
	}
	return fmt.Sprintf("  %-30s %6d%s", name, n, note)
}

// waitUntil polls cond until it holds or timeout passes, and reports which.
func waitUntil(timeout time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(50 * time.Millisecond) // polling a condition, with a deadline
	}
	return true
}

// sleepCtx waits d, or less if ctx ends first; it reports whether the full
// wait passed.
func sleepCtx(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}
