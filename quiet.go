package outbox

import (
	"context"
	"time"

	"github.com/ThreeDotsLabs/watermill"
)

// quietLease is how far ahead of the database's clock a relay in a flow
// keeps its table's NOTIFY trigger quiet; it sets the time again every
// half of it while the flow lasts. A relay that dies leaves the trigger
// quiet for this long at most: the commits of that time wake no other
// relay, which finds them at its poll (PollInterval).
const quietLease = time.Second

// quietLeavePoll is the longest a relay leaving its flow waits between two
// looks while a transaction the trigger kept quiet is open: its commit
// wakes nobody. Two statements a look (the lock's, a probe), for as long
// as such a transaction stays open; most have ended by the first look.
const quietLeavePoll = 20 * time.Millisecond

// quietWindow is the span over which the relay measures its flow.
const quietWindow = 100 * time.Millisecond

// quietFlow keeps a PostgreSQL table's NOTIFY trigger quiet while the
// relay is in a flow (ForwarderConfig.QuietAbove; migration 0010).
//
// A NOTIFY makes the services' commits go one per WAL flush: PostgreSQL
// holds a database-wide lock from a notifying transaction's commit until
// the commit is durable. In a flow the relay has no use for it: its claims
// find rows at every look, and it polls, MinPollInterval after each sweep
// that published, as it does where nothing wakes it.
//
// No commit the trigger kept quiet waits for the poll's safety net: such a
// transaction holds the table's advisory lock, shared, until it ends, and
// a relay that leaves its flow clears the time first, then polls as in the
// flow until it can take that lock exclusively (without waiting, once per
// poll), and then looks once more before it waits for NOTIFY again.
type quietFlow struct {
	on      bool      // the trigger is quiet, by this relay: it polls
	leaving bool      // the time is cleared; transactions kept quiet may be open
	renew   time.Time // when to set the time again, while on
	since   time.Time // the start of the window being measured
	rows    int       // the rows claimed in it
	failed  bool      // a statement failed, and was logged
}

// polls reports whether the relay polls rather than wait for NOTIFY.
func (q *quietFlow) polls() bool { return q.on || q.leaving }

// quietSequence is the table's quiet sequence when the relay listens and
// may keep the trigger quiet, "" otherwise.
func (f *Forwarder) quietSequence() string {
	if f.cfg.QuietAbove < 0 || !f.woken.Load() {
		return ""
	}
	if p := f.quietSeq.Load(); p != nil {
		return *p
	}
	return ""
}

// quiet follows the flow after a sweep: it keeps the trigger quiet while
// the flow is above QuietAbove, and lets it notify again when the flow
// falls below half of it.
func (l *relayLoop) quiet(ctx context.Context, s swept) {
	q, f := &l.q, l.f
	now := time.Now()
	if s.claimed != nil {
		q.rows += len(s.claimed.claim.rows)
	}
	seq := f.quietSequence()
	switch {
	case q.leaving:
		over, err := f.store.quietOver(ctx)
		if f.quietFailed(q, "see whether the transactions the NOTIFY trigger kept quiet have ended", err) || !over {
			break
		}
		// A last look, at once, takes what they committed; NOTIFY wakes
		// the relay from here on.
		q.leaving = false
		f.Notify()
	case q.on && seq == "":
		q.leave(ctx, f, f.quietSequenceAny()) // the trigger or LISTEN is gone
	case q.on && !now.Before(q.renew):
		if err := f.store.quietFor(ctx, seq, quietLease); f.quietFailed(q, "keep the NOTIFY trigger quiet", err) {
			q.on, q.leaving = false, true // it lapses by itself
			break
		}
		q.renew = now.Add(quietLease / 2)
	}
	elapsed := now.Sub(q.since)
	if elapsed < quietWindow {
		return
	}
	rate := float64(q.rows) / elapsed.Seconds()
	q.rows, q.since = 0, now
	above := float64(f.cfg.QuietAbove)
	switch {
	case !q.polls() && seq != "" && rate >= above:
		if err := f.store.quietFor(ctx, seq, quietLease); f.quietFailed(q, "keep the NOTIFY trigger quiet", err) {
			break
		}
		q.on, q.renew = true, now.Add(quietLease/2)
		f.log.Debug("Outbox relay in a flow: the NOTIFY trigger stays quiet, the relay polls", watermill.LogFields{"per_second": int(rate)})
	case q.on && rate < above/2:
		q.leave(ctx, f, seq)
		f.log.Debug("Outbox relay out of its flow: the NOTIFY trigger notifies again", watermill.LogFields{"per_second": int(rate)})
	}
}

// quietSequenceAny is the last quiet sequence the relay read, whether or
// not it may use it now.
func (f *Forwarder) quietSequenceAny() string {
	if p := f.quietSeq.Load(); p != nil {
		return *p
	}
	return ""
}

// leave lets the trigger notify again, and has the relay poll until the
// transactions it kept quiet have ended.
func (q *quietFlow) leave(ctx context.Context, f *Forwarder, seq string) {
	q.on, q.leaving = false, true
	if seq == "" {
		return // nothing to clear: the time lapses
	}
	// A failure leaves the time to lapse, within quietLease.
	f.quietFailed(q, "let the NOTIFY trigger notify again", f.store.quietOff(ctx, seq))
}

// stop lets the trigger notify again as the relay stops, for the other
// relays, rather than leave the time to lapse.
func (q *quietFlow) stop(f *Forwarder) {
	if !q.on {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), stopGrace)
	defer cancel()
	q.leave(ctx, f, f.quietSequenceAny())
}

// quietFailed reports whether err is an error, and logs the first of a
// run of them.
func (f *Forwarder) quietFailed(q *quietFlow, what string, err error) bool {
	if err == nil {
		q.failed = false
		return false
	}
	if !q.failed {
		f.log.Error("Outbox relay cannot "+what+"; it polls meanwhile", err, nil)
	}
	q.failed = true
	return true
}
