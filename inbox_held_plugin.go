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
// ordered inbox (Ordered); for another it adds nothing:
//
//	router.AddPlugin(inbox.Plugin())
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
		if in.ordered == nil || r.IsClosed() {
			return nil
		}
		name := "outbox-inbox-held"
		for i := 2; ; i++ {
			if _, taken := r.Handlers()[name]; !taken {
				break
			}
			name = fmt.Sprintf("outbox-inbox-held #%d", i)
		}
		r.AddConsumerHandler(name, in.cfg.Table, &heldSubscriber{in: in, done: make(chan struct{})}, func(*message.Message) error {
			return errors.New("outbox: the inbox's held-message handler received a message; its subscriber delivers none")
		})
		return nil
	}
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
