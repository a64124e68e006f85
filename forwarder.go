package outbox

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"strconv"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
)

// ForwarderConfig configures a Forwarder. The zero value of every field but
// Dialect (needed unless the handle is a *sqlx.DB) is a working default.
type ForwarderConfig struct {
	Dialect Dialect
	// Table is the outbox table. Default acemq_outbox.
	Table string

	// BatchSize is how many rows one sweep claims. Default 100, at most 1000.
	// On two cores, 100 drains a backlog at ~0.9 of the broker's raw rate
	// with the broker on a core of its own, ~0.8 with the database and the
	// broker sharing both (outbox-bench -scenario relay -batch N, see the
	// README). Larger batches gain a little there, at the cost of memory
	// per claim and of more rows sent again behind a failed one.
	BatchSize int
	// MaxAttempts: see StoreConfig. Default 10.
	MaxAttempts int
	// PollInterval is how long the relay waits for new rows when nothing
	// woke it. Default 1 s. On PostgreSQL LISTEN/NOTIFY wakes it at commit,
	// and Notify wakes it from the same process, so the poll only bounds
	// the latency of what those miss.
	PollInterval time.Duration
	// PublishTimeout bounds the wait for the broker's confirms of one batch.
	// Past it the unconfirmed records are held up as behind a failure (but
	// count no attempt: see ErrConnectionLost), and the connection is
	// dropped and opened again. Default 15 s.
	PublishTimeout time.Duration
	// Lease is how long a claim holds rows on SQLite, where a claim is a
	// lease rather than a row lock: a relay killed mid-batch leaves its rows
	// for this long. It must outlast a sweep (twice PublishTimeout).
	// Default 60 s.
	Lease time.Duration
	// RetryMin and RetryMax bound the backoff after a failed sweep (the
	// broker or the database unreachable, or a record refused): the delay
	// doubles from RetryMin up to RetryMax and resets after a good sweep.
	// Defaults 100 ms and 10 s.
	RetryMin, RetryMax time.Duration
	// DisableListen turns LISTEN/NOTIFY off on PostgreSQL.
	DisableListen bool
	// RelayID names this relay in locked_by. Default host-pid-random.
	RelayID string

	// OnError is called for every failed record, with where it was going,
	// and for every failed sweep (with an empty MessageID). By default the
	// error is logged.
	OnError func(err error, dest ErrorContext)
	Logger  watermill.LoggerAdapter

	// Metrics, if set, counts what the relay publishes and fails, times its
	// batches, and sets the pending, oldest-pending and stuck gauges every
	// StatsInterval (default 15 s; each reading is one COUNT over the
	// pending index).
	Metrics       *Metrics
	StatsInterval time.Duration
}

// pipelineDepth is how many batches Run keeps in flight beyond the one it
// is sending: enough that the broker always has a batch to work on while
// the relay marks one and claims the next. Each holds a claim (a
// connection and its row locks on PostgreSQL) until it is settled, and one
// more is held while the next is claimed; Run keeps fewer in flight when
// the pool is capped too low for them.
const pipelineDepth = 2

// maxBatchSize bounds BatchSize: a claim's IN lists and the confirms in
// flight stay of a size every database and the broker take in their stride.
const maxBatchSize = 1000

func (c *ForwarderConfig) setDefaults() {
	if c.BatchSize == 0 {
		c.BatchSize = 100
	}
	if c.PollInterval == 0 {
		c.PollInterval = time.Second
	}
	if c.PublishTimeout == 0 {
		c.PublishTimeout = 15 * time.Second
	}
	if c.Lease == 0 {
		c.Lease = 60 * time.Second
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
}

func (c ForwarderConfig) validate() error {
	switch {
	case c.BatchSize < 1 || c.BatchSize > maxBatchSize:
		return &ConfigError{Field: "BatchSize", Reason: fmt.Sprintf("%d; want 1 to %d", c.BatchSize, maxBatchSize)}
	case c.PollInterval < 0:
		return &ConfigError{Field: "PollInterval", Reason: "negative"}
	case c.PublishTimeout < 0:
		return &ConfigError{Field: "PublishTimeout", Reason: "negative"}
	case c.Lease < 2*c.PublishTimeout:
		return &ConfigError{Field: "Lease", Reason: fmt.Sprintf("%s is shorter than a sweep can take (2 × PublishTimeout = %s): a second relay would publish rows still in flight", c.Lease, 2*c.PublishTimeout)}
	case c.RetryMin <= 0 || c.RetryMax < c.RetryMin:
		return &ConfigError{Field: "RetryMin", Reason: fmt.Sprintf("want 0 < RetryMin (%s) <= RetryMax (%s)", c.RetryMin, c.RetryMax)}
	case len(c.RelayID) > 64:
		return &ConfigError{Field: "RelayID", Reason: "longer than the 64 characters locked_by holds"}
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
type Forwarder struct {
	store *Store
	dest  Destination
	cfg   ForwarderConfig
	log   watermill.LoggerAdapter

	sweepMu sync.Mutex // one batch at a time
	wake    chan struct{}

	mu        sync.Mutex
	runCalled bool
	running   chan struct{} // closed once Run works
	closing   chan struct{} // closed by Close
	done      chan struct{} // closed when Run returns
	closeOnce sync.Once
	closeErr  error

	// lostID is the record at which the connection was lost last, lostN how
	// many times in a row (under sweepMu).
	lostID string
	lostN  int

	// afterPublish, when set (tests), runs between the broker's confirms and
	// the marks: the window in which a relay's death duplicates a message.
	// An error fails the marks as the database would.
	afterPublish func(published []string) error
}

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
	return &Forwarder{
		store:   store,
		dest:    dest,
		cfg:     cfg,
		log:     cfg.Logger.With(watermill.LogFields{"relay_id": cfg.RelayID}),
		wake:    make(chan struct{}, 1),
		running: make(chan struct{}),
		closing: make(chan struct{}),
		done:    make(chan struct{}),
	}, nil
}

// Store returns the store of the forwarder's table: pending count, stuck
// rows, retry, purge.
func (f *Forwarder) Store() *Store { return f.store }

// Running is closed once Run is at work.
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

// ErrForwarderClosed is returned by Run after Close, and by Run called twice.
var ErrForwarderClosed = errors.New("outbox: forwarder is closed")

// Run relays until ctx ends or Close is called, then finishes the batch in
// flight and returns. Failed sweeps are reported through OnError and retried
// with backoff; Run returns nil when stopped.
func (f *Forwarder) Run(ctx context.Context) error {
	f.mu.Lock()
	if f.runCalled {
		f.mu.Unlock()
		return fmt.Errorf("%w: Run called twice", ErrForwarderClosed)
	}
	f.runCalled = true
	f.mu.Unlock()
	defer close(f.done)

	select {
	case <-f.closing:
		return ErrForwarderClosed
	default:
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
	depth := pipelineDepth
	if limit > 0 && !f.store.leases() {
		free := limit
		if listen {
			free--
		}
		depth = min(depth, free-2) // the batches in flight and the one being claimed
	}

	if err := f.store.prepareRelay(ctx, f.cfg.BatchSize); err != nil {
		f.log.Error("Outbox forwarder could not prepare its statements; it runs them unprepared", err, nil)
	}

	var listener sync.WaitGroup
	if listen {
		listener.Add(1)
		go func() {
			defer listener.Done()
			f.listen(ctx)
		}()
	}
	defer listener.Wait()

	f.log.Info("Outbox forwarder running", watermill.LogFields{"batch_size": f.cfg.BatchSize, "poll_interval": f.cfg.PollInterval})
	close(f.running)

	pipe := pipelineOf(f.dest)
	if pipe != nil {
		// No more in flight than the pipeline takes: depth+1 batches.
		depth = min(depth, pipe.Capacity()/f.cfg.BatchSize-1)
	}
	if depth < 0 {
		pipe = nil
	}
	var (
		delay     time.Duration
		queue     []*batch // sent, their confirms not yet collected, oldest first
		after     *cursor  // where the next claim of a drain starts
		lastStats time.Time
	)
	for {
		if f.cfg.Metrics != nil && ctx.Err() == nil && time.Since(lastStats) >= f.cfg.StatsInterval {
			f.refreshStats(ctx)
			lastStats = time.Now()
		}
		// The batches are not cut short by ctx or Close: a stopping relay
		// finishes what it claimed, bounded by the publish timeout.
		work := context.WithoutCancel(ctx)
		stopping := ctx.Err() != nil

		f.sweepMu.Lock()
		var claimed *batch
		failed := false
		if !stopping {
			var err error
			if claimed, err = f.claimNext(work, after); err != nil {
				f.reportError(err, ErrorContext{})
				failed = true
			}
		}
		next := claimed   // claimed and not sent yet
		var done []*batch // to settle now, oldest first
		held := false     // the oldest batch failed: nothing more goes out
		// Pipelined once the store knows its claims may overlap (on MySQL,
		// once the claim found the pending index). A batch holding a record
		// that failed before goes through Publish, which sends that record
		// alone.
		if next != nil && len(next.records) > 0 && pipe != nil && f.store.claimsOverlap() && !hasRetries(next.records) {
			// The next batch goes out the moment the pipeline has room, and
			// the one confirmed is marked after that, as the next is claimed:
			// the broker confirms in bursts, once it has caught up with what
			// was sent, so database work done between a confirm and the next
			// send would leave it idle.
			if len(queue) > depth {
				oldest := queue[0]
				queue = queue[1:]
				f.collect(work, pipe, oldest)
				done = append(done, oldest)
				held = !oldest.clean()
			}
			if !held {
				f.send(work, pipe, next)
				queue, next = append(queue, next), nil
			}
		}
		// Everything in flight is settled, oldest first, when a batch
		// failed, when the relay is about to stop, when nothing more was
		// claimed, or before a batch that goes synchronously (its marks
		// must come after theirs), so that nothing stays in flight. A batch
		// sent while one before it failed is behind that failure: none of
		// it is marked.
		if held || failed || stopping || claimed == nil || next != nil {
			done, queue = append(done, queue...), nil
		}
		for i := 0; i < len(done); i++ {
			failed = f.settleSent(work, pipe, done[i], failed) || failed
			if failed && len(queue) > 0 {
				// A mark failed: the relay backs off with nothing in flight.
				done, queue = append(done, queue...), nil
			}
		}
		if next != nil {
			if failed {
				next.holdBack()
			} else if len(next.records) > 0 {
				sendCtx, cancel := context.WithTimeout(work, f.cfg.PublishTimeout)
				next.results = f.dest.Publish(sendCtx, next.records)
				cancel()
			}
			_, bad, err := f.settle(work, next, true)
			failed = failed || bad || err != nil
		}
		f.sweepMu.Unlock()

		// A drain resumes after the last row claimed; anything that failed
		// or was left behind sends the next claim back to the head.
		after = nil
		if !failed && claimed.full(f.cfg.BatchSize) {
			after = claimed.last()
		}

		var wait time.Duration
		switch {
		case stopping:
			f.log.Info("Outbox forwarder stopped", nil)
			return nil
		case failed:
			delay = f.nextDelay(delay)
			wait = delay
		case len(queue) > 0 || claimed.full(f.cfg.BatchSize):
			if len(done) > 0 || next != nil {
				delay = 0 // a batch went through: the failure is over
			}
			continue // more are waiting, or a batch is in flight
		default:
			delay, wait = 0, f.cfg.PollInterval
		}
		timer := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			timer.Stop()
		case <-f.wake:
			timer.Stop()
			if failed {
				// A wake-up does not cut a backoff short: the failure is
				// still there, and each try of a refused record counts.
				f.sleep(ctx, delay)
			}
		case <-timer.C:
		}
	}
}

// refreshStats sets the metrics' gauges from one Stats reading.
func (f *Forwarder) refreshStats(ctx context.Context) {
	st, err := f.store.Stats(ctx)
	if err != nil {
		f.log.Error("Outbox stats for metrics failed", err, nil)
		return
	}
	f.cfg.Metrics.stats(st, time.Now())
}

// send sends a batch on the pipeline; its confirms are collected later.
func (f *Forwarder) send(ctx context.Context, pipe Pipeline, b *batch) {
	b.deadline = time.Now().Add(f.cfg.PublishTimeout)
	sendCtx, cancel := context.WithDeadline(ctx, b.deadline)
	defer cancel()
	b.pending = pipe.Send(sendCtx, b.records)
}

// collect waits for the confirms of a sent batch, if they are still out.
func (f *Forwarder) collect(ctx context.Context, pipe Pipeline, b *batch) {
	if b.pending == nil {
		return
	}
	waitCtx, cancel := context.WithDeadline(ctx, b.deadline)
	defer cancel()
	b.results = pipe.Wait(waitCtx, b.pending)
	b.pending = nil
}

// settleSent collects a batch's confirms, if they are still out, and
// settles it. It reports whether anything failed.
func (f *Forwarder) settleSent(ctx context.Context, pipe Pipeline, b *batch, behindFailure bool) bool {
	f.collect(ctx, pipe, b)
	if behindFailure {
		b.holdBack()
	}
	_, failed, err := f.settle(ctx, b, true)
	return failed || err != nil
}

// pipelineOf returns dest's pipeline, or nil when dest publishes one batch
// at a time. Only a pipeline that publishes for dest itself is used: a type
// that embeds a pipelining destination and overrides Publish would
// otherwise be skipped, its own Publish never called.
func pipelineOf(dest Destination) Pipeline {
	p, ok := dest.(Pipeliner)
	if !ok {
		return nil
	}
	if pipe := p.Pipeline(); pipe != nil && pipe.Destination() == dest {
		return pipe
	}
	return nil
}

// hasRetries reports whether any record failed before.
func hasRetries(records []Record) bool {
	for i := range records {
		if records[i].Attempts > 0 {
			return true
		}
	}
	return false
}

func (f *Forwarder) sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

func (f *Forwarder) nextDelay(prev time.Duration) time.Duration {
	if prev == 0 {
		return f.cfg.RetryMin
	}
	return min(2*prev, f.cfg.RetryMax)
}

// Close stops Run, waits for the batch in flight, and closes the
// destination. Calling it again does nothing and returns the same error.
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
// message on the broker before it answers.
func (f *Forwarder) Sweep(ctx context.Context) (int, error) {
	select {
	case <-f.closing:
		return 0, ErrForwarderClosed
	default:
	}
	return f.sweep(ctx, false)
}

func (f *Forwarder) sweep(ctx context.Context, report bool) (int, error) {
	f.sweepMu.Lock()
	defer f.sweepMu.Unlock()
	b, err := f.claimNext(ctx, nil)
	if err != nil || b == nil {
		if err != nil && report {
			f.reportError(err, ErrorContext{})
		}
		return 0, err
	}
	if len(b.records) > 0 {
		pubCtx, cancel := context.WithTimeout(ctx, f.cfg.PublishTimeout)
		b.results = f.dest.Publish(pubCtx, b.records)
		cancel()
	}
	n, _, err := f.settle(ctx, b, report)
	return n, err
}

// batch is one claim on its way through the relay.
type batch struct {
	claim     *claim
	claimedAt time.Time
	records   []Record       // the decodable rows, in order
	failures  []failure      // malformed rows, failed at once
	errs      []error        // their errors, then the publish failures
	attempts  map[string]int // attempts before this batch, by id
	pending   Sent           // sent, confirms not yet collected (pipelined)
	deadline  time.Time      // for the confirms of pending
	results   []error        // one per record once known
}

// holdBack makes every record of the batch not sent (whether it went out or
// not): it is behind a record that failed, and nothing behind a failure is
// published before it.
func (b *batch) holdBack() {
	if b.results == nil { // never sent
		b.results = make([]error, len(b.records))
	}
	for i := range b.results {
		b.results[i] = fmt.Errorf("%w: held back behind an earlier record that failed", ErrNotSent)
	}
}

// clean reports whether every record of the batch went out: nothing failed,
// nothing was held back.
func (b *batch) clean() bool {
	if len(b.failures) > 0 || len(b.results) != len(b.records) {
		return false
	}
	for _, err := range b.results {
		if err != nil {
			return false
		}
	}
	return true
}

// fail records rec's failure, with the attempts it will have.
func (b *batch) fail(rec Record, attempts int, err error) {
	b.failures = append(b.failures, failure{id: rec.ID, exchange: rec.Exchange, attempts: attempts, reason: err.Error()})
	b.errs = append(b.errs, &PublishError{Dest: ErrorContext{rec.Exchange, rec.RoutingKey, rec.ID}, Err: err})
}

// full reports whether the claim took as many rows as it asked for: more
// are probably waiting.
func (b *batch) full(size int) bool { return b != nil && len(b.claim.rows) == size }

// last is the cursor after the batch's last row.
func (b *batch) last() *cursor {
	r := b.claim.rows[len(b.claim.rows)-1]
	return &cursor{createdAt: r.createdAt, id: r.id}
}

// claimNext claims the next batch and decodes it. It returns nil when there
// is nothing to claim, and claims nothing while the broker is down: an
// outage must not count attempts against records, nor hold their locks.
func (f *Forwarder) claimNext(ctx context.Context, after *cursor) (*batch, error) {
	if c, ok := f.dest.(Connector); ok {
		// Bounded like a batch: a broker that answers nothing must not
		// hold the relay.
		connectCtx, cancel := context.WithTimeout(ctx, f.cfg.PublishTimeout)
		err := c.Connect(connectCtx)
		cancel()
		if err != nil {
			return nil, err
		}
	}
	started := time.Now()
	cl, err := f.store.claimBatch(ctx, f.cfg.BatchSize, f.cfg.RelayID, f.cfg.Lease, after)
	if err != nil {
		return nil, err
	}
	if len(cl.rows) == 0 {
		return nil, f.store.abandon(ctx, cl)
	}
	b := &batch{claim: cl, claimedAt: started, records: make([]Record, 0, len(cl.rows)), attempts: make(map[string]int, len(cl.rows))}
	for _, row := range cl.rows {
		b.attempts[row.id] = row.attempts
		rec, err := decodeRecord(row)
		if err != nil {
			// A malformed row fails alone and at once: no retry mends it,
			// and it stands in nobody's way.
			perr := &PublishError{Dest: ErrorContext{row.exchange, row.routingKey, row.id}, Err: Permanent(fmt.Errorf("malformed row: %w", err))}
			b.failures = append(b.failures, failure{id: row.id, exchange: row.exchange, attempts: max(row.attempts+1, f.cfg.MaxAttempts), reason: perr.Err.Error()})
			b.errs = append(b.errs, perr)
			continue
		}
		b.records = append(b.records, rec)
	}
	return b, nil
}

// settle marks what the broker confirmed, records the first failure, frees
// the rest, and ends the claim. It returns how many went out, and whether a
// record failed.
func (f *Forwarder) settle(ctx context.Context, b *batch, report bool) (int, bool, error) {
	if len(b.results) != len(b.records) {
		_ = f.store.abandon(context.WithoutCancel(ctx), b.claim)
		err := fmt.Errorf("outbox: destination returned %d results for %d records", len(b.results), len(b.records))
		if report {
			f.reportError(err, ErrorContext{})
		}
		return 0, false, err
	}
	var (
		published    []string
		publishedRec []Record
	)
	failedOne := false
	for i, err := range b.results {
		rec := b.records[i]
		switch {
		case failedOne:
			// Behind a failure: not published before it, even if it was
			// in flight and confirmed. It is sent again after the failed
			// record (the consumers' inbox absorbs the copy), and no attempt
			// is counted against it.
		case err == nil:
			published = append(published, rec.ID)
			if f.cfg.Metrics != nil {
				publishedRec = append(publishedRec, rec)
			}
		case errors.Is(err, ErrNotSent):
			// Not sent; the claim's end frees it.
		case errors.Is(err, ErrConnectionLost):
			// The broker went, not the record: it is held up like a
			// failure, keeps its last_error, and counts no attempt, unless
			// the connection is lost at the same record time after time:
			// then the record is what breaks it.
			failedOne = true
			n := b.attempts[rec.ID]
			if f.lostAgain(rec.ID) {
				n++
			}
			b.fail(rec, n, err)
		case IsPermanent(err):
			// No retry mends it: it is stuck at once, and holds nobody
			// back, as a malformed row does not.
			b.fail(rec, max(b.attempts[rec.ID]+1, f.cfg.MaxAttempts), err)
		default:
			failedOne = true
			b.fail(rec, b.attempts[rec.ID]+1, err)
		}
	}
	// The marks are not cut short: the broker has the messages.
	if err := f.mark(context.WithoutCancel(ctx), b, published); err != nil {
		// Published but not marked: sent again later, and deduped by the
		// consumers. Nothing is lost.
		if report {
			f.reportError(err, ErrorContext{})
		}
		return 0, true, err
	}
	f.cfg.Metrics.batch(b.claimedAt, publishedRec, b.failures)
	if report {
		for _, err := range b.errs {
			var perr *PublishError
			errors.As(err, &perr)
			f.reportError(err, perr.Dest)
		}
	}
	if len(published) > 0 {
		f.log.Trace("Outbox batch published", watermill.LogFields{"published": len(published), "failed": len(b.failures)})
	}
	return len(published), len(b.failures) > 0, errors.Join(b.errs...)
}

// mark marks the batch's published rows and failures, and ends its claim.
func (f *Forwarder) mark(ctx context.Context, b *batch, published []string) error {
	if f.afterPublish != nil {
		if err := f.afterPublish(published); err != nil {
			_ = f.store.abandon(ctx, b.claim)
			return err
		}
	}
	return f.store.finish(ctx, b.claim, published, b.failures)
}

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

func (f *Forwarder) reportError(err error, dest ErrorContext) {
	if f.cfg.OnError != nil {
		f.cfg.OnError(err, dest)
		return
	}
	f.log.Error("Outbox relay failed", err, watermill.LogFields{
		"exchange": dest.Exchange, "routing_key": dest.RoutingKey, "message_id": dest.MessageID,
	})
}
