package outbox

import (
	"context"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
)

// PoisonPublisher wraps pub, the publisher given to Watermill's
// middleware.PoisonQueue before this inbox's Middleware, so that a message
// set aside on the poison topic counts as processed: once pub has taken
// it, its outbox record (with MarkOutboxProcessed, of a tracked topic) is
// marked processed, as the handler's transaction would have marked it.
//
// Without it, PoisonQueue acks a message whose handler kept failing and its
// record stays unprocessed: every boot's Republish made it pending again,
// the relay sent it again, its handler failed again and the poison topic
// got one more copy of it, at every boot, for ever. The operator re-drives
// a poisoned message from the poison topic, where it is.
//
//	poisonQueue, err := middleware.PoisonQueue(inbox.PoisonPublisher(pub), "orders.poison")
//
// A publish that fails marks nothing and returns its error (PoisonQueue
// then fails the message, which is nacked and delivered again). A mark
// that fails is logged and returns nil: the message is on the poison
// topic, and the next boot's Republish may send it again. Close closes
// pub.
func (in *Inbox) PoisonPublisher(pub message.Publisher) message.Publisher {
	return poisonPublisher{in: in, pub: pub}
}

type poisonPublisher struct {
	in  *Inbox
	pub message.Publisher
}

func (p poisonPublisher) Publish(topic string, msgs ...*message.Message) error {
	if err := p.pub.Publish(topic, msgs...); err != nil {
		return err
	}
	for _, msg := range msgs {
		// Not the message context's end: middleware.Timeout, before the
		// inbox, cancels it as it returns, before PoisonQueue publishes.
		p.in.markOnPool(context.WithoutCancel(msg.Context()), msg,
			"Message set aside on the poison topic, but its outbox record could not be marked processed; Republish may send it again",
			watermill.LogFields{"poison_topic": topic})
	}
	return nil
}

func (p poisonPublisher) Close() error { return p.pub.Close() }
