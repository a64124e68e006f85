package outbox

import (
	"context"
	"sync"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
)

// WakeMetadataKey is set ("true") on the message inbox.Subscriber delivers
// to a handler as it starts (see Subscriber): a middleware before the
// inbox that counts, traces or validates messages may leave it alone. The
// inbox and Plugin know the message by its context, or by its UUID, which
// only the process that sent it knows: a broker message carrying this key
// is a message like any other.
const WakeMetadataKey = "x-acemq-inbox-wake"

// Subscriber wraps sub, the subscriber of router handlers behind this
// ordered inbox, so that each handler's held messages whose turn has come
// run as the router starts, with no delivery to wait for:
//
//	router.AddConsumerHandler("ledger-paid", "order.paid", inbox.Subscriber(sub), paid)
//	router.AddPlugin(inbox.Plugin())
//
// A held message runs in the handler it was delivered to, through the
// middlewares after the inbox and with that handler's router context,
// which the inbox learns from a delivery: Watermill tells no plugin which
// chain is whose. So a restarted service's message held on one topic and
// released by its predecessor on another (or by outboxctl skip, or whose
// handler failed before the stop) waited for its handler's next delivery,
// for good on a topic gone quiet (a review's ledger had 98 of 100 keys
// held after a restart until a new order came). Wrapped, each of the
// router's Subscribe calls first delivers one message of the inbox's own
// (payload {}, UUID its own, WakeMetadataKey set): the router gives it the
// handler's context, and the middlewares before the inbox see it as a
// delivery; the inbox learns the handler from it, applies the consumer's
// held messages that are ready, and acks it. It never reaches a handler:
// Plugin's middleware, the innermost, ends one that no inbox took (a
// handler of the subscriber not behind this inbox), and PoisonPublisher
// sets none aside.
//
// Plugin's middleware is added as the router runs, so it is the innermost
// only of the middlewares added before Run: give a handler the inbox's
// Middleware (router- or handler-level) before Run. One given it after
// Run (a handler added after Run, then RunHandlers) has its wake ended
// before the inbox, and its held messages wait for its first delivery, as
// without the wrapper. A middleware before the inbox that hands on a
// rebuilt message (a copy without the delivery's context) has its router
// values given back by the inbox where it can tell the delivery (see
// restoreDelivery); a wake is known by its UUID even where it cannot.
//
// Without Plugin on the router, or for an inbox that is not Ordered, it
// delivers nothing of its own: sub as it is.
func (in *Inbox) Subscriber(sub message.Subscriber) message.Subscriber {
	return &wakeSubscriber{Subscriber: sub, in: in}
}

// pluggedKey is set, in the context a handler's Subscribe is given, by the
// subscriber decorator of in's Plugin: the router runs in's plugin, and
// its middleware ends a wake no inbox took.
type pluggedKey struct{ in *Inbox }

// wakeKey holds, in a wake message's context, the Inbox it wakes; a
// route's context masks it with nil (see Inbox.wake).
type wakeKey struct{}

// wakes holds the wakes sent and not yet taken, by UUID, each's Inbox: a
// middleware before the inbox that hands on a rebuilt message (decrypting,
// decompressing) drops the wake's context, and the inbox took such a
// message for a delivery, which its handler then saw. A wake no inbox or
// Plugin took stays, one per handler and start.
var wakes sync.Map // string → *Inbox

// wakeOf is the Inbox msg is a wake of, nil for any other message: known by
// its context, or, rebuilt, by its UUID and WakeMetadataKey (a broker
// message carrying that key is a message like any other: it cannot know
// the UUID of a wake in flight).
func wakeOf(msg *message.Message) *Inbox {
	if in, ok := msg.Context().Value(wakeKey{}).(*Inbox); ok {
		return in
	}
	if msg.Metadata.Get(WakeMetadataKey) == "" {
		return nil
	}
	if in, ok := wakes.Load(msg.UUID); ok {
		return in.(*Inbox)
	}
	return nil
}

// wakeTaken forgets the wake msg once an inbox or Plugin took it.
func wakeTaken(msg *message.Message) { wakes.Delete(msg.UUID) }

// wakeSubscriber is Subscriber's.
type wakeSubscriber struct {
	message.Subscriber
	in *Inbox
	wg sync.WaitGroup
}

func (s *wakeSubscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	msgs, err := s.Subscriber.Subscribe(ctx, topic)
	if err != nil || s.in.ordered == nil || ctx.Value(pluggedKey{s.in}) == nil {
		return msgs, err
	}
	// A payload of its own, which a copy of it shares: the inbox knows a
	// copy's delivery by it (see inFlight), and so the handler it woke
	// behind a middleware that hands on msg.Copy(). "{}", not "": a JSON
	// decoder before the inbox reads it.
	wake := message.NewMessage(watermill.NewUUID(), []byte("{}"))
	wake.Metadata.Set(WakeMetadataKey, "true")
	wake.SetContext(context.WithValue(ctx, wakeKey{}, s.in))
	wakes.Store(wake.UUID, s.in)
	out := make(chan *message.Message)
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		defer close(out)
		select {
		case out <- wake:
		case <-ctx.Done():
			wakeTaken(wake)
		}
		for msg := range msgs {
			out <- msg
		}
	}()
	return out, nil
}

func (s *wakeSubscriber) Close() error {
	err := s.Subscriber.Close()
	s.wg.Wait()
	return err
}

// wake learns, from a wake message of its own that reached its Middleware
// (h: what the middleware wraps; code: h's), the route of the handler it
// was delivered to, and applies the consumer's ready held messages. A
// failure is logged: the message is the inbox's own, and ApplyHeld's ticks
// try again, now that the route is known.
func (in *Inbox) wake(h message.HandlerFunc, code handlerCode, msg *message.Message) {
	ctx := msg.Context()
	consumer := in.consumerIn(ctx)
	fields := watermill.LogFields{"consumer": consumer, "woken_by": message.HandlerNameFromCtx(ctx)}
	if err := checkConsumer(in.dialect, consumer); err != nil {
		in.log.Error("Outbox inbox: a handler's held messages cannot be applied at its start: its consumer name is not valid", err, fields)
		return
	}
	// The route keeps the context: masked, so that a held message run in
	// it is no wake.
	if err := in.remember(consumer, h, code, context.WithValue(ctx, wakeKey{}, nil)); err != nil {
		in.log.Error("Outbox inbox: a handler's held messages cannot be applied at its start", err, fields)
		return
	}
	// One wake of a consumer at a time: the wakes of its handlers come at
	// once, and each read the same ready keys and contended for them (a
	// review: about 250 keys a second, however many handlers). The next
	// one then finds what only its handler could run.
	release, ok := in.ordered.scanTurn(ctx, consumer)
	if !ok {
		return
	}
	defer release()
	n, err := in.applyHeldOf(ctx, consumer)
	if n > 0 {
		fields["applied"] = n
		in.log.Info("Outbox inbox: held messages whose turn had come applied as a handler of their consumer started", fields)
	}
	switch {
	case err == nil:
	case ctx.Err() != nil:
		// The router closing, or Timeout's deadline, before the inbox.
		in.log.Info("Outbox inbox: held messages left for ApplyHeld's ticks: the wake's context ended before it applied them all", fields)
	default:
		in.log.Error("Outbox inbox: held messages could not all be applied as their handler started; ApplyHeld tries again", err, fields)
	}
}

// scanTurn waits, until ctx ends (ok false), for the consumer's turn to
// apply its ready held messages at a wake; release gives it back.
func (o *orderedState) scanTurn(ctx context.Context, consumer string) (release func(), ok bool) {
	o.mu.Lock()
	if o.scans == nil {
		o.scans = map[string]chan struct{}{}
	}
	turn, had := o.scans[consumer]
	if !had {
		turn = make(chan struct{}, 1)
		o.scans[consumer] = turn
	}
	o.mu.Unlock()
	select {
	case turn <- struct{}{}:
		return func() { <-turn }, true
	case <-ctx.Done():
		return nil, false
	}
}

// endWakes is Plugin's middleware, the router's innermost: a wake message
// that no inbox took (its handler is not behind the inbox whose Subscriber
// wrapped the handler's subscriber) ends here, acked, before the handler.
func endWakes(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		if wakeOf(msg) != nil {
			wakeTaken(msg)
			return nil, nil
		}
		return h(msg)
	}
}
