package outbox

import (
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
)

// inFlight gives a copy the delivery whose payload it shares, and nothing
// else: not a rebuilt payload, nor another message of the UUID; a
// delivery sharing its payload with one in flight gets bytes of its own;
// each is forgotten once acked or nacked.
func TestInFlight_FindsTheDeliveryACopyCameFrom_ForgetsItOnceDone(t *testing.T) {
	var f inFlight
	billing := message.NewMessage("m-1", []byte("order 11"))
	shipping := message.NewMessage("m-1", []byte("order 11")) // its own delivery, its own bytes
	fanned := message.NewMessage("m-2", []byte("order 12"))
	sharing := fanned.Copy() // gochannel's fan-out: one payload for both
	empty := message.NewMessage("m-3", nil)
	for _, m := range []*message.Message{billing, shipping, fanned, sharing, empty} {
		f.add(m)
	}
	if &sharing.Payload[0] == &fanned.Payload[0] || string(sharing.Payload) != "order 12" {
		t.Error("a delivery sharing its payload with one in flight kept it")
	}
	for name, m := range map[string]*message.Message{"billing": billing, "shipping": shipping, "fanned": fanned, "sharing": sharing} {
		if d := f.find(m.Copy()); d == nil || d.payload != &m.Payload[0] {
			t.Errorf("a copy of %s's delivery found %v", name, d)
		}
	}
	for what, m := range map[string]*message.Message{
		"a rebuilt payload":             message.NewMessage("m-1", []byte("order 11")),
		"an empty payload":              empty.Copy(),
		"a UUID not in flight":          message.NewMessage("m-4", []byte("x")),
		"a rebuilt payload of one UUID": message.NewMessage("m-3", []byte("rebuilt")),
	} {
		if d := f.find(m); d != nil {
			t.Errorf("%s found a delivery", what)
		}
	}
	billing.Ack()
	shipping.Nack()
	waitForInFlight(t, &f, 3)
	if d := f.find(shipping.Copy()); d != nil {
		t.Error("a copy of a nacked delivery found it")
	}
	for _, m := range []*message.Message{fanned, sharing, empty} {
		m.Ack()
	}
	waitForInFlight(t, &f, 0)
}

func waitForInFlight(t *testing.T, f *inFlight, want int) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		f.mu.Lock()
		n := 0
		for _, ds := range f.byUUID {
			n += len(ds)
		}
		f.mu.Unlock()
		if n == want {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d deliveries in flight, want %d", n, want)
		}
		time.Sleep(5 * time.Millisecond) // polling the cleanup goroutines, with a deadline
	}
}
