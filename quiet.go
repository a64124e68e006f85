package outbox

import (
	"context"
	"errors"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/acemq/watermill-outbox/internal/sqldialect"
)

// quietLease is how far ahead of the database's clock a relay in a flow
// keeps its table's NOTIFY trigger quiet; it sets the time again every
// half of it while the flow lasts. A relay that dies leaves the trigger
// quiet for this long at most: the commits of that time, and those of the
// transactions it kept quiet that were still open, wake no other relay,
// which finds them at its poll (PollInterval).
const quietLease = time.Second

// quietLeavePoll is the longest a relay leaving its flow waits between two
// looks while a transaction the trigger kept quiet is open: its commit
// wakes nobody. Two statements a look (the lock's, a probe), for as long
// as such a transaction stays open; most have ended by the first look.
// A relay whose MinPollInterval is longer never keeps the trigger quiet:
// its poll would stand in for NOTIFY too slowly.
const quietLeavePoll = 20 * time.Millisecond

// quietWindow is the span over which the relay measures its flow to leave
// it, and quietEnterWindow the longer one over which it measures it to
// enter: a burst of a few milliseconds at QuietAbove (eight services
// committing at once, at a lower rate on average) is no flow.
const (
	quietWindow      = 100 * time.Millisecond
	quietEnterWindow = time.Second
)

// quietLongLeave is how long a relay leaves its flow before it says that
// a transaction the trigger kept quiet is still open.
const quietLongLeave = 10 * time.Second

// quietFlow keeps a PostgreSQL table's NOTIFY trigger quiet while the
// relay is in a flow (ForwarderConfig.QuietAbove; migration 0010).
//
// A NOTIFY makes the services' commits go one per WAL flush: PostgreSQL
// holds a database-wide lock from a notifying transaction's commit until
// the commit is durable. In a flow the relay has no use for it: its claims
// find rows at every look, and it polls every MinPollInterval.
//
// No commit the trigger kept quiet waits for the poll's safety net while
// this relay runs: such a transaction holds the table's advisory lock,
// shared, until it ends, and a relay that leaves its flow clears the time
// first (or, where that failed, waits until the time it set, or may have
// set, has lapsed), then polls as in the flow until it can take that lock
// exclusively (without waiting, once per look), and then looks once more
// before it waits for NOTIFY again. Other relays of the table get no NOTIFY while
// the trigger is quiet: they find what this one leaves at their poll.
type quietFlow struct {
	on      bool      // the trigger is quiet, by this relay: it polls
	leaving bool      // the flow is over; transactions kept quiet may be open
	left    time.Time // when leaving began
	// until is when the last time this relay set has lapsed for sure, on
	// the relay's clock; zero once it is cleared.
	until time.Time
	renew time.Time // when to set the time again, while on
	since time.Time // the start of the window being measured
	rows  int       // the rows claimed in it
	// enterSince and enterRows are since and rows of quietEnterWindow.
	enterSince time.Time
	enterRows  int
	// setFailed: a setval of the time (set, or its clear) failed, and
	// was logged; lookFailed: the same for quietOver's look. Each is a run
	// of its own, ended only by a success of its own statement: one flag
	// for all, ended by the look that succeeds between two entries, logged
	// a setval that kept failing (its privilege revoked, the sequence
	// dropped) again at every entry window, every second of a flow.
	setFailed, lookFailed bool
	long                  bool // a long leave was logged
}

// polls reports whether the relay polls rather than wait for NOTIFY.
func (q *quietFlow) polls() bool { return q.on || q.leaving }

// quietSequence is the table's quiet sequence when the relay listens and
// may keep the trigger quiet, "" otherwise.
func (f *Forwarder) quietSequence() string {
	if f.cfg.QuietAbove < 0 || f.cfg.MinPollInterval > quietLeavePoll || !f.woken.Load() {
		return ""
	}
	return f.quietSequenceAny()
}

// quietSequenceAny is the last quiet sequence the relay read, whether or
// not it may use it now.
func (f *Forwarder) quietSequenceAny() string {
	if p := f.quietSeq.Load(); p != nil {
		return *p
	}
	return ""
}

// quiet follows the flow after a sweep: it keeps the trigger quiet once
// the flow was above QuietAbove over a second, and lets it notify again
// when the flow falls below half of it over 100 ms.
func (l *relayLoop) quiet(ctx context.Context, s swept) {
	q, f := &l.q, l.f
	now := time.Now()
	if s.claimed != nil {
		q.rows += len(s.claimed.claim.rows)
		q.enterRows += len(s.claimed.claim.rows)
	}
	seq := f.quietSequence()
	switch {
	case q.leaving:
		if q.over(ctx, f, now) {
			// A last look, at once, takes what they committed; NOTIFY
			// wakes the relay from here on.
			q.leaving = false
			f.Notify()
		}
	case q.on && seq == "":
		q.leave(ctx, f, now) // the trigger, LISTEN or the privilege is gone
	case q.on && !now.Before(q.renew):
		if !q.set(ctx, f, seq, now) {
			q.leave(ctx, f, now)
		}
	}
	above := float64(f.cfg.QuietAbove)
	if elapsed := now.Sub(q.enterSince); elapsed >= quietEnterWindow {
		rate := float64(q.enterRows) / elapsed.Seconds()
		q.enterRows, q.enterSince = 0, now
		if !q.polls() && seq != "" && rate >= above {
			switch {
			case q.set(ctx, f, seq, now):
				q.on, q.rows, q.since = true, 0, now
				f.log.Debug("Outbox relay in a flow: the NOTIFY trigger stays quiet, the relay polls", watermill.LogFields{"per_second": int(rate)})
			case !q.until.IsZero():
				// The time may be set all the same: cleared, or left to
				// lapse, and what it kept quiet waited for, as at the end
				// of a flow.
				q.leave(ctx, f, now)
			}
		}
	}
	if elapsed := now.Sub(q.since); elapsed >= quietWindow {
		rate := float64(q.rows) / elapsed.Seconds()
		q.rows, q.since = 0, now
		if q.on && rate < above/2 {
			q.leave(ctx, f, now)
			f.log.Debug("Outbox relay out of its flow: the NOTIFY trigger notifies again", watermill.LogFields{"per_second": int(rate)})
		}
	}
}

// set keeps the trigger quiet for quietLease from now, and reports whether
// it did. A set that failed may have taken effect all the same: setval is
// not transactional, and the server may have run it with its answer lost
// to a connection reset or to a context cut at stop. Unless the driver
// says the statement never went out, until moves to the latest time the
// server may hold, and the caller leaves the flow, which clears that time
// or polls until it has lapsed, and then until the transactions it kept
// quiet have ended. Taken as not set, the time left the relay waiting for
// the NOTIFYs the trigger kept quiet, and a commit of that second for the
// poll.
func (q *quietFlow) set(ctx context.Context, f *Forwarder, seq string, now time.Time) bool {
	err := f.store.quietFor(ctx, seq, quietLease)
	// The time was set on the database's clock while the statement ran:
	// after it returned (or failed), quietLease on this clock is past it,
	// and a margin covers the clocks' rates, and a statement the server
	// ran a little after the client gave it up.
	lapsed := time.Now().Add(quietLease + quietLease/10)
	if err != nil {
		what := "keep the NOTIFY trigger quiet; NOTIFY wakes it meanwhile"
		if !sqldialect.NeverSent(err) && !errors.Is(err, errNoConnection) {
			q.until = lapsed
		}
		if !q.until.IsZero() {
			what = "keep the NOTIFY trigger quiet; it polls until the time it may have set is cleared or has lapsed"
		}
		f.quietFailed(&q.setFailed, what, err)
		return false
	}
	q.setFailed = false
	q.renew, q.until = now.Add(quietLease/2), lapsed
	return true
}

// leave lets the trigger notify again, and has the relay poll until the
// transactions it kept quiet have ended (see over).
func (q *quietFlow) leave(ctx context.Context, f *Forwarder, now time.Time) {
	q.on, q.leaving, q.left, q.long = false, true, now, false
	if seq := f.quietSequenceAny(); seq != "" && !q.until.IsZero() {
		if err := f.store.quietOff(ctx, seq); !f.quietFailed(&q.setFailed, "let the NOTIFY trigger notify again; it polls until the time has lapsed", err) {
			q.until = time.Time{}
		}
		// Otherwise the time lapses by itself, at until.
	}
}

// over reports whether the relay leaving its flow may count on NOTIFY
// again: the time it set is cleared or has lapsed, and every transaction
// the trigger kept quiet has ended.
func (q *quietFlow) over(ctx context.Context, f *Forwarder, now time.Time) bool {
	if !q.until.IsZero() {
		if now.Before(q.until) {
			q.leave(ctx, f, q.left) // try the clear again
			if !q.until.IsZero() {
				return false
			}
		} else {
			q.until = time.Time{} // lapsed
		}
	}
	over, err := f.store.quietOver(ctx)
	if f.quietFailed(&q.lookFailed, "see whether the transactions the NOTIFY trigger kept quiet have ended; it polls meanwhile", err) || !over {
		if !q.long && now.Sub(q.left) > quietLongLeave {
			q.long = true
			f.log.Info("A transaction the NOTIFY trigger kept quiet is still open; the relay polls until it ends",
				watermill.LogFields{"for": now.Sub(q.left).Round(time.Second), "poll": quietLeavePoll})
		}
		return false
	}
	return true
}

// stop lets the trigger notify again as the relay stops, rather than leave
// the time to lapse, waits stopGrace at most for the transactions it kept
// quiet, and wakes the other relays of the table for what they committed.
func (q *quietFlow) stop(f *Forwarder) {
	if !q.polls() {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), stopGrace)
	defer cancel()
	if q.on {
		q.leave(ctx, f, time.Now())
	}
	q.setFailed, q.lookFailed = true, true // a stopping relay logs none of these failures: it is gone
	for !q.over(ctx, f, time.Now()) && sleepCtx(ctx, quietLeavePoll) {
	}
	wake, cancel := context.WithTimeout(context.Background(), stopGrace)
	defer cancel()
	f.store.wake(wake, 1)
}

// quietFailed reports whether err is an error, and logs the first of a
// run of them, which *failed (setFailed or lookFailed) follows.
func (f *Forwarder) quietFailed(failed *bool, what string, err error) bool {
	if err == nil {
		*failed = false
		return false
	}
	if errors.Is(err, errNoConnection) {
		return true // the pool is busy: tried again at the next sweep
	}
	if !*failed {
		f.log.Error("Outbox relay cannot "+what, err, nil)
	}
	*failed = true
	return true
}
