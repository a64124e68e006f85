package integration_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/components/forwarder"
	"github.com/ThreeDotsLabs/watermill/message"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testamqp"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// The README's switch from Watermill's own outbox (watermill-sql and
// components/forwarder, to watermill-amqp), consumers first: the consumer
// already has the inbox and AMQPMarshaler, Watermill's forwarder and this
// library's relay publish side by side into one exchange, each event of
// Watermill's path twice (its forwarder is at least once too). Every
// event's effect happens once: the id Watermill's path carries
// (_watermill_message_uuid) is the one the inbox dedupes on, the relay's
// records are marked processed, and a Republish then finds none to send.
// A review of such a switch measured it with processes killed; this keeps
// the README's order true.
func TestSwitchFromWatermillForwarder_ConsumersFirst_EachEventOnce(t *testing.T) {
	for _, kind := range []string{testdb.Postgres, testdb.MySQL} {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			switchFromWatermillForwarder(t, kind)
		})
	}
}

func switchFromWatermillForwarder(t *testing.T, kind string) {
	const (
		topic = "order.placed"
		old   = 60 // events through Watermill's path, each published twice
		fresh = 60 // events through TxPublisher and the relay
	)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	db := testdb.New(t, kind)
	d := map[string]outbox.Dialect{testdb.Postgres: outbox.Postgres, testdb.MySQL: outbox.MySQL}[kind]
	if err := outbox.Migrate(ctx, db.DB.DB, d); err != nil {
		t.Fatal(err)
	}
	db.MustExec("CREATE TABLE effects (event_id VARCHAR(64) NOT NULL)")
	b := testamqp.New(t)
	queue := b.Queue(topic)
	logger := watermill.NopLogger{}
	amqpCfg := func(m wamqp.Marshaler) wamqp.Config {
		cfg := wamqp.NewDurableTopicConfig(testdb.AMQPURL(), b.Exchange, queue)
		cfg.Exchange.Type, cfg.Exchange.Durable = "direct", true // as the exchange is declared
		cfg.Marshaler = m
		cfg.Consume.Qos.PrefetchCount = 10
		return cfg
	}

	// The consumer, switched first: AMQPMarshaler and the inbox.
	inbox, err := outbox.NewInbox(db.DB, outbox.InboxConfig{Dialect: d, ConsumerName: "orders", MarkOutboxProcessed: true, TrackedTopics: outbox.NewTrackedTopics(topic)})
	if err != nil {
		t.Fatal(err)
	}
	sub, err := wamqp.NewSubscriber(amqpCfg(outbox.AMQPMarshaler{}), logger)
	if err != nil {
		t.Fatal(err)
	}
	router, err := message.NewRouter(message.RouterConfig{}, logger)
	if err != nil {
		t.Fatal(err)
	}
	var deliveries atomic.Int64
	router.AddMiddleware(func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			deliveries.Add(1)
			return h(msg)
		}
	}, inbox.Middleware)
	router.AddConsumerHandler("orders", topic, sub, func(msg *message.Message) error {
		tx, _ := outbox.TxFromContext(msg.Context())
		_, err := tx.Exec(tx.Rebind("INSERT INTO effects (event_id) VALUES (?)"), msg.UUID)
		return err
	})
	routed := make(chan error, 1)
	go func() { routed <- router.Run(ctx) }()
	<-router.Running()

	// Watermill's outbox: watermill-sql into a topic of its own, its
	// forwarder to watermill-amqp with the DefaultMarshaler.
	schema, offsets := wsql.SchemaAdapter(wsql.DefaultPostgreSQLSchema{}), wsql.OffsetsAdapter(wsql.DefaultPostgreSQLOffsetsAdapter{})
	if kind == testdb.MySQL {
		schema, offsets = wsql.DefaultMySQLSchema{}, wsql.DefaultMySQLOffsetsAdapter{}
	}
	const envelopes = "forwarded"
	sqlPub, err := wsql.NewPublisher(wsql.BeginnerFromStdSQL(db.DB.DB), wsql.PublisherConfig{SchemaAdapter: schema, AutoInitializeSchema: true}, logger)
	if err != nil {
		t.Fatal(err)
	}
	oldPub := forwarder.NewPublisher(sqlPub, forwarder.PublisherConfig{ForwarderTopic: envelopes})
	sqlSub, err := wsql.NewSubscriber(wsql.BeginnerFromStdSQL(db.DB.DB), wsql.SubscriberConfig{SchemaAdapter: schema, OffsetsAdapter: offsets, InitializeSchema: true, PollInterval: 10 * time.Millisecond}, logger)
	if err != nil {
		t.Fatal(err)
	}
	amqpPub, err := wamqp.NewPublisher(amqpCfg(wamqp.DefaultMarshaler{}), logger)
	if err != nil {
		t.Fatal(err)
	}
	oldRelay, err := forwarder.NewForwarder(sqlSub, amqpPub, logger, forwarder.Config{ForwarderTopic: envelopes})
	if err != nil {
		t.Fatal(err)
	}
	oldRelayed := make(chan error, 1)
	go func() { oldRelayed <- oldRelay.Run(ctx) }()
	<-oldRelay.Running()

	// This library's relay, beside it.
	dest, err := outbox.NewAMQPDestination(outbox.AMQPConfig{URLs: []string{testdb.AMQPURL()}})
	if err != nil {
		t.Fatal(err)
	}
	relay, err := outbox.NewForwarder(db.DB, dest, outbox.ForwarderConfig{Dialect: d})
	if err != nil {
		t.Fatal(err)
	}
	relayed := make(chan error, 1)
	go func() { relayed <- relay.Run(ctx) }()

	var ids []string
	for i := range max(old, fresh) {
		if i < old {
			id := fmt.Sprintf("old-%03d-%s", i, testdb.RandomName())
			ids = append(ids, id)
			for range 2 {
				if err := oldPub.Publish(topic, message.NewMessage(id, []byte("{}"))); err != nil {
					t.Fatal(err)
				}
			}
		}
		if i < fresh {
			id := fmt.Sprintf("new-%03d-%s", i, testdb.RandomName())
			ids = append(ids, id)
			tx := db.MustBegin()
			pub, err := outbox.NewTxPublisher(tx, outbox.TxPublisherConfig{Dialect: d, Exchange: b.Exchange})
			if err != nil {
				t.Fatal(err)
			}
			if err := pub.Publish(topic, message.NewMessage(id, []byte("{}"))); err != nil {
				t.Fatal(err)
			}
			if err := tx.Commit(); err != nil {
				t.Fatal(err)
			}
		}
	}

	// Every event applied, not a count of deliveries: a relay's copy (each
	// relay may send one twice, the inbox drops it) reached the count
	// before the last event came, and the router closed under it (the last
	// new event "lost" on MariaDB in a CI run of 2026-12-07).
	deadline := time.Now().Add(60 * time.Second)
	for {
		var applied int
		if err := db.Get(&applied, "SELECT COUNT(DISTINCT event_id) FROM effects"); err != nil {
			t.Fatal(err)
		}
		if applied >= len(ids) && deliveries.Load() >= int64(2*old+fresh) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d deliveries, %d events applied in 60 s, want %d and %d", deliveries.Load(), applied, 2*old+fresh, len(ids))
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err := router.Close(); err != nil {
		t.Fatal(err)
	}
	effects := map[string]int{}
	rows, err := db.Query("SELECT event_id FROM effects")
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var id string
		if err := rows.Scan(&id); err != nil {
			t.Fatal(err)
		}
		effects[id]++
	}
	if err := rows.Close(); err != nil {
		t.Fatal(err)
	}
	for _, id := range ids {
		if effects[id] != 1 {
			t.Errorf("event %s: %d effects, want 1", id, effects[id])
		}
	}
	if len(effects) != len(ids) {
		t.Errorf("%d events with effects, want %d", len(effects), len(ids))
	}

	rp, err := outbox.NewRepublisher(db.DB, outbox.RepublisherConfig{Dialect: d, TrackedTopics: outbox.NewTrackedTopics(topic), Grace: time.Nanosecond})
	if err != nil {
		t.Fatal(err)
	}
	if n, err := rp.Republish(ctx); err != nil || n != 0 {
		t.Errorf("Republish after the switch: %d records made pending, %v; want none: the inbox marked every one", n, err)
	}
	cancel()
	for _, done := range []chan error{routed, oldRelayed, relayed} {
		if err := <-done; err != nil {
			t.Error(err)
		}
	}
	if err := relay.Close(); err != nil {
		t.Error(err)
	}
	if err := oldRelay.Close(); err != nil {
		t.Error(err)
	}
}
