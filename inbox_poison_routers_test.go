package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

func failingRouter(t *testing.T, in *outbox.Inbox, pq message.HandlerMiddleware, bus *gochannel.GoChannel, runs *atomic.Int64, plugin bool) *message.Router {
	t.Helper()
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	retry := middleware.Retry{MaxRetries: 1, InitialInterval: time.Millisecond, ResetContextOnRetry: true}
	router.AddMiddleware(pq, retry.Middleware, middleware.Timeout(30*time.Second), in.Middleware)
	router.AddConsumerHandler("fulfil-orders", "orders", bus, func(*message.Message) error {
		runs.Add(1)
		return errors.New("no such warehouse") // a real, permanent failure
	})
	if plugin {
		router.AddPlugin(in.Plugin())
	}
	return router
}

func runFailingRouter(t *testing.T, r *message.Router) chan error {
	done := make(chan error, 1)
	go func() { done <- r.Run(context.Background()) }()
	<-r.Running()
	return done
}

// A first router with the plugin stops (an in-process restart); the next
// router of the same Inbox runs the same handler name without the plugin.
// A message whose handler really keeps failing is set aside: a plugin
// that kept the stopped router's run by handler name refused it for ever,
// a redelivery loop (about 4,000 runs in 3 s).
func TestInbox_PoisonPublisher_RouterRestartedWithoutThePlugin_PoisonStillSetAside(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	id, in, poison, pq := poisonedChainSetup(t, db, "order.placed")
	var runs atomic.Int64

	bus1 := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	defer bus1.Close()
	r1 := failingRouter(t, in, pq, bus1, &runs, true)
	d1 := runFailingRouter(t, r1)
	if err := r1.Close(); err != nil {
		t.Fatal(err)
	}
	<-d1

	bus2 := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
	defer bus2.Close()
	r2 := failingRouter(t, in, pq, bus2, &runs, false)
	d2 := runFailingRouter(t, r2)
	defer func() { r2.Close(); <-d2 }()
	wantSetAsideOnce(t, db, bus2, id, poison, &runs)
}

// Two routers of one process share the Inbox and a handler name, both with
// the plugin; the second one started stops while the first runs on: the
// first's real poison is set aside, not refused for the other's stop.
func TestInbox_PoisonPublisher_AnotherRouterOfTheInboxStopped_PoisonStillSetAside(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	id, in, poison, pq := poisonedChainSetup(t, db, "order.placed")
	var runs atomic.Int64

	bus1 := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
	defer bus1.Close()
	r1 := failingRouter(t, in, pq, bus1, &runs, true)
	d1 := runFailingRouter(t, r1)
	defer func() { r1.Close(); <-d1 }()

	bus2 := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	defer bus2.Close()
	r2 := failingRouter(t, in, pq, bus2, &runs, true)
	d2 := runFailingRouter(t, r2)
	time.Sleep(100 * time.Millisecond)
	r2.Close()
	<-d2

	wantSetAsideOnce(t, db, bus1, id, poison, &runs)
}

// wantSetAsideOnce publishes record id's message on bus, to a running
// failingRouter, and wants it set aside once, its record processed.
func wantSetAsideOnce(t *testing.T, db *testdb.DB, bus *gochannel.GoChannel, id string, poison *poisonRecorder, runs *atomic.Int64) {
	t.Helper()
	if err := bus.Publish("orders", message.NewMessage(id, []byte("x"))); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(3 * time.Second)
	for poison.count() == 0 && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	if poison.count() != 1 || !outboxStateOf(t, db, id).Processed {
		t.Errorf("poison message under a running router: set aside %d times, record processed %v, handler ran %d times in 3s; want set aside once",
			poison.count(), outboxStateOf(t, db, id).Processed, runs.Load())
	}
}

// Watermill closes a router whose handlers have all stopped (its
// subscriptions ended), with an unordered inbox's plugin as without it: a
// plugin that added a handler of its own kept such a router open.
func TestInbox_Plugin_NotOrdered_RouterClosesWhenItsHandlersStop(t *testing.T) {
	for _, plugin := range []bool{false, true} {
		t.Run(map[bool]string{false: "without plugin", true: "with plugin"}[plugin], func(t *testing.T) {
			db := migrated(t, testdb.SQLite)
			_, in, _, pq := poisonedChainSetup(t, db, "order.placed")
			var runs atomic.Int64
			bus := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
			r := failingRouter(t, in, pq, bus, &runs, plugin)
			d := runFailingRouter(t, r)
			bus.Close() // the subscription ends: every user handler stops
			select {
			case <-d:
			case <-time.After(3 * time.Second):
				t.Errorf("router.Run did not return 3s after all of its handlers stopped (closed %v)", r.IsClosed())
				r.Close()
				<-d
			}
		})
	}
}

// As TestInbox_PoisonPublisher_DeliveryAfterTheServicesContextEndedWithACause_NotSetAside,
// with a user middleware between PoisonQueue and Retry that wraps the error
// (no plugin: the call is not through a router): the reason ends with the
// cause's text.
func TestInbox_PoisonPublisher_DeliveryAfterTheStop_CauseWrappedByAMiddleware_NotSetAside(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	id, in, poison, pq := poisonedChainSetup(t, db, "order.placed")
	runCtx, stop := context.WithCancelCause(context.Background())
	stop(errSignalled)
	wrap := func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			msgs, err := h(msg)
			if err != nil {
				err = fmt.Errorf("fulfil-orders: %w", err)
			}
			return msgs, err
		}
	}
	h := pq(wrap(middleware.Retry{MaxRetries: 3, InitialInterval: time.Millisecond, ResetContextOnRetry: true}.Middleware(
		middleware.Timeout(30 * time.Second)(in.Middleware(func(*message.Message) ([]*message.Message, error) {
			return nil, nil
		})))))
	msg := message.NewMessage(id, []byte("x"))
	msg.SetContext(runCtx)
	_, _ = h(msg)
	if poison.count() != 0 || outboxStateOf(t, db, id).Processed {
		t.Errorf("never-run message set aside %d (reason %q), processed %v", poison.count(), poisonReason(poison), outboxStateOf(t, db, id).Processed)
	}
}
