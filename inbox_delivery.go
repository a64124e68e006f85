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

// add notes msg, delivered and not yet handed to the router, until it is
// acked or nacked. The router acks or nacks every message it takes, after
// Close too (a Retry under way crosses it), and a handler's panic too: a
// delivery is forgotten only when no copy of it can reach the inbox again.
// One that shares its payload with another in flight (gochannel hands its
// subscribers copies of one message) is given bytes of its own first: its
// copies are then told apart.
func (f *inFlight) add(msg *message.Message) {
	f.mu.Lock()
	if f.byUUID == nil {
		f.byUUID = map[string][]*delivery{}
	}
	if p := payloadOf(msg); p != nil {
		for _, x := range f.byUUID[msg.UUID] {
			if x.payload == p {
				msg.Payload = append([]byte(nil), msg.Payload...)
				break
			}
		}
	}
	d := &delivery{payload: payloadOf(msg), ctx: msg.Context()}
	f.byUUID[msg.UUID] = append(f.byUUID[msg.UUID], d)
	f.mu.Unlock()
	go func() {
		select {
		case <-msg.Acked():
		case <-msg.Nacked():
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
// it shares (msg.Copy() keeps the slice). Nil where there is none: its
// payload rebuilt (decrypted, decompressed) or empty, or a message of the
// same UUID that is no copy (a consume loop's, outside the router): the
// only delivery of its UUID in flight may be another handler's of one
// message fanned out (its own acked before the inbox, by InstantAck), and
// a copy given that handler's name took its dedupe row, and its delivery
// was then skipped as a duplicate.
func (f *inFlight) find(msg *message.Message) *delivery {
	p := payloadOf(msg)
	if p == nil {
		return nil
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, d := range f.byUUID[msg.UUID] {
		if d.payload == p {
			return d
		}
	}
	return nil
}

// restoreDelivery gives msg, handed to the inbox without the context its
// router delivered it with (its handler name, its run), the values of
// that context beneath its own: a middleware before the inbox handed on a
// copy (msg.Copy()). Its own context keeps its cancellation, deadline and
// values. A message that is no copy of a delivery in flight (see find),
// or that carries its router's context, is left as it is.
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
