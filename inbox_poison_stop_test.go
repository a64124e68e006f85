package outbox_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// errSignalled is the cause signal.NotifyContext cancels its context with
// (Go 1.26 on), as router.Run's context carries it to every delivery's.
var errSignalled = errors.New("terminated signal received")

// A delivery the router takes up once the service's context has ended
// (SIGTERM, through signal.NotifyContext): Retry runs nothing and answers
// with the context's cause, not context.Canceled, and PoisonQueue passed
// it on as the handler's error. PoisonPublisher set the message aside,
// acked, and marked its record processed: never applied, never sent again,
// its key stalled for good (a review's service lost 2–8 messages in each
// such stop). It knows the cause for the message context's, and refuses.
func TestInbox_PoisonPublisher_DeliveryAfterTheServicesContextEndedWithACause_NotSetAside(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		id, in, poison, pq := poisonedChainSetup(t, db, "order.placed")
		runCtx, stop := context.WithCancelCause(context.Background())
		stop(errSignalled)
		ran := false
		h := pq(middleware.Retry{MaxRetries: 3, InitialInterval: time.Millisecond, ResetContextOnRetry: true}.Middleware(
			middleware.Timeout(30 * time.Second)(in.Middleware(func(*message.Message) ([]*message.Message, error) {
				ran = true
				return nil, nil
			}))))
		msg := message.NewMessage(id, []byte("x"))
		msg.SetContext(runCtx)
		_, err := h(msg)
		if err == nil {
			t.Errorf("a delivery whose context had ended (%v) was acked (poisoned %d)", context.Cause(runCtx), poison.count())
		}
		if ran || poison.count() != 0 || outboxStateOf(t, db, id).Processed {
			t.Errorf("handler ran %v, poisoned %d, record processed %v; want false, 0, false: it is delivered again",
				ran, poison.count(), outboxStateOf(t, db, id).Processed)
		}
	})
}

// The service's context ends (SIGTERM, with its cause) while Retry backs
// off after a handler's failure, through a running router with the inbox's
// plugin: Retry answers with the cause, and the message's own context is
// the one Timeout ended, with context.Canceled, which says nothing of the
// router. The plugin tells PoisonPublisher the router is stopping: the
// message is not set aside, its record not processed, and it is delivered
// again at the next start, its retries not spent on the stop.
func TestInbox_PoisonPublisher_RouterStoppedWithACauseDuringRetryBackoff_PluginKeepsItFromThePoisonTopic(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		id, in, poison, pq := poisonedChainSetup(t, db, "order.placed")
		bus := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
		defer bus.Close()
		router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
		if err != nil {
			t.Fatal(err)
		}
		runCtx, stop := context.WithCancelCause(context.Background())
		defer stop(nil)
		retry := middleware.Retry{MaxRetries: 3, InitialInterval: 50 * time.Millisecond, ResetContextOnRetry: true,
			ShouldRetry: func(middleware.RetryParams) bool {
				stop(errSignalled) // SIGTERM, as Retry is about to back off
				return true
			}}
		router.AddMiddleware(pq, retry.Middleware, middleware.Timeout(30*time.Second), in.Middleware)
		runs := make(chan struct{}, 16)
		router.AddConsumerHandler("fulfil-orders", "orders", bus, func(*message.Message) error {
			runs <- struct{}{}
			return errors.New("the payment service is down")
		})
		router.AddPlugin(in.Plugin())
		done := make(chan error, 1)
		go func() { done <- router.Run(runCtx) }()
		<-router.Running()
		if err := bus.Publish("orders", message.NewMessage(id, []byte("x"))); err != nil {
			t.Fatal(err)
		}
		select {
		case <-runs:
		case <-time.After(10 * time.Second):
			t.Fatal("the handler never ran")
		}
		select {
		case err := <-done:
			if err != nil {
				t.Fatal(err)
			}
		case <-time.After(20 * time.Second):
			t.Fatal("the router did not stop")
		}
		if poison.count() != 0 || outboxStateOf(t, db, id).Processed {
			t.Errorf("a message whose retries the stop cut short: poisoned %d (reason %q), record processed %v; want 0, false: it is delivered again",
				poison.count(), poisonReason(poison), outboxStateOf(t, db, id).Processed)
		}
	})
}

func poisonReason(p *poisonRecorder) string {
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.msgs) == 0 {
		return ""
	}
	return p.msgs[0].Metadata.Get(middleware.ReasonForPoisonedKey)
}
