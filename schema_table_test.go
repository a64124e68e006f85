package outbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testamqp"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// An outbox in a schema of its own (a database of its own on MySQL), named
// "schema.acemq_outbox" by a service whose connections default to another
// schema that holds no outbox: keyed publishing numbers from the sequences
// table beside the outbox, the relay claims key heads and sends from it, a
// purge there leaves the numbers where they were, and nothing is written
// to the default schema.
func TestSchemaQualifiedTable_KeyedPublishRelayAndPurge(t *testing.T) {
	t.Parallel()
	for _, kind := range []string{testdb.Postgres, testdb.MySQL} {
		t.Run(kind, func(t *testing.T) {
			home := migrated(t, kind) // where the outbox lives
			app := testdb.New(t, kind)
			table := home.Name + ".acemq_outbox"
			b := testamqp.New(t)
			queue := b.Queue("order.placed")
			pub := outbox.TxPublisherConfig{Table: table, Exchange: b.Exchange}

			first := []*message.Message{keyed("pay-1"), keyed("pay-1"), keyed("pay-2")}
			publishInTx(t, app, "order.placed", first, pub)
			f := newForwarder(t, app, outbox.ForwarderConfig{Table: table})
			if n := sweepAll(t, f); n != 3 {
				t.Fatalf("published %d, want 3", n)
			}

			publishAllAt(t, home, time.Now().Add(-48*time.Hour))
			store, err := outbox.NewStore(app.DB, outbox.StoreConfig{Table: table})
			if err != nil {
				t.Fatal(err)
			}
			if n, err := store.PurgePublished(context.Background(), 24*time.Hour); err != nil || n != 3 {
				t.Fatalf("purged %d (%v), want 3", n, err)
			}

			next := keyed("pay-1")
			publishInTx(t, app, "order.placed", []*message.Message{next}, pub)
			if n := sweepAll(t, f); n != 1 {
				t.Fatalf("published %d after the purge, want 1", n)
			}

			want := map[string]struct {
				key string
				seq int64
			}{
				first[0].UUID: {"pay-1", 1}, first[1].UUID: {"pay-1", 2},
				first[2].UUID: {"pay-2", 1}, next.UUID: {"pay-1", 3},
			}
			got := b.Drain(queue, len(want), 5*time.Second)
			if len(got) != len(want) {
				t.Fatalf("queue received %d messages, want %d", len(got), len(want))
			}
			for _, d := range got {
				w, ok := want[d.MessageId]
				key, _ := d.Headers[outbox.HeaderAggregateID].(string)
				seq, _ := d.Headers[outbox.HeaderSeq].(int64)
				if !ok || key != w.key || seq != w.seq {
					t.Errorf("message %s arrived as %s#%d, want %s#%d", d.MessageId, key, seq, w.key, w.seq)
				}
			}

			var tables int
			if err := app.Get(&tables, app.Rebind("SELECT COUNT(*) FROM information_schema.tables WHERE table_schema = ?"), app.Name); err != nil {
				t.Fatal(err)
			}
			if tables != 0 {
				t.Errorf("the default schema %s holds %d tables, want none", app.Name, tables)
			}
		})
	}
}
