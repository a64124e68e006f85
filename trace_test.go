package outbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// A trace id that goes in at publish comes out in the handler: the
// traceparent rides in the row's headers, through the relay and the broker,
// and the inbox restores it.
func TestTrace_TraceparentAtPublish_RestoredInHandler(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		testdb.Require(t, "amqp")
		createEffects(t, db)
		topic := "traced-" + testdb.RandomName()
		sub, err := wamqp.NewSubscriber(wamqp.NewDurableQueueConfig(testdb.AMQPURL()), watermill.NopLogger{})
		if err != nil {
			t.Fatal(err)
		}
		defer testamqpDeleteQueue(t, topic)
		in := newInbox(t, db, outbox.InboxConfig{Propagator: propagation.TraceContext{}})
		router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
		if err != nil {
			t.Fatal(err)
		}
		got := make(chan trace.SpanContext, 1)
		router.AddConsumerHandler("traced", topic, sub, func(msg *message.Message) error {
			got <- trace.SpanContextFromContext(msg.Context())
			return nil
		}).AddMiddleware(in.Middleware)
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		go func() { _ = router.Run(ctx) }()
		defer router.Close()
		<-router.Running()

		traceID, _ := trace.TraceIDFromHex("4bf92f3577b34da6a3ce929d0e0e4736")
		spanID, _ := trace.SpanIDFromHex("00f067aa0ba902b7")
		sc := trace.NewSpanContext(trace.SpanContextConfig{TraceID: traceID, SpanID: spanID, TraceFlags: trace.FlagsSampled})
		msg := message.NewMessage(watermill.NewUUID(), []byte("x"))
		msg.SetContext(trace.ContextWithSpanContext(context.Background(), sc))
		publishInTx(t, db, topic, []*message.Message{msg}, outbox.TxPublisherConfig{Propagator: propagation.TraceContext{}})
		if msg.Metadata.Get("traceparent") != "" {
			t.Error("the publisher wrote the traceparent into the caller's message")
		}

		f := newForwarder(t, db, outbox.ForwarderConfig{})
		sweepAll(t, f)
		select {
		case sc := <-got:
			if sc.TraceID() != traceID || !sc.IsRemote() {
				t.Fatalf("handler's span context %v, want trace %s from the publisher", sc, traceID)
			}
		case <-time.After(20 * time.Second):
			t.Fatal("the handler never ran")
		}
	})
}
