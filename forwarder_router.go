package outbox

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sync"
	"weak"

	"github.com/ThreeDotsLabs/watermill/message"
)

// ErrForwarderInUse is returned by the plugin of a Forwarder that runs
// already (under another router's plugin, under the same plugin added
// twice, under a Run of its own), by a plugin whose router runs a relay
// of the same table already, by Run on a Forwarder whose plugin is on
// a router that has not closed, and by Run called while a Run runs.
var ErrForwarderInUse = errors.New("outbox: forwarder runs already")

// Plugin runs the relay as part of a Watermill router: router.AddPlugin
// registers it, it starts with the router's handlers and stops when the
// router closes, finishing the batch in flight, and the router's Close
// waits for it (up to RouterConfig.CloseTimeout, whose default of 30 s is
// twice the default PublishTimeout: a shorter one returns "router close
// timeout" while the batch still finishes). The router closes the
// Forwarder, and so its destination; a deferred Close of your own is
// harmless, and closes it if the router never started.
//
// Add it in the process that should relay, and leave it out of one that
// should not. Under the router it is a
// handler named "outbox-relay <table>" whose subscriber is the relay
// itself: it delivers no message, so no handler function, middleware or
// router metric ever sees one. It starts after every plugin, so the rows
// Republisher's plugin makes pending are in its first claim whatever the
// order the two were added in.
//
// A router closed before its Run starts no relay, and leaves the Forwarder
// alone.
//
// A Forwarder runs once: its plugin on a second router, or the same plugin
// added twice, fails that router's Run with ErrForwarderInUse, and so does
// a Forwarder already under Run; a Run once the plugin is on a router
// returns ErrForwarderInUse itself. A router closed without starting the
// relay (its Run failed in a later plugin, or at another handler's
// Subscribe) lets the Forwarder go, open: its own Run, or its plugin on
// another router, runs it then, and a Close of your own closes it. A
// router whose Run failed and that is not closed keeps it: nothing tells
// its failed Run from one that is still starting, and Watermill's
// RunHandlers may start its handlers yet.
//
// Two Forwarders of one table, under two routers of one process or of
// two, are safe: claims are exclusive, so each row is published once by
// one of them (and a router refuses the second relay of a table it
// already runs one of from the same pool). A table of the same name in
// another pool (a second database) is relayed under "outbox-relay
// <table> #2", and so on.
//
// The relay stops only when the router closes, its context ends, or the
// Forwarder is closed by hand; in the last case its handler ends, and a
// router left with no handler running closes, as Watermill's routers do.
func (f *Forwarder) Plugin() message.RouterPlugin {
	return func(r *message.Router) error {
		f.unrouteClosed()
		// A router closed before its Run runs its plugins all the same,
		// and its handlers, and then closes them: the relay would have
		// published a batch and closed the Forwarder, the user's. Asked
		// here, under no lock of the router's; asked at Subscribe, under
		// RunHandlers' lock, it would wait for a Close that waits for it.
		if r.IsClosed() {
			f.log.Info("Outbox forwarder: the router closed before its Run; its plugin starts no relay", nil)
			return nil
		}
		routerRelays.Lock()
		defer routerRelays.Unlock()
		name, err := relayHandlerName(r, f)
		if err != nil {
			return err
		}
		sub := &relaySubscriber{f: f, router: weak.Make(r), stopped: make(chan struct{})}
		if err := f.route(sub); err != nil {
			return err
		}
		routerRelays.m[weak.Make(r)][name] = weak.Make(f.store.db)
		r.AddConsumerHandler(name, f.store.cfg.Table, sub, func(*message.Message) error {
			return errors.New("outbox: the relay's handler received a message; its subscriber delivers none")
		})
		return nil
	}
}

// routerRelays is the pool each relay handler of a router relays from, by
// handler name: two databases may each have an acemq_outbox, and a
// service with both runs a relay of each under one router. Weak pointers:
// a router or a pool that is gone is not kept for it.
var routerRelays struct {
	sync.Mutex
	m map[weak.Pointer[message.Router]]map[string]weak.Pointer[sql.DB]
}

// relayHandlerName names f's handler on r, under routerRelays' lock:
// "outbox-relay <table>", or with " #2", " #3"… for a table of that name
// in another pool. A second relay of the same table from the same pool is
// refused (it would only share the claims), and so is a name the router
// has for a handler of its own. The caller records the name once the
// plugin is sure to add it.
func relayHandlerName(r *message.Router, f *Forwarder) (string, error) {
	if routerRelays.m == nil {
		routerRelays.m = map[weak.Pointer[message.Router]]map[string]weak.Pointer[sql.DB]{}
	}
	for k := range routerRelays.m {
		if k.Value() == nil {
			delete(routerRelays.m, k)
		}
	}
	relays := routerRelays.m[weak.Make(r)]
	if relays == nil {
		relays = map[string]weak.Pointer[sql.DB]{}
		routerRelays.m[weak.Make(r)] = relays
	}
	table, handlers := f.store.cfg.Table, r.Handlers()
	name := "outbox-relay " + table
	for i := 2; ; i++ {
		db, ours := relays[name]
		if _, taken := handlers[name]; !taken && !ours {
			return name, nil
		}
		if !ours || db.Value() == f.store.db {
			return "", fmt.Errorf("%w: the router has a relay of %s already (%q)", ErrForwarderInUse, table, name)
		}
		name = fmt.Sprintf("outbox-relay %s #%d", table, i)
	}
}

// route marks the forwarder as run by the router of sub, a router's
// plugin's subscriber, or says why it cannot be: refused here, the
// router's Run returns before any handler starts; refused at Subscribe,
// Watermill would have started some of the others, and would wait for
// ever for the one that failed.
func (f *Forwarder) route(sub *relaySubscriber) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	switch {
	case f.routedBy != nil:
		return fmt.Errorf("%w: its plugin is on a router already; give each router a Forwarder of its own", ErrForwarderInUse)
	case f.runCalled:
		return fmt.Errorf("%w: Run was called; a Forwarder runs under Run or under its plugin, not both", ErrForwarderInUse)
	}
	select {
	case <-f.closing:
		return ErrForwarderClosed
	default:
	}
	f.routedBy = sub
	return nil
}

// unrouteClosed lets the Forwarder go from the router whose plugin took
// it, when that router closed (or is gone) before it started the relay:
// no router runs it then, and it stayed taken for ever, its own Run and
// its plugin on another router refused. The router's Subscribe, should a
// closed router call it yet, ends its handler at once (see claimRun).
// Watermill's IsClosed waits while a Close of that router waits for its
// handlers, up to its CloseTimeout: so does this, under no lock of ours.
func (f *Forwarder) unrouteClosed() {
	f.mu.Lock()
	sub, started := f.routedBy, f.runCalled
	f.mu.Unlock()
	if sub == nil || started {
		return // started: the router runs it, and closes it as it closes
	}
	if r := sub.router.Value(); r != nil && !r.IsClosed() {
		return
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.routedBy == sub && !f.runCalled {
		f.routedBy = nil
	}
}

// errUnrouted is claimRun's answer to the subscriber of a router that let
// the Forwarder go (unrouteClosed).
var errUnrouted = errors.New("outbox: the router closed before it started the relay, and let the forwarder go")

// relaySubscriber is the Subscriber of the relay's router handler: Subscribe
// starts Run, and the channel it returns delivers nothing and closes once
// Run returned and the Forwarder is closed. The router's Close waits for
// that channel, so it waits for the batch in flight.
type relaySubscriber struct {
	f      *Forwarder
	router weak.Pointer[message.Router] // whose plugin added it; gone, it runs nothing

	mu      sync.Mutex
	owns    bool          // Subscribe claimed the run: closing the Forwarder is ours
	stopped chan struct{} // closed when Subscribe's goroutine returned
}

// Subscribe starts the relay under ctx, which the router cancels when it
// closes, and returns once it works, or once it ended because the
// Forwarder was closed before it started.
func (s *relaySubscriber) Subscribe(ctx context.Context, _ string) (<-chan *message.Message, error) {
	s.mu.Lock()
	if s.owns {
		s.mu.Unlock()
		return nil, errors.New("outbox: the relay's subscriber subscribes once")
	}
	// Claimed for the router, whose plugin Run now refuses: no Run started
	// since the plugin ran closes Running for us.
	switch err := s.f.claimRun(s); {
	case errors.Is(err, errUnrouted):
		// The router closed before it got here, and the Forwarder is
		// the user's: the handler ends at once, as one whose Forwarder
		// was closed does. An error would fail the router's Run, and its
		// Close would wait CloseTimeout for this handler.
		s.mu.Unlock()
		out := make(chan *message.Message)
		close(out)
		return out, nil
	case err != nil:
		s.mu.Unlock()
		return nil, err
	}
	s.owns = true
	s.mu.Unlock()

	out := make(chan *message.Message)
	go func() {
		defer close(s.stopped)
		defer close(out)
		// run fails only for a Forwarder closed before it started: by hand,
		// after the plugin ran and before the router started its handlers.
		// Then the handler ends at once, as one closed later would; an
		// error here would fail the router's Run after it started the
		// other handlers, and its Close would wait CloseTimeout for this
		// one.
		if s.f.run(ctx) != nil {
			return
		}
		// run returns nil only once stopped, its batch finished.
		if err := s.f.Close(); err != nil {
			s.f.log.Error("Outbox forwarder: closing the destination failed", err, nil)
		}
	}()
	select {
	case <-s.f.Running():
	case <-s.stopped:
	}
	return out, nil
}

// Close stops the relay, waits for the batch in flight, and closes the
// Forwarder. The router calls it when it closes (its context's end may stop
// the relay first); a subscriber that did not claim the run leaves the
// Forwarder alone.
func (s *relaySubscriber) Close() error {
	s.mu.Lock()
	owns := s.owns
	s.mu.Unlock()
	if !owns {
		return nil
	}
	err := s.f.Close()
	<-s.stopped
	return err
}
