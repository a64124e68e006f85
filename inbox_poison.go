package outbox

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/google/uuid"

	"github.com/acemq/watermill-outbox/internal/sqldialect"
)

// PoisonPublisher wraps pub, the publisher given to Watermill's
// middleware.PoisonQueue before this inbox's Middleware, so that a message
// set aside on the poison topic counts as processed: once pub has taken
// it, its outbox record (with MarkOutboxProcessed, of a tracked topic) is
// marked processed, as the handler's transaction would have marked it.
// Whatever became of it: give pub a publisher that waits for the broker's
// confirm and fails an unroutable message, and bind a queue to the poison
// topic, or use PoisonOutbox, which sends the message through the outbox
// and its relay (watermill-amqp's publisher does neither, and RabbitMQ
// drops a message no queue is bound for).
//
// Without it, PoisonQueue acks a message whose handler kept failing and its
// record stays unprocessed: every boot's Republish made it pending again,
// the relay sent it again, its handler failed again and the poison topic
// got one more copy of it, at every boot, for ever. The operator re-drives
// a poisoned message from the poison topic, where it is.
//
//	poisonQueue, err := middleware.PoisonQueue(inbox.PoisonPublisher(pub), "orders.poison")
//
// pub is given copies of the messages whose context keeps the message
// context's values but not its end, and ends poisonPublishTimeout after
// the publish begins: middleware.Timeout, between PoisonQueue and the
// inbox, cancels the message's context as the last attempt returns, before
// PoisonQueue publishes, and a publisher that honours it (watermill-amqp's
// publishes with the message's context) failed every time, at once. A
// publish that fails marks nothing and returns its error (PoisonQueue
// then fails the message, which is nacked and delivered again). A mark
// that fails is logged and returns nil: the message is on the poison
// topic, and the next boot's Republish may send it again. Close closes
// pub.
//
// A message whose handler was interrupted, not failed, is refused, and
// none is published: one whose context the router's Close (or the
// subscriber's) cancelled while the inbox ran it, which Retry (with
// ResetContextOnRetry, which brings that context back) then fails at each
// retry at once. PoisonQueue set such a message aside and acked it, and
// PoisonPublisher marked its record processed, so neither a redelivery nor
// Republish brought it back (a review lost an order so). The error makes
// PoisonQueue fail the message, which is nacked, or, on a closing channel,
// left unacked, and delivered again. So is one set aside for
// context.Canceled itself: Retry's answer when the router closed during
// its backoff, after a failure the next try might not have had (a review
// lost one so too). A message whose handler failed and whose retries
// found the context Timeout had ended (no ResetContextOnRetry) is set
// aside as before: the inbox's error names that cause. Retry answers with
// the cause the delivery's context was cancelled with, which is not
// context.Canceled for a router run under signal.NotifyContext (Go 1.26
// on: "terminated signal received") or another WithCancelCause context:
// a message whose reason is its own context's cause is refused as well,
// and, with the inbox's Plugin on the router, every message the router
// hands on while it stops (a review's service, stopped with SIGTERM, lost
// 2–8 messages a stop to the poison topic before). So is a message whose
// database did not answer before its context ended (the inbox runs a
// delivery again after a lost connection until then): a review killing a
// consumer's connections for 3–6 s set 3–9 of 2,000 aside before.
func (in *Inbox) PoisonPublisher(pub message.Publisher) message.Publisher {
	return poisonPublisher{in: in, pub: pub}
}

// interruptedKey marks, in a message's metadata, one whose context was
// cancelled while the inbox ran its handler (see PoisonPublisher). Set on
// the delivery's message only, it never reaches a broker: PoisonPublisher
// refuses such a message.
const interruptedKey = "x-acemq-inbox-interrupted"

// dbLostKey marks, in a message's metadata, one whose last run found the
// database gone (its connection dropped, and no answer again before the
// delivery's context ended): no failure of the message's, and
// PoisonPublisher refuses it, as it refuses an interrupted one.
const dbLostKey = "x-acemq-inbox-db-lost"

// markToken is the value of the marks above, one per process: a header of
// a mark's name from the wire (a service that forwards the headers it got)
// kept a message failing for good from its poison queue for ever, also
// where a middleware before the inbox failed it, so that the inbox never
// dropped the header (a code review). Only this process's mark counts.
var markToken = uuid.NewString()

// poisonPublishTimeout bounds PoisonPublisher's publish, whose context no
// longer ends with the message's: a broker that takes no message holds the
// delivery that long (and a router's Close as long, up to its
// CloseTimeout), then the message is failed and delivered again. Watermill's
// router waits 30 s for its handlers by default.
const poisonPublishTimeout = 30 * time.Second

type poisonPublisher struct {
	in  *Inbox
	pub message.Publisher
}

func (p poisonPublisher) Publish(topic string, msgs ...*message.Message) error {
	msgs, err := p.in.toSetAside(topic, msgs)
	if err != nil || len(msgs) == 0 {
		return err
	}
	// Copies, detached from the ended context: handed the messages as they
	// were, watermill-amqp's publisher failed with "context canceled", so
	// PoisonQueue failed the message, the router nacked it, and it came
	// back, its handler failed again, its retries ran again, for ever: the
	// README's chain set nothing aside (a review counted 129 runs of one
	// message in 10 s, and on an ordered consumer its key went no further).
	// One bound for the publish and the marks after it: a router's Close
	// waits 30 s for its handlers by default.
	deadline := time.Now().Add(poisonPublishTimeout)
	detached := make([]*message.Message, len(msgs))
	for i, msg := range msgs {
		ctx, cancel := context.WithDeadline(context.WithoutCancel(msg.Context()), deadline)
		defer cancel()
		detached[i] = msg.Copy()
		detached[i].SetContext(ctx)
	}
	if err := p.pub.Publish(topic, detached...); err != nil {
		return err
	}
	for _, msg := range msgs {
		p.in.loggedAside(topic, msg, "")
		// Not the message context's end: middleware.Timeout, before the
		// inbox, cancels it as it returns, before PoisonQueue publishes.
		// A lost connection is waited out, within the publish's bound: a
		// mark that failed so was only logged, and the next boot's
		// Republish sent the message again (a user review: 1 of ~40 with
		// connections killed).
		ctx, cancel := context.WithDeadline(context.WithoutCancel(msg.Context()), deadline)
		if key := dedupeKey(msg); key != "" {
			now := time.Now()
			note := p.in.asideNote(topic, msg, "")
			if err := p.in.retryConflicts(ctx, func() error { return p.in.markProcessedNoting(ctx, p.in.db, key, now, note) }); err != nil {
				p.in.log.Error("Message set aside on the poison topic, but its outbox record could not be marked processed; Republish may send it again", err,
					watermill.LogFields{"poison_topic": topic, "message_uuid": idText(key)})
			}
		}
		cancel()
	}
	return nil
}

func (p poisonPublisher) Close() error { return p.pub.Close() }

// toSetAside is msgs, given to a poison publisher for topic, without the
// inbox's own wakes (a wake of Subscriber's that a middleware before the
// inbox failed is no message of the service's: nothing to set aside); or
// the error that refuses them all, where one of them is no poison (see
// PoisonPublisher).
func (in *Inbox) toSetAside(topic string, msgs []*message.Message) ([]*message.Message, error) {
	msgs = slices.DeleteFunc(slices.Clone(msgs), func(msg *message.Message) bool {
		if wakeOf(msg) == nil {
			return false
		}
		wakeTaken(msg)
		return true
	})
	for _, msg := range msgs {
		why := ""
		switch {
		case msg.Metadata.Get(dbLostKey) == markToken:
			why = "the database did not answer"
		case in.interrupted(msg):
			why = "its context was cancelled while its handler ran"
		default:
			continue
		}
		return nil, fmt.Errorf("outbox: inbox: message %s not set aside on %s: %s (%s), which is no failure of it;"+
			" it is delivered again", idText(msg.UUID), topic, why, msg.Metadata.Get(middleware.ReasonForPoisonedKey))
	}
	return msgs, nil
}

// loggedAside logs msg set aside on topic (as copyID, where its copy has
// an id of its own): an operator saw Retry's errors, then nothing. A keyed
// message's key and number are in the line: the gap lines that follow
// name the key, and resend --key K --seq N and skip-gap take them (an
// on-call drill could not join the two lines).
func (in *Inbox) loggedAside(topic string, msg *message.Message, copyID string) {
	reason := msg.Metadata.Get(middleware.ReasonForPoisonedKey)
	fields := watermill.LogFields{"message_uuid": idText(msg.UUID), "poison_topic": topic,
		"handler": message.HandlerNameFromCtx(msg.Context())}
	if copyID != "" {
		fields["poison_copy_id"] = copyID
	}
	if key := msg.Metadata.Get(HeaderAggregateID); key != "" {
		fields["aggregate_id"], fields["seq"] = key, msg.Metadata.Get(HeaderSeq)
		if seq, err := strconv.ParseInt(msg.Metadata.Get(HeaderSeq), 10, 64); err == nil {
			in.aside.note(in.consumerIn(msg.Context()), key, asideKey{seq: seq, id: msg.UUID, copyID: copyID, topic: topic, at: time.Now()})
		}
	}
	// The handler's error as the line's err: a nil one printed err=<nil>
	// on an ERROR line (a user review), the error only in reason. Only
	// there: a panic's stack, in a reason field as well, made the line 45
	// lines long (an on-call drill).
	in.log.Error("Outbox inbox: message set aside on the poison topic: its handler kept failing; once the cause is fixed, "+
		"outboxctl resend ID on the database of the outbox it came from sends it again (a keyed message's key waits for it)", errors.New(reason), fields)
	if in.tracer != nil {
		in.setAsideSpan(topic, msg, copyID, reason)
	}
	counted := in.consumerIn(msg.Context())
	if checkConsumer(in.dialect, counted) != nil {
		counted = "" // as the inbox's other counts label a name it refuses
	}
	in.cfg.Metrics.inbox(counted, inboxSetAside)
}

// asideNote is what the record of msg, set aside on topic (as copyID, if
// any), keeps in its last_error: by whom, where and why, in plain ASCII
// (a last_error column another library made may hold no more), for show.
func (in *Inbox) asideNote(topic string, msg *message.Message, copyID string) string {
	consumer := in.consumerIn(msg.Context())
	where := topic
	if copyID != "" {
		where += " as " + copyID
	}
	return asciiError(storableError(fmt.Sprintf("%s%s to %s: %s", sqldialect.SetAsideNote, consumer, where, msg.Metadata.Get(middleware.ReasonForPoisonedKey))))
}

// interrupted reports whether msg comes to the poison topic because its
// delivery was cut short, not because its handler failed: the inbox saw
// its context cancelled as the handler ran; or the reason is a
// cancellation's, context.Canceled or the cause its context was cancelled
// with (Retry, finding the delivery's context ended, answers with its
// cause, such as signal.NotifyContext's "terminated signal received",
// and this is the context, where Retry did not run the handler again);
// or the router that delivered it is stopping (Plugin).
func (in *Inbox) interrupted(msg *message.Message) bool {
	reason := msg.Metadata.Get(middleware.ReasonForPoisonedKey)
	ctx := msg.Context()
	cause := context.Cause(ctx)
	switch {
	case msg.Metadata.Get(interruptedKey) == markToken, reason == context.Canceled.Error():
		return true
	case errors.Is(ctx.Err(), context.Canceled) && cause != context.Canceled && strings.HasSuffix(reason, cause.Error()):
		// The suffix: a middleware between PoisonQueue and Retry may wrap
		// it ("fulfil-orders: terminated signal received").
		return true
	}
	return in.routerStopping(msg)
}

// asideKeys recalls, for each consumer's key, the last keyed message this
// process set aside: its gap line then names that cause. The on-call drill
// that found it read, for a key whose first message its own poison queue
// had set aside, a line that blamed a consumer new to the key or a renamed
// handler, and pointed at skip-gap, which gives the message up. Another
// process's set-aside, or one before a restart, is not recalled: the line
// says then what may have happened, the set-aside first. At most
// asideRecall keys are kept.
type asideKeys struct {
	mu   sync.Mutex
	keys map[[2]string]asideKey
}

// asideKey is a keyed message set aside: its number, its id, its copy's
// id (PoisonOutbox's; "" for PoisonPublisher's), where and when.
type asideKey struct {
	seq               int64
	id, copyID, topic string
	at                time.Time
}

// asideRecall bounds asideKeys: past it one key is forgotten for each new.
const asideRecall = 1000

func (a *asideKeys) note(consumer, key string, k asideKey) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.keys == nil {
		a.keys = map[[2]string]asideKey{}
	}
	at := [2]string{consumer, key}
	if _, known := a.keys[at]; !known && len(a.keys) >= asideRecall {
		for old := range a.keys {
			delete(a.keys, old)
			break
		}
	}
	a.keys[at] = k
}

// recall is the key's message set aside, if it is one of seqs from..through.
func (a *asideKeys) recall(consumer, key string, from, through int64) (asideKey, bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	k, ok := a.keys[[2]string{consumer, key}]
	return k, ok && k.seq >= from && k.seq <= through
}
