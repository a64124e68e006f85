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
// context. It knows the handlers the router has when it starts; a router
// it was added to that has stopped counts as stopping for its handlers'
// names until a router with the plugin runs them again.
//
// A held message whose handler fails when its predecessor commits stays
// held until its key's next delivery or an ApplyHeld, and a key with no
// next delivery (its last event) waited for good, with its outbox record
// marked processed, where the service ran no ticker of its own (a review's
// service did so). The plugin adds a handler of its own to the router
// ("outbox-inbox-held", and " #2", " #3"… for a second inbox), which
// receives no message: its subscriber ticks until the router closes. A
// failed ApplyHeld is logged and tried again at the next tick.
func (in *Inbox) Plugin() message.RouterPlugin {
	return func(r *message.Router) error {
		if r.IsClosed() {
			return nil
		}
		base := "outbox-inbox"
		if in.ordered != nil {
			base = "outbox-inbox-held"
		}
		handlers := r.Handlers()
		name := base
		for i := 2; ; i++ {
			if _, taken := handlers[name]; !taken {
				break
			}
			name = fmt.Sprintf("%s #%d", base, i)
		}
		names := make([]string, 0, len(handlers))
		for h := range handlers {
			names = append(names, h)
		}
		r.AddConsumerHandler(name, in.cfg.Table, &heldSubscriber{in: in, handlers: names, done: make(chan struct{})}, func(*message.Message) error {
			return errors.New("outbox: the inbox's plugin handler received a message; its subscriber delivers none")
		})
		return nil
	}
}

// heldSubscriber is the subscriber of Plugin's handler: Subscribe records
// the router's handlers under the context the router cancels when it
// stops, starts the ticks of an ordered inbox under it, and returns a
// channel that closes when it ends.
type heldSubscriber struct {
	in       *Inbox
	handlers []string // the router's, when Plugin ran

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
	s.in.routersMu.Lock()
	if s.in.routers == nil {
		s.in.routers = make(map[string]context.Context)
	}
	for _, h := range s.handlers {
		s.in.routers[h] = ctx // the router's: not the one Close below cancels
	}
	s.in.routersMu.Unlock()
	ctx, s.stop = context.WithCancel(ctx)
	out := make(chan *message.Message)
	go func() {
		defer close(s.done)
		defer close(out)
		if s.in.ordered == nil {
			<-ctx.Done()
			return
		}
		s.tick(ctx)
	}()
	return out, nil
}

func (s *heldSubscriber) tick(ctx context.Context) {
	t := time.NewTicker(s.in.cfg.ApplyHeldEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if _, err := s.in.ApplyHeld(ctx); err != nil && ctx.Err() == nil {
			s.in.log.Error("Outbox inbox: held messages could not all be applied; trying again at the next tick", err,
				watermill.LogFields{"every": s.in.cfg.ApplyHeldEvery.String()})
		}
	}
}

// Close stops the ticks and waits for them: an ApplyHeld under way ends
// with its context.
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
