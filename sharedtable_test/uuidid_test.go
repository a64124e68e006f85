package sharedtable_test

import (
	"context"
	"fmt"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testamqp"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// Another library (EF Core's or Hibernate's, say) made acemq_outbox on
// PostgreSQL with a uuid id. The relay's keyed drain compared ids with
// text: with records of a key in flight, its claim asked uuid = text,
// which PostgreSQL has no operator for, and a drain resumed before a key's
// next record compared the id with "", which no uuid reads; each such
// claim failed and the relay backed off. And a consumer in the same
// database with MarkOutboxProcessed failed every message whose id is no
// UUID (Watermill's ULIDs, another service's ids): the mark's id did not
// read as a uuid and aborted the inbox's transaction, delivery after
// delivery. The keyed drain goes through, in order, without an error; a
// message from elsewhere runs, and one from this outbox is marked.
func TestPostgres_UUIDIDColumn_KeyedDrainAndInboxMark(t *testing.T) {
	c := alteredTable(t, "postgres", testdb.Postgres, "ALTER TABLE acemq_outbox ALTER id TYPE uuid USING id::uuid")
	b := testamqp.New(t)
	queue := b.Queue("ok")

	const keys, perKey = 20, 10
	for s := 1; s <= perKey; s++ {
		if err := c.publish(t, func(pub *outbox.TxPublisher) error {
			for k := range keys {
				m := message.NewMessage(watermill.NewUUID(), []byte(strconv.Itoa(s)))
				m.Metadata.Set(outbox.MetadataExchange, b.Exchange)
				m.Metadata.Set(outbox.MetadataAggregateID, fmt.Sprintf("key-%02d", k))
				if err := pub.Publish("ok", m); err != nil {
					return err
				}
			}
			return nil
		}); err != nil {
			t.Fatal(err)
		}
	}
	var mu sync.Mutex
	var errs []error
	f := c.forwarder(t, outbox.ForwarderConfig{BatchSize: 7, OnError: func(err error, _ outbox.ErrorContext) {
		mu.Lock()
		errs = append(errs, err)
		mu.Unlock()
	}})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- f.Run(ctx) }()
	ds := b.Drain(queue, keys*perKey, 30*time.Second)
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	last := map[string]int64{}
	for _, d := range ds {
		key, _ := d.Headers[outbox.HeaderAggregateID].(string)
		seq, _ := d.Headers[outbox.HeaderSeq].(int64)
		if seq != last[key]+1 {
			t.Errorf("%s seq %d after %d", key, seq, last[key])
		}
		last[key] = seq
	}
	if len(ds) != keys*perKey {
		t.Errorf("%d of %d messages arrived", len(ds), keys*perKey)
	}
	mu.Lock()
	if len(errs) > 0 {
		t.Errorf("%d relay errors, the first: %v", len(errs), errs[0])
	}
	mu.Unlock()

	in, err := outbox.NewInbox(c.lib, outbox.InboxConfig{ConsumerName: "billing", MarkOutboxProcessed: true})
	if err != nil {
		t.Fatal(err)
	}
	ran := 0
	h := in.Middleware(func(*message.Message) ([]*message.Message, error) { ran++; return nil, nil })
	if _, err := h(message.NewMessage(watermill.NewULID(), []byte("from another service"))); err != nil {
		t.Errorf("a message whose id is no UUID, from another service: %v, want it run", err)
	}
	ours := ds[0].MessageId
	if _, err := h(message.NewMessage(ours, []byte("from this outbox"))); err != nil {
		t.Fatal(err)
	}
	var processed bool
	if err := c.db.Get(&processed, "SELECT processed_at IS NOT NULL FROM acemq_outbox WHERE id = $1", ours); err != nil {
		t.Fatal(err)
	}
	if ran != 2 || !processed {
		t.Errorf("handler ran %d times, record %s processed %v; want 2 and true", ran, ours, processed)
	}
}
