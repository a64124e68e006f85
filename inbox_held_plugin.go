package outbox

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
)

// DefaultApplyHeldEvery is the default of InboxConfig.ApplyHeldEvery.
const DefaultApplyHeldEvery = 10 * time.Second

// Plugin runs ApplyHeld every ApplyHeldEvery while the router runs, for an
// ordered inbox (Ordered), and, for every inbox, tells PoisonPublisher
// when the router stops:
//
//	router.AddPlugin(inbox.Plugin())
//
// A message whose retries the router's stop cut short is then never set
// aside, whatever error Retry answers with: the cause of the context
// router.Run was given (signal.NotifyContext's "interrupt signal
// received", errgroup's, …), which PoisonPublisher cannot tell from a
// handler's failure otherwise once Timeout has ended the message's own
// context. It puts, through a subscriber decorator, the context of the
// handler's run into each delivery's context: a message knows the router
// that delivered it, whatever other router runs a handler of that name.
// It notes each delivery until it is acked or nacked: a copy a middleware
// before the inbox hands on without the delivery's context (msg.Copy())
// gets the delivery's router values back at the inbox (its handler name,
// its topics, the run).
//
// A held message whose handler fails when its predecessor commits stays
// held until its key's next delivery or an ApplyHeld, and a key with no
// next delivery (its last event) waited for good, with its outbox record
// marked processed, where the service ran no ticker of its own (a review's
// service did so). For that, the plugin of an ordered inbox adds a
// handler of its own to the router ("outbox-inbox-held", and " #2", " #3"…
// for a second inbox), which receives no message: its subscriber ticks
// until the router closes. A failed ApplyHeld is logged; a held message
// whose handler failed is tried again 100 ms later, doubling up to
// ApplyHeldEvery while it fails.
//
// With the plugin, a handler's subscriber wrapped by Subscriber has the
// handler's held messages applied as the router starts; the plugin's
// middleware, the router's innermost, keeps the inbox's own message from
// any handler.
func (in *Inbox) Plugin() message.RouterPlugin {
	return func(r *message.Router) error {
		if r.IsClosed() {
			return nil
		}
		in.plugged.Store(true)
		// Every delivery carries the context of the handler's run that
		// delivered it (see routerStopping): the router's own, whatever
		// other router runs a handler of the same name with this Inbox,
		// and for handlers added after Run as well.
		r.AddSubscriberDecorators(func(sub message.Subscriber) (message.Subscriber, error) {
			return &runStampingSubscriber{Subscriber: sub, in: in}, nil
		})
		// Added as the router runs, after the service's own: the innermost,
		// it ends a wake of Subscriber's that no inbox took.
		r.AddMiddleware(endWakes)
		if in.ordered == nil {
			return nil
		}
		name := "outbox-inbox-held"
		handlers := r.Handlers()
		for i := 2; ; i++ {
			if _, taken := handlers[name]; !taken {
				break
			}
			name = fmt.Sprintf("outbox-inbox-held #%d", i)
		}
		r.AddConsumerHandler(name, in.cfg.InboxTable, &heldSubscriber{in: in, done: make(chan struct{})}, func(*message.Message) error {
			return errors.New("outbox: the inbox's held-message handler received a message; its subscriber delivers none")
		})
		return nil
	}
}

// routerRunKey holds, in a delivery's context, the context of the router
// handler's run that delivered it (Plugin's subscriber decorator).
type routerRunKey struct{}

// runStampingSubscriber puts the context its Subscribe is given (the
// router's, for the handler; done once the router or the handler stops)
// into every message's context.
type runStampingSubscriber struct {
	message.Subscriber
	in *Inbox
	wg sync.WaitGroup
}

func (s *runStampingSubscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	// Down to the service's subscriber: a Subscriber of the inbox's wakes
	// the handler (see Subscriber).
	msgs, err := s.Subscriber.Subscribe(context.WithValue(ctx, pluggedKey{s.in}, true), topic)
	if err != nil {
		return nil, err
	}
	out := make(chan *message.Message)
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		defer close(out)
		for msg := range msgs {
			msg.SetContext(context.WithValue(msg.Context(), routerRunKey{}, ctx))
			s.in.flight.add(msg)
			out <- msg
		}
	}()
	return out, nil
}

func (s *runStampingSubscriber) Close() error {
	err := s.Subscriber.Close()
	s.wg.Wait()
	return err
}

// heldSubscriber is the subscriber of Plugin's handler: Subscribe starts
// the ticks, under the context the router cancels when it closes, and
// returns a channel that closes when they stop.
type heldSubscriber struct {
	in *Inbox

	mu      sync.Mutex
	started bool
	stop    context.CancelFunc
	done    chan struct{} // closed when the ticks stopped
}

func (s *heldSubscriber) Subscribe(ctx context.Context, _ string) (<-chan *message.Message, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.started {
		return nil, errors.New("outbox: the inbox's held-message subscriber subscribes once")
	}
	s.started = true
	ctx, s.stop = context.WithCancel(ctx)
	out := make(chan *message.Message)
	go func() {
		defer close(s.done)
		defer close(out)
		s.tick(ctx)
	}()
	return out, nil
}

func (s *heldSubscriber) tick(ctx context.Context) {
	every := s.in.cfg.ApplyHeldEvery
	wait := every
	// retry is the backoff under way since a held message's handler failed
	// (0: none): a failure signalled during it does not start it again, or
	// a stream of them (a downstream outage) kept the ticks at 100 ms.
	var retry time.Duration
	t := time.NewTimer(wait)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-s.in.ordered.failed:
			// A held message's handler failed (at its turn, after its
			// predecessor): tried again soon, as Retry would a delivery,
			// not an ApplyHeldEvery later.
			if retry == 0 {
				retry = min(heldRetryFirst, every)
				if wait > retry {
					wait = retry
					t.Reset(wait)
				}
			}
			continue
		case <-t.C:
		}
		// Under way as the router closes, a held message finishes (see
		// finishing); the next key is not begun.
		work, cancel := finishing(ctx)
		_, err := s.in.applyAllHeld(work, ctx)
		// This tick's own failures are signalled too, and start the backoff
		// where none is under way; they are not cleared here, or a
		// delivery's failure signalled meanwhile went with them, and its
		// held message waited ApplyHeldEvery (a review: 10.7 s, 4 runs of 4).
		cancel()
		switch {
		case err == nil:
			retry, wait = 0, every
		case ctx.Err() != nil:
		case s.in.databaseDown(err):
			// An outage, as the deliveries wait it out: not an error at
			// every tick of it. A backoff under way goes on.
			s.in.log.Info("Outbox inbox: the database connection was lost (SQLite: it stayed locked by another connection) applying held messages; trying again at the next tick",
				watermill.LogFields{"every": every.String(), "error": err.Error()})
			wait = every
			if retry > 0 {
				wait = retry
			}
		default:
			// From heldRetryFirst, doubling while held messages keep failing.
			if retry == 0 {
				retry = min(heldRetryFirst, every)
			} else {
				retry = min(2*retry, every)
			}
			wait = retry
			s.in.log.Error("Outbox inbox: held messages could not all be applied; trying again", err,
				watermill.LogFields{"in": wait.String()})
		}
		t.Reset(wait)
	}
}

// heldRetryFirst is how soon the plugin's ticks try again a held message
// whose handler failed, doubling up to ApplyHeldEvery while it fails: as
// the README's Retry tries a delivery again after 100 ms.
const heldRetryFirst = 100 * time.Millisecond

// Close stops the ticks and waits for them: a held message under way
// finishes, and no other is begun.
func (s *heldSubscriber) Close() error {
	s.mu.Lock()
	started, stop := s.started, s.stop
	s.mu.Unlock()
	if !started {
		return nil
	}
	stop()
	<-s.done
	return nil
}
