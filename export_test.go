package outbox

import (
	"context"
	"database/sql"
	"time"
)

// SetAfterPublishHook installs fn to run between the broker's confirms and
// the marks of every sweep: the window in which a relay's death duplicates.
// An error fails the marks, as a database failure would.
func SetAfterPublishHook(f *Forwarder, fn func(published []string) error) { f.afterPublish = fn }

// SetBackoffHook installs fn to be told of each backoff Run waits out
// after a failed sweep, before Run.
func SetBackoffHook(f *Forwarder, fn func(wait time.Duration)) { f.backedOff = fn }

// SetGrowBytes sets the bodies' size at which a drain's claims stop growing
// (growBytes), before Run.
func SetGrowBytes(f *Forwarder, n int) { f.growBytes = n }

// ClaimsOverlap reports whether the store's claims may overlap (pipelining).
func ClaimsOverlap(s *Store) bool { return s.claimsOverlap() }

// PendingIndex is the step of a locking claim that looks the pending index
// up in tx if it is not known yet, and returns the index the claim names.
func PendingIndex(s *Store, tx *sql.Tx) (string, error) {
	index, _, err := s.claimIndexes(context.Background(), tx)
	return index, err
}

// KeyIndex is the same step's index of a key's pending rows, which the
// claim's key-head probe names.
func KeyIndex(s *Store, tx *sql.Tx) (string, error) {
	_, keyIndex, err := s.claimIndexes(context.Background(), tx)
	return keyIndex, err
}

// SwapPrepared replaces each statement the relay prepared with the same SQL
// prepared on other, which the relay's transactions cannot use: every
// prepared claim and mark then fails, as on a proxy that lost them. It
// returns how many it replaced.
func SwapPrepared(f *Forwarder, other *sql.DB) (int, error) {
	m := f.store.stmts.Load()
	if m == nil {
		return 0, nil
	}
	swapped := make(map[string]*sql.Stmt, len(*m))
	for q := range *m {
		st, err := other.Prepare(q)
		if err != nil {
			return 0, err
		}
		swapped[q] = st
	}
	f.store.stmts.Store(&swapped)
	return len(swapped), nil
}

// Prepared is how many statements the relay runs prepared.
func Prepared(f *Forwarder) int {
	if m := f.store.stmts.Load(); m != nil {
		return len(*m)
	}
	return 0
}

// HeldClaim is a claim a test holds: its rows are in flight until it
// publishes or abandons them.
type HeldClaim struct {
	s *Store
	c *claim
}

// Claim claims up to n rows as a relay's sweep does (leased to relayID on
// SQLite), and returns their ids in claim order.
func Claim(s *Store, n int, relayID string) ([]string, *HeldClaim, error) {
	return ClaimInFlight(s, n, relayID, nil)
}

// ClaimInFlight is Claim by a relay that has the keyed records inFlight in
// flight: their keys' next records are claimable too.
func ClaimInFlight(s *Store, n int, relayID string, inFlight []string) ([]string, *HeldClaim, error) {
	c, err := s.claimBatch(context.Background(), n, relayID, time.Minute, nil, inFlight)
	if err != nil {
		return nil, nil, err
	}
	ids := make([]string, len(c.rows))
	for i, r := range c.rows {
		ids[i] = r.ID
	}
	return ids, &HeldClaim{s: s, c: c}, nil
}

// Publish marks the claim's rows published, as the relay does once the
// broker confirmed them, and ends the claim.
func (h *HeldClaim) Publish() error {
	ids := make([]string, len(h.c.rows))
	for i, r := range h.c.rows {
		ids[i] = r.ID
	}
	return h.s.finish(context.Background(), h.c, ids, nil)
}

// Abandon ends the claim, marking nothing.
func (h *HeldClaim) Abandon() error { return h.s.abandon(context.Background(), h.c) }

// SetTriggerRecheck sets how often a listening relay looks at the NOTIFY
// trigger, and returns a func that sets it back.
func SetTriggerRecheck(d time.Duration) (restore func()) {
	old := triggerRecheck
	triggerRecheck = d
	return func() { triggerRecheck = old }
}

// Woken reports whether the relay counts on being woken at another
// process's commit (a LISTEN on a table whose NOTIFY trigger fires, or
// SQLite's file watch), so that its poll is only a safety net.
func Woken(f *Forwarder) bool { return f.woken.Load() }

// StatementsSent is how many statements the store's relay sent.
func StatementsSent(s *Store) int64 { return s.sent.Load() }

// DestBookkeeping reports the sizes of an AMQPDestination's bookkeeping:
// returns filed on its current channel, suspects, windows in flight, short
// windows, exchanges known.
func DestBookkeeping(d *AMQPDestination) (returned, suspects, inflight, short, exchanges int) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.cc != nil {
		for _, r := range d.cc.returned {
			returned += len(r)
		}
	}
	return returned, len(d.suspects), len(d.inflight), len(d.short), len(d.exchanges)
}

// PrepareClaims prepares the relay's statements on s, its claims of sizes
// among them, as a relay does at Run, and returns how many it prepared.
func PrepareClaims(s *Store, sizes ...int) (int, error) {
	if err := s.prepareRelay(context.Background(), sizes); err != nil {
		return 0, err
	}
	if m := s.stmts.Load(); m != nil {
		return len(*m), nil
	}
	return 0, nil
}

// SetInboxClock makes in read this process's clock from local (see dbClock):
// a host whose clock is off.
func SetInboxClock(in *Inbox, local func() time.Time) { in.clock.local = local }

// SetClaimWindow sets how many pending entries s's claims of n rows walk
// before they look for the rest key by key. Set before s is used.
func SetClaimWindow(s *Store, f func(n int) int) { s.window = f }

// SetEveryClaimWindow sets every store's window; call it before any test
// runs.
func SetEveryClaimWindow(n int) { everyClaimWindow = n }

// SetForwarderClaimWindow is SetClaimWindow on f's store.
func SetForwarderClaimWindow(f *Forwarder, fn func(n int) int) { f.store.window = fn }

// SetKeysPerClaim sets how many keys s's windowed claims of n rows look at
// beyond their window, each after where the last stopped. Set before s is
// used.
func SetKeysPerClaim(s *Store, f func(n int) int) { s.slice = f }

// SetBeforeStats has f run fn before each reading of its metrics' figures.
// Set before Run.
func SetBeforeStats(f *Forwarder, fn func()) { f.beforeStats = fn }

// SetFloorOn makes the relay of f keep its floor (see headFloor), read
// from the head by its next claim or probe, and start at the head again
// only every every.
func SetFloorOn(f *Forwarder, every time.Duration) {
	fl := f.store.floor
	fl.mu.Lock()
	defer fl.mu.Unlock()
	fl.checkAbove, fl.checkEvery, fl.gainAbove, fl.everyMin, fl.everyMax = 0, 0, -time.Hour, every, every
	fl.on, fl.next = true, time.Time{}
}

// FloorOn reports whether the relay of f keeps its floor.
func FloorOn(f *Forwarder) bool {
	fl := f.store.floor
	fl.mu.Lock()
	defer fl.mu.Unlock()
	return fl.on
}

// SetListenLived sets how long a LISTEN must last for the reconnect after
// its loss to start from the shortest backoff, and returns a func that
// sets it back.
func SetListenLived(d time.Duration) (restore func()) {
	old := listenLived
	listenLived = d
	return func() { listenLived = old }
}

// InFlightDeliveries is how many deliveries of uuid in's plugged routers
// have handed out and not yet seen acked or nacked.
func InFlightDeliveries(in *Inbox, uuid string) int {
	in.flight.mu.Lock()
	defer in.flight.mu.Unlock()
	return len(in.flight.byUUID[uuid])
}
