package outbox

import (
	"context"
	"errors"
	"strconv"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"
)

// metadataCarrier lets an OpenTelemetry propagator read and write a
// message's metadata, which is the outbox row's headers and, through the
// relay, the AMQP headers: a W3C traceparent set at publish reaches the
// consumer as it was.
type metadataCarrier message.Metadata

var _ propagation.TextMapCarrier = metadataCarrier(nil)

func (c metadataCarrier) Get(key string) string { return c[key] }

func (c metadataCarrier) Set(key, value string) { c[key] = value }

func (c metadataCarrier) Keys() []string {
	keys := make([]string, 0, len(c))
	for k := range c {
		keys = append(keys, k)
	}
	return keys
}

// headersCarrier lets a propagator read a record's headers, whose values
// are typed (Record.Headers): a trace header is a string; any other type
// is no trace context. The relay only reads them.
type headersCarrier map[string]any

func (c headersCarrier) Get(key string) string {
	s, _ := c[key].(string)
	return s
}

func (c headersCarrier) Set(string, string) {}

func (c headersCarrier) Keys() []string {
	keys := make([]string, 0, len(c))
	for k := range c {
		keys = append(keys, k)
	}
	return keys
}

// tracerName is the instrumentation scope of the library's spans.
const tracerName = "github.com/acemq/watermill-outbox"

// The attributes of the library's own, beside OpenTelemetry's messaging
// conventions.
const (
	attrOutcome     = attribute.Key("acemq.outcome")      // what became of the record or message
	attrAggregateID = attribute.Key("acemq.aggregate_id") // a keyed message's ordering key
	attrSeq         = attribute.Key("acemq.seq")          // and its number within the key
	attrAttempts    = attribute.Key("acemq.outbox.attempts")
	attrRecordAge   = attribute.Key("acemq.outbox.record.age") // seconds from created_at to the send
	attrRelayID     = attribute.Key("acemq.relay.id")
	attrPoisonTopic = attribute.Key("acemq.poison.topic")   // where a message set aside went
	attrPoisonCopy  = attribute.Key("acemq.poison.copy_id") // its copy's id, through PoisonOutbox
)

// relayTracing makes the relay's spans: one per record sent that carries
// a trace context, a PRODUCER span "publish <exchange>" whose parent is the
// context the publisher stored in the record's headers, from the send to
// the record's end in the relay (published and marked, failed, held back
// or released). A record without one gets none: the relay carries traces
// on, it starts none (a root span per untraced record would be a trace of
// one span each, joined to nothing).
type relayTracing struct {
	tracer trace.Tracer
	prop   propagation.TextMapPropagator
	common trace.SpanStartOption // the attributes every span has
	amqp   bool                  // the destination is RabbitMQ: routing keys are its
}

func newRelayTracing(cfg ForwarderConfig, dest Destination) *relayTracing {
	if cfg.TracerProvider == nil {
		return nil
	}
	t := &relayTracing{
		tracer: cfg.TracerProvider.Tracer(tracerName),
		prop:   cfg.Propagator,
	}
	common := []attribute.KeyValue{semconv.MessagingOperationTypeSend, semconv.MessagingOperationName("publish")}
	if _, ok := dest.(*AMQPDestination); ok {
		// Another Destination's broker is its own: a PublisherDestination's
		// Watermill publisher may be any.
		t.amqp = true
		common = append(common, semconv.MessagingSystemRabbitMQ)
	}
	if cfg.RelayID != "" {
		common = append(common, attrRelayID.String(cfg.RelayID))
	}
	t.common = trace.WithAttributes(common...)
	return t
}

// start starts the span of each record of b about to be sent (none for one
// preset, held back unsent), at now.
func (t *relayTracing) start(b *batch, now time.Time) {
	if t == nil {
		return
	}
	for i := range b.records {
		if b.preset != nil && b.preset[i] != nil {
			continue
		}
		r := &b.records[i]
		parent := t.prop.Extract(context.Background(), headersCarrier(r.Headers))
		if !trace.SpanContextFromContext(parent).IsValid() {
			continue
		}
		// The attributes that are the same for every record go in at the
		// start, where a sampler sees them (messaging.system).
		_, span := t.tracer.Start(parent, publishSpanName(r), trace.WithSpanKind(trace.SpanKindProducer), trace.WithTimestamp(now), t.common)
		if !span.IsRecording() {
			// Only a span the sampler kept is kept and pays for its
			// attributes: a publisher that samples one trace in ten
			// leaves the relay nine spans in ten that record nothing.
			span.End()
			continue
		}
		attrs := make([]attribute.KeyValue, 0, 8)
		attrs = append(attrs,
			semconv.MessagingDestinationName(validUTF8(r.Exchange)), // "" for the default exchange, as RabbitMQ's conventions say
			semconv.MessagingMessageID(validUTF8(r.ID)),
			semconv.MessagingMessageBodySize(len(r.Body)),
			attrAttempts.Int(r.Attempts),
		)
		if t.amqp && r.RoutingKey != "" {
			attrs = append(attrs, semconv.MessagingRabbitMQDestinationRoutingKey(validUTF8(r.RoutingKey)))
		}
		if !r.CreatedAt.IsZero() {
			attrs = append(attrs, attrRecordAge.Float64(max(0, now.Sub(r.CreatedAt).Seconds())))
		}
		if r.AggregateID != "" {
			attrs = append(attrs, attrAggregateID.String(validUTF8(r.AggregateID)), attrSeq.Int64(r.Seq))
		}
		span.SetAttributes(attrs...)
		if b.spans == nil {
			b.spans = make([]trace.Span, len(b.records))
		}
		b.spans[i] = span
	}
}

// publishSpanName is "publish <exchange>", or "publish <routing key>" for
// the default exchange, where the routing key is the queue's name (every
// topic of a service on the default exchange was one span name, "publish
// ", a review), or "publish".
func publishSpanName(r *Record) string {
	switch {
	case r.Exchange != "":
		return "publish " + validUTF8(r.Exchange)
	case r.RoutingKey != "":
		return "publish " + validUTF8(r.RoutingKey)
	}
	return "publish"
}

// errAbandoned ends the spans of a batch whose claim a panic ended (a
// Destination's, an OnError's), recovered by Run's caller or Sweep's.
var errAbandoned = errors.New("outbox: the relay abandoned the claim (a panic): its records go out again")

// The outcomes a relay's span ends with (acemq.outcome).
const (
	spanPublished = "published"  // confirmed by the broker and marked
	spanHeldBack  = "held_back"  // confirmed or not, behind a record that was not published: sent again after it
	spanReleased  = "released"   // not sent, or sent and not confirmed: claimed again, no attempt counted
	spanFailed    = "failed"     // its publish failed: tried again after a backoff
	spanStuck     = "stuck"      // its publish failed, and it is stuck (MaxAttempts, or refused for good)
	spanNotMarked = "not_marked" // confirmed, and the mark failed: sent again
)

// failedSpan is the span of a batch's record i that failed with err, to
// end once the batch is marked: stuck, if the mark made it so.
type failedSpan struct {
	i     int
	err   error
	stuck bool
}

// endSpan ends the span of b's record i, if it has one, with outcome. err,
// if not nil, is recorded on it, and gives it an error status if failed.
func (b *batch) endSpan(i int, outcome string, err error, failed bool) {
	if b.spans == nil || b.spans[i] == nil {
		return
	}
	span := b.spans[i]
	b.spans[i] = nil
	span.SetAttributes(attrOutcome.String(outcome))
	if err != nil {
		span.RecordError(err)
		if failed {
			span.SetStatus(codes.Error, err.Error())
		}
	}
	span.End()
}

// endSpans ends every span of b still open as endSpan does.
func (b *batch) endSpans(outcome string, err error, failed bool) {
	for i := range b.spans {
		b.endSpan(i, outcome, err, failed)
	}
}

// startProcessSpan starts the span of a delivery the inbox handles, a child
// of its context's (the publisher's, restored), linked to links, and puts
// it in the message's context for the handler.
func (in *Inbox) startProcessSpan(msg *message.Message, links ...trace.Link) trace.Span {
	ctx := msg.Context()
	topic := message.SubscribeTopicFromCtx(ctx)
	name := "process"
	if topic != "" {
		name += " " + topic
	}
	ctx, span := in.tracer.Start(ctx, name, trace.WithSpanKind(trace.SpanKindConsumer), trace.WithLinks(links...), processStart)
	msg.SetContext(ctx)
	if !span.IsRecording() {
		return span // dropped by the sampler: its attributes would go nowhere
	}
	attrs := []attribute.KeyValue{semconv.MessagingMessageBodySize(len(msg.Payload))}
	if topic != "" {
		attrs = append(attrs, semconv.MessagingDestinationName(topic))
	}
	if id := dedupeKey(msg); id != "" {
		attrs = append(attrs, semconv.MessagingMessageID(validUTF8(id)))
	}
	if c := in.consumerIn(ctx); c != "" {
		attrs = append(attrs, semconv.MessagingConsumerGroupName(c))
	}
	if key := msg.Metadata.Get(HeaderAggregateID); key != "" {
		attrs = append(attrs, attrAggregateID.String(validUTF8(key)))
		if seq, err := strconv.ParseInt(msg.Metadata.Get(HeaderSeq), 10, 64); err == nil {
			attrs = append(attrs, attrSeq.Int64(seq))
		}
	}
	span.SetAttributes(attrs...)
	return span
}

// processStart is the attributes every span of the inbox has, given at its
// start, where a sampler sees them. The system is the broker the library
// relays to.
var processStart = trace.WithAttributes(semconv.MessagingSystemRabbitMQ, semconv.MessagingOperationTypeProcess, semconv.MessagingOperationName("process"))

// endProcessSpan ends a delivery's span with what became of it.
func endProcessSpan(span trace.Span, outcome inboxOutcome, err error) {
	if err != nil {
		span.SetAttributes(attrOutcome.String("failed"))
		span.RecordError(err)
		span.SetStatus(codes.Error, err.Error())
	} else {
		span.SetAttributes(attrOutcome.String(outcome.String()))
	}
	span.End()
}

// String is the outcome as a span's acemq.outcome gives it.
func (o inboxOutcome) String() string {
	switch o {
	case inboxProcessed, inboxAtMostOnce:
		return "processed"
	case inboxDuplicate, inboxHeldAgain:
		return "duplicate"
	case inboxHeld:
		return "held"
	default:
		return "failed"
	}
}

// setAsideSpan records in its trace a message a poison publisher of the
// inbox set aside on topic: a span "set aside <topic>", its publisher's
// child, ended at once with acemq.outcome set_aside and the handler's last
// error. Its trace ended with its failed runs, as of a message still tried
// again, where the metrics and the log said it was given up (an SRE
// review).
func (in *Inbox) setAsideSpan(topic string, msg *message.Message, copyID, reason string) {
	ctx := msg.Context()
	if in.cfg.Propagator != nil {
		ctx = in.cfg.Propagator.Extract(ctx, metadataCarrier(msg.Metadata))
	}
	_, span := in.tracer.Start(ctx, "set aside "+validUTF8(topic), trace.WithSpanKind(trace.SpanKindInternal))
	if span.IsRecording() {
		attrs := []attribute.KeyValue{semconv.MessagingSystemRabbitMQ, attrOutcome.String("set_aside"), attrPoisonTopic.String(validUTF8(topic))}
		if id := dedupeKey(msg); id != "" {
			attrs = append(attrs, semconv.MessagingMessageID(validUTF8(id)))
		}
		if c := in.consumerIn(msg.Context()); c != "" {
			attrs = append(attrs, semconv.MessagingConsumerGroupName(c))
		}
		if copyID != "" {
			attrs = append(attrs, attrPoisonCopy.String(copyID))
		}
		span.SetAttributes(attrs...)
		span.SetStatus(codes.Error, validUTF8(reason))
	}
	span.End()
}
