package outbox

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
)

// ErrNotSent is the result of a record a Destination did not send because an
// earlier record of the batch failed: the records behind a failure wait for
// it, so the relay never steps over a record. AMQPDestination also gives it
// to the records that another record's publish took down with it (the
// broker closing the channel over that one): they count no attempt and go
// out again.
var ErrNotSent = errors.New("outbox: not sent, behind a failed record")

// ErrConnectionLost is the result of a record whose publish the broker
// neither confirmed nor refused: the connection or the channel went away, or
// no confirm came within the publish timeout. Whether the broker has the
// message is unknown, and the record is not at fault. The Forwarder counts no
// attempt against it (an outage of any length makes no row stuck), records
// the error as its last_error, holds back the records behind it as behind a
// failure, and backs off. Only when the connection is lost at the same record
// more than three times in a row is an attempt counted: that record is what
// breaks it. Through [PublisherDestination], which cannot tell an outage
// from such a record as a rule, only a publish timeout after the publisher
// answered the record's previous publish counts so (see its Publish).
var ErrConnectionLost = errors.New("outbox: connection to the broker lost before it confirmed")

// ErrBrokerUnreachable is the error of a connect that no node of the
// broker answered: nothing was sent. It is an ErrConnectionLost as well,
// for what the Forwarder does with it (no attempt is counted), but its text
// says what happened: "lost before it confirmed" told an on-call drill's
// engineer, every 10 s of a broker outage, that a batch in flight was lost
// and duplicates were coming.
var ErrBrokerUnreachable = errors.New("outbox: broker unreachable, nothing sent")

// connectFailed is a failed connect's error: an ErrConnectionLost (no
// attempt is counted), and ErrBrokerUnreachable unless every node answered
// and refused it (refused: credentials, a vhost, permissions), which is no
// broker out of reach (a code review: a rotated password read "cannot
// reach the broker").
type connectFailed struct {
	err     error
	refused bool
}

func (e connectFailed) Error() string {
	if e.refused {
		return "outbox: the broker refused the connection, nothing sent: " + e.err.Error()
	}
	return ErrBrokerUnreachable.Error() + ": " + e.err.Error()
}

func (e connectFailed) Unwrap() error { return e.err }

func (e connectFailed) Is(target error) bool {
	return target == ErrConnectionLost || target == ErrBrokerUnreachable && !e.refused
}

// ErrBrokerBlocked marks an ErrConnectionLost whose connection the broker
// had blocked (connection.blocked: a memory or disk alarm, during which
// RabbitMQ reads nothing more from a publishing connection, and a publish
// times out). The Forwarder never counts an attempt for it, however many
// times in a row it comes: an alarm of any length makes no row stuck, where
// a connection lost at the same record time after time otherwise charges
// the record.
var ErrBrokerBlocked = errors.New("outbox: the broker blocked the connection")

// unprobedLost is an ErrConnectionLost that no record caused, however often
// it comes at the same one: AMQPDestination's confirms that stopped coming
// (see silent) and windows that sent nothing (no connection could be made,
// the exchanges' check went unanswered), and PublisherDestination's
// outages. That destination has no Connect to tell an outage before the
// claim: the Forwarder claims during one, and the connection is lost at the
// same head record on every sweep. Counting an attempt for a loss that
// repeats there (as it does for AMQPDestination's lost connections, whose
// Connect keeps it from claiming through an outage) would make that record
// stuck, and let the records behind it out first, after a few minutes of
// outage. So it counts none: a record that makes the
// publisher fail so, every time, holds the records behind it, visibly, in
// last_error and OnError, rather than being stepped over. The exception, a
// timeout at a record whose previous publish the publisher has answered
// since, is a plain ErrConnectionLost (see PublisherDestination.Publish).
type unprobedLost struct{ error }

func (e unprobedLost) Unwrap() error { return e.error }

// publisherLost wraps err as an ErrConnectionLost that counts no attempt.
func publisherLost(err error) error { return unprobedLost{connectionLost(err)} }

// connectionLost wraps err as ErrConnectionLost.
func connectionLost(err error) error {
	if err == nil || errors.Is(err, ErrConnectionLost) {
		return err
	}
	return fmt.Errorf("%w: %w", ErrConnectionLost, err)
}

// Destination is where a Forwarder publishes records.
//
// Publish sends the records in their order and returns one result per
// record: nil once the broker has confirmed it (and only then), an error
// wrapping ErrNotSent for a record it did not send, an error wrapping
// ErrConnectionLost for one the broker did not answer for, any other error
// for a record whose publish failed. After the first failure it sends
// nothing more. Publish is not called concurrently.
//
// [AMQPDestination] is the one built for RabbitMQ; [NewPublisherDestination]
// adapts any Watermill publisher.
type Destination interface {
	Publish(ctx context.Context, records []Record) []error
}

// Pipeliner is a Destination that can keep batches in flight under
// Forwarder.Run: it sends a batch and collects its confirms later, so that
// the broker works on one batch while the relay marks the one before and
// claims the next. [AMQPDestination] is one unless its Window is set.
//
// A pipeline that gets its contract wrong marks rows published that the
// broker never confirmed: implement it only over a broker that confirms
// each message, and only with results taken from those confirms.
type Pipeliner interface {
	Destination
	// Pipeline returns the destination's pipeline, or nil when it publishes
	// one batch at a time (AMQPConfig.Window set, say): then every batch
	// goes through Publish.
	Pipeline() Pipeline
}

// Pipeline sends batches and collects their confirms later, for a
// [Pipeliner].
//
// Run calls it from one goroutine, never concurrently, and waits for each
// batch sent, once, in the order they were sent. Other calls of the
// destination come between a Send and its Wait: Connect before each claim,
// and Publish from a Forwarder.Sweep. Run itself calls Publish only with
// nothing in flight, for a batch it does not pipeline: one holding a
// record that failed before (Attempts > 0), which Publish can send alone.
type Pipeline interface {
	// Destination is the destination this pipeline publishes for (the one
	// whose Pipeline returned it), a comparable value: a pointer, as every
	// destination of this package. Run pipelines only when it is the
	// Forwarder's own destination, so that a type that embeds a pipelining
	// destination and overrides Publish has its own Publish called, not
	// skipped.
	Destination() Destination
	// Capacity is the most records that may be sent and not yet waited for.
	// Run keeps no more than that in flight: Capacity()/BatchSize batches
	// at most (ForwarderConfig), a drain's claims growing no larger than
	// keeps them within it; it publishes every batch through Publish when
	// Capacity is less than one batch.
	Capacity() int
	// Send publishes records in their order and returns without waiting for
	// their confirms. It stops at the first record it cannot publish; the
	// records after it are not sent. ctx bounds the sending.
	Send(ctx context.Context, records []Record) Sent
	// Wait waits for the confirms of a batch Send returned, within ctx, and
	// returns one result per record on the same terms as
	// Destination.Publish: nil once the broker has confirmed the record,
	// and only then.
	Wait(ctx context.Context, s Sent) []error
}

// Sent is a batch a Pipeline sent and has not confirmed yet.
type Sent interface {
	// Records are the records Send was given, in order: Wait returns a
	// result for each.
	Records() []Record
}

// Connector is implemented by a Destination that can tell, before any row
// is claimed, whether its broker is reachable (AMQPDestination does). The
// Forwarder claims nothing while the broker is down, so an outage counts
// no attempts against any record.
type Connector interface {
	Connect(ctx context.Context) error
}

// PublisherDestination publishes records through a Watermill publisher, one
// at a time: for brokers other than RabbitMQ (Kafka, NATS, …). A record
// becomes a message with the record's id as UUID, its headers as metadata
// (plus x-acemq-id, and a keyed record's aggregateId and seq, the number
// in decimal; a header that is not a string as its JSON text, as
// [AMQPMarshaler] renders it) and its body as payload, published to the
// topic that TopicFor gives. Its content_type goes as the metadata
// MetadataContentType, unless a header of that name is there already. Its
// created_at does not go: AMQPDestination sends it as the AMQP timestamp
// property, but a Watermill message has no time of its own, nor Watermill
// a metadata key for one that its consumers read.
type PublisherDestination struct {
	// Transient, when set, tells which of the publisher's errors mean its
	// broker is unreachable (an outage: the record is not at fault), as
	// only the user knows for their publisher: such a record's result
	// wraps ErrConnectionLost. Set it before the Forwarder starts. Without
	// it, only context errors and the publish timeout are taken for an
	// outage, and any other error counts an attempt against the record.
	Transient func(error) bool

	pub      message.Publisher
	topicFor func(Record) string
	// abandoned, when not nil, is a publish that Publish stopped waiting
	// for at its context's end: the next publish waits for it first, so
	// that a publisher that hangs has one publish in flight, not one more
	// per sweep, and a later record never overtakes it. Publish and Close
	// touch it, which are not called concurrently (the Forwarder closes
	// its destination once its sweeps are over). Close waits for it, but
	// no longer than its wait.
	abandoned *abandonedPublish
}

// abandonedPublish is a publish past its timeout, still under way.
type abandonedPublish struct {
	id   string       // its record's
	done <-chan error // its outcome, once the publisher returns
	// wait is the time its Publish was given (from its context's
	// deadline: PublishTimeout under a Forwarder), which bounds Close's
	// wait for it.
	wait time.Duration
}

// closeWait bounds Close's wait for a publish cut off by a context
// without a deadline (a caller's cancel, not the relay's timeout): the
// default PublishTimeout.
const closeWait = 15 * time.Second

// NewPublisherDestination adapts pub. topicFor maps a record to the topic to
// publish on; nil uses the routing key, which by default is the topic given to
// TxPublisher.
func NewPublisherDestination(pub message.Publisher, topicFor func(Record) string) *PublisherDestination {
	if topicFor == nil {
		topicFor = func(r Record) string { return r.RoutingKey }
	}
	return &PublisherDestination{pub: pub, topicFor: topicFor}
}

// Publish publishes the records one at a time, in order, and stops at the
// first failure. A Watermill publisher's Publish returning nil is taken as
// the broker's confirmation: how strong that is depends on the publisher.
//
// ctx (the Forwarder's PublishTimeout) bounds the batch even with a
// publisher that ignores the message's context, as most do: past it,
// Publish returns without waiting for the publish under way, whose record
// fails with ErrConnectionLost, and sends nothing more of the batch. The
// publish it stopped waiting for may still deliver the message: the record
// is then sent again (at-least-once, the consumers' inbox absorbs the
// copy), and the next publish waits for that one to return first.
//
// A timeout counts no attempt against its record (see unprobedLost): a
// publisher whose broker is down hangs on every record, and the head
// record would be charged for the outage. But a publisher that hangs on
// one record alone (its payload, say) would then hold the records behind it
// for ever, never stuck. What tells the two apart is the publisher's answer
// to the publish cut off: in an outage it gives none until the broker is
// back (and then the record goes, at once), or gives an outage's error (a
// context error, one Transient tells); a publisher that answers anything
// else (nil: it delivered, late; or an error of its own) is working, and
// what it cannot get through in time is that record. So a timeout at a
// record whose publish cut off before has since been answered so is a
// plain ErrConnectionLost, which the Forwarder charges once it comes more
// than three times in a row at that record: it becomes stuck after
// MaxAttempts more, with the timeout as its last_error, and the records
// behind it go. A publisher slower than PublishTimeout on every message,
// but delivering, makes each record stuck in turn that way: PublishTimeout
// is too short for it.
func (d *PublisherDestination) Publish(ctx context.Context, records []Record) []error {
	started := time.Now()
	results := make([]error, len(records))
	// answered is the record whose publish, cut off at an earlier timeout,
	// the publisher has answered, other than with an outage's error.
	answered := ""
	if d.abandoned != nil {
		select {
		case err := <-d.abandoned.done:
			if !errors.Is(d.classify(err), ErrConnectionLost) {
				answered = d.abandoned.id
			}
			d.abandoned = nil
		case <-ctx.Done():
			fillNotSent(results, 0, publisherLost(fmt.Errorf("an earlier publish, past its timeout, has not returned: %w", ctx.Err())))
			return results
		}
	}
	for i, r := range records {
		if err := ctx.Err(); err != nil {
			fillNotSent(results, i, publisherLost(fmt.Errorf("publish timed out before this record was sent: %w", err)))
			return results
		}
		msg := message.NewMessage(r.ID, r.Body)
		for k, v := range r.Headers {
			msg.Metadata.Set(k, metadataValue(v))
		}
		// The content type where a Watermill consumer reads it: the key
		// TxPublisher takes a row's content_type from, so that a copy a
		// handler publishes through one keeps it. A header of that name is
		// the message's own (a TxPublisher wrote it beside the column it
		// took from it), and stands.
		if _, ok := msg.Metadata[MetadataContentType]; !ok && r.ContentType != "" {
			msg.Metadata.Set(MetadataContentType, r.ContentType)
		}
		msg.Metadata.Set(HeaderMessageID, r.ID)
		if r.AggregateID != "" {
			msg.Metadata.Set(HeaderAggregateID, r.AggregateID)
			msg.Metadata.Set(HeaderSeq, strconv.FormatInt(r.Seq, 10))
		}
		// The relay's values (a trace) without its cancellation: the
		// relay cancels ctx as soon as Publish returns, and a publisher
		// that hands the message's context on (a GoChannel with
		// PreserveContext) would deliver it dead, failing the consumer's
		// transaction at BEGIN on every delivery.
		msg.SetContext(context.WithoutCancel(ctx))
		topic := d.topicFor(r)
		// The publish writes only to its own channel, never to results,
		// so that one abandoned at the timeout writes nothing the caller
		// holds once Publish returned.
		done := make(chan error, 1)
		go func() {
			defer func() {
				if p := recover(); p != nil {
					done <- publishPanic{p}
				}
			}()
			done <- d.pub.Publish(topic, msg)
		}()
		var err error
		select {
		case err = <-done:
		case <-ctx.Done():
			select {
			case err = <-done: // returned as the time ran out: its answer stands
			default:
				d.abandoned = &abandonedPublish{id: r.ID, done: done, wait: closeWait}
				if deadline, ok := ctx.Deadline(); ok {
					d.abandoned.wait = deadline.Sub(started)
				}
				err := fmt.Errorf("the publisher did not return within the publish timeout; it may still deliver the message: %w", ctx.Err())
				if r.ID == answered {
					// The record's, and its last_error says why: see Publish.
					fillNotSent(results, i, connectionLost(fmt.Errorf("%w (again, after the publisher answered this record's previous publish: the record is what it cannot publish in time)", err)))
					return results
				}
				fillNotSent(results, i, publisherLost(err))
				return results
			}
		}
		if p, ok := err.(publishPanic); ok {
			// In the caller, as before the publish had a goroutine: the
			// Forwarder ends its claim on the way up, and a recovering
			// caller (net/http) keeps the process.
			panic(p.v)
		}
		if err != nil {
			fillNotSent(results, i, d.classify(err))
			return results
		}
	}
	return results
}

// classify makes err, a publish's error, an ErrConnectionLost when it
// means an outage: a context error (a publisher that honours its own
// timeout, or the message's context, gives one) or one Transient tells.
func (d *PublisherDestination) classify(err error) error {
	if errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled) ||
		errors.Is(err, ErrConnectionLost) || (d.Transient != nil && d.Transient(err)) {
		return publisherLost(err)
	}
	return err
}

// publishPanic carries a publisher's panic out of the goroutine its publish
// runs in (an abandoned one's is dropped: its Publish has returned).
type publishPanic struct{ v any }

func (p publishPanic) Error() string { return fmt.Sprintf("outbox: the publisher panicked: %v", p.v) }

// Close closes the Watermill publisher, once a publish that Publish cut
// off at its timeout and that is still under way has returned: closed
// from under it, the publisher would be used after its Close, and the
// caller, once Close returned, could close what it uses (its client, its
// connection). Close waits for it no longer than its Publish was given
// (PublishTimeout), and then closes the publisher all the same, which ends
// that publish in a publisher that honours its Close: one that never
// returns would hold Close for ever, the hang the timeout is there to
// escape.
func (d *PublisherDestination) Close() error {
	if a := d.abandoned; a != nil {
		t := time.NewTimer(a.wait)
		select {
		case <-a.done:
			d.abandoned = nil
		case <-t.C:
		}
		t.Stop()
	}
	return d.pub.Close()
}

// PublishError is a record's failure, with where it was going: what the
// Forwarder reports and stores (as last_error) for it.
type PublishError struct {
	Dest ErrorContext
	Err  error
}

func (e *PublishError) Error() string {
	return fmt.Sprintf("outbox: message %s to exchange %q routing key %q: %v", idText(e.Dest.MessageID), e.Dest.Exchange, e.Dest.RoutingKey, e.Err)
}

func (e *PublishError) Unwrap() error { return e.Err }

// ErrorContext says where a failed message was going. For a failure of the
// relay as a whole (database or broker unreachable) MessageID is empty.
type ErrorContext struct {
	Exchange   string
	RoutingKey string
	MessageID  string
	// Attempts is the record's failed publishes with this one, and
	// MaxAttempts the relay's ceiling; Stuck reports that it reached it:
	// the relay leaves the record alone from now on (a keyed one holds its
	// key's later records) until an operator retries it. Set in what
	// ForwarderConfig.OnError is given for a record's failure (an API
	// review: an OnError that pages could not tell a record giving up from
	// one retrying, which the default log says); zero in a PublishError's.
	Attempts, MaxAttempts int
	Stuck                 bool
}
