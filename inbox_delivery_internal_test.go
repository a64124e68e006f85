package outbox

import (
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
)

// inFlight gives a copy the delivery it shares its payload with, or the
// only delivery of its UUID; none where two cannot be told apart; and
// forgets each delivery once acked, nacked, or its subscriber closed.
func TestInFlight_FindsTheDeliveryACopyCameFrom_ForgetsItOnceDone(t *testing.T) {
	var f inFlight
	closed := make(chan struct{})
	billing := message.NewMessage("m-1", []byte("order 11"))
	shipping := message.NewMessage("m-1", []byte("order 11")) // its own delivery, its own bytes
	fanned := message.NewMessage("m-2", []byte("order 12"))
	sharing := fanned.Copy() // gochannel's fan-out: one payload for both
	empty := message.NewMessage("m-3", nil)
	for _, m := range []*message.Message{billing, shipping, fanned, sharing, empty} {
		f.add(m, closed)
	}
	if d := f.find(billing.Copy()); d == nil || d.payload != &billing.Payload[0] {
		t.Errorf("a copy of billing's delivery found %v", d)
	}
	if d := f.find(shipping.Copy()); d == nil || d.payload != &shipping.Payload[0] {
		t.Errorf("a copy of shipping's delivery found %v", d)
	}
	if d := f.find(message.NewMessage("m-1", []byte("order 11"))); d != nil {
		t.Error("a rebuilt payload of a UUID delivered twice found a delivery")
	}
	if d := f.find(fanned.Copy()); d != nil {
		t.Error("a copy of a payload two deliveries share found a delivery")
	}
	if d := f.find(message.NewMessage("m-3", []byte("rebuilt"))); d == nil {
		t.Error("a rebuilt payload of a UUID delivered once found none")
	}
	if d := f.find(message.NewMessage("m-4", nil)); d != nil {
		t.Error("a UUID not in flight found a delivery")
	}

	billing.Ack()
	shipping.Nack()
	waitForInFlight(t, &f, 3)
	if d := f.find(fanned.Copy()); d != nil {
		t.Error("a copy of a payload two deliveries share found a delivery after others finished")
	}
	close(closed)
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
