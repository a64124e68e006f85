package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	amqp "github.com/rabbitmq/amqp091-go"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testamqp"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// recordedSpans is a TracerProvider that keeps every span ended.
type recordedSpans struct {
	*sdktrace.TracerProvider
	rec *tracetest.SpanRecorder
}

func newRecordedSpans(t testing.TB) recordedSpans {
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	return recordedSpans{tp, rec}
}

// named returns the ended spans of that name.
func (r recordedSpans) named(name string) []sdktrace.ReadOnlySpan {
	var out []sdktrace.ReadOnlySpan
	for _, s := range r.rec.Ended() {
		if s.Name() == name {
			out = append(out, s)
		}
	}
	return out
}

// withMessageID returns the spans of spans whose messaging.message.id is id.
func withMessageID(spans []sdktrace.ReadOnlySpan, id string) []sdktrace.ReadOnlySpan {
	var out []sdktrace.ReadOnlySpan
	for _, s := range spans {
		if attrOf(s, "messaging.message.id").AsString() == id {
			out = append(out, s)
		}
	}
	return out
}

func attrOf(s sdktrace.ReadOnlySpan, key string) attribute.Value {
	for _, kv := range s.Attributes() {
		if string(kv.Key) == key {
			return kv.Value
		}
	}
	return attribute.Value{}
}

// One trace from the request that published to the consumer's handler:
// the relay's span of the record and the inbox's span of its delivery are
// children of the publisher's span, the handler's own span a child of the
// inbox's; a copy delivered again (the relay sent it twice) is a span of
// its own, a duplicate; a record published without a trace context gets
// no relay span (the relay starts no trace), and its delivery a root span.
func TestTrace_Spans_RelayAndInboxJoinThePublishersTrace(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		testdb.Require(t, "amqp")
		createEffects(t, db)
		spans := newRecordedSpans(t)
		topic := "spans-" + testdb.RandomName()
		// After the router's stop (a cleanup registered later runs first):
		// deleted under a running subscriber, the queue was declared again.
		t.Cleanup(func() { testamqpDeleteQueue(t, topic) })
		sub, err := wamqp.NewSubscriber(wamqp.NewDurableQueueConfig(testdb.AMQPURL()), watermill.NopLogger{})
		if err != nil {
			t.Fatal(err)
		}
		in := newInbox(t, db, outbox.InboxConfig{TracerProvider: spans, ConsumerName: "ledger"})
		handled := make(chan string, 10)
		router := newRouter(t)
		router.AddConsumerHandler("ledger-handler", topic, sub, func(msg *message.Message) error {
			_, work := spans.Tracer("test").Start(msg.Context(), "handler-work")
			work.End()
			tx, _ := outbox.TxFromContext(msg.Context())
			if _, err := tx.ExecContext(msg.Context(), db.Rebind("INSERT INTO effects (message_id, note) VALUES (?, 'x')"), msg.UUID); err != nil {
				return err
			}
			handled <- msg.UUID
			return nil
		}).AddMiddleware(in.Middleware)
		startRouter(t, router)

		ctx, request := spans.Tracer("test").Start(context.Background(), "request")
		traced := message.NewMessage(watermill.NewUUID(), []byte("traced"))
		traced.SetContext(ctx)
		publishInTx(t, db, topic, []*message.Message{traced}, outbox.TxPublisherConfig{Propagator: propagation.TraceContext{}})
		request.End()
		untraced := message.NewMessage(watermill.NewUUID(), []byte("untraced"))
		publishInTx(t, db, topic, []*message.Message{untraced})

		f := newForwarder(t, db, outbox.ForwarderConfig{TracerProvider: spans})
		sweepAll(t, f)
		waitHandled(t, handled, traced.UUID, untraced.UUID)

		// Sent again, as by a relay killed between the confirm and the mark.
		if n, err := f.Store().Resend(context.Background(), traced.UUID); err != nil || n != 1 {
			t.Fatalf("Resend = %d, %v; want 1", n, err)
		}
		sweepAll(t, f)
		// The copy is acked without running: its span ends as the delivery does.
		waitFor(t, 20*time.Second, "the copy's span", func() bool {
			return len(withMessageID(spans.named("process "+topic), traced.UUID)) == 2
		})

		reqCtx := request.SpanContext()
		sends := withMessageID(spansOfKind(spans.rec.Ended(), trace.SpanKindProducer), traced.UUID)
		if len(sends) != 2 {
			t.Fatalf("%d relay spans of the traced record, want 2 (one per send): %v", len(sends), names(spans.rec.Ended()))
		}
		for _, s := range sends {
			if s.Parent().SpanID() != reqCtx.SpanID() || s.SpanContext().TraceID() != reqCtx.TraceID() {
				t.Errorf("relay span %q: parent %s, want the publisher's span %s", s.Name(), s.Parent().SpanID(), reqCtx.SpanID())
			}
			if s.SpanKind() != trace.SpanKindProducer {
				t.Errorf("relay span kind %v, want producer", s.SpanKind())
			}
			if got := attrOf(s, "acemq.outcome").AsString(); got != "published" {
				t.Errorf("relay span outcome %q, want published", got)
			}
			if got := attrOf(s, "messaging.system").AsString(); got != "rabbitmq" {
				t.Errorf("relay span messaging.system %q, want rabbitmq", got)
			}
		}
		if n := len(withMessageID(spansOfKind(spans.rec.Ended(), trace.SpanKindProducer), untraced.UUID)); n != 0 {
			t.Errorf("%d relay spans of the record published without a trace context, want 0", n)
		}

		processed := withMessageID(spans.named("process "+topic), traced.UUID)
		outcomes := map[string]int{}
		for _, s := range processed {
			outcomes[attrOf(s, "acemq.outcome").AsString()]++
			if s.Parent().SpanID() != reqCtx.SpanID() || s.SpanContext().TraceID() != reqCtx.TraceID() {
				t.Errorf("inbox span: parent %s, want the publisher's span %s", s.Parent().SpanID(), reqCtx.SpanID())
			}
			if s.SpanKind() != trace.SpanKindConsumer {
				t.Errorf("inbox span kind %v, want consumer", s.SpanKind())
			}
			if got := attrOf(s, "messaging.consumer.group.name").AsString(); got != "ledger" {
				t.Errorf("inbox span consumer %q, want ledger", got)
			}
		}
		if outcomes["processed"] != 1 || outcomes["duplicate"] != 1 {
			t.Errorf("inbox span outcomes %v, want one processed and one duplicate", outcomes)
		}
		var ranUnder trace.SpanID
		for _, s := range processed {
			if attrOf(s, "acemq.outcome").AsString() == "processed" {
				ranUnder = s.SpanContext().SpanID()
			}
		}
		work := spans.named("handler-work")
		found := false
		for _, w := range work {
			found = found || w.Parent().SpanID() == ranUnder && w.SpanContext().TraceID() == reqCtx.TraceID()
		}
		if !found {
			t.Errorf("no handler span is a child of the inbox's span %s in the publisher's trace", ranUnder)
		}

		rootless := withMessageID(spans.named("process "+topic), untraced.UUID)
		if len(rootless) != 1 || rootless[0].Parent().IsValid() {
			t.Errorf("the untraced message's inbox spans %d (parent valid: %v), want one root span", len(rootless), len(rootless) == 1 && rootless[0].Parent().IsValid())
		}
	})
}

func waitHandled(t *testing.T, handled <-chan string, ids ...string) {
	t.Helper()
	want := map[string]bool{}
	for _, id := range ids {
		want[id] = true
	}
	deadline := time.After(20 * time.Second)
	for len(want) > 0 {
		select {
		case id := <-handled:
			delete(want, id)
		case <-deadline:
			t.Fatalf("messages %v never handled", want)
		}
	}
}

func spansOfKind(spans []sdktrace.ReadOnlySpan, kind trace.SpanKind) []sdktrace.ReadOnlySpan {
	var out []sdktrace.ReadOnlySpan
	for _, s := range spans {
		if s.SpanKind() == kind {
			out = append(out, s)
		}
	}
	return out
}

func names(spans []sdktrace.ReadOnlySpan) []string {
	out := make([]string, len(spans))
	for i, s := range spans {
		out[i] = s.Name()
	}
	return out
}

// failingOne is a Destination that fails the records of one id (for good,
// if permanent) and publishes the rest (as far as the relay can tell).
type failingOne struct {
	id        string
	permanent bool
	mu        sync.Mutex
}

func (d *failingOne) Publish(_ context.Context, records []outbox.Record) []error {
	d.mu.Lock()
	defer d.mu.Unlock()
	res := make([]error, len(records))
	for i, r := range records {
		switch {
		case r.ID != d.id:
		case d.permanent:
			res[i] = outbox.Permanent(errors.New("refused for good (test)"))
		default:
			res[i] = errors.New("refused by the test")
		}
	}
	return res
}

// A record whose publish fails ends its span with an error status and
// outcome failed, then stuck at MaxAttempts; the record behind it, not
// published before it, ends held_back each time, then published; the one
// before it published.
func TestTrace_RelaySpans_FailedStuckAndHeldBackTold(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.SQLite)
	spans := newRecordedSpans(t)
	msgs := make([]*message.Message, 3)
	ctx, request := spans.Tracer("test").Start(context.Background(), "request")
	for i := range msgs {
		msgs[i] = message.NewMessage(fmt.Sprintf("rec-%d", i), []byte("x"))
		msgs[i].SetContext(ctx)
	}
	publishInTx(t, db, "orders", msgs, outbox.TxPublisherConfig{Propagator: propagation.TraceContext{}})
	request.End()
	f, err := outbox.NewForwarder(db.DB, &failingOne{id: "rec-1"}, outbox.ForwarderConfig{
		TracerProvider: spans, MaxAttempts: 2, RetryMin: time.Millisecond, RetryMax: time.Millisecond,
	})
	if err != nil {
		t.Fatal(err)
	}
	for try := 0; try < 2; try++ {
		if _, err := f.Sweep(context.Background()); err == nil {
			t.Fatalf("sweep %d: nil error, want rec-1's failure", try)
		}
		time.Sleep(5 * time.Millisecond) // past RetryMax
	}
	if n, err := f.Sweep(context.Background()); err != nil || n != 1 {
		t.Fatalf("third sweep = %d, %v; want rec-2 published past rec-1, stuck", n, err)
	}
	sends := spansOfKind(spans.rec.Ended(), trace.SpanKindProducer)
	outcomes := func(id string) []string {
		var out []string
		for _, s := range withMessageID(sends, id) {
			out = append(out, attrOf(s, "acemq.outcome").AsString())
			if s.Parent().SpanID() != request.SpanContext().SpanID() {
				t.Errorf("%s: parent %s, want the publisher's span", id, s.Parent().SpanID())
			}
			if failed := s.Status().Code == codes.Error; failed != (id == "rec-1") {
				t.Errorf("%s: status %v, want an error only for the failed record", id, s.Status())
			}
		}
		return out
	}
	if got := outcomes("rec-0"); fmt.Sprint(got) != "[published]" {
		t.Errorf("rec-0 spans %v, want [published]", got)
	}
	if got := outcomes("rec-1"); fmt.Sprint(got) != "[failed stuck]" {
		t.Errorf("rec-1 spans %v, want [failed stuck]", got)
	}
	if got := outcomes("rec-2"); fmt.Sprint(got) != "[held_back held_back published]" {
		t.Errorf("rec-2 spans %v, want [held_back held_back published]: behind rec-1 while it failed, then past it, stuck", got)
	}
}

// An ordered message ahead of its predecessor: its delivery's span ends
// held; applied at its turn, in the delivery of its predecessor, it gets a
// span of its own, processed, a child of its own publisher's span.
func TestTrace_OrderedInbox_HeldThenAppliedEachASpan(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.SQLite)
	createEffects(t, db)
	spans := newRecordedSpans(t)
	var l applyLog
	h := orderedInbox(t, db, outbox.InboxConfig{TracerProvider: spans}).Middleware(l.handler(t, db))
	parents := map[int]trace.SpanContext{}
	deliverTraced := func(seq int) {
		ctx, span := spans.Tracer("test").Start(context.Background(), fmt.Sprint("publish-", seq))
		span.End()
		parents[seq] = span.SpanContext()
		msg := keyedMsg("pay-1", seq)
		propagation.TraceContext{}.Inject(ctx, propagation.MapCarrier(msg.Metadata))
		if _, err := h(msg); err != nil {
			t.Fatalf("seq %d: %v", seq, err)
		}
	}
	deliverTraced(2)
	deliverTraced(1)
	if got := l.of("pay-1"); fmt.Sprint(got) != "[1 2]" {
		t.Fatalf("applied %v, want [1 2]", got)
	}
	var got []string
	for _, s := range spans.named("process") {
		seq := attrOf(s, "acemq.seq").AsInt64()
		got = append(got, fmt.Sprintf("%d:%s", seq, attrOf(s, "acemq.outcome").AsString()))
		if p := parents[int(seq)]; s.Parent().SpanID() != p.SpanID() || s.SpanContext().TraceID() != p.TraceID() {
			t.Errorf("seq %d's span: parent %s, want its publisher's %s", seq, s.Parent().SpanID(), p.SpanID())
		}
	}
	// Ended in this order: 2's delivery, 2's apply inside 1's delivery, 1's.
	if fmt.Sprint(got) != "[2:held 2:processed 1:processed]" {
		t.Errorf("inbox spans %v, want [2:held 2:processed 1:processed]", got)
	}
}

// A record whose publisher's trace was not sampled gets no recorded span
// from the relay (the SDK's default sampler follows the parent's choice),
// and the relay publishes it all the same.
func TestTrace_RelaySpans_UnsampledPublisherRecordsNone(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.SQLite)
	spans := newRecordedSpans(t)
	tid, _ := trace.TraceIDFromHex("4bf92f3577b34da6a3ce929d0e0e4736")
	sid, _ := trace.SpanIDFromHex("00f067aa0ba902b7")
	unsampled := trace.NewSpanContext(trace.SpanContextConfig{TraceID: tid, SpanID: sid}) // TraceFlags 0
	msg := message.NewMessage("unsampled-1", []byte("x"))
	msg.SetContext(trace.ContextWithSpanContext(context.Background(), unsampled))
	publishInTx(t, db, "orders", []*message.Message{msg}, outbox.TxPublisherConfig{Propagator: propagation.TraceContext{}})
	f, err := outbox.NewForwarder(db.DB, &failingOne{}, outbox.ForwarderConfig{TracerProvider: spans})
	if err != nil {
		t.Fatal(err)
	}
	if n, err := f.Sweep(context.Background()); err != nil || n != 1 {
		t.Fatalf("Sweep = %d, %v; want 1 published", n, err)
	}
	if got := spans.rec.Ended(); len(got) != 0 {
		t.Errorf("%d spans recorded (%v), want none for an unsampled trace", len(got), names(got))
	}
}

// publishTraced commits n records to topic orders, prefix-0…, carrying
// the trace of a sampled span, and returns that span's context.
func publishTraced(t *testing.T, db *testdb.DB, spans recordedSpans, prefix string, n int) trace.SpanContext {
	t.Helper()
	return publishTracedTo(t, db, spans, "orders", prefix, n)
}

func publishTracedTo(t *testing.T, db *testdb.DB, spans recordedSpans, topic, prefix string, n int) trace.SpanContext {
	t.Helper()
	ctx, request := spans.Tracer("test").Start(context.Background(), "request")
	msgs := make([]*message.Message, n)
	for i := range msgs {
		msgs[i] = message.NewMessage(fmt.Sprintf("%s-%d", prefix, i), []byte("x"))
		msgs[i].SetContext(ctx)
	}
	publishInTx(t, db, topic, msgs, outbox.TxPublisherConfig{Propagator: propagation.TraceContext{}})
	request.End()
	return request.SpanContext()
}

// defaultExchangeQueue declares a durable queue named prefix…, which the
// default exchange routes its name to, deleted when the test ends.
func defaultExchangeQueue(t *testing.T, prefix string) string {
	t.Helper()
	testdb.Require(t, "amqp")
	q := prefix + testdb.RandomName()
	testamqp.New(t).With(func(ch *amqp.Channel) error { _, err := ch.QueueDeclare(q, true, false, false, false, nil); return err })
	t.Cleanup(func() { testamqpDeleteQueue(t, q) })
	return q
}

type panickingDestination struct{}

func (panickingDestination) Publish(context.Context, []outbox.Record) []error {
	panic("destination bug")
}

// A Destination that panics, the panic recovered by Sweep's caller (as
// net/http recovers a handler's): the claim is abandoned, and every span
// the relay started for it ends, released, rather than stay open for ever
// and never be exported.
func TestTrace_RelaySpans_DestinationPanics_EachSpanEndsReleased(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.SQLite)
	spans := newRecordedSpans(t)
	publishTraced(t, db, spans, "pan", 2)
	f, err := outbox.NewForwarder(db.DB, panickingDestination{}, outbox.ForwarderConfig{TracerProvider: spans})
	if err != nil {
		t.Fatal(err)
	}
	if _, _, p := sweepRecovering(f); p == nil {
		t.Fatal("Sweep did not panic")
	}
	ended := spansOfKind(spans.rec.Ended(), trace.SpanKindProducer)
	var started []sdktrace.ReadOnlySpan
	for _, s := range spans.rec.Started() {
		if s.SpanKind() == trace.SpanKindProducer {
			started = append(started, s)
		}
	}
	if len(started) != 2 || len(ended) != 2 {
		t.Fatalf("%d relay spans started, %d ended; want 2 and 2", len(started), len(ended))
	}
	for _, s := range ended {
		if got := attrOf(s, "acemq.outcome").AsString(); got != "released" || s.Status().Code != codes.Error {
			t.Errorf("span of %s: outcome %q, status %v; want released, an error", attrOf(s, "messaging.message.id").AsString(), got, s.Status())
		}
	}
}

// A record refused for good is stuck once its batch is marked; when the
// mark fails, nothing is recorded, the record is pending and goes out
// again, and its span says failed, not stuck.
func TestTrace_RelaySpans_MarkFails_FailedRecordNotSaidStuck(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.SQLite)
	spans := newRecordedSpans(t)
	publishTraced(t, db, spans, "mk", 1)
	f, err := outbox.NewForwarder(db.DB, &failingOne{id: "mk-0", permanent: true}, outbox.ForwarderConfig{TracerProvider: spans, MaxAttempts: 3})
	if err != nil {
		t.Fatal(err)
	}
	outbox.SetAfterPublishHook(f, func([]string) error { return errors.New("mark failed (test)") })
	if _, err := f.Sweep(context.Background()); err == nil {
		t.Fatal("Sweep: nil error, want the mark's failure")
	}
	if s := stateOf(t, db, "mk-0"); s.Attempts != 0 {
		t.Fatalf("mk-0: %+v, want no attempt recorded", s)
	}
	sends := withMessageID(spansOfKind(spans.rec.Ended(), trace.SpanKindProducer), "mk-0")
	if len(sends) != 1 || attrOf(sends[0], "acemq.outcome").AsString() != "failed" {
		t.Errorf("mk-0's spans %d, outcome %q; want one, failed (not stuck: its failure was not recorded)", len(sends), attrOf(sends[0], "acemq.outcome").AsString())
	}
}

// A held message without a trace context of its own, applied in the
// delivery of its predecessor (another request's trace), gets a root span
// linked to that delivery's, not a child in the other request's trace.
func TestTrace_OrderedInbox_UntracedHeldMessage_RootLinkedToTheDeliveryThatReleasedIt(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.SQLite)
	createEffects(t, db)
	spans := newRecordedSpans(t)
	var l applyLog
	h := orderedInbox(t, db, outbox.InboxConfig{TracerProvider: spans}).Middleware(l.handler(t, db))
	if _, err := h(keyedMsg("pay-2", 2)); err != nil { // no trace context, held
		t.Fatal(err)
	}
	ctx, other := spans.Tracer("test").Start(context.Background(), "other-request")
	other.End()
	first := keyedMsg("pay-2", 1)
	propagation.TraceContext{}.Inject(ctx, propagation.MapCarrier(first.Metadata))
	if _, err := h(first); err != nil {
		t.Fatal(err)
	}
	if got := l.of("pay-2"); fmt.Sprint(got) != "[1 2]" {
		t.Fatalf("applied %v, want [1 2]", got)
	}
	var releaser trace.SpanContext
	for _, s := range spans.named("process") {
		if attrOf(s, "acemq.seq").AsInt64() == 1 {
			releaser = s.SpanContext()
		}
	}
	found := false
	for _, s := range spans.named("process") {
		if attrOf(s, "acemq.seq").AsInt64() != 2 || attrOf(s, "acemq.outcome").AsString() != "processed" {
			continue
		}
		found = true
		if s.Parent().IsValid() || s.SpanContext().TraceID() == other.SpanContext().TraceID() {
			t.Errorf("seq 2's apply span: parent %s in trace %s; want a root, not in seq 1's trace", s.Parent().SpanID(), s.SpanContext().TraceID())
		}
		if links := s.Links(); len(links) != 1 || links[0].SpanContext.SpanID() != releaser.SpanID() {
			t.Errorf("seq 2's apply span links %v, want seq 1's delivery span %s", links, releaser.SpanID())
		}
	}
	if !found {
		t.Error("no span of seq 2's apply")
	}
}

// The inbox's spans carry messaging.system (Required by the messaging
// conventions; backends group messaging spans by it) from their start.
func TestTrace_InboxSpans_MessagingSystemRabbitMQ(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.SQLite)
	spans := newRecordedSpans(t)
	h := newInbox(t, db, outbox.InboxConfig{TracerProvider: spans}).Middleware(func(*message.Message) ([]*message.Message, error) { return nil, nil })
	if _, err := h(message.NewMessage("sys-1", []byte("x"))); err != nil {
		t.Fatal(err)
	}
	got := spans.named("process")
	if len(got) != 1 || attrOf(got[0], "messaging.system").AsString() != "rabbitmq" {
		t.Errorf("process spans %d, messaging.system %q; want one, rabbitmq", len(got), attrOf(got[0], "messaging.system").AsString())
	}
}

// Through the default exchange (TxPublisher's default), the span is named
// by the routing key, the queue's name, rather than "publish " for every
// topic; messaging.destination.name is "" as RabbitMQ's conventions say.
func TestTrace_RelaySpans_DefaultExchange_NamedByTheQueue(t *testing.T) {
	t.Parallel()
	testdb.Require(t, "amqp")
	db := migrated(t, testdb.SQLite)
	spans := newRecordedSpans(t)
	q := defaultExchangeQueue(t, "spans-default-")
	publishTracedTo(t, db, spans, q, "default", 1)
	sweepAll(t, newForwarder(t, db, outbox.ForwarderConfig{TracerProvider: spans}))
	sends := spansOfKind(spans.rec.Ended(), trace.SpanKindProducer)
	if len(sends) != 1 || sends[0].Name() != "publish "+q {
		t.Fatalf("relay spans %v, want one, %q", names(sends), "publish "+q)
	}
	if v := attrOf(sends[0], "messaging.destination.name"); v.Type() != attribute.STRING || v.AsString() != "" {
		t.Errorf("messaging.destination.name %v, want \"\" (the default exchange)", v.Emit())
	}
}

// Run, pipelined, stopped while batches are in flight, ends every span it
// started, once each.
func TestTrace_RelaySpans_RunStoppedMidFlow_EverySpanEndsOnce(t *testing.T) {
	t.Parallel()
	testdb.Require(t, "amqp")
	db := migrated(t, testdb.SQLite)
	spans := newRecordedSpans(t)
	q := defaultExchangeQueue(t, "spans-run-")
	publishTracedTo(t, db, spans, q, "run", 3000)
	f := newForwarder(t, db, outbox.ForwarderConfig{TracerProvider: spans, BatchSize: 50})
	runCtx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- f.Run(runCtx) }()
	waitFor(t, 20*time.Second, "some spans", func() bool { return len(spans.rec.Ended()) > 200 })
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("Run: %v", err)
	}
	started := 0
	for _, s := range spans.rec.Started() {
		if s.SpanKind() == trace.SpanKindProducer {
			started++
		}
	}
	ended := map[trace.SpanID]int{}
	for _, s := range spansOfKind(spans.rec.Ended(), trace.SpanKindProducer) {
		ended[s.SpanContext().SpanID()]++
	}
	if started != len(ended) {
		t.Errorf("%d relay spans started, %d ended", started, len(ended))
	}
	for id, n := range ended {
		if n != 1 {
			t.Errorf("span %s ended %d times", id, n)
		}
	}
}

// A Retry around the inbox gives each run a span of its own, the
// publisher's child (not the run before's), which the handler's context
// carries; the message leaves the inbox with the context it came with.
func TestTrace_InboxSpans_RetryAroundTheInbox_EachRunThePublishersChild(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.SQLite)
	spans := newRecordedSpans(t)
	in := newInbox(t, db, outbox.InboxConfig{TracerProvider: spans})
	runs := 0
	var inHandler []trace.SpanContext
	var after context.Context
	h := middleware.Retry{MaxRetries: 3}.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		out, err := in.Middleware(func(msg *message.Message) ([]*message.Message, error) {
			inHandler = append(inHandler, trace.SpanContextFromContext(msg.Context()))
			if runs++; runs < 3 {
				return nil, errors.New("again")
			}
			return nil, nil
		})(msg)
		after = msg.Context()
		return out, err
	})
	ctx, request := spans.Tracer("test").Start(context.Background(), "request")
	request.End()
	msg := message.NewMessage("retry-1", []byte("x"))
	propagation.TraceContext{}.Inject(ctx, propagation.MapCarrier(msg.Metadata))
	orig := msg.Context()
	if _, err := h(msg); err != nil {
		t.Fatal(err)
	}
	got := spans.named("process")
	if len(got) != 3 || len(inHandler) != 3 {
		t.Fatalf("%d spans, %d runs; want 3 and 3", len(got), len(inHandler))
	}
	for i, s := range got {
		if s.Parent().SpanID() != request.SpanContext().SpanID() {
			t.Errorf("run %d: parent %s, want the publisher's %s", i, s.Parent().SpanID(), request.SpanContext().SpanID())
		}
		if inHandler[i].SpanID() != s.SpanContext().SpanID() {
			t.Errorf("run %d: the handler's span %s, want the run's %s", i, inHandler[i].SpanID(), s.SpanContext().SpanID())
		}
	}
	if after != orig {
		t.Error("the message left the inbox with another context than it came with")
	}
}

// A message a poison publisher of the inbox set aside: its trace ended
// with its failed runs, as of one still tried again, where the metrics
// and the log said it was given up. A span "set aside <topic>", its
// publisher's child, says so.
func TestTrace_InboxSpans_SetAsideEndsTheTrace(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.SQLite)
	spans := newRecordedSpans(t)
	in := newInbox(t, db, outbox.InboxConfig{TracerProvider: spans})
	poison := &poisonRecorder{}
	pq, err := middleware.PoisonQueue(in.PoisonPublisher(poison), "orders.poison")
	if err != nil {
		t.Fatal(err)
	}
	h := pq(in.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, errors.New("the order is malformed") }))
	ctx, request := spans.Tracer("test").Start(context.Background(), "request")
	request.End()
	msg := message.NewMessage("aside-1", []byte("x"))
	propagation.TraceContext{}.Inject(ctx, propagation.MapCarrier(msg.Metadata))
	if _, err := h(msg); err != nil || poison.count() != 1 {
		t.Fatalf("%v, set aside %d; want nil and 1", err, poison.count())
	}
	aside := spans.named("set aside orders.poison")
	if len(aside) != 1 {
		t.Fatalf("spans %v, want one set aside orders.poison", names(spans.rec.Ended()))
	}
	s := aside[0]
	if s.Parent().SpanID() != request.SpanContext().SpanID() || attrOf(s, "acemq.outcome").AsString() != "set_aside" ||
		s.Status().Code != codes.Error || attrOf(s, "messaging.message.id").AsString() != "aside-1" {
		t.Errorf("set-aside span: parent %s (want the publisher's %s), outcome %q, status %v, id %q",
			s.Parent().SpanID(), request.SpanContext().SpanID(), attrOf(s, "acemq.outcome").AsString(), s.Status(), attrOf(s, "messaging.message.id").AsString())
	}
}
