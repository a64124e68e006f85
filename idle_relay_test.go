package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	amqp "github.com/rabbitmq/amqp091-go"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testamqp"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// An idle relay whose broker went down tries to connect again on a backoff
// of its own, not the sweep's: counted as a failed sweep, it held a record
// committed once the broker was back, the relay woken, for the rest of the
// backoff (RetryMax), though no record had failed.
func TestForwarder_IdleConnectFailed_BrokerBack_WokenRecordGoesAtOnce(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.SQLite)
	broker := testamqp.New(t)
	queue := broker.Queue("rk")
	node := testamqp.NewNode(t)
	var down atomic.Bool
	dest, err := outbox.NewAMQPDestination(outbox.AMQPConfig{URLs: []string{node.URL}, AMQP: amqp.Config{
		Dial: func(network, addr string) (net.Conn, error) {
			if down.Load() {
				return nil, errors.New("connection refused (test)")
			}
			return net.DialTimeout(network, addr, 5*time.Second)
		},
	}})
	if err != nil {
		t.Fatal(err)
	}
	// Every failure the relay reports, with when: should the record go
	// late, the test says which failure held it (one CI run saw it go
	// after RetryMin, a sweep's backoff, once in some ten runs).
	var (
		mu       sync.Mutex
		failures []string
		refused  atomic.Bool
	)
	start := time.Now()
	f, err := outbox.NewForwarder(db.DB, dest, outbox.ForwarderConfig{Dialect: outbox.SQLite,
		RetryMin: 6 * time.Second, RetryMax: 6 * time.Second,
		OnError: func(err error, _ outbox.ErrorContext) {
			mu.Lock()
			defer mu.Unlock()
			failures = append(failures, fmt.Sprintf("%s: %v", time.Since(start).Round(time.Millisecond), err))
			if strings.Contains(err.Error(), "connection refused (test)") {
				refused.Store(true)
			}
		}})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() { _ = f.Run(ctx) }()
	<-f.Running()
	waitFor(t, 20*time.Second, "the idle relay connected", func() bool { return dest.Node() != "" })
	down.Store(true)
	node.Drop() // the broker goes down
	// The idle relay's own connect, refused while the broker is down (not,
	// say, a channel that failed on the dying connection before its
	// close was seen).
	waitFor(t, 20*time.Second, "the idle relay's connect refused", refused.Load)
	down.Store(false) // and comes back
	back := time.Since(start)

	publishN(t, db, broker.Exchange, "rk", 1)
	f.Notify()
	committed := time.Now()
	waitFor(t, 20*time.Second, "the record published", func() bool { return pendingCount(t, f) == 0 })
	if took := time.Since(committed); took > 2*time.Second {
		mu.Lock()
		t.Errorf("a record committed with the broker back (at %s), the relay woken: published after %s, want within 2 s; the relay's failures:\n%s",
			back.Round(time.Millisecond), took.Round(time.Millisecond), strings.Join(failures, "\n"))
		mu.Unlock()
	}
	if d := broker.Drain(queue, 1, 5*time.Second); len(d) != 1 {
		t.Errorf("queue received %d messages, want 1", len(d))
	}
}

// A broker (or a load balancer before it) that takes each connection and
// drops it soon after: every connect of the idle relay succeeds, and it
// dialled again at every poll (38 connects in 10 s, each logged with its
// loss). Its connects back off until one lasts.
func TestForwarder_IdleRelay_FlappingBroker_ConnectsBackOff(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.SQLite)
	node := testamqp.NewNode(t)
	dest, err := outbox.NewAMQPDestination(outbox.AMQPConfig{URLs: []string{node.URL}})
	if err != nil {
		t.Fatal(err)
	}
	log := &recordingLogger{}
	f, err := outbox.NewForwarder(db.DB, dest, outbox.ForwarderConfig{Dialect: outbox.SQLite, Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() { _ = f.Run(ctx) }()
	<-f.Running()
	waitFor(t, 20*time.Second, "the idle relay connected", func() bool { return dest.Node() != "" })
	stop, dropped := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(dropped)
		for {
			select {
			case <-stop:
				return
			case <-time.After(20 * time.Millisecond):
				if node.Connections() > 0 {
					time.Sleep(50 * time.Millisecond)
					node.Drop()
				}
			}
		}
	}()
	before := len(log.find("Connected to RabbitMQ"))
	time.Sleep(6 * time.Second)
	close(stop)
	<-dropped
	if n := len(log.find("Connected to RabbitMQ")) - before; n > 8 {
		t.Errorf("an idle relay, its broker dropping each connection after ~50 ms: %d connects in 6 s; want at most 8 (backed off)", n)
	}
}

// A relay that stopped (Run returned) reads no more: its gauges are no
// longer exported. The oldest pending age, taken at the scrape, grew for
// as long as the process served /metrics, and an alert on it fired for a
// process that no longer relays.
func TestMetrics_RelayStopped_GaugesNoLongerExported(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.SQLite)
	id := publishN(t, db, "x", "rk", 1)[0]
	reg, stop := runRefusingRelay(t, db.DB, id)
	stop()
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range families {
		switch mf.GetName() {
		case "outbox_oldest_pending_age_seconds", "outbox_pending", "outbox_stuck":
			t.Errorf("%s exported after the relay stopped", mf.GetName())
		}
	}
}

// The mark of a run the database lost stayed in the message's metadata
// through Retry's next run, where the handler saw it, and a handler that
// forwards its input's headers sent this process's mark on: the message it
// published, failed for good in this process by a middleware before the
// inbox, was refused by PoisonPublisher ("the database did not answer")
// for ever. The handler sees no mark now.
func TestInbox_DBLostMark_NotSeenByTheHandlerOnRetrysNextRun(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.Postgres)
	id, in, _, pq := poisonedChainSetup(t, db, "order.placed")
	runs, seen := 0, ""
	h := pq(middleware.Retry{MaxRetries: 1, InitialInterval: 10 * time.Millisecond, ResetContextOnRetry: true}.Middleware(
		middleware.Timeout(time.Second)(in.Middleware(func(msg *message.Message) ([]*message.Message, error) {
			runs++
			if v := msg.Metadata.Get("x-acemq-inbox-db-lost"); v != "" {
				seen = v
			}
			inTxKill(t, db, msg)
			tx, _ := outbox.TxFromContext(msg.Context())
			_, err := tx.Exec(db.Rebind("INSERT INTO effects (message_id, note) VALUES (?, ?)"), msg.UUID, "placed")
			return nil, err
		}))))
	_, _ = h(message.NewMessage(id, []byte("x")))
	if runs < 2 {
		t.Fatalf("the handler ran %d times, want Retry's second run", runs)
	}
	if seen != "" {
		t.Errorf("the handler saw x-acemq-inbox-db-lost=%q on Retry's next run: a handler that forwards its headers sends the inbox's mark on", seen)
	}
}
