package outbox

import (
	"context"
	"database/sql"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/google/uuid"

	"github.com/acemq/watermill-outbox/internal/sqldialect"
)

// Metadata keys of a message PoisonOutbox set aside: the id of the message
// it is a copy of, and that message's ordering key and sequence number
// (which the copy does not carry as its own: see PoisonOutbox).
const (
	PoisonedIDMetadataKey  = "x-acemq-poisoned-id"
	PoisonedKeyMetadataKey = "x-acemq-poisoned-aggregate-id"
	PoisonedSeqMetadataKey = "x-acemq-poisoned-seq"
)

// PoisonOutbox returns the publisher to give Watermill's
// middleware.PoisonQueue before this inbox's Middleware, in place of
// PoisonPublisher(pub): it writes each message set aside into the outbox
// (the inbox's OutboxTable, as InboxConfig.Outbox writes the messages a
// handler returns: that exchange, the poison topic for routing key) in one
// transaction with its record's processed mark (MarkOutboxProcessed, a
// tracked topic), and the relay on that database publishes it, as it
// publishes every record: with the broker's confirm, and a poison topic
// no queue is bound to shows as a record stuck unroutable.
//
//	poisonQueue, err := middleware.PoisonQueue(inbox.PoisonOutbox(), "orders.poison")
//
// Through PoisonPublisher(pub), a message pub took is marked processed
// whatever became of it: watermill-amqp's publisher waits for no confirm
// and hears of no unroutable message, so with no queue bound to the poison
// topic RabbitMQ dropped it (a review: 22 of 138 poison orders gone, their
// records marked processed, nothing logged); and a mark that failed (a
// lost connection) was only logged, and the next boot's Republish sent the
// message again. Here the write and the mark commit together, run again
// after a lost connection for up to 30 s; a failure fails the message,
// which is nacked and delivered again.
//
// The copy's id is its own, derived from the message's id, the consumer's
// name and the poison topic (a version 5 UUID): the same message set
// aside again (its ack lost) is written once, and the copy of a message
// whose record is in the same table is no duplicate of it. Its metadata is
// the message's, PoisonQueue's reason among it, with PoisonedIDMetadataKey
// the message's id; a keyed message's aggregateId and seq go in
// PoisonedKeyMetadataKey and PoisonedSeqMetadataKey, not as the copy's own
// (an ordered inbox on the poison topic would take them for its order).
// A message without an id gets a copy of a random id. Metadata the
// outbox's headers cannot carry is made to fit: RabbitMQ's CC and BCC and
// the publisher's steering keys renamed (x-acemq-poisoned-header-…), a
// key or value that is not UTF-8 quoted (its key with "-quoted"), and
// headers too many or too large for one AMQP frame dropped but for the
// reason (x-acemq-poisoned-headers-dropped). Set aside again (a
// redelivery whose ack was lost, or its record resent once the cause
// seemed fixed, and failing again), a message's copy is not written twice:
// its row, published already, is made pending again, and the relay sends
// it to the poison topic again under the same id.
//
// What PoisonPublisher refuses, it refuses. It needs a relay on the inbox's
// database, as returned messages do.
func (in *Inbox) PoisonOutbox() message.Publisher { return poisonOutbox{in: in} }

// poisonNamespace is the namespace of the poison copies' ids.
var poisonNamespace = uuid.MustParse("5a0c6f6e-2d43-4b8e-9f1a-61636d71706f")

type poisonOutbox struct{ in *Inbox }

func (p poisonOutbox) Publish(topic string, msgs ...*message.Message) error {
	in := p.in
	msgs, err := in.toSetAside(topic, msgs)
	if err != nil || len(msgs) == 0 {
		return err
	}
	// Not the message's context, which Timeout ended as the last attempt
	// returned (see PoisonPublisher): bounded on its own.
	ctx, cancel := context.WithTimeout(context.WithoutCancel(msgs[0].Context()), poisonPublishTimeout)
	defer cancel()
	copies := make([]*message.Message, len(msgs))
	for i, msg := range msgs {
		copies[i] = in.poisonCopy(topic, msg, false)
		copies[i].SetContext(beneath{ctx, msg.Context()})
		if err := checkWritable(copies[i], in.returned); err != nil {
			// Headers the outbox cannot carry (too many, too large): the
			// payload, the id and the reason, rather than a message that
			// is never set aside and comes back for ever.
			copies[i] = in.poisonCopy(topic, msg, true)
			copies[i].SetContext(beneath{ctx, msg.Context()})
		}
	}
	err = in.retryConflicts(ctx, func() error {
		tx, err := in.db.BeginTxx(ctx, &sql.TxOptions{Isolation: in.cfg.Isolation})
		if err != nil {
			return fmt.Errorf("outbox: inbox: begin: %w", err)
		}
		defer func() { _ = tx.Rollback() }() // a no-op after the commit
		pub := &TxPublisher{tx: stdTx{tx.Tx}, cfg: in.returned, q: in.outbox}
		if err := pub.publish(ctx, topic, copies); err != nil {
			return fmt.Errorf("outbox: inbox: write %d message(s) set aside into the outbox, topic %q: %w", len(copies), topic, err)
		}
		// A copy written before (the publish left its row as it was) and
		// published since goes out again: a message resent and failing
		// again was otherwise set aside with no copy on the poison topic
		// after the first, which its operator may have consumed.
		ids := make([]string, len(copies))
		for i, c := range copies {
			ids[i] = c.UUID
		}
		if _, err := in.exec(ctx, tx, in.outbox.Resend(ids)); err != nil {
			return fmt.Errorf("outbox: inbox: send again the copies written before of the message(s) set aside, topic %q: %w", topic, err)
		}
		now := time.Now()
		for i, msg := range msgs {
			if key := dedupeKey(msg); key != "" {
				// The message's context for its topic (TrackedTopics).
				if err := in.markProcessedNoting(beneath{ctx, msg.Context()}, tx, key, now, in.asideNote(topic, msg, copies[i].UUID)); err != nil {
					return err
				}
			}
		}
		if err := tx.Commit(); err != nil {
			return fmt.Errorf("outbox: inbox: commit the message(s) set aside: %w", err)
		}
		return nil
	})
	if err != nil {
		return err
	}
	for i, msg := range msgs {
		in.loggedAside(topic, msg, copies[i].UUID)
	}
	return nil
}

func (p poisonOutbox) Close() error { return nil }

// poisonCopy is msg as PoisonOutbox writes it to topic (see PoisonOutbox);
// bare, its payload with only the message's id and PoisonQueue's reason.
func (in *Inbox) poisonCopy(topic string, msg *message.Message, bare bool) *message.Message {
	id := dedupeKey(msg)
	if id == "" {
		id = msg.UUID
	}
	consumer := in.consumerIn(msg.Context())
	copyID := uuid.NewSHA1(poisonNamespace, []byte(consumer+"\x00"+id+"\x00"+topic)).String()
	if id == "" {
		// No id to derive one from: every such message's copy had the one
		// id of its consumer and topic, and all but the first were taken
		// for it and dropped (a review). A copy set aside twice is then
		// written twice.
		copyID = watermill.NewUUID()
	}
	c := message.NewMessage(copyID, msg.Payload)
	set := func(k, v string) {
		k, v = headerSafe(k, v)
		c.Metadata.Set(k, v)
	}
	for k, v := range msg.Metadata {
		switch {
		case k == HeaderMessageID:
		case k == HeaderAggregateID:
			set(PoisonedKeyMetadataKey, v)
		case k == HeaderSeq:
			set(PoisonedSeqMetadataKey, v)
		case steeringKeys[k]:
			// The publisher's steering (exchange, routing key, ordering
			// key) would send the copy elsewhere than the poison topic.
			set("x-acemq-poisoned-header-"+k, v)
		case !bare:
			set(k, v)
		}
	}
	if bare {
		reason := msg.Metadata.Get(middleware.ReasonForPoisonedKey)
		if len(reason) > poisonReasonBytes {
			reason = strings.ToValidUTF8(reason[:poisonReasonBytes], "") + "…"
		}
		set(middleware.ReasonForPoisonedKey, reason)
		set(poisonedHeadersDropped, "true")
	}
	if id != "" {
		set(PoisonedIDMetadataKey, id)
	}
	return c
}

// poisonReasonBytes bounds the reason a bare poison copy keeps.
const poisonReasonBytes = 1024

// poisonedHeadersDropped marks a bare poison copy: the message's metadata
// did not fit the outbox's headers, and only its id and reason are kept.
const poisonedHeadersDropped = "x-acemq-poisoned-headers-dropped"

// headerSafe is k and v as a poison copy's metadata carries them: RabbitMQ's
// CC and BCC, which a delivery keeps and the outbox refuses (a broker would
// route by them), renamed; a key or value that is not valid UTF-8, or holds
// NUL, which the outbox's headers cannot carry (another language's relay
// on MySQL or SQLite may have sent such an id or aggregateId), quoted as Go
// quotes it, under the key with "-quoted" added.
func headerSafe(k, v string) (string, string) {
	if k == "CC" || k == "BCC" {
		k = "x-acemq-poisoned-header-" + k
	}
	if !textHolds(k) {
		k = "x-acemq-poisoned-header-" + strconv.Quote(k)
	}
	if !textHolds(v) {
		k, v = k+"-quoted", strconv.Quote(v)
	}
	return k, v
}

// checkWritable reports whether TxPublisher under cfg would write msg.
func checkWritable(msg *message.Message, cfg TxPublisherConfig) error {
	var r sqldialect.Row
	return (&TxPublisher{cfg: cfg}).buildRow(&r, 0, "poison", msg)
}
