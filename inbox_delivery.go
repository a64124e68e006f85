package outbox

import (
	"context"
	"sync"

	"github.com/ThreeDotsLabs/watermill/message"
)

// inFlight holds the deliveries a plugged inbox's router has handed to its
// handlers and not yet seen acked or nacked, by UUID: what a copy of one
// without its context (msg.Copy() in a middleware before the inbox) is
// given back (see restoreDelivery).
//
// Such a copy had lost the router's values: its handler name, which an
// ordered inbox holds a message for (a review's ledger, behind a
// middleware that handed on msg.Copy(), applied 251 of 300 order.paid
// events in its order.placed handler), and which is the consumer where
// ConsumerName is unset (every such message refused); its subscribe topic;
// the router's run, which tells PoisonPublisher the router is stopping.
type inFlight struct {
	mu     sync.Mutex
	byUUID map[string][]*delivery
}

// delivery is one message as the router delivered it: the first byte of
// its payload, which a copy shares (Copy keeps the slice), and its context.
type delivery struct {
	payload *byte
	ctx     context.Context
}

func payloadOf(msg *message.Message) *byte {
	if len(msg.Payload) == 0 {
		return nil
	}
	return &msg.Payload[0]
}

// add notes msg, delivered, until it is acked or nacked, or closed (the
// subscriber that delivered it closed).
func (f *inFlight) add(msg *message.Message, closed <-chan struct{}) {
	d := &delivery{payload: payloadOf(msg), ctx: msg.Context()}
	f.mu.Lock()
	if f.byUUID == nil {
		f.byUUID = map[string][]*delivery{}
	}
	f.byUUID[msg.UUID] = append(f.byUUID[msg.UUID], d)
	f.mu.Unlock()
	go func() {
		select {
		case <-msg.Acked():
		case <-msg.Nacked():
		case <-closed:
		}
		f.remove(msg.UUID, d)
	}()
}

func (f *inFlight) remove(uuid string, d *delivery) {
	f.mu.Lock()
	defer f.mu.Unlock()
	ds := f.byUUID[uuid]
	for i, x := range ds {
		if x == d {
			ds = append(ds[:i], ds[i+1:]...)
			break
		}
	}
	if len(ds) == 0 {
		delete(f.byUUID, uuid)
	} else {
		f.byUUID[uuid] = ds
	}
}

// find is the delivery msg is a copy of: the one of its UUID whose payload
// it shares, or the only one of its UUID (its payload rebuilt: decrypted,
// decompressed). Nil where none is in flight, or where it cannot tell two
// apart (one message fanned out to two handlers, and rebuilt; or sharing
// the payload, as gochannel's copies do).
func (f *inFlight) find(msg *message.Message) *delivery {
	f.mu.Lock()
	defer f.mu.Unlock()
	ds := f.byUUID[msg.UUID]
	if len(ds) == 1 {
		return ds[0]
	}
	p := payloadOf(msg)
	if p == nil {
		return nil
	}
	var found *delivery
	for _, d := range ds {
		if d.payload == p {
			if found != nil {
				return nil
			}
			found = d
		}
	}
	return found
}

// restoreDelivery gives msg, handed to the inbox without the context its router
// delivered it with (its handler name, its run), the values of that
// context beneath its own: a middleware before the inbox handed on a copy
// (msg.Copy()). Its own context keeps its cancellation, deadline and
// values. A message not from a plugged router, or with its context, is
// left as it is.
func (in *Inbox) restoreDelivery(msg *message.Message) {
	if !in.plugged.Load() || msg.Context().Value(routerRunKey{}) != nil {
		return
	}
	if d := in.flight.find(msg); d != nil {
		msg.SetContext(beneath{msg.Context(), d.ctx})
	}
}

// beneath is a context whose values are its own first, then under's.
type beneath struct {
	context.Context
	under context.Context
}

func (c beneath) Value(key any) any {
	if v := c.Context.Value(key); v != nil {
		return v
	}
	return c.under.Value(key)
}
