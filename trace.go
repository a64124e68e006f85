package outbox

import (
	"context"
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
	common []attribute.KeyValue
	amqp   bool // the destination is RabbitMQ: routing keys are its
}

func newRelayTracing(cfg ForwarderConfig, dest Destination) *relayTracing {
	if cfg.TracerProvider == nil {
		return nil
	}
	t := &relayTracing{
		tracer: cfg.TracerProvider.Tracer(tracerName),
		prop:   cfg.Propagator,
		common: []attribute.KeyValue{semconv.MessagingOperationTypeSend, semconv.MessagingOperationName("publish")},
	}
	if _, ok := dest.(*AMQPDestination); ok {
		t.amqp = true
		t.common = append(t.common, semconv.MessagingSystemRabbitMQ)
	}
	if cfg.RelayID != "" {
		t.common = append(t.common, attrRelayID.String(cfg.RelayID))
	}
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
		_, span := t.tracer.Start(parent, "publish "+r.Exchange, trace.WithSpanKind(trace.SpanKindProducer), trace.WithTimestamp(now))
		if !span.IsRecording() {
			// Only a span the sampler kept is kept and pays for its
			// attributes: a publisher that samples one trace in ten
			// leaves the relay nine spans in ten that record nothing.
			span.End()
			continue
		}
		attrs := make([]attribute.KeyValue, 0, len(t.common)+8)
		attrs = append(attrs, t.common...)
		attrs = append(attrs,
			semconv.MessagingDestinationName(r.Exchange),
			semconv.MessagingMessageID(r.ID),
			semconv.MessagingMessageBodySize(len(r.Body)),
			attrAttempts.Int(r.Attempts),
		)
		if t.amqp && r.RoutingKey != "" {
			attrs = append(attrs, semconv.MessagingRabbitMQDestinationRoutingKey(r.RoutingKey))
		}
		if !r.CreatedAt.IsZero() {
			attrs = append(attrs, attrRecordAge.Float64(max(0, now.Sub(r.CreatedAt).Seconds())))
		}
		if r.AggregateID != "" {
			attrs = append(attrs, attrAggregateID.String(r.AggregateID), attrSeq.Int64(r.Seq))
		}
		span.SetAttributes(attrs...)
		if b.spans == nil {
			b.spans = make([]trace.Span, len(b.records))
		}
		b.spans[i] = span
	}
}

// The outcomes a relay's span ends with (acemq.outcome).
const (
	spanPublished = "published"  // confirmed by the broker and marked
	spanHeldBack  = "held_back"  // confirmed or not, behind a record that was not published: sent again after it
	spanReleased  = "released"   // not sent, or sent and not confirmed: claimed again, no attempt counted
	spanFailed    = "failed"     // its publish failed: tried again after a backoff
	spanStuck     = "stuck"      // its publish failed, and it is stuck (MaxAttempts, or refused for good)
	spanNotMarked = "not_marked" // confirmed, and the mark failed: sent again
)

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
// of its context's (the publisher's, restored), and puts it in the
// message's context for the handler.
func (in *Inbox) startProcessSpan(msg *message.Message) trace.Span {
	ctx := msg.Context()
	topic := message.SubscribeTopicFromCtx(ctx)
	name := "process"
	if topic != "" {
		name += " " + topic
	}
	attrs := []attribute.KeyValue{
		semconv.MessagingOperationTypeProcess,
		semconv.MessagingOperationName("process"),
		semconv.MessagingMessageBodySize(len(msg.Payload)),
	}
	if topic != "" {
		attrs = append(attrs, semconv.MessagingDestinationName(topic))
	}
	if id := dedupeKey(msg); id != "" {
		attrs = append(attrs, semconv.MessagingMessageID(id))
	}
	if c := in.consumerIn(ctx); c != "" {
		attrs = append(attrs, semconv.MessagingConsumerGroupName(c))
	}
	if key := msg.Metadata.Get(HeaderAggregateID); key != "" {
		attrs = append(attrs, attrAggregateID.String(key))
		if seq, err := strconv.ParseInt(msg.Metadata.Get(HeaderSeq), 10, 64); err == nil {
			attrs = append(attrs, attrSeq.Int64(seq))
		}
	}
	ctx, span := in.tracer.Start(ctx, name, trace.WithSpanKind(trace.SpanKindConsumer), trace.WithAttributes(attrs...))
	msg.SetContext(ctx)
	return span
}

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
	case inboxSetAside:
		return "set_aside"
	default:
		return "failed"
	}
}
