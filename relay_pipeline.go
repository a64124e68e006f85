package outbox

import (
	"context"
	"errors"
	"slices"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/acemq/watermill-outbox/internal/sqldialect"
)

// relayLoop is Run's state from one sweep to the next: the batches it keeps
// in flight on the destination's pipeline, where a drain resumes, and the
// backoff. Only Run's goroutine uses it.
type relayLoop struct {
	f     *Forwarder
	pipe  Pipeline // nil: every batch goes through the destination's Publish
	depth int      // batches in flight beyond the one being sent

	// cut ends stopGrace after Run's context: the probes, connects and
	// claims of a stopping relay run under it (see sweep).
	cut context.Context
	// idleDial, idleDelay: the idle relay's next connect is not before
	// idleDial; idleDelay grows with each connect it had to make (failed, or
	// a connection that did not last), and is reset once one lasts.
	idleDial  time.Time
	idleDelay time.Duration
	queue     []*batch           // sent, their confirms not yet collected, oldest first
	settling  []*batch           // being settled by settle (see abandon)
	after     *sqldialect.Cursor // where the next claim of a drain starts
	size      int                // rows the next claim takes (see grow)
	maxSize   int                // the most it grows to
	delay     time.Duration      // the backoff after a failed sweep; 0 after a good one
	// poll is the adaptive poll's next wait (see idleWait); idle: the last
	// sweep found nothing, so the next one probes before it claims.
	poll time.Duration
	idle bool
	// drained: the last claim took every claimable row there was (fewer
	// than a batch), and nothing failed; unblocked: the last sweep
	// published a keyed record; woke: a wake-up (not a timer, not a batch
	// in flight) started this sweep; found: the last sweep claimed rows.
	// See claimNow.
	drained, unblocked, woke, found bool
	// claimInFlow: the database cannot wake the relay at all (see
	// claimNow).
	claimInFlow bool
	// swept is when the last sweep started (see pause).
	swept time.Time
	// crowdedFor is how many more full keyed claims are taken as crowded
	// without a look (see crowded).
	crowdedFor int
	// q keeps the NOTIFY trigger quiet in a flow (see quietFlow).
	q quietFlow
}

// newRelayLoop sets up Run's loop. limit is the pool's cap (0: none), and
// listen whether a LISTEN holds one of its connections for good. Where a
// claim is a row lock, every batch in flight holds a connection until it is
// marked, and one more is held while the next is claimed: the loop keeps
// fewer in flight than pipelineDepth when the pool has no room for them.
func (f *Forwarder) newRelayLoop(limit int, listen bool) *relayLoop {
	depth := pipelineDepth
	if limit > 0 && !f.store.leases() {
		free := limit
		if listen {
			free--
		}
		depth = min(depth, free-2) // the batches in flight and the one being claimed
	}
	pipe := pipelineOf(f.dest)
	if pipe != nil {
		// No more in flight than the pipeline takes: depth+1 batches.
		depth = min(depth, pipe.Capacity()/f.cfg.BatchSize-1)
	}
	if depth < 0 {
		pipe = nil
	}
	// A drain's claims grow as far as the pipeline holds depth+1 of them.
	// Where batches go one at a time through Publish they stay at
	// BatchSize: a destination that publishes a batch record by record (a
	// Window) would gain nothing from larger ones but a longer wait
	// against PublishTimeout.
	maxSize := f.cfg.BatchSize
	if pipe != nil {
		maxSize = max(f.cfg.BatchSize, min(f.cfg.MaxBatchSize, pipe.Capacity()/(depth+1)))
	}
	return &relayLoop{f: f, pipe: pipe, depth: depth, size: f.cfg.BatchSize, maxSize: maxSize, claimInFlow: !f.store.listens() && !f.store.watchesFile()}
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

// swept is what one sweep of Run did.
type swept struct {
	claimed    *batch // nil: nothing claimed, or the claim failed
	size       int    // the rows the claim asked for
	failed     bool   // the claim, a record or a mark failed
	stopping   bool   // ctx had ended: nothing was claimed, everything settled
	progressed bool   // a batch was settled or published
	// parked: failed, and only by records the failure made stuck
	// (batch.onlyParked), which hold nothing back from now on.
	parked bool
	// crowded: the claim passed over many rows it keeps locked (see
	// crowded).
	crowded bool
	// leaseDue: the sweep claimed nothing, to settle a batch in flight
	// whose lease runs out (see leaseRunningOut), or whose rows a
	// transaction holding the capped pool's last connection may wait for
	// (errNoConnection); the next sweep claims.
	leaseDue bool
	// unblocked: a keyed record was published, so its key's next record,
	// which another relay's claims (and on MySQL a claim that passed it
	// over) could not take while it was in flight, may be waiting.
	unblocked bool
	// behind: the claim went back from the drain's cursor to the floor or
	// the head for a look back or the floor's period (claim.lookedBack;
	// see Store.drainRewinds) and came back short: it took what was behind
	// the cursor, not the rows after it (see sweep).
	behind bool
}

// sweep claims the next batch and sends it down the pipeline, or publishes
// it, and settles what is due. It moves the cursor of the drain.
func (l *relayLoop) sweep(ctx context.Context) swept {
	f := l.f
	// The batches are not cut short by ctx or Close: a stopping relay
	// finishes what it claimed, bounded by the publish timeout.
	work := withStop(ctx)
	s := swept{stopping: ctx.Err() != nil, size: l.size}
	l.swept = time.Now()
	var took sweepTook

	var (
		next     *batch   // claimed and not sent yet
		done     []*batch // to settle now, oldest first
		unlocked bool
	)
	f.sweepMu.Lock()
	defer func() {
		if !unlocked {
			// A panic (a Destination's, an OnError's, a Logger's): the
			// claims still open would hold their rows for as long as the
			// process lives, and sweepMu every Close and Sweep.
			l.abandon(work, append(append(append(done, l.settling...), l.queue...), next))
			f.store.holding.Store(false)
			f.sweepMu.Unlock()
		}
	}()
	// The probe, the broker's connect and the claim end stopGrace after
	// ctx: a relay told to stop does not wait for a broker or a database
	// that does not answer, with nothing claimed yet, and one that answers
	// finishes the statement it has (cut, go-sql-driver closes the
	// connection).
	cut := l.cut
	if cut == nil {
		cut = ctx
	}
	s.leaseDue = !s.stopping && l.leaseRunningOut()
	cursor := l.after
	claim := !s.stopping && !s.leaseDue && l.claimNow()
	if claim && l.nothingToClaim(cut) {
		claim = false
		if err := l.keepConnected(cut); err != nil && ctx.Err() == nil {
			// Reported, and paced by its own backoff (keepConnected), not
			// the sweep's: no record failed, and a wake-up must still claim.
			f.reportError(err, ErrorContext{})
		}
	}
	if claim {
		var (
			err  error
			back bool
		)
		start := time.Now()
		s.claimed, back, err = f.claimNext(cut, cursor, s.size, l.inFlight())
		took.claim = time.Since(start)
		s.behind = back && err == nil && !s.claimed.full(s.size)
		switch {
		case errors.Is(err, errNoConnection):
			// The pool's other connections are taken, perhaps by
			// transactions waiting for the rows in flight: those are
			// settled first, and the next sweep claims.
			s.claimed, s.leaseDue = nil, true
		case err == nil:
			l.dependOn(s.claimed)
			// Not once Run's ctx ended: the look is not worth the stop's wait.
			start := time.Now()
			s.crowded = ctx.Err() != nil || l.crowded(work, s)
			took.look = time.Since(start)
		case ctx.Err() != nil:
			s.claimed, s.stopping = nil, true // stopped while it claimed: nothing is
		default:
			f.reportError(err, ErrorContext{})
			s.failed = true
		}
	}
	next = s.claimed
	held := false // the oldest batch failed: nothing more goes out
	if l.pipelines(next) {
		start := time.Now()
		done, held = l.send(work, next)
		took.send = time.Since(start)
		if !held {
			next = nil
		}
	}
	// Everything in flight is settled, oldest first, when a batch
	// failed, when the relay is about to stop, when nothing more was
	// claimed, or before a batch that goes synchronously (its marks
	// must come after theirs), so that nothing stays in flight. A batch
	// sent while one before it failed is behind that failure: none of
	// it is marked.
	if held || s.failed || s.stopping || s.claimed == nil && !s.behind || next != nil {
		done, l.queue = append(done, l.queue...), nil
	}
	// A failed claim is behind no batch in flight: they are marked as
	// their confirms say, and the relay backs off after. Held back, the
	// confirmed ones would go out again.
	claimFailed := s.failed
	start := time.Now()
	done, bad, parked := l.settle(work, done)
	took.settle = time.Since(start)
	start = time.Now()
	s.failed = s.failed || bad
	switch {
	case next == nil:
	case !s.failed && leftBehind(done):
		// Records of the settled batches were released, before next in
		// the order: next goes back too, to be claimed again after them,
		// rather than overtake them. Nothing failed; no backoff.
		next.holdBack()
		_, s.failed, _ = f.settle(work, next, true)
		parked = parked && !s.failed
	default:
		next.holdBackBehindKeys() // what it waited for is settled
		var nextBad bool
		nextBad, s.failed = l.publish(work, next, s.failed)
		parked = parked && (!nextBad || next.onlyParked())
	}
	if next != nil {
		took.publish, took.published = time.Since(start), 1
	}
	s.parked = s.failed && !claimFailed && parked
	f.store.holding.Store(len(l.queue) > 0) // for the statements before the next sweep, and a Sweep's
	unlocked = true
	f.sweepMu.Unlock()
	s.progressed = len(done) > 0 || next != nil
	s.unblocked = publishedKeyed(done) || publishedKeyed([]*batch{next})
	// On MySQL a sweep that claimed nothing makes the next one probe
	// first even when it settled batches: the claim that ends a flow
	// found nothing, and the poll after it need not claim again to learn
	// that there is still nothing.
	l.idle = s.claimed == nil && !s.failed && !s.behind && (!s.progressed || l.claimInFlow)
	if s.claimed == nil && !s.failed && !s.stopping && !s.behind {
		l.crowdedFor = 0 // the drain is over; the next one looks afresh
	}
	l.drained = !s.failed && !s.full() && !s.behind
	l.traceSweep(s, done, took)
	l.unblocked = s.unblocked
	l.found = s.claimed != nil

	// A drain resumes after the last row claimed; anything that failed
	// or was left behind (records not sent behind a keyed failure or one
	// stuck at once, released with the claim) sends the next claim back
	// to the head, which they are nearer than the cursor.
	//
	// A claim that went back (behind) took what was behind the cursor and
	// came back short: not because the drain is over, but because the rows
	// at the head are this relay's own, in flight (on PostgreSQL its
	// window and its choice beyond it are all theirs, each passed over
	// locked). Taken for the drain's end, it settled every batch in flight
	// and started again at BatchSize from the head, at every look back
	// (drainLookBack): a fifth of a drain's rate, a review found. The
	// drain goes on from its cursor, at its size.
	l.after = nil
	if ok := !s.failed && !leftBehind(done) && !next.released(); ok && s.full() {
		l.after = s.claimed.last()
	} else if ok && s.behind {
		l.after = cursor
	}
	if l.after != nil && s.unblocked {
		l.after = l.behindNextOfKeys(work, l.after, append(done[:len(done):len(done)], next))
	}
	if l.after != nil && s.behind {
		l.size = s.size
	} else {
		l.size = l.grow(s, done)
	}
	return s
}

// sweepTook is where a sweep's time went (see traceSweep).
type sweepTook struct {
	claim   time.Duration // the claim: its statements, and the broker's connect if lost
	look    time.Duration // the look at the rows a keyed claim passed over (crowded)
	send    time.Duration // waiting for the confirms of batches before the next goes out, and its send
	settle  time.Duration // the confirms still out collected, the marks, COMMIT
	publish time.Duration // the claimed batch published outside the pipeline: its send, confirms and marks
	// published is 1 when the claimed batch went outside the pipeline
	// (or was released unsent) and was settled in this sweep.
	published int
}

// traceSweep logs, at Trace, a sweep that claimed or settled something:
// how many rows it asked for and took, the batches in flight after it, and
// where its time went. A drain slower than the broker takes says there
// which side holds it: the database's claims and marks, or the confirms
// it waits for. (Issue 16's measures of the keyed drain were made so.)
func (l *relayLoop) traceSweep(s swept, done []*batch, took sweepTook) {
	if s.claimed == nil && len(done) == 0 && took.published == 0 {
		return // an idle poll
	}
	claimed := 0
	if s.claimed != nil {
		claimed = len(s.claimed.claim.rows)
	}
	l.f.log.Trace("Outbox relay sweep", watermill.LogFields{
		"asked": s.size, "claimed": claimed, "settled_batches": len(done) + took.published, "in_flight_batches": len(l.queue),
		"claim_ms": ms(took.claim), "look_ms": ms(took.look), "send_ms": ms(took.send), "settle_ms": ms(took.settle),
		"publish_ms": ms(took.publish),
		"failed":     s.failed,
	})
}

// ms is d in milliseconds, to the microsecond.
func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

// inFlight is the ids of the keyed records this relay has sent and whose
// confirms are not collected yet: a key's next record may be claimed while
// they are in flight (sqldialect.ClaimParams.InFlight), and goes out once
// their confirms are in (see send). Records held back unsent (preset) are
// not among them, nor an id that is not UTF-8, which JSON would not carry
// as it is: leaving one out only makes its key wait for its mark.
func (l *relayLoop) inFlight() []string {
	var ids []string
	for _, b := range l.queue {
		for i := range b.records {
			r := &b.records[i]
			if r.AggregateID != "" && (b.preset == nil || b.preset[i] == nil) && utf8.ValidString(r.ID) {
				ids = append(ids, r.ID)
			}
		}
	}
	return ids
}

// dependOn sets b.waitsFor: the batches in flight that hold a predecessor
// of a keyed record of b (its key's, a smaller seq). b may hold such a
// record, claimed while its unpublished predecessors were all in this
// relay's flight: it must not reach the broker before them, nor at all if
// one of them fails.
func (l *relayLoop) dependOn(b *batch) {
	if b == nil || len(l.queue) == 0 {
		return
	}
	var seqs map[string]int64 // by key: b's record's seq (a claim takes one per key)
	for i := range b.records {
		if r := &b.records[i]; r.AggregateID != "" {
			if seqs == nil {
				seqs = make(map[string]int64)
			}
			if s, ok := seqs[r.AggregateID]; !ok || r.Seq > s {
				seqs[r.AggregateID] = r.Seq
			}
		}
	}
	if seqs == nil {
		return
	}
	for _, q := range l.queue {
		if slices.ContainsFunc(q.records, func(r Record) bool { s, ok := seqs[r.AggregateID]; return ok && r.Seq < s }) {
			b.waitsFor = append(b.waitsFor, q)
		}
	}
}

// abandon ends the claims of bs (nil entries skipped) and forgets the
// batches in flight: what a panic leaves. A claim settled already is not
// changed by it (its transaction is over; its lease's rows are published
// or failed).
func (l *relayLoop) abandon(ctx context.Context, bs []*batch) {
	for _, b := range bs {
		if b != nil {
			_ = l.f.store.abandon(ctx, b.claim)
			b.endSpans(spanReleased, errAbandoned, true)
		}
	}
	l.queue, l.settling = nil, nil
}

// maxNextOfKeys is how many published keyed records behindNextOfKeys looks
// after. Past it the flow is mostly keyed, its claims skip rows often and
// come back short, which sends the next claim to the head anyway, and a
// look-up per sweep cost a keyed drain more than it gained: 0.22 of the
// unkeyed drain's rate on MariaDB against 0.63, 0.61 against 0.66–0.76 on
// PostgreSQL (outbox-bench -scenario relay, 1,000 keys).
const maxNextOfKeys = 16

// behindNextOfKeys moves the cursor back before the next records of the
// keyed records bs published, when they are behind it: a claim skipped
// them while their predecessors were in flight (another relay's claims, or
// on MySQL this relay's claim that passed them over), and resuming at the
// cursor would leave them until the drain came back to the head (after
// 3,000 rows behind them, say). One statement, on the key index; a lookup that fails
// sends the claim back to the head.
func (l *relayLoop) behindNextOfKeys(ctx context.Context, after *sqldialect.Cursor, bs []*batch) *sqldialect.Cursor {
	if after == nil {
		// The claim's last row has no created_at (another library's,
		// sorted last): the drain goes on from the head, before them all.
		// Compared with it, the relay panicked.
		return nil
	}
	// A key with a record still in flight here: that record is the next
	// one of the record published (or, after a Retry or a Republish, one
	// further on), claimed already, and the look-up would only send the
	// claim back over rows this relay holds.
	flying := make(map[string]bool)
	for _, q := range l.queue {
		for i := range q.records {
			flying[q.records[i].AggregateID] = true
		}
	}
	var recs []sqldialect.KeySeq
	for _, b := range bs {
		if b == nil || len(b.results) != len(b.records) {
			continue
		}
		for i, err := range b.results {
			if r := &b.records[i]; err == nil && r.AggregateID != "" && !flying[r.AggregateID] {
				recs = append(recs, sqldialect.KeySeq{Key: r.AggregateID, Seq: r.Seq})
			}
		}
	}
	if len(recs) == 0 || len(recs) > maxNextOfKeys {
		return after
	}
	next, err := l.f.store.firstNext(ctx, recs)
	if err != nil {
		if !errors.Is(err, errNoConnection) { // the claim goes back to the head
			l.f.reportError(databaseFailed{err}, ErrorContext{})
		}
		return nil
	}
	if next != nil && (next.CreatedAt.Before(after.CreatedAt) || next.CreatedAt.Equal(after.CreatedAt) && next.ID < after.ID) {
		return next
	}
	return after
}

// sizes are the sizes the loop's claims take: BatchSize, and each size a
// drain grows them to.
func (l *relayLoop) sizes() []int {
	sizes := []int{l.f.cfg.BatchSize}
	for n := l.f.cfg.BatchSize; n < l.maxSize; {
		n = min(2*n, l.maxSize)
		sizes = append(sizes, n)
	}
	return sizes
}

// full reports whether the sweep's claim took as many rows as it asked
// for: more are probably waiting.
func (s swept) full() bool { return s.claimed.full(s.size) }

// grow is the size of the next claim. A drain's claims double while they
// come back full and the drain goes on from where they ended and a batch
// was confirmed (done), up to maxSize and to the rows growBytes holds at
// the claim's mean body; they stay at their size while the batches settled
// were in flight over an eighth of PublishTimeout, and halve over a
// quarter. Anything else (a short claim, a failure, records left behind,
// a crowded claim) starts again at BatchSize. See
// ForwarderConfig.MaxBatchSize for why, and for the figures.
func (l *relayLoop) grow(s swept, done []*batch) int {
	cfg := l.f.cfg
	if l.after == nil || s.crowded {
		return cfg.BatchSize
	}
	var slowest time.Duration
	for _, b := range done {
		slowest = max(slowest, b.inFlight)
	}
	next := min(2*s.size, l.maxSize)
	switch {
	case slowest > cfg.PublishTimeout/4:
		next = s.size / 2
	case slowest > cfg.PublishTimeout/8 || len(done) == 0:
		// No batch confirmed since the last claim: nothing yet says
		// how fast the broker takes them.
		next = s.size
	}
	if bytes := s.claimed.bodyBytes(); bytes > 0 {
		next = min(next, int(int64(l.f.growBytes)*int64(len(s.claimed.records))/int64(bytes)))
	}
	return max(next, cfg.BatchSize)
}

// crowded reports whether the full claim of a keyed drain passed over more
// than a quarter as many rows as it took, where a claim keeps the rows it
// passed over locked until its batch is marked (MySQL): other relays'
// records (their keys' next ones, which their next claims then skip), or
// its own keys' records it could not take yet (a key's records written
// together). A larger claim would pass over more: the drain's claims go
// back to BatchSize (see grow). The relay's own batches in flight, which
// a claim from the head passes over, do not count, nor do stuck rows. With
// two relays over the same keys MariaDB's keyed drain measured 0.73 of the
// unkeyed one's rate (0.70 at BatchSize, 0.57 with claims grown); one relay
// over interleaved keys passes over nothing, and measured 0.80 (0.67 at
// BatchSize). One read in the claim's transaction, on MySQL after full
// keyed claims only; one that fails says crowded, and is reported.
func (l *relayLoop) crowded(ctx context.Context, s swept) bool {
	b := s.claimed
	if b == nil || b.claim.tx == nil || !l.f.store.locksPassedOver() || !s.full() || !b.keyed() {
		return false
	}
	if l.crowdedFor > 0 {
		l.crowdedFor--
		return true
	}
	last := b.last()
	if last == nil {
		return true
	}
	n, err := l.f.store.passedOver(ctx, b.claim, b.claim.from, last)
	if err != nil {
		l.f.reportError(databaseFailed{err}, ErrorContext{})
	}
	// The relay's own rows in flight that the claim passed over.
	for _, q := range l.queue {
		for _, r := range q.claim.rows {
			if inRange(r, b.claim.from, last) {
				n--
			}
		}
	}
	if err != nil || 4*n > len(b.claim.rows) {
		l.crowdedFor = crowdedClaims
		return true
	}
	return false
}

// inRange reports whether row r comes after after (any row, when nil) and
// no later than last, in claim order.
func inRange(r sqldialect.ClaimedRow, after, last *sqldialect.Cursor) bool {
	cmp := func(c *sqldialect.Cursor) int {
		if x := r.CreatedAt.Compare(c.CreatedAt); x != 0 {
			return x
		}
		return strings.Compare(r.ID, c.ID)
	}
	return (after == nil || cmp(after) > 0) && cmp(last) <= 0
}

// crowdedClaims is how many full keyed claims after a crowded one are taken
// as crowded too, without the look, until a sweep finds nothing to claim:
// other relays stay, and a look per claim and the claims grown in its lulls
// cost a keyed drain of two relays on MariaDB 0.57 of the unkeyed one's
// rate, against 0.73.
const crowdedClaims = 16

// leftBehind reports whether a batch of bs released records (see released).
func leftBehind(bs []*batch) bool {
	return slices.ContainsFunc(bs, (*batch).released)
}

// pipelines reports whether b goes down the pipeline. Pipelined once the
// store knows its claims may overlap (on MySQL, once the claim found the
// pending index). A batch holding a record that failed before, or one the
// destination wants alone, goes through Publish, which sends that record
// alone.
func (l *relayLoop) pipelines(b *batch) bool {
	return b != nil && len(b.records) > 0 && l.pipe != nil && l.f.store.claimsOverlap() && !hasRetries(b.records) && !isolates(l.f.dest, b.records)
}

// isolates reports whether dest wants one of records sent alone, through
// Publish: AMQPDestination's suspects (see its blame).
func isolates(dest Destination, records []Record) bool {
	i, ok := dest.(interface{ isolates([]Record) bool })
	return ok && i.isolates(records)
}

// send sends b down the pipeline, after collecting the oldest batch in
// flight if the pipeline is full, and every batch up to the last that b
// waits for (see dependOn). It returns those batches, to be settled, and
// whether one failed: then b is not sent, and nothing more goes out. A
// record of b whose key's earlier record was not published is not sent
// (holdBackBehindKeys).
//
// The next batch goes out the moment the pipeline has room, and the one
// confirmed is marked after that, as the next is claimed: the broker
// confirms in bursts, once it has caught up with what was sent, so database
// work done between a confirm and the next send would leave it idle.
func (l *relayLoop) send(ctx context.Context, b *batch) (done []*batch, held bool) {
	n := max(len(l.queue)-l.depth, 0) // the oldest batches to collect first
	for i, q := range l.queue {
		if slices.Contains(b.waitsFor, q) {
			n = max(n, i+1)
		}
	}
	for ; n > 0 && !held; n-- {
		oldest := l.queue[0]
		l.collect(ctx, oldest) // in the queue still: a panic here ends its claim too (see sweep)
		l.queue = l.queue[1:]
		done = append(done, oldest)
		held = !oldest.clean()
	}
	if !held {
		b.holdBackBehindKeys()
		b.deadline = time.Now().Add(l.f.cfg.PublishTimeout)
		if out := b.outgoing(); len(out) > 0 {
			sendCtx, cancel := context.WithDeadlineCause(withWriteBound(ctx, b.deadline), b.deadline, errNoConfirmInTime)
			l.f.tracing.start(b, time.Now())
			b.pending = l.pipe.Send(sendCtx, out)
			cancel()
		} else {
			b.setResults(nil) // all held back behind their keys
		}
		l.queue = append(l.queue, b)
	}
	return done, held
}

// collect waits for the confirms of a sent batch, if they are still out.
func (l *relayLoop) collect(ctx context.Context, b *batch) {
	if b.pending == nil {
		return
	}
	waitCtx, cancel := context.WithDeadlineCause(ctx, b.deadline, errNoConfirmInTime)
	defer cancel()
	b.setResults(l.pipe.Wait(waitCtx, b.pending))
	b.pending = nil
	b.inFlight = time.Since(b.deadline.Add(-l.f.cfg.PublishTimeout))
}

// settle collects the confirms of the batches in done, if they are still
// out, and settles them, oldest first. A batch behind a failed record is
// held back. It returns the batches it settled, whether anything failed,
// and whether every batch that failed failed only by records it made
// stuck (batch.onlyParked).
func (l *relayLoop) settle(ctx context.Context, done []*batch) (_ []*batch, failed, parked bool) {
	l.settling = done
	defer func() { l.settling = nil }()
	parked = true
	behind := false // the batches from here on are behind a failed record
	for i := 0; i < len(done); i++ {
		b := done[i]
		l.collect(ctx, b)
		if behind {
			b.holdBack()
		}
		// Only what holds the relay back counts: a keyed record's failure
		// holds back its own key, and nothing else (see keyedFailure).
		_, bad, err := l.f.settle(ctx, b, true)
		failed = bad || failed
		parked = parked && (!bad || b.onlyParked())
		// A mark that failed is no record's failure: the broker has the
		// batch's records, and those behind them overtake nothing. They
		// are marked as their confirms say (held back, the confirmed ones
		// went out again), and their own marks fail too if the database
		// is down.
		var marking *markError
		// A record released unsent holds back what is behind it too
		// (batch.clean): a batch confirmed behind it is not marked first.
		behind = behind || bad && !errors.As(err, &marking) || b.released()
		if failed && len(l.queue) > 0 {
			// A mark failed: the relay backs off with nothing in flight.
			done, l.queue = append(done, l.queue...), nil
			l.settling = done
		}
	}
	return done, failed, parked
}

// publish publishes a batch that does not go down the pipeline through the
// destination's Publish, or holds it back behind a failure, and settles
// it. It reports whether b failed, and whether anything failed.
func (l *relayLoop) publish(ctx context.Context, b *batch, behindFailure bool) (bad, failed bool) {
	if behindFailure {
		b.holdBack()
	} else {
		l.f.publish(ctx, b)
	}
	_, bad, _ = l.f.settle(ctx, b, true)
	return bad, behindFailure || bad
}

// pace says how long Run waits before the next sweep, and moves the
// backoff. ok is false when the next sweep goes at once.
func (l *relayLoop) pace(s swept) (wait time.Duration, ok bool) {
	switch {
	case s.parked:
		// What failed is stuck now (MaxAttempts), and holds nothing back:
		// the records behind it go at once, and a failure of theirs backs
		// off from RetryMin. Kept, the backoff a stuck record had grown
		// to held each bad record after it at RetryMax for all its
		// attempts (100 s at the defaults, against 33 s for the first).
		l.delay = 0
		return 0, false
	case s.failed:
		l.delay = l.f.nextDelay(l.delay)
		return l.delay, true
	case len(l.queue) > 0 || s.full() || s.unblocked || s.leaseDue || s.behind:
		if s.progressed {
			l.delay = 0 // a batch went through: the failure is over
		}
		return 0, false // more are waiting, or a batch is in flight
	default:
		l.delay = 0
		// A relay that keeps a floor looks from the head once its period
		// is over, woken or not: what became pending below the floor (a
		// NOTIFY woke it for, say) waits for that, not for a long
		// PollInterval. A short one looks soon enough: woken between its
		// polls, an idle relay beside a held snapshot sent 12 statements a
		// second at a 100 ms poll.
		wait := l.idleWait(s)
		if due := l.f.store.floorDue(); wait > floorEveryMin && due < wait {
			wait = max(due, l.f.cfg.MinPollInterval)
		}
		return wait, true
	}
}

// leaseRunningOut reports whether the oldest batch in flight has too little
// of its lease left to see another claim and send before it is marked,
// where claims are leases (SQLite): 2 × PublishTimeout and two busy waits
// (the claim's and the mark's). A lease is written once, at the claim, and
// a batch in flight stays unmarked while the batches behind it are claimed
// and sent: a slow send, within PublishTimeout, took it past its lease,
// and another relay's claim took its rows, in flight, and published them
// too. The sweep then claims nothing and settles what is in flight; the
// next one claims. At the defaults (Lease 60 s, PublishTimeout 15 s, a
// busy timeout of 5 s) a batch 20 s in flight comes to it; with Lease at
// its least (2 × PublishTimeout) no batch waits in flight behind another.
func (l *relayLoop) leaseRunningOut() bool {
	if len(l.queue) == 0 || !l.f.store.leases() {
		return false
	}
	left := l.f.cfg.Lease - time.Since(l.queue[0].claimedAt)
	// PublishTimeout is at most Lease / 2 (validate), and the busy wait
	// SQLite's 32-bit milliseconds: their sum does not overflow, its double
	// may.
	return left < doubled(l.f.cfg.PublishTimeout+l.f.store.busyBound())
}

// claimNow reports whether this sweep claims. It does not when the last
// claim drained the table, batches are in flight, and this sweep was not
// started by a wake-up nor follows a keyed record published or a failure:
// the sweep only settles them. Without this a
// relay in a flow of single messages claimed twice per message, the second
// time finding nothing (four statements on PostgreSQL) while the confirms
// of the first were out. A wake-up that started this sweep (a commit's
// NOTIFY, the file watch, Notify), a keyed record published (its key's next
// one became claimable) or a failure all mean a claim.
//
// A wake-up that came while batches are out waits, pending, for them to be
// settled, and the sweep after that claims: the claim then takes the rows
// committed in the meantime (a batch of them, and the drain goes on while
// claims come back full). Claiming at each wake-up instead, with
// commits coming every few milliseconds (500 msg/s on PostgreSQL, each
// commit a NOTIFY), kept three batches of one or two rows in flight and
// made every sweep a claim and a mark: the relay fell behind a flow it
// could carry, and the commit-to-broker latency grew to the time a few of
// those sweeps took. Side by side (outbox-bench -scenario latency, the
// relay in its own process), PostgreSQL's p50 / p99 at 500 msg/s went from
// 10.7 / 50–57 ms to 1.3–2.5 / 5.7–8.4 ms, and its p99 with 2,000 msg/s
// asked (about 1,000 reached: see the README on NOTIFY) from 104–284 to
// 27–30 ms; SQLite's, woken by its file watch, did not move,
// nor did a backlog's drain, whose claims come back full.
//
// On a database that has no way to wake the relay at another process's
// commit (MySQL: claimInFlow), a last claim that found rows means a claim
// too: in a flow the next rows are likely there by now, and claiming them
// while the last batch's confirms are out keeps the pipeline going rather
// than waiting for the marks and the next poll. Measured on MySQL in three
// pairs of runs, side by side: the commit-to-broker p50 over the services'
// own transaction (commit_to_broker_p50_vs_publish_tx) fell from 2.5–2.6 to
// 1.7–1.8 at 500 msg/s and from 3.2–3.6 to 2.3–3.0 at 2,000 msg/s, for one
// claim that finds nothing at the end of each burst (2.5–2.9 statements
// per message at 500 msg/s became 4.1–4.6, and the relay's CPU 23–24 % of
// a core 28–29 %). On PostgreSQL with its NOTIFY trigger disabled the same
// measured worse (1.9 to 2.4–3.1 at 2,000 msg/s): its claim is four round
// trips, and the claims taken back to back left the services less of the
// server. There, and on SQLite, whose claims take the services' write
// lock, the poll alone finds the next rows.
func (l *relayLoop) claimNow() bool {
	if l.woke || !l.drained || l.unblocked || len(l.queue) == 0 {
		return true
	}
	return l.found && l.claimInFlow
}

// nothingToClaim: an idle relay (the last sweep found nothing, nothing is
// in flight) asks first whether there is anything to claim, in one
// statement without a transaction, and claims only if there is. An idle
// outbox so costs one statement per poll; a claim is three or four, and on
// SQLite takes the write lock the publishers need. A probe that fails says
// nothing: the claim runs, and reports the error.
//
// A wake-up probes after the writers of the moment (hasClaimableNow). On
// SQLite the file watch reports a commit's write to the log, and the
// commit becomes visible to readers only when the writer then updates the
// log's index: a plain probe in between read the snapshot before it, found
// nothing, and left the row to the poll (measured: about one commit in 400
// from another pool).
func (l *relayLoop) nothingToClaim(ctx context.Context) bool {
	if !l.idle || len(l.queue) > 0 {
		return false
	}
	probe := l.f.store.hasClaimable
	if l.woke {
		probe = l.f.store.hasClaimableNow
	}
	found, err := probe(ctx)
	return err == nil && !found
}

// keepConnected connects an idle relay's destination where it is not
// connected: a broker restart dropped the connection, or the relay started
// with nothing to send. The relay connected only before a claim, so on a
// quiet outbox outbox_forwarder_broker_connected stayed 0 with the broker
// back, and an alert on it never cleared (a review); and the first record
// after a quiet spell waited for the connect. A connect that fails is the
// sweep's failure, reported and backed off as a claim's would be.
func (l *relayLoop) keepConnected(ctx context.Context) error {
	c, ok := l.f.dest.(interface {
		Connector
		connected() bool
	})
	if !ok {
		return nil
	}
	if c.connected() {
		if !time.Now().Before(l.idleDial) {
			l.idleDelay = 0 // the last connect lasted its backoff
		}
		return nil
	}
	if time.Now().Before(l.idleDial) {
		return nil
	}
	l.idleDelay = l.f.nextDelay(l.idleDelay)
	l.idleDial = time.Now().Add(l.idleDelay)
	connectCtx, cancel := context.WithTimeout(ctx, l.f.cfg.PublishTimeout)
	defer cancel()
	return c.Connect(connectCtx)
}

// idleWait is how long the relay waits for a wake-up when a sweep left
// nothing to do. Where another process's commit wakes it (PostgreSQL's
// LISTEN, the watch of SQLite's file), the poll is a safety net:
// PollInterval. Where nothing does (MySQL; DisableListen; LISTEN without
// pgx, or on a table whose NOTIFY trigger does not fire), the poll adapts:
// MinPollInterval after a sweep that did something, twice the last wait
// after one that found nothing, up to PollInterval. So it follows a steady
// flow within a few milliseconds, and an idle outbox costs one statement
// per PollInterval. A relay that keeps PostgreSQL's trigger quiet in a flow
// polls every MinPollInterval, and one leaving its flow at most every
// quietLeavePoll (see quietFlow).
func (l *relayLoop) idleWait(s swept) time.Duration {
	cfg := l.f.cfg
	if l.f.woken.Load() && !l.q.polls() {
		return cfg.PollInterval
	}
	if l.q.on {
		// In a flow of QuietAbove a second or more, standing in for the
		// NOTIFY it keeps quiet: every look finds rows or will soon.
		l.poll = cfg.MinPollInterval
		return l.poll
	}
	if s.progressed || s.claimed != nil {
		l.poll = cfg.MinPollInterval
	} else {
		l.poll = min(max(doubled(l.poll), cfg.MinPollInterval), cfg.PollInterval)
	}
	if l.q.leaving {
		l.poll = min(l.poll, max(quietLeavePoll, cfg.MinPollInterval))
	}
	return l.poll
}

// wakeCooldown is the least time from one sweep to the next that a wake-up
// starts: in a flow of commits, each waking the relay (NOTIFY, the file
// watch, Notify), the commits of that time share one claim and one batch
// rather than each taking its own, and a flow slower than one commit per
// millisecond waits for nothing. (River's FetchCooldown, at 100 ms by
// default, does the same for its job fetches.)
const wakeCooldown = time.Millisecond

// pause waits wait, or until ctx ends or the relay is woken, and reports
// whether it was woken.
func (l *relayLoop) pause(ctx context.Context, wait time.Duration, failed bool) (woken bool) {
	end := time.Now().Add(wait)
	timer := time.NewTimer(wait)
	select {
	case <-ctx.Done():
		timer.Stop()
	case <-l.f.wake:
		timer.Stop()
		if failed {
			// A wake-up does not cut a backoff short: the failure is
			// still there, and each try of a refused record counts. Nor
			// does it lengthen it: the rest of the wait, not the whole
			// again after part of it on the timer, which made a backoff
			// up to twice as long.
			sleepCtx(ctx, time.Until(end))
		} else if cool := time.Until(l.swept.Add(wakeCooldown)); cool > 0 {
			sleepCtx(ctx, cool)
		}
		return true
	case <-timer.C:
	}
	return false
}

// publishedKeyed reports whether a keyed record of the settled batches bs
// was published. The claims made while it was in flight may have skipped
// its key's next record (another relay's; on MySQL one that had passed it
// over before), and the sweep that settles the last batch in flight claimed
// nothing: without another claim at once, a drain of keyed records would
// wait PollInterval at every such turn.
func publishedKeyed(bs []*batch) bool {
	for _, b := range bs {
		if b == nil || len(b.results) != len(b.records) {
			continue
		}
		for i, err := range b.results {
			if err == nil && b.records[i].AggregateID != "" {
				return true
			}
		}
	}
	return false
}

// hasRetries reports whether any unkeyed record failed before. A keyed
// record's retry orders nothing else in its batch (a claim takes one record
// of a key, and a batch holding its key's next record waits for it: see
// dependOn), so it needs no Publish of its own.
func hasRetries(records []Record) bool {
	for i := range records {
		if records[i].Attempts > 0 && records[i].AggregateID == "" {
			return true
		}
	}
	return false
}
