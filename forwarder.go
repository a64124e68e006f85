package outbox

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/acemq/watermill-outbox/internal/sqldialect"
)

// ForwarderConfig configures a Forwarder. The zero value of every field but
// Dialect (needed unless the handle is a *sqlx.DB) is a working default.
type ForwarderConfig struct {
	// Dialect of the database. Optional when the handle is a *sqlx.DB.
	Dialect Dialect
	// Table is the outbox table. Default acemq_outbox.
	Table string

	// BatchSize is how many rows one sweep claims in a flow, and the first
	// claim of a drain. Default 100, at most 1000. A claim takes what is
	// there, so in a flow of messages the batches are smaller.
	BatchSize int
	// MaxBatchSize bounds a drain's claims. When a claim of Run comes back
	// full (a backlog: more are waiting) and nothing failed, the next
	// claims twice as many, up to MaxBatchSize (on MySQL, unless it is a
	// keyed claim that passed over many rows: see below); any
	// other claim sends the next back to BatchSize. Default 1000, at least
	// BatchSize; MaxBatchSize = BatchSize keeps every claim at BatchSize.
	// Claims grow only where the destination pipelines (a Pipeliner such
	// as AMQPDestination without a Window), and no further than its
	// Capacity holds the batches in flight.
	//   - Why: a batch costs the relay its statements and a commit whatever
	//     its size, so larger batches drain a backlog faster. On two cores
	//     shared with the broker an unkeyed drain went from 0.58–0.88 of
	//     the broker's raw rate to 0.93–1.10 (outbox-bench -scenario relay,
	//     see the README).
	//   - Claims of keyed records grow too: a claim may take the next
	//     record of a key whose earlier records are in the relay's own
	//     batches in flight (sent once those are confirmed), so a larger
	//     claim finds records rather than searching further for keys with
	//     nothing in flight (keyed drain over unkeyed, one relay, fixed
	//     claims of 100 against growing ones: from 0.61 to 0.88 on
	//     PostgreSQL, 0.60 to 0.87 on SQLite, 0.67 to 0.80 on MariaDB, when
	//     it was made; 0.78–0.96 on 2026-12-06, see the README). On MySQL
	//     a claim keeps the rows it passed over locked
	//     until its batch is marked, other relays' keys' next records among
	//     them: a full keyed claim that passed over more than a quarter as
	//     many rows as it took sends the next back to BatchSize, and the
	//     16 full keyed claims after it too (two relays: 0.73, against 0.57
	//     when they grew).
	//   - A claim takes no more rows than 16 MiB holds at the mean body
	//     size of the claim before it (and never fewer than BatchSize), so
	//     a drain that meets larger bodies shrinks its claims again.
	//   - A claim stays at its size while batches stay in flight (from
	//     their send to their confirms) over an eighth of PublishTimeout,
	//     and halves over a quarter: a slow broker or link gets smaller
	//     batches rather than timeouts.
	//
	// Sweep claims BatchSize.
	MaxBatchSize int
	// MaxAttempts: see StoreConfig. Default 10.
	MaxAttempts int
	// PollInterval is the longest the relay waits for new rows when nothing
	// woke it. Default 250 ms. On PostgreSQL LISTEN/NOTIFY wakes it at any
	// process's commit (but in a flow above QuietAbove, where it polls
	// every MinPollInterval), on SQLite a watch of the database file's writes,
	// and Notify from the same process: there the poll only bounds the
	// latency of what those miss. Where nothing wakes it (MySQL; a
	// PostgreSQL table whose NOTIFY trigger is missing or disabled), the
	// poll adapts: MinPollInterval after a sweep that published, doubling
	// while sweeps find nothing, up to PollInterval; and on MySQL, while
	// its claims find rows, the relay claims again without waiting. An
	// idle relay sends one statement per PollInterval (a probe, not a
	// claim); the first row after an idle spell waits up to PollInterval
	// on MySQL.
	PollInterval time.Duration
	// MinPollInterval is the adaptive poll's shortest wait, right after a
	// sweep that published. Default 1 ms: in a steady flow the relay looks
	// again within a few milliseconds, at one statement (a probe) for each
	// look that finds nothing.
	MinPollInterval time.Duration
	// PublishTimeout bounds the wait for the broker's confirms of one batch.
	// Past it the unconfirmed records are held up as behind a failure (but
	// count no attempt: see ErrConnectionLost), and the connection is
	// dropped and opened again. Default 15 s.
	PublishTimeout time.Duration
	// Lease is how long a claim holds rows on SQLite, where a claim is a
	// lease rather than a row lock: a relay killed mid-batch leaves its rows
	// for this long. It must outlast a sweep: at least twice PublishTimeout
	// (refused otherwise), and longer than PublishTimeout and the pool's
	// busy timeout together, which the batch's mark may wait for SQLite's
	// write lock after its publish (logged as an error at the first claim
	// otherwise, once that timeout is known: a lock held past the lease's
	// end lets a second relay claim and publish the batch too).
	// Default 4 × PublishTimeout, 60 s at least (60 s with the defaults).
	// Used on SQLite only, but one set by hand is checked against
	// PublishTimeout on every database.
	Lease time.Duration
	// RetryMin and RetryMax bound the backoff after a failed sweep (the
	// broker or the database unreachable, or a record refused): the delay
	// doubles from RetryMin up to RetryMax and resets after a good sweep.
	// Defaults 100 ms and 10 s.
	RetryMin, RetryMax time.Duration
	// QuietAbove is the flow, in records claimed per second over a second,
	// above which the relay keeps its PostgreSQL table's NOTIFY trigger
	// quiet and polls instead (every MinPollInterval), until the flow falls
	// below half of it over 100 ms. PostgreSQL holds a database-wide lock
	// from a notifying transaction's commit until that commit is flushed,
	// so the services' notifying commits go one per WAL flush however many
	// commit at once (about 1,000 a second on a disk that flushes in a
	// millisecond, fewer under load); in such a flow the relay needs no
	// wake-up. The trigger reads the table's quiet sequence (migration
	// 0010), which the relay keeps a second ahead of the database's clock
	// and which lapses if the relay dies; a relay leaving its flow waits
	// for every transaction the trigger kept quiet to end before it counts
	// on NOTIFY again; one that stops clears it and wakes the other
	// relays. While the trigger is quiet the table's other relays (this
	// library's or another's) get no NOTIFY: they find what this one
	// leaves at their poll. Polling costs about a millisecond of
	// commit-to-broker latency against a wake-up. The trigger costs every
	// inserting transaction 8–13 µs in the server, quiet or not
	// (outbox-bench's trigger_cost_us_postgres), its look at the sequence
	// about 4.5 µs of that (measured by hand; docs/measurements.md). It needs
	// UPDATE on the sequence and a MinPollInterval of 20 ms at most;
	// without them, and on MySQL and SQLite, nothing changes. Default 600;
	// negative: never.
	QuietAbove int
	// DisableListen turns off what wakes the relay at another process's
	// commit: LISTEN/NOTIFY on PostgreSQL, the watch of the database file's
	// writes on SQLite. The relay then finds new rows by its poll alone.
	DisableListen bool
	// RelayID names this relay in locked_by. Default host-pid-random.
	RelayID string

	// OnError is called for every failed record, with where it was going
	// and its attempts (ErrorContext.Stuck once it reached MaxAttempts),
	// and for every failed sweep (with an empty MessageID). By default the
	// error is logged by Logger (which logs nothing unless it is set). It
	// runs on the relay's goroutine, in the middle of a sweep: it must not
	// call Close or Sweep, which wait for that sweep (a deadlock); to stop
	// the relay from it, cancel Run's context.
	OnError func(err error, dest ErrorContext)
	// Logger logs the relay's connects, losses, stuck records and failed
	// sweeps, and an AMQPDestination's given none. Nil logs nothing.
	Logger watermill.LoggerAdapter

	// Metrics, if set, counts what the relay publishes and fails, times its
	// batches, and sets the pending, oldest-pending and stuck gauges every
	// StatsInterval (default 15 s; each reading is one COUNT over the
	// pending index, on a goroutine of its own beside the relay's loop).
	// An AMQPDestination given to NewForwarder as it is reports its broker
	// nodes in them too (AMQPConfig.Metrics).
	Metrics *Metrics
	// StatsInterval is how often the relay reads the gauges of Metrics.
	// Default 15 s.
	StatsInterval time.Duration

	// TracerProvider, if set, gives each record the relay sends that
	// carries a trace context (a TxPublisher's with a Propagator, or
	// another library's traceparent header) a span: "publish <exchange>",
	// of kind PRODUCER, a child of the publisher's span, from the send to
	// the record's end in the relay (acemq.outcome: published once
	// confirmed and marked; failed, with the error, or stuck once marked
	// so; held_back behind a record that was not published; released
	// unsent, or its claim abandoned; not_marked, confirmed and its mark
	// failed, sent again), with OpenTelemetry's
	// messaging attributes (messaging.message.id is the record's id). A
	// record without a trace context gets none: the relay carries traces
	// on, and starts none. The message goes out with the publisher's trace
	// context as it was stored, so the consumer's span is the publisher's
	// child too. Nil costs nothing.
	TracerProvider trace.TracerProvider
	// Propagator reads the trace context from a record's headers when
	// TracerProvider is set. Default W3C trace context
	// (propagation.TraceContext), what TxPublisherConfig.Propagator should
	// write.
	Propagator propagation.TextMapPropagator
}

// pipelineDepth is how many batches Run keeps in flight beyond the one it
// is sending: enough that the broker always has a batch to work on while
// the relay marks one and claims the next. Each holds a claim (a
// connection and its row locks on PostgreSQL) until it is settled, and one
// more is held while the next is claimed; Run keeps fewer in flight when
// the pool is capped too low for them, or when the destination's pipeline
// takes fewer records (Pipeline.Capacity).
const pipelineDepth = 2

// maxBatchSize bounds BatchSize and MaxBatchSize: a claim's IN lists and
// the confirms in flight stay of a size every database and the broker take
// in their stride.
const maxBatchSize = 1000

func (c *ForwarderConfig) setDefaults() {
	if c.TracerProvider != nil && c.Propagator == nil {
		c.Propagator = propagation.TraceContext{}
	}
	if c.BatchSize == 0 {
		c.BatchSize = 100
	}
	if c.MaxBatchSize == 0 {
		c.MaxBatchSize = maxBatchSize
	}
	if c.PollInterval == 0 {
		c.PollInterval = 250 * time.Millisecond
	}
	if c.MinPollInterval == 0 {
		c.MinPollInterval = time.Millisecond
	}
	if c.PublishTimeout == 0 {
		c.PublishTimeout = 15 * time.Second
	}
	if c.Lease == 0 {
		// Grows with PublishTimeout: a longer PublishTimeout alone, on any
		// database, was refused as longer than half the lease.
		c.Lease = max(60*time.Second, doubled(doubled(c.PublishTimeout)))
	}
	if c.RetryMin == 0 {
		c.RetryMin = 100 * time.Millisecond
	}
	if c.RetryMax == 0 {
		c.RetryMax = 10 * time.Second
	}
	if c.RelayID == "" {
		host, _ := os.Hostname()
		if len(host) > 40 {
			host = host[:40]
		}
		c.RelayID = host + "-" + strconv.Itoa(os.Getpid()) + "-" + strconv.FormatUint(rand.Uint64()%1e8, 36)
	}
	if c.Logger == nil {
		c.Logger = watermill.NopLogger{}
	}
	if c.StatsInterval == 0 {
		c.StatsInterval = 15 * time.Second
	}
	if c.QuietAbove == 0 {
		c.QuietAbove = 600
	}
}

// growBytes bounds a drain's claims: no more rows than this holds at the
// mean body size of the claim before (see MaxBatchSize).
// Forwarder.growBytes holds it, for tests.
const growBytes = 16 << 20

func (c ForwarderConfig) validate() error {
	switch {
	case c.BatchSize < 1 || c.BatchSize > maxBatchSize:
		return &ConfigError{Field: "BatchSize", Reason: fmt.Sprintf("%d; want 1 to %d", c.BatchSize, maxBatchSize)}
	case c.MaxBatchSize < c.BatchSize || c.MaxBatchSize > maxBatchSize:
		return &ConfigError{Field: "MaxBatchSize", Reason: fmt.Sprintf("%d; want BatchSize (%d) to %d", c.MaxBatchSize, c.BatchSize, maxBatchSize)}
	case c.PollInterval < 0:
		return &ConfigError{Field: "PollInterval", Reason: "negative"}
	case c.MinPollInterval < 0 || c.MinPollInterval > c.PollInterval:
		return &ConfigError{Field: "MinPollInterval", Reason: fmt.Sprintf("%s; want 0 < MinPollInterval <= PollInterval (%s)", c.MinPollInterval, c.PollInterval)}
	case c.PublishTimeout < 0:
		return &ConfigError{Field: "PublishTimeout", Reason: "negative"}
	case c.Lease < 0:
		return &ConfigError{Field: "Lease", Reason: "negative"}
	case c.PublishTimeout > c.Lease/2:
		// Lease < 2 × PublishTimeout, which overflows for a PublishTimeout
		// past half of time.Duration's range, and took it.
		return &ConfigError{Field: "Lease", Reason: fmt.Sprintf("%s is shorter than a sweep can take (2 × PublishTimeout, PublishTimeout %s): a second relay would publish rows still in flight", c.Lease, c.PublishTimeout)}
	case c.RetryMin <= 0 || c.RetryMax < c.RetryMin:
		return &ConfigError{Field: "RetryMin", Reason: fmt.Sprintf("want 0 < RetryMin (%s) <= RetryMax (%s)", c.RetryMin, c.RetryMax)}
	case len(c.RelayID) > 64:
		return &ConfigError{Field: "RelayID", Reason: "longer than the 64 characters locked_by holds"}
	case c.RelayID == sqldialect.RetryHold:
		return &ConfigError{Field: "RelayID", Reason: fmt.Sprintf("%q marks a failed keyed record's backoff in locked_by, which a retry ends", sqldialect.RetryHold)}
	}
	return nil
}

// Forwarder is the relay: the only thing in a service that publishes outbox
// messages to the broker. It claims pending rows, publishes them to its
// Destination, and marks each published only after the broker confirmed it.
// At-least-once, on purpose: a relay that dies between the confirm and the
// mark publishes the row again, and consumers dedupe by message id.
//
// One relay is enough and two are safe: claims are exclusive (FOR UPDATE
// SKIP LOCKED on PostgreSQL and MySQL, a lease on SQLite).
//
// Run it with Run, or with a Watermill router through Plugin.
type Forwarder struct {
	store   *Store
	dest    Destination
	cfg     ForwarderConfig
	log     watermill.LoggerAdapter
	tracing *relayTracing // nil without a TracerProvider

	sweepMu sync.Mutex // one batch at a time
	// counted is the store's statement count last reported to Metrics
	// (see countStatements).
	counted atomic.Int64
	wake    chan struct{}
	// woken: a LISTEN on a table whose NOTIFY trigger fires, or a file
	// watch, is in place, so another process's commit wakes the relay and
	// the poll is only a safety net.
	woken atomic.Bool
	// quietSeq is the table's quiet sequence (migration 0010) when its
	// NOTIFY trigger fires and the relay may set it, "" or nil otherwise
	// (see quietFlow). Set by the LISTEN's look at the trigger.
	quietSeq atomic.Pointer[string]
	// swept is when Run's loop last finished a sweep, Unix nanoseconds; 0
	// before the first (see LastSweep).
	swept atomic.Int64

	mu        sync.Mutex
	runCalled bool
	routedBy  *relaySubscriber // the subscriber of the router whose plugin runs it (Plugin)
	running   chan struct{}    // closed once Run works
	closing   chan struct{}    // closed by Close
	done      chan struct{}    // closed when Run returns
	closeOnce sync.Once
	closeErr  error

	// lostID is the record at which the connection was lost last, lostN how
	// many times in a row (under sweepMu).
	lostID string
	lostN  int

	// leaseChecked: Lease was compared with PublishTimeout and the pool's
	// busy timeout (see checkLease).
	leaseChecked sync.Once
	// zoneChecked: the session's time zone was compared with the table's
	// TIMESTAMP columns (see checkZone).
	zoneChecked sync.Once
	// charsetOK: the session sends text results as stored (MySQL; see
	// checkCharset).
	charsetOK atomic.Bool

	// afterPublish, when set (tests), runs between the broker's confirms and
	// the marks: the window in which a relay's death duplicates a message.
	// An error fails the marks as the database would.
	afterPublish func(published []string) error
	// backedOff, when set (tests), is told of each backoff Run waits out
	// after a failed sweep, before it waits.
	backedOff func(wait time.Duration)
	// growBytes: see the constant; tests set it lower.
	growBytes int
	// beforeStats, when set (tests), runs before each reading of the
	// metrics' figures (see statsLoop).
	beforeStats func()
	// statsPanic holds a panic of the stats' goroutine (a Logger's), which
	// Run's loop raises on its own goroutine, as it raised it when it read
	// them itself.
	statsPanic atomic.Pointer[any]
}

// metricsUser is a destination that takes the Forwarder's Metrics when it
// has none of its own: AMQPDestination, for its broker nodes.
type metricsUser interface{ useMetrics(*Metrics) }

// loggerUser is a destination that logs with the relay's Logger when given
// none of its own (AMQPDestination).
type loggerUser interface{ useLogger(watermill.LoggerAdapter) }

// NewForwarder returns a relay over db (a *sql.DB or *sqlx.DB) that
// publishes to dest. The Forwarder owns dest from here on: Close closes it
// if it has a Close method.
func NewForwarder(db any, dest Destination, cfg ForwarderConfig) (*Forwarder, error) {
	if dest == nil {
		return nil, &ConfigError{Field: "dest", Reason: "nil destination"}
	}
	cfg.setDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	store, err := NewStore(db, StoreConfig{Dialect: cfg.Dialect, Table: cfg.Table, MaxAttempts: cfg.MaxAttempts})
	if err != nil {
		return nil, err
	}
	cfg.Dialect, cfg.MaxAttempts = store.dialect, store.cfg.MaxAttempts
	if m, ok := dest.(metricsUser); ok && cfg.Metrics != nil {
		m.useMetrics(cfg.Metrics) // the broker's node shows with the relay's figures
	}
	log := cfg.Logger.With(watermill.LogFields{"relay_id": cfg.RelayID})
	store.log = log
	if l, ok := dest.(loggerUser); ok {
		l.useLogger(log)
	}
	return &Forwarder{
		store:   store,
		dest:    dest,
		cfg:     cfg,
		log:     log,
		tracing: newRelayTracing(cfg, dest),
		wake:    make(chan struct{}, 1),
		running: make(chan struct{}),
		closing: make(chan struct{}),
		done:    make(chan struct{}),

		growBytes: growBytes,
	}, nil
}

// Store returns the store of the forwarder's table: pending count, stuck
// rows, retry, purge.
func (f *Forwarder) Store() *Store { return f.store }

// LastSweep is when Run's loop last finished a sweep (published what there
// was, found nothing, or failed and backed off), or the zero time before
// its first. A running relay sweeps at least once per PollInterval, or per
// backoff (RetryMax at most), and a sweep takes PublishTimeout twice at
// most, and its marks: a LastSweep older than that is a relay held by
// something that does not answer (a database behind a partition, whose
// statement in flight waits for the kernel to give the connection up,
// minutes): what a liveness probe asks. outboxctl relay's /healthz does.
func (f *Forwarder) LastSweep() time.Time {
	if n := f.swept.Load(); n != 0 {
		return time.Unix(0, n)
	}
	return time.Time{}
}

// Running is closed once Run is at work. A Run that Close came before
// returns ErrForwarderClosed without closing it: wait for Running and for
// Run's return together, not for Running alone. A Run whose context had
// ended already closes it all the same, and returns nil once stopped, as
// one stopped later does (the router's Subscribe waits for Running).
func (f *Forwarder) Running() chan struct{} { return f.running }

// Notify wakes the relay now rather than at its next poll. Call it after
// committing a transaction that published, in a process that also runs the
// forwarder; it never blocks.
func (f *Forwarder) Notify() {
	select {
	case f.wake <- struct{}{}:
	default:
	}
}

// ErrForwarderClosed is returned by Run after Close, and by Run called
// after a Run returned: a Forwarder runs once. Run called while a Run runs
// returns ErrForwarderInUse.
var ErrForwarderClosed = errors.New("outbox: forwarder is closed")

// Run relays until ctx ends or Close is called, then finishes the batch in
// flight and returns. Failed sweeps are reported through OnError and retried
// with backoff; Run returns nil when stopped.
// A Forwarder whose plugin is on a router runs under it: Run returns
// ErrForwarderInUse, or ErrForwarderClosed once it is closed; once that
// router is closed without having started the relay, Run runs it.
func (f *Forwarder) Run(ctx context.Context) error {
	if f.isClosing() {
		return ErrForwarderClosed
	}
	f.unrouteClosed()
	if err := f.claimRun(nil); err != nil {
		return err
	}
	return f.run(ctx)
}

// claimRun makes the caller the one that runs the forwarder: it runs once,
// and once its plugin is on a router only that router's handler runs it
// (by, its subscriber; nil for Run). A Run let through there would leave
// the router's Subscribe to fail after the plugins, with the other
// handlers started, and its Close to wait CloseTimeout for the relay's.
// The subscriber of a router that let the Forwarder go gets errUnrouted.
func (f *Forwarder) claimRun(by *relaySubscriber) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	switch {
	case by == nil && f.routedBy != nil:
		return fmt.Errorf("%w: its plugin is on a router that has not closed; a Forwarder runs under Run or under its plugin, not both", ErrForwarderInUse)
	case by != nil && f.routedBy != by:
		return errUnrouted
	case f.runCalled:
		select {
		case <-f.done:
			return fmt.Errorf("%w: its Run has returned; a Forwarder runs once, make a new one", ErrForwarderClosed)
		default:
			// Not ErrForwarderClosed: a supervisor that takes that for a
			// clean stop took a second start for one (an API review).
			return fmt.Errorf("%w: Run called while a Run runs", ErrForwarderInUse)
		}
	}
	f.runCalled = true
	return nil
}

// run is Run, once the caller claimed the run.
func (f *Forwarder) run(ctx context.Context) error {
	defer close(f.done)
	// Its gauges go with it: the oldest pending age, taken at the scrape,
	// grew for as long as the process served /metrics after its relay
	// stopped (a review), and the others stayed at their last reading.
	defer f.cfg.Metrics.relayStopped()

	if f.isClosing() {
		return ErrForwarderClosed
	}

	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() {
		select {
		case <-f.closing:
			cancel()
		case <-ctx.Done():
		}
	}()

	// The pool may be capped, and shared with the service: the relay never
	// waits for a connection that only it can free. LISTEN holds one for
	// good, and on PostgreSQL and MySQL every batch in flight holds its
	// claim's until it is marked.
	limit := f.store.maxOpenConns() // 0: no cap
	listen := f.store.listens() && !f.cfg.DisableListen
	if listen && limit == 1 {
		listen = false
		f.log.Info("Outbox forwarder: the pool's one connection is for the claims, so no LISTEN; the relay polls", watermill.LogFields{"poll_interval": f.cfg.PollInterval})
	}

	loop := f.newRelayLoop(limit, listen)
	defer f.store.holding.Store(false) // however Run ends, nothing of it is in flight after
	cut, cutNow := context.WithCancel(context.WithoutCancel(ctx))
	defer cutNow()
	defer context.AfterFunc(ctx, func() { time.AfterFunc(stopGrace, cutNow) })()
	loop.cut = cut

	// On SQLite, the lock that tells other relays this one runs, taken
	// before the first claim (and before the file watch starts: see
	// holdAlive), let go once the last batch is settled (not at ctx's end,
	// when batches may still be in flight), so that no relay takes this
	// one's leases while it has them.
	if f.store.leases() {
		if db, release := f.holdAlive(ctx); release != nil {
			alive, aliveStop := context.WithCancel(context.WithoutCancel(ctx))
			taking := make(chan struct{})
			go func() {
				defer close(taking)
				f.keepTakingBack(alive, db)
			}()
			defer func() {
				aliveStop()
				<-taking
				release()
			}()
		}
	}
	var listener sync.WaitGroup
	if listen {
		listener.Add(1)
		go func() {
			defer listener.Done()
			f.listen(ctx)
		}()
	}
	if f.store.watchesFile() && !f.cfg.DisableListen {
		listener.Add(1)
		go func() {
			defer listener.Done()
			f.watch(ctx)
		}()
	}
	// Cancelled before the wait, whichever way run ends: a panic in the
	// loop (a Destination's, an OnError's, a Logger's) goes on up rather
	// than wait for ever on the listener, whose ctx nothing else ends.
	defer func() {
		cancel()
		listener.Wait()
	}()

	f.log.Info("Outbox forwarder running", watermill.LogFields{"batch_size": f.cfg.BatchSize, "max_batch_size": loop.maxSize, "poll_interval": f.cfg.PollInterval})
	close(f.running)
	defer func() {
		if p := recover(); p != nil {
			// A panic outside a sweep's claims (a Logger's in the stats,
			// an OnError's after the sweep's lock): the batches in flight
			// are ended, so that a recovered panic leaves no transaction
			// open and no row locked.
			loop.abandon(context.Background(), loop.queue)
			loop.q.stop(f)
			panic(p)
		}
	}()

	// After Running: on MySQL the preparation dials the server, which may
	// not answer, and a router's Close waits for its plugin's relay to be
	// running (Watermill holds the router's handlers lock meanwhile) before
	// it can end the relay's ctx: a server that dropped the packets held the
	// whole router's Close for as long as the kernel tries a connection.
	if err := f.store.prepareRelay(ctx, loop.sizes()); err != nil && ctx.Err() == nil {
		f.log.Error("Outbox forwarder could not prepare its statements; it runs them unprepared", err, nil)
	}

	if f.cfg.Metrics != nil {
		listener.Add(1)
		go func() {
			defer listener.Done()
			f.statsLoop(ctx)
		}()
	}

	for {
		if p := f.statsPanic.Load(); p != nil {
			panic(*p)
		}
		s := loop.sweep(ctx)
		f.swept.Store(time.Now().UnixNano())
		f.countStatements()
		if s.stopping {
			loop.q.stop(f)
			// The stats' goroutine ends with ctx: a panic of its last
			// reading comes out of Run too.
			cancel()
			listener.Wait()
			if p := f.statsPanic.Load(); p != nil {
				panic(*p)
			}
			f.log.Info("Outbox forwarder stopped", nil)
			return nil
		}
		loop.quiet(loop.cut, s)
		loop.woke = false
		if wait, ok := loop.pace(s); ok {
			if s.failed && f.backedOff != nil {
				f.backedOff(wait)
			}
			loop.woke = loop.pause(ctx, wait, s.failed)
		}
	}
}

// cutOnClose is ctx, ended stopGrace after Close is called: a Sweep's
// claim that waits on the database (a lock, a pool's last connection) held
// Close, which waits for the Sweep, for as long, and then published. stop
// ends the watch.
func (f *Forwarder) cutOnClose(ctx context.Context) (_ context.Context, stop func()) {
	cut, cancel := context.WithCancelCause(ctx)
	go func() {
		select {
		case <-f.closing:
		case <-cut.Done():
			return
		}
		grace := time.NewTimer(stopGrace)
		defer grace.Stop()
		select {
		case <-grace.C:
			cancel(ErrForwarderClosed)
		case <-cut.Done():
		}
	}()
	return cut, func() { cancel(nil) }
}

// stopGrace is how long a stopping relay lets a probe, a connect or a claim
// it has in flight finish before it cuts it: a database or broker that
// answers takes milliseconds, and one that does not would hold the stop
// for as long as the kernel keeps its connection.
const stopGrace = 250 * time.Millisecond

// statsLoop sets the metrics' gauges every StatsInterval until ctx ends,
// on a goroutine of its own: a reading is a COUNT over the pending index,
// 110–190 ms at 1,000,000 pending rows on PostgreSQL, and on Run's loop it
// held the relay as long at every interval, in the backlog the relay most
// needs to drain. A reading starts no sooner than minStatsGap after the
// last one ended.
func (f *Forwarder) statsLoop(ctx context.Context) {
	defer func() {
		if p := recover(); p != nil {
			f.statsPanic.Store(&p)
			f.Notify() // the loop raises it at its next sweep
		}
	}()
	for ctx.Err() == nil {
		started := time.Now()
		if f.beforeStats != nil {
			f.beforeStats()
		}
		f.refreshStats(ctx)
		wait := max(f.cfg.StatsInterval-time.Since(started), minStatsGap)
		if !sleepCtx(ctx, wait) {
			return
		}
	}
}

// minStatsGap is the least time between two readings of the metrics'
// figures: a StatsInterval of a millisecond (a test's) would otherwise keep
// a connection busy with them.
const minStatsGap = 5 * time.Millisecond

// refreshStats sets the metrics' gauges from one Stats reading.
// With batches in flight, on a capped pool whose connections are taken,
// the figures wait for the next interval (see Store.poolConn).
func (f *Forwarder) refreshStats(ctx context.Context) {
	st, err := f.store.stats(ctx, true)
	if errors.Is(err, errNoConnection) || err != nil && ctx.Err() != nil {
		return // the relay stops: a reading cut short says nothing
	}
	if err != nil {
		f.log.Error("Outbox stats for metrics failed", err, nil)
		return
	}
	f.cfg.Metrics.stats(st, time.Now())
}

// sleepCtx waits d, or less when ctx ends first: then it reports false.
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

// retryDelay is how long a keyed record waits before its retry after its
// attempts-th failure: RetryMin, doubling with each failure up to RetryMax.
func (f *Forwarder) retryDelay(attempts int) time.Duration {
	d := f.cfg.RetryMin
	for i := 1; i < attempts && d < f.cfg.RetryMax; i++ {
		d = doubled(d)
	}
	return min(d, f.cfg.RetryMax)
}

func (f *Forwarder) nextDelay(prev time.Duration) time.Duration {
	if prev == 0 {
		return f.cfg.RetryMin
	}
	return min(doubled(prev), f.cfg.RetryMax)
}

// doubled is 2 × d, or the longest duration where that overflows: a
// RetryMax or PollInterval past half of time.Duration's range doubled a
// wait into a negative one, a backoff or a poll of no wait at all.
func doubled(d time.Duration) time.Duration {
	if d > math.MaxInt64/2 {
		return math.MaxInt64
	}
	return 2 * d
}

// Close stops Run, waits for the batch in flight, and closes the
// destination (a PublisherDestination's Close waits, up to PublishTimeout
// more, for a publish cut off at its timeout). Calling it again does
// nothing and returns the same error.
func (f *Forwarder) Close() error {
	f.closeOnce.Do(func() {
		close(f.closing)
		f.mu.Lock()
		started := f.runCalled
		f.mu.Unlock()
		if started {
			<-f.done
		}
		f.sweepMu.Lock() // a Sweep called directly finishes too
		defer f.sweepMu.Unlock()
		f.store.closePrepared()
		if c, ok := f.dest.(io.Closer); ok {
			f.closeErr = c.Close()
		}
	})
	return f.closeErr
}

// Sweep publishes one batch now and returns how many records went out. It
// returns the errors of the sweep and of every failed record (joined),
// rather than reporting them: for tests, and for a request that wants its
// message on the broker before it answers. Its claim starts at the head of
// the pending index, also while Run's claims start at a floor (see the
// README's Operating it). A claim takes one record of a key (its next, in
// seq order): a request that published k records of one key needs k
// sweeps to see them all out, each one after the last is confirmed.
func (f *Forwarder) Sweep(ctx context.Context) (int, error) {
	if f.isClosing() {
		return 0, ErrForwarderClosed
	}
	return f.sweep(ctx, false)
}

// countStatements reports to Metrics the statements the relay sent since
// the last report, whoever's calls sent them: Run's loop, a Sweep.
func (f *Forwarder) countStatements() {
	for {
		prev, n := f.counted.Load(), f.store.sent.Load()
		if n <= prev {
			return
		}
		if f.counted.CompareAndSwap(prev, n) {
			f.cfg.Metrics.sentStatements(n - prev)
			return
		}
	}
}

func (f *Forwarder) sweep(ctx context.Context, report bool) (int, error) {
	f.sweepMu.Lock()
	defer f.sweepMu.Unlock()
	// Again under the lock: a Sweep that passed Sweep's look before Close
	// took the lock would otherwise claim and publish after Close returned.
	if f.isClosing() {
		return 0, ErrForwarderClosed
	}
	defer f.countStatements()
	claimCtx, claimed := f.cutOnClose(ctx)
	b, _, err := f.claimNext(claimCtx, atHead, f.cfg.BatchSize, nil)
	claimed()
	select {
	case <-f.closing:
		// Close was called during the claim: Close waits for this Sweep,
		// and what it claimed goes out with the next relay, not now.
		if b != nil {
			_ = f.store.abandon(context.WithoutCancel(ctx), b.claim)
		}
		return 0, ErrForwarderClosed
	default:
	}
	if err != nil || b == nil {
		if err != nil && report && !errors.Is(err, errNoConnection) {
			f.reportError(err, ErrorContext{})
		}
		return 0, err
	}
	settled := false
	defer func() {
		if !settled {
			// A panic (a Destination's, an OnError's) between the claim and
			// its end: a recovered one (net/http recovers a handler's) would
			// leave the claim's transaction open, its rows locked for as
			// long as the process lives.
			_ = f.store.abandon(context.WithoutCancel(ctx), b.claim)
			b.endSpans(spanReleased, errAbandoned, true)
		}
	}()
	f.publish(ctx, b)
	n, _, err := f.settle(ctx, b, report)
	settled = true
	return n, err
}

// publish publishes a batch through the destination's Publish, bounded by
// the publish timeout.
func (f *Forwarder) publish(ctx context.Context, b *batch) {
	if out := b.outgoing(); len(out) > 0 {
		// A Sweep's caller may give up on it: its writes go on (see
		// withWriteBound), and it stops waiting for the confirms.
		pubCtx, cancel := context.WithTimeoutCause(withWriteBound(ctx, time.Now().Add(f.cfg.PublishTimeout)), f.cfg.PublishTimeout, errNoConfirmInTime)
		f.tracing.start(b, time.Now())
		b.setResults(f.dest.Publish(pubCtx, out))
		cancel()
	} else {
		b.setResults(nil)
	}
}

// batch is one claim on its way through the relay.
type batch struct {
	claim     *claim
	claimedAt time.Time
	records   []Record  // the decodable rows, in order
	failures  []failure // malformed rows, failed at once
	errs      []error   // their errors, then the publish failures
	// isolated counts the failures that hold nothing back: keyed records'
	// (see keyedFailure), and rows stuck at once (malformed, or refused for
	// good), which no retry will send.
	isolated int
	// parked counts the failures that hold back what is behind them and
	// took their record to MaxAttempts: marked so, each is stuck, and
	// holds nothing back from then on.
	parked   int
	attempts map[string]int // attempts before this batch, by id
	pending  Sent           // sent, confirms not yet collected (pipelined)
	deadline time.Time      // for the confirms of pending
	inFlight time.Duration  // from its Send to its confirms collected
	results  []error        // one per record once known
	// waitsFor are the batches in flight when it was claimed that hold
	// earlier records of its keys (see relayLoop.dependOn): it goes out
	// only once their confirms are in, and without the records whose
	// predecessors failed there (preset).
	waitsFor []*batch
	// preset, when set, holds the results known before sending, one per
	// record: errBehindKey for the records not sent, nil for the rest.
	preset []error
	// answered, when results is nil for a wrong answer, is how many
	// results the destination gave (see setResults).
	answered int
	// spans, with a TracerProvider, are the records' spans, one per record
	// (nil for one without), from the send to settle.
	spans []trace.Span
}

// errHeldBack is the result of a record of a batch held back behind an
// earlier record that failed (batch.holdBack).
var errHeldBack = fmt.Errorf("%w: held back behind an earlier record that failed", ErrNotSent)

// errBehindKey is the result of a keyed record claimed while an earlier
// record of its key was in flight in this relay, which then was not
// published: it is not sent, and holds back nothing but its key.
var errBehindKey = fmt.Errorf("%w: held back behind an earlier record of its key that was not published", ErrNotSent)

// holdBackBehindKeys presets errBehindKey for each keyed record of b that
// has a predecessor (its key's, a smaller seq) in a batch of waitsFor that
// was not published. Those batches' confirms are in (see relayLoop.send).
// A later record of its key in flight (after a Retry or a Republish made
// an earlier one pending again) holds nothing back.
func (b *batch) holdBackBehindKeys() {
	var failed map[string]int64 // by key: the smallest seq not published
	for _, w := range b.waitsFor {
		for i := range w.records {
			r := &w.records[i]
			if r.AggregateID != "" && (len(w.results) != len(w.records) || w.results[i] != nil) {
				if failed == nil {
					failed = make(map[string]int64)
				}
				if s, ok := failed[r.AggregateID]; !ok || r.Seq < s {
					failed[r.AggregateID] = r.Seq
				}
			}
		}
	}
	b.waitsFor = nil // settled ones need not be kept
	if failed == nil {
		return
	}
	for i := range b.records {
		r := &b.records[i]
		if s, ok := failed[r.AggregateID]; ok && r.AggregateID != "" && s < r.Seq {
			if b.preset == nil {
				b.preset = make([]error, len(b.records))
			}
			b.preset[i] = errBehindKey
		}
	}
}

// outgoing is the records to send: all but the preset ones.
func (b *batch) outgoing() []Record {
	if b.preset == nil {
		return b.records
	}
	out := make([]Record, 0, len(b.records))
	for i, err := range b.preset {
		if err == nil {
			out = append(out, b.records[i])
		}
	}
	return out
}

// setResults sets the results of the batch from those of outgoing's
// records. An answer of another length leaves no results, which settle
// refuses (answered says how many came): placed around the preset ones, it
// could have lined up with the batch's records and marked one never sent.
func (b *batch) setResults(res []error) {
	if b.preset == nil {
		b.results = res
		return
	}
	full := slices.Clone(b.preset)
	j := 0
	for i := range full {
		if full[i] == nil {
			if j == len(res) {
				break
			}
			full[i] = res[j]
			j++
		}
	}
	if n := len(b.records) - countNonNil(b.preset); j != n || len(res) != n {
		b.results, b.answered = nil, len(res)
		return
	}
	b.results = full
}

func countNonNil(errs []error) int {
	n := 0
	for _, err := range errs {
		if err != nil {
			n++
		}
	}
	return n
}

// holdBack makes every record of the batch not sent (whether it went out or
// not): it is behind a record that failed, and nothing behind a failure is
// published before it.
func (b *batch) holdBack() {
	if b.results == nil { // never sent
		b.results = make([]error, len(b.records))
	}
	for i := range b.results {
		b.results[i] = errHeldBack
	}
}

// clean reports whether nothing in the batch holds back what comes after
// it: every record went out, or failed as a keyed record (not for a lost
// connection), which holds back only its own key (see keyedFailure), or
// was refused for good, which no retry will send. A record released unsent
// holds back what comes after it: it is claimed again, and nothing claimed
// after it may overtake it. Malformed rows, never sent, hold nothing back.
func (b *batch) clean() bool {
	if len(b.results) != len(b.records) {
		return false
	}
	for i, err := range b.results {
		if err != nil && !keyedFailure(b.records[i], err) && !isRefusedForGood(err) && !errors.Is(err, errBehindKey) {
			return false
		}
	}
	return true
}

// released reports whether the settled batch released records it did not
// send: they are pending again, before the cursor of the drain. Records
// held back behind their key (errBehindKey) do not count: nothing else
// waits for them, and their key's next claim follows its failed record's
// retry (see behindNextOfKeys).
func (b *batch) released() bool {
	if b == nil || len(b.results) != len(b.records) {
		return false
	}
	for _, err := range b.results {
		if errors.Is(err, ErrNotSent) && !errors.Is(err, errBehindKey) {
			return true
		}
	}
	return false
}

// isRefusedForGood reports whether err is a permanent failure of the record
// itself, not a lost connection: it is stuck at once, and holds nobody back.
func isRefusedForGood(err error) bool {
	return IsPermanent(err) && !errors.Is(err, ErrNotSent) && !errors.Is(err, ErrConnectionLost)
}

// keyedFailure reports whether err is a failure of keyed record rec that
// holds back only the later records of its key. Those cannot be in this
// batch (a claim takes one record of a key), nor sent in any other: a batch
// claimed while rec was in flight goes out once rec's confirm is in, and
// without its key's records if rec failed (holdBackBehindKeys), so nothing
// else waits for it. A lost connection is the broker's failure, not the
// record's, and holds everything back as it does for unkeyed records.
func keyedFailure(rec Record, err error) bool {
	return rec.AggregateID != "" && err != nil && !errors.Is(err, ErrNotSent) && !errors.Is(err, ErrConnectionLost)
}

// fail records rec's failure, with the attempts it will have.
func (b *batch) fail(rec Record, attempts int, err error) {
	b.failures = append(b.failures, failure{id: rec.ID, exchange: rec.Exchange, attempts: attempts, reason: err.Error()})
	b.errs = append(b.errs, &PublishError{Dest: ErrorContext{Exchange: rec.Exchange, RoutingKey: rec.RoutingKey, MessageID: rec.ID}, Err: err})
}

// failHolding fails rec, which holds back what is behind it, at attempts,
// and counts it parked when that makes it stuck (at maxAttempts).
func (b *batch) failHolding(rec Record, attempts int, err error, maxAttempts int) {
	b.fail(rec, attempts, err)
	if attempts >= maxAttempts {
		b.parked++
	}
}

// onlyParked reports whether b has failures that hold back what is behind
// them, and each of them made its record stuck (see parked).
func (b *batch) onlyParked() bool {
	holding := len(b.failures) - b.isolated
	return holding > 0 && b.parked == holding
}

// full reports whether the claim took as many rows as it asked for: more
// are probably waiting.
func (b *batch) full(size int) bool { return b != nil && len(b.claim.rows) == size }

// bodyBytes is the size of the batch's bodies, what a claim's memory grows
// with.
func (b *batch) bodyBytes() int {
	n := 0
	for i := range b.records {
		n += len(b.records[i].Body)
	}
	return n
}

// keyed reports whether the batch holds a keyed record.
func (b *batch) keyed() bool {
	return slices.ContainsFunc(b.records, func(r Record) bool { return r.AggregateID != "" })
}

// last is the cursor after the batch's last row, or nil (the next claim
// starts at the head) when that row's created_at could not be read: the
// zero time is no place in the order to resume from.
//
// A batch of points alone (see headFloor.points) resumes at the floor it
// was claimed from: after the last point, the drain would walk all that
// lies between it and the floor.
func (b *batch) last() *sqldialect.Cursor {
	if b.claim.points == len(b.claim.rows) && b.claim.from != nil {
		return b.claim.from
	}
	r := b.claim.rows[len(b.claim.rows)-1]
	if r.CreatedAt.IsZero() {
		return nil
	}
	return &sqldialect.Cursor{CreatedAt: r.CreatedAt, ID: r.ID, IDArg: r.RawID}
}

// claimNext claims the next batch, of n rows at most, and decodes it. It
// returns nil when there is nothing to claim, and claims nothing while the
// broker is down: an outage must not count attempts against records, nor
// hold their locks.
func (f *Forwarder) claimNext(ctx context.Context, after *sqldialect.Cursor, n int, inFlight []string) (_ *batch, back bool, err error) {
	if c, ok := f.dest.(Connector); ok {
		// Bounded like a batch: a broker that answers nothing must not
		// hold the relay.
		connectCtx, cancel := context.WithTimeout(ctx, f.cfg.PublishTimeout)
		err := c.Connect(connectCtx)
		cancel()
		if err != nil {
			return nil, false, err
		}
	}
	started := time.Now()
	cl, err := f.store.claimBatch(ctx, n, f.cfg.RelayID, f.cfg.Lease, after, inFlight)
	if err != nil {
		return nil, false, databaseFailed{err}
	}
	back = cl.lookedBack
	if f.store.leases() {
		f.leaseChecked.Do(f.checkLease)
	}
	f.zoneChecked.Do(func() { f.checkZone(ctx, cl.tx) })
	if err := f.checkCharset(ctx, cl.tx); err != nil {
		_ = f.store.abandon(ctx, cl)
		return nil, false, err
	}
	if len(cl.rows) == 0 {
		if err := f.store.abandon(ctx, cl); err != nil {
			return nil, back, databaseFailed{err}
		}
		return nil, back, nil
	}
	defer func() {
		if p := recover(); p != nil {
			_ = f.store.abandon(context.WithoutCancel(ctx), cl) // a row whose reading panics
			panic(p)
		}
	}()
	b := &batch{claim: cl, claimedAt: started, records: make([]Record, 0, len(cl.rows)), attempts: make(map[string]int, len(cl.rows))}
	for _, row := range cl.rows {
		b.attempts[row.ID] = row.Attempts
		rec, err := readRecord(row)
		if err != nil {
			// A malformed row fails alone and at once: no retry mends it,
			// and it stands in nobody's way.
			perr := &PublishError{Dest: ErrorContext{Exchange: row.Exchange, RoutingKey: row.RoutingKey, MessageID: row.ID}, Err: Permanent(fmt.Errorf("malformed row: %w", err))}
			b.failures = append(b.failures, failure{id: row.ID, exchange: row.Exchange, attempts: max(row.Attempts+1, f.cfg.MaxAttempts), reason: perr.Err.Error()})
			b.errs = append(b.errs, perr)
			b.isolated++
			continue
		}
		b.records = append(b.records, rec)
	}
	return b, back, nil
}

// checkLease reports, once, a Lease a batch can outlive on SQLite: its
// publish takes up to PublishTimeout, and its mark then waits up to the
// pool's busy timeout for the write lock. A lease that ran out meanwhile
// lets a second relay, waiting for the same lock, claim the batch's rows
// and publish them again while the first still has them to mark. validate
// cannot count the busy timeout: it is the pool's, read at the first
// claim (busyBound). Logged rather than refused: such a relay publishes
// twice only while a lock is held that long, and a refusal at run time
// would stop relays that run today (2 × PublishTimeout is what validate
// has always let through). Not through
// OnError, which is for failed records and sweeps, and whose handlers
// branch on those.
func (f *Forwarder) checkLease() {
	// PublishTimeout is at most Lease / 2 (validate), and the busy timeout
	// SQLite's 32-bit milliseconds: the sum does not overflow.
	busy, known := f.store.busyRead()
	if known && busy == 0 {
		// A user review opened the file with _busy_timeout=0: the relay's
		// claims and marks failed with "database is locked" beside every
		// writer, without a word of why.
		f.log.Error("Outbox forwarder: the SQLite pool does not wait for a lock", errors.New(`busy_timeout is 0: the relay's claims and marks fail with "database is locked" whenever another connection writes; open the database with _busy_timeout=5000 (and _txlock=immediate)`), nil)
		return
	}
	if f.cfg.Lease > f.cfg.PublishTimeout+busy {
		return
	}
	f.log.Error("Outbox forwarder: Lease is too short for SQLite's busy timeout; two relays may publish the same batch", &ConfigError{Field: "Lease", Reason: fmt.Sprintf(
		"%s is not longer than a batch can stay unmarked: PublishTimeout %s for its publish and the pool's busy timeout %s for its mark's wait for the write lock; a lock held past the lease's end lets a second relay publish the batch again. Raise Lease past %s, or lower the busy timeout",
		f.cfg.Lease, f.cfg.PublishTimeout, busy, f.cfg.PublishTimeout+busy)},
		watermill.LogFields{"lease": f.cfg.Lease, "publish_timeout": f.cfg.PublishTimeout, "busy_timeout": busy})
}

// checkZone reports, once, a MySQL table whose time columns are TIMESTAMP
// (another library's: Laravel's $table->timestamp()) read through a session
// whose time_zone is not UTC. MySQL converts a TIMESTAMP from and to the
// session's zone, so every time the relay writes and compares is that far
// off for relays of other services connected at UTC: a live lease of
// theirs reads expired (the row is published twice) or an expired one
// alive for hours. Logged rather than refused, as checkLease: an estate
// whose every service connects in that one zone agrees with itself.
//
// It asks on tx, the claim's (MySQL's claims are locking): on the pool it
// would wait for a connection the claim holds, for ever with a pool of one.
func (f *Forwarder) checkZone(ctx context.Context, tx claimTx) {
	if tx == nil {
		return
	}
	list, offset, ok := f.store.zonedTimes(ctx, tx)
	if !ok || len(list) == 0 || offset == 0 {
		return // nothing to report, or nothing known: the relay goes on as before
	}
	cols := strings.Join(list, ",")
	f.log.Error("Outbox forwarder: TIMESTAMP columns read in a session that is not at UTC; relays of other services read its times hours off",
		fmt.Errorf("%s of %s are TIMESTAMP, which MySQL converts to and from the session's time_zone, %+d s from UTC here: connect at UTC (DSN time_zone=%%27%%2B00%%3A00%%27, or the server's time_zone '+00:00')",
			cols, f.store.q.Table(), offset), watermill.LogFields{"columns": cols, "offset_seconds": offset})
}

// checkCharset refuses to relay, until it is mended, through a MySQL
// session that sends text results in a character set other than utf8mb4
// (a DSN's charset=utf8, 3-byte, or latin1): the claim's bodies, headers,
// keys and ids came back with what the set lacks replaced by '?', and went
// out so, acknowledged, without an error (a review); an id so read would
// not find its row to mark. The rows stay pending. Asked on tx, the
// claim's, as checkZone asks; once it passes, not again. A look that
// fails says nothing, and is asked again at the next claim.
func (f *Forwarder) checkCharset(ctx context.Context, tx claimTx) error {
	if f.store.dialect != MySQL || tx == nil || f.charsetOK.Load() {
		return nil
	}
	var client, results string
	if err := tx.QueryRowContext(ctx, sqldialect.MySQLSessionCharsets).Scan(&client, &results); err != nil {
		return nil
	}
	if !sqldialect.FullCharset(results) {
		return &ConfigError{Field: "db", Reason: fmt.Sprintf("the connection's character_set_results is %s: bodies, headers and ids would go out with what it lacks replaced by '?'; "+
			"open the pool with charset=utf8mb4 (go-sql-driver's default); the relay claims nothing until then", results)}
	}
	f.charsetOK.Store(true)
	return nil
}

// readRecord decodes a claimed row, or says why it cannot be read at all:
// a column the claim could not read (a NULL, a created_at that is no time)
// makes the row as malformed as a body or headers that do not decode.
func readRecord(row sqldialect.ClaimedRow) (Record, error) {
	if row.Unreadable != nil {
		return Record{}, row.Unreadable
	}
	return decodeRecord(row)
}

// markError is settle's error when a batch's marks failed and none of its
// records failed in a way that holds back what is behind it: its records
// reached the broker as their results say.
type markError struct{ error }

func (e *markError) Unwrap() error { return e.error }

// settle marks what the broker confirmed, records the first failure, frees
// the rest, and ends the claim. It returns how many went out, whether
// something failed that holds the relay back (anything but the failures of
// keyed records: see keyedFailure), and the errors of the sweep and of
// every failed record (a *markError when the marks failed).
func (f *Forwarder) settle(ctx context.Context, b *batch, report bool) (int, bool, error) {
	if len(b.results) != len(b.records) {
		_ = f.store.abandon(context.WithoutCancel(ctx), b.claim)
		got := len(b.results)
		if b.results == nil {
			got = b.answered
		}
		err := fmt.Errorf("outbox: destination returned %d results for %d records", got, len(b.records)-countNonNil(b.preset))
		b.endSpans(spanReleased, err, true)
		if report {
			f.reportError(err, ErrorContext{})
		}
		return 0, true, err
	}
	var (
		published    []string
		publishedRec []Record
	)
	// failedOne: a record failed, and what is behind it is not published
	// before it. releasedOne: a record was released unsent, and what the
	// broker confirmed behind it waits for it too (no backoff: nothing
	// failed; the batches in flight behind it are held back by
	// relayLoop.settle, as released).
	failedOne, releasedOne := false, false
	// failedSpans are the records that failed, whose spans end once the
	// mark says whether their failures were recorded (stuck or not).
	var failedSpans []failedSpan
	for i, err := range b.results {
		rec := b.records[i]
		failures := len(b.failures)
		switch {
		case failedOne:
			// Behind a failure: not published before it, even if it was
			// in flight and confirmed. It is sent again after the failed
			// record (the consumers' inbox absorbs the copy), and no attempt
			// is counted against it.
		case err == nil && releasedOne:
			// Confirmed behind a record sent and not confirmed (the broker
			// closed the channel over another message, having confirmed
			// this one, to another queue, first): not published before
			// it. It is sent again after it, as behind a failure.
		case err == nil:
			published = append(published, rec.ID)
			if f.cfg.Metrics != nil {
				publishedRec = append(publishedRec, rec)
			}
			continue // its span ends with the mark
		case errors.Is(err, errBehindKey):
			// Held back behind its key's record: it holds back nobody.
		case errors.Is(err, ErrNotSent):
			// Not sent (behind a record the send stopped at), or sent and
			// not confirmed: the claim's end frees it, it counts no
			// attempt, and it is claimed again.
			releasedOne = true
			if errors.Is(err, errHeldBack) {
				b.endSpan(i, spanHeldBack, nil, false)
			} else {
				b.endSpan(i, spanReleased, err, false)
			}
		case errors.Is(err, ErrConnectionLost):
			// The broker went, not the record: it is held up like a
			// failure, keeps its last_error, and counts no attempt, unless
			// the connection is lost at the same record time after time:
			// then the record is what breaks it. Not while the broker
			// blocks the connection (an alarm), nor through a destination
			// that cannot tell an outage from the record (unprobedLost):
			// then no record is. Nor when the caller's context ended
			// before the confirm (a Sweep bounded by its caller, Run
			// stopping): that says nothing of the record, and a caller
			// that bounds every sweep would otherwise make it stuck.
			failedOne = true
			n := b.attempts[rec.ID]
			var unprobed unprobedLost
			if !errors.Is(err, ErrBrokerBlocked) && !errors.As(err, &unprobed) && ctx.Err() == nil && f.lostAgain(rec.ID) {
				n++
			}
			b.failHolding(rec, n, err, f.cfg.MaxAttempts)
		case keyedFailure(rec, err):
			// A keyed record holds back only its own key, whose later
			// records no other relay can claim while it is unpublished,
			// and this one sends only once it is published (see
			// holdBackBehindKeys): the records after it here are other
			// keys', and go on, as does
			// the relay, at full speed. Its retry waits out a backoff of
			// its own, a lease on the row that every relay respects, so
			// that a record the broker keeps refusing is not hammered.
			n := f.charge(b.attempts[rec.ID], err)
			if IsPermanent(err) {
				n = max(n, f.cfg.MaxAttempts) // stuck at once; it holds its key, visibly
			}
			b.fail(rec, n, err)
			last := &b.failures[len(b.failures)-1]
			last.holdBy, last.holdUntil = sqldialect.RetryHold, time.Now().Add(f.retryDelay(n))
			if n < f.cfg.MaxAttempts {
				f.store.retryAt(last.holdUntil) // the drain comes back for it
			}
			b.isolated++
		case IsPermanent(err):
			// No retry mends it: it is stuck at once, and holds nobody
			// back, as a malformed row does not: the relay neither backs
			// off nor holds the batches in flight behind it.
			b.fail(rec, max(b.attempts[rec.ID]+1, f.cfg.MaxAttempts), err)
			b.isolated++
		default:
			failedOne = true
			b.failHolding(rec, f.charge(b.attempts[rec.ID], err), err, f.cfg.MaxAttempts)
		}
		switch {
		case b.spans == nil:
		case len(b.failures) > failures:
			failedSpans = append(failedSpans, failedSpan{i, err, b.failures[failures].attempts >= f.cfg.MaxAttempts})
		default:
			b.endSpan(i, spanHeldBack, nil, false) // not ended above: behind a record not published
		}
	}
	// The marks are not cut short: the broker has the messages.
	if err := f.mark(ctx, b, published); err != nil {
		// Nothing recorded: the failed records are not stuck, and the
		// published ones go out again.
		for _, fs := range failedSpans {
			b.endSpan(fs.i, spanFailed, fs.err, true)
		}
		b.endSpans(spanNotMarked, err, true)
		f.cfg.Metrics.unmarkedBatch(publishedRec)
		b.parked = 0 // nothing is stuck: the attempts were not recorded
		// Published but not marked: sent again later, and deduped by the
		// consumers. Nothing is lost.
		if report {
			f.reportError(err, ErrorContext{})
		}
		if len(b.failures) > b.isolated {
			return 0, true, err // a record failed too, and holds back what is behind it
		}
		return 0, true, &markError{err}
	}
	for _, fs := range failedSpans {
		outcome := spanFailed
		if fs.stuck {
			outcome = spanStuck
		}
		b.endSpan(fs.i, outcome, fs.err, true)
	}
	b.endSpans(spanPublished, nil, false)
	f.cfg.Metrics.batch(b.claimedAt, publishedRec, b.failures)
	if report {
		failed := make(map[string]failure, len(b.failures))
		for _, fl := range b.failures {
			failed[fl.id] = fl
		}
		for _, err := range b.errs {
			var perr *PublishError
			errors.As(err, &perr)
			f.reportRecordError(err, perr.Dest, failed[perr.Dest.MessageID])
		}
	}
	if len(published) > 0 {
		f.log.Trace("Outbox batch published", watermill.LogFields{"published": len(published), "failed": len(b.failures)})
	}
	return len(published), len(b.failures) > b.isolated, errors.Join(b.errs...)
}

// charge is the attempts a record that had attempts has after it failed
// with err: one more, except that a broker's nack (errNacked: a queue's
// state, never the record's content) does not take it to MaxAttempts. A
// quorum queue without its majority nacks every publish on every
// connection for as long as it lasts: counted in full, its records were
// stuck within a minute of the outage, and stayed so after it.
func (f *Forwarder) charge(attempts int, err error) int {
	n := attempts + 1
	if errors.Is(err, errNacked) {
		n = min(n, max(attempts, f.cfg.MaxAttempts-1))
	}
	return n
}

// mark marks the batch's published rows and failures, and ends its claim.
func (f *Forwarder) mark(runCtx context.Context, b *batch, published []string) error {
	ctx := context.WithoutCancel(runCtx) // the broker has the messages
	stop := stopOf(runCtx)
	if f.afterPublish != nil {
		if err := f.afterPublish(published); err != nil {
			_ = f.store.abandon(ctx, b.claim)
			return err
		}
	}
	err := f.store.finish(ctx, b.claim, published, b.failures)
	// A leased batch (SQLite) whose mark found the write lock held past
	// the busy timeout by another connection (another process's long
	// transaction, a VACUUM): no other relay takes its rows while the lease
	// lasts, so the mark is tried again, until a quarter of the lease is
	// left or the relay stops, rather than leave rows the broker confirmed
	// pending under the relay's own lease, to be sent again when it ends (a
	// review: a 12 s lock kept two confirmed rows "pending" 60 s, then sent
	// them again).
	for try := 0; err != nil && b.claim.tx == nil && sqldialect.Busy(err); try++ {
		left := f.cfg.Lease - time.Since(b.claimedAt)
		if left < f.cfg.Lease/4 || stop.Err() != nil || f.isClosing() {
			break
		}
		if try == 0 {
			f.log.Info("Outbox relay: the database is locked by another connection past its busy timeout; "+
				"the batch the broker confirmed is marked once it is free", watermill.LogFields{"records": len(published), "lease_left": left.Round(time.Second).String()})
		}
		if !sleepCtx(stop, markBusyPause) {
			break
		}
		err = f.store.finish(ctx, b.claim, published, b.failures)
	}
	if err != nil {
		return databaseFailed{err}
	}
	return nil
}

// stopKey is the context value withStop keeps: the context whose end
// stops the relay, under one that does not end with it.
type stopKey struct{}

// withStop is ctx not cut short (a stopping relay finishes what it
// claimed), which still tells, through stopOf, when ctx ends: a mark tried
// again for a lock held elsewhere stops then (a code review: it went on
// past the stop's bound, as the pipeline's sweep had dropped ctx's end).
func withStop(ctx context.Context) context.Context {
	return context.WithValue(context.WithoutCancel(ctx), stopKey{}, ctx)
}

// stopOf is the context whose end stops the relay: the one withStop kept
// in ctx, or ctx itself.
func stopOf(ctx context.Context) context.Context {
	if stop, ok := ctx.Value(stopKey{}).(context.Context); ok {
		return stop
	}
	return ctx
}

// isClosing reports whether Close was called.
func (f *Forwarder) isClosing() bool {
	select {
	case <-f.closing:
		return true
	default:
		return false
	}
}

// markBusyPause is the pause between two tries of a leased batch's mark
// that found SQLite's write lock busy; each try waits the busy timeout.
const markBusyPause = 100 * time.Millisecond

// lostRepeats is how many times in a row the connection may be lost at the
// same record before the record is counted an attempt for it: an outage
// moves on (nothing is claimed while the broker is unreachable), a record
// that makes the broker or the client close the connection does not.
const lostRepeats = 3

// lostAgain notes a lost connection at record id, and reports whether it
// was lost there more than lostRepeats times in a row.
func (f *Forwarder) lostAgain(id string) bool {
	if id != f.lostID {
		f.lostID, f.lostN = id, 0
	}
	f.lostN++
	return f.lostN > lostRepeats
}

// databaseFailed is an error of a statement of the relay's on its
// database (a claim, a mark), which reportError says is the database's:
// "not for a record of its own" left the operator to read the cause out of
// the driver's text (an SRE review). OnError gets the error inside.
type databaseFailed struct{ err error }

func (e databaseFailed) Error() string { return e.err.Error() }
func (e databaseFailed) Unwrap() error { return e.err }

// reportError reports a failure of the relay's that is no record's (a
// claim's or a mark's statement, the destination as a whole): to OnError
// with an empty ErrorContext, or logged without a record's fields, which
// read as a record of the id "" (a user review).
func (f *Forwarder) reportError(err error, dest ErrorContext) {
	db, isDB := err.(databaseFailed)
	if isDB {
		err = db.err
	}
	if f.cfg.OnError != nil {
		f.cfg.OnError(err, dest)
		return
	}
	if errors.Is(err, ErrBrokerUnreachable) {
		f.log.Error("Outbox relay cannot reach the broker; it claims nothing until a node answers, and tries again", err, nil)
		return
	}
	if cf := (connectFailed{}); errors.As(err, &cf) && cf.refused {
		f.log.Error("Outbox relay: the broker refused its connection (credentials, a vhost, permissions); it claims nothing, and tries again", err, nil)
		return
	}
	if isDB {
		f.log.Error("Outbox relay: a statement on its database failed; it claims again once the database answers, and a batch published but not marked goes out again (the inbox dedupes it)", err,
			watermill.LogFields{"table": f.store.cfg.Table, "dialect": f.store.dialect.Name()})
		return
	}
	if dest.MessageID == "" {
		f.log.Error("Outbox relay failed, not for a record of its own; it tries again, and a batch published but not marked goes out again (the inbox dedupes it)", err, nil)
		return
	}
	f.log.Error("Outbox relay failed", err, watermill.LogFields{
		"exchange": dest.Exchange, "routing_key": dest.RoutingKey, "message_id": idText(dest.MessageID),
	})
}

// reportRecordError reports the failure of the record dest names, fl as
// the batch marks it: logged with its attempts out of MaxAttempts, what it
// holds back, and, once it is stuck, how to send it again (the log said
// the same line at every attempt, and never that the record gave up).
func (f *Forwarder) reportRecordError(err error, dest ErrorContext, fl failure) {
	if fl.id != "" {
		dest.Attempts, dest.MaxAttempts, dest.Stuck = fl.attempts, f.cfg.MaxAttempts, fl.attempts >= f.cfg.MaxAttempts
	}
	if f.cfg.OnError != nil || fl.id == "" {
		f.reportError(err, dest)
		return
	}
	fields := watermill.LogFields{
		"exchange": dest.Exchange, "routing_key": dest.RoutingKey, "message_id": idText(dest.MessageID),
		"attempts": fl.attempts, "max_attempts": f.cfg.MaxAttempts,
	}
	switch {
	case fl.attempts >= f.cfg.MaxAttempts:
		f.log.Error("Outbox record stuck: the relay leaves it alone from now on (a keyed one holds its key's later records); outboxctl show ID says why, outboxctl retry ID sends it again", err, fields)
	case fl.holdBy != "":
		f.log.Error("Outbox relay failed to publish a keyed record; its key's later records wait for it, other keys go on", err, fields)
	default:
		f.log.Error("Outbox relay failed to publish a record; it tries again, and the records behind it wait for it", err, fields)
	}
}
