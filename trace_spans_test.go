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
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	outbox "github.com/acemq/watermill-outbox"
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
		defer testamqpDeleteQueue(t, topic)
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

// failingOne is a Destination that fails the records of one id and
// publishes the rest (as far as the relay can tell).
type failingOne struct {
	id string
	mu sync.Mutex
}

func (d *failingOne) Publish(_ context.Context, records []outbox.Record) []error {
	d.mu.Lock()
	defer d.mu.Unlock()
	res := make([]error, len(records))
	for i, r := range records {
		if r.ID == d.id {
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
