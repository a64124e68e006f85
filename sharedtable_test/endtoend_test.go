package sharedtable_test

import (
	"context"
	"maps"
	"slices"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testamqp"
	"github.com/acemq/watermill-outbox/internal/testrails"
	"github.com/acemq/watermill-outbox/sqlschema"
)

const (
	placed = "order.placed" // the topic republish tracks
	audit  = "audit.logged" // one it does not
	day    = 24 * time.Hour
	// foreignLease is how long the Ruby relay's lease on a row has left when
	// the test starts: longer than the sweeps that must respect it take,
	// which with two migrations and three outboxctl processes before them
	// under -race on a loaded 2-core machine can pass 5 s.
	foreignLease = 15 * time.Second
)

// A service joins an estate whose Rails service made acemq_outbox with its
// own migration and keeps writing to it. In a process far from UTC, the
// table is migrated in place (Migrate, outboxctl migrate, Migrate again),
// and then rows written by Ruby and by TxPublisher are relayed, the Ruby
// relay's lease is respected until it runs out, the inbox marks what it
// processed, republish resends only what its grace allows, a purge takes
// only what is old enough, and stats, stuck, retry and status tell the
// truth. Every time stored is UTC as the database reads it, and every
// message arrives, none stuck, none lost.
func TestRailsTable_MigratedInPlace_DrivenEndToEndFarFromUTC_TimesUTCNothingLost(t *testing.T) {
	eachConn(t, func(t *testing.T, c *conn) {
		ctx := context.Background()
		b := testamqp.New(t)
		queue := b.Queue(placed)
		testrails.CreateTable(t, c.db)

		// What the Rails service wrote before this one came, in UTC and to
		// the microsecond the columns keep.
		now := time.Now().UTC().Truncate(time.Microsecond)
		leaseUntil := now.Add(foreignLease)
		ruby := func(r testrails.Row) {
			r.Exchange, r.Body, r.Headers = b.Exchange, `{"from":"ruby"}`, `{"tenant":"acme","attempt":3,"priority":true,"ratio":0.5,"tags":["a","b"],"note":null}`
			if r.RoutingKey == "" {
				r.RoutingKey = placed
			}
			testrails.Insert(t, c.db, r)
		}
		ruby(testrails.Row{ID: "rb-pending", CreatedAt: now.Add(-2 * time.Minute)})
		ruby(testrails.Row{ID: "rb-leased", CreatedAt: now.Add(-time.Minute), LockedBy: "ruby-relay-1", LockedUntil: leaseUntil})
		ruby(testrails.Row{ID: "rb-stuck", CreatedAt: now.Add(-time.Hour), Attempts: outbox.DefaultMaxAttempts, LastError: "NOT_FOUND - no exchange"})
		ruby(testrails.Row{ID: "rb-unprocessed", CreatedAt: now.Add(-11 * time.Minute), PublishedAt: now.Add(-10 * time.Minute)})
		// Published 10 days ago and 6 days 18 hours ago: a purge of what is
		// older than 7 days takes the first, and would take the second too
		// with a cutoff 13 h 45 min late.
		ruby(testrails.Row{ID: "rb-old", RoutingKey: audit, CreatedAt: now.Add(-10*day - time.Minute), PublishedAt: now.Add(-10 * day)})
		ruby(testrails.Row{ID: "rb-week", RoutingKey: audit, CreatedAt: now.Add(-7*day + 6*time.Hour - time.Minute), PublishedAt: now.Add(-7*day + 6*time.Hour)})

		c.migrate(t)
		c.ctl(t, "migrate")
		c.migrate(t)
		migs, err := sqlschema.Migrations(c.d.Name())
		if err != nil {
			t.Fatal(err)
		}
		var versions int
		if err := c.db.Get(&versions, "SELECT COUNT(*) FROM acemq_schema_migrations"); err != nil || versions != len(migs) {
			t.Fatalf("%d versions recorded (%v), want %d, each once", versions, err, len(migs))
		}

		// Before the relay runs, the operator's questions read Ruby's times
		// as the UTC they are, whatever the driver's zone.
		store, err := outbox.NewStore(c.lib, outbox.StoreConfig{Dialect: c.d})
		if err != nil {
			t.Fatal(err)
		}
		st, err := store.Stats(ctx)
		if err != nil || st.Pending != 2 || st.Stuck != 1 || !st.OldestPending.Equal(now.Add(-2*time.Minute)) {
			t.Errorf("stats %+v (%v), want 2 pending, 1 stuck, oldest pending created at %s", st, err, now.Add(-2*time.Minute))
		}
		stuck, err := store.Stuck(ctx, 10)
		if err != nil || len(stuck) != 1 || stuck[0].ID != "rb-stuck" || !stuck[0].CreatedAt.Equal(now.Add(-time.Hour)) {
			t.Errorf("stuck %+v (%v), want rb-stuck created at %s", stuck, err, now.Add(-time.Hour))
		}
		var status struct {
			Pending         int64      `json:"pending"`
			Stuck           int64      `json:"stuck"`
			OldestPendingAt *time.Time `json:"oldest_pending_at"`
			PublishedHour   int64      `json:"published_last_hour"`
		}
		c.ctlJSON(t, &status, "status")
		if status.Pending != 2 || status.Stuck != 1 || status.OldestPendingAt == nil || !status.OldestPendingAt.Equal(now.Add(-2*time.Minute)) {
			t.Errorf("outboxctl status %+v, want 2 pending, 1 stuck, oldest pending created at %s", status, now.Add(-2*time.Minute))
		}
		var stuckOut struct {
			Rows []struct {
				ID        string    `json:"id"`
				CreatedAt time.Time `json:"created_at"`
			} `json:"rows"`
		}
		c.ctlJSON(t, &stuckOut, "stuck")
		if len(stuckOut.Rows) != 1 || !stuckOut.Rows[0].CreatedAt.Equal(now.Add(-time.Hour)) {
			t.Errorf("outboxctl stuck %+v, want rb-stuck created at %s", stuckOut, now.Add(-time.Hour))
		}

		// This service publishes in its transaction; Ruby writes one more.
		tx, err := c.lib.Beginx()
		if err != nil {
			t.Fatal(err)
		}
		pub, err := outbox.NewTxPublisher(tx, outbox.TxPublisherConfig{Exchange: b.Exchange})
		if err != nil {
			t.Fatal(err)
		}
		var goIDs []string
		var msgs []*message.Message
		for i := 0; i < 3; i++ {
			msg := message.NewMessage(watermill.NewUUID(), []byte(`{"from":"go"}`))
			goIDs, msgs = append(goIDs, msg.UUID), append(msgs, msg)
		}
		if err := pub.Publish(placed, msgs...); err != nil {
			t.Fatal(err)
		}
		if err := tx.Commit(); err != nil {
			t.Fatal(err)
		}
		ruby(testrails.Row{ID: "rb-after", CreatedAt: time.Now()})

		// The relay: everything pending but the row under Ruby's live lease.
		f := c.forwarder(t, outbox.ForwarderConfig{})
		first := append(slices.Clone(goIDs), "rb-pending", "rb-after")
		if n := sweepAll(t, f); n != len(first) {
			t.Errorf("relayed %d, want %d", n, len(first))
		}
		if !time.Now().Before(leaseUntil) {
			t.Fatalf("Ruby's lease ran out before the test could see the relay respect it; raise foreignLease")
		}
		if s := c.state(t, "rb-leased"); s.Published || s.LockedBy != "ruby-relay-1" {
			t.Errorf("rb-leased under Ruby's live lease: %+v, want untouched", s)
		}
		got := map[string]int{}
		deliveries := drain(t, b, queue, len(first), got)
		for _, id := range goIDs {
			c.assertUTCNow(t, "acemq_outbox", "created_at", "id", id)
		}
		for _, id := range first {
			c.assertUTCNow(t, "acemq_outbox", "published_at", "id", id)
		}

		// The inbox of a consumer of this same database marks what it
		// processed; one message it has not processed yet.
		in, err := outbox.NewInbox(c.lib, outbox.InboxConfig{ConsumerName: "fulfilment", MarkOutboxProcessed: true})
		if err != nil {
			t.Fatal(err)
		}
		h := in.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, nil })
		for _, d := range deliveries {
			if d.MessageId == goIDs[2] {
				continue
			}
			if _, err := h(message.NewMessage(d.MessageId, d.Body)); err != nil {
				t.Fatalf("inbox, %s: %v", d.MessageId, err)
			}
			c.assertUTCNow(t, "acemq_outbox", "processed_at", "id", d.MessageId)
			c.assertUTCNow(t, "processed_messages", "processed_at", "message_id", d.MessageId)
		}

		// Republish, with the default grace of 5 minutes: Ruby's row
		// published 10 minutes ago and never processed goes again; this
		// service's unprocessed one, published a moment ago, waits.
		rp, err := outbox.NewRepublisher(c.lib, outbox.RepublisherConfig{TrackedTopics: outbox.NewTrackedTopics(placed)})
		if err != nil {
			t.Fatal(err)
		}
		if n, err := rp.Republish(ctx); err != nil || n != 1 {
			t.Errorf("republished %d (%v), want rb-unprocessed alone", n, err)
		}
		if s := c.state(t, goIDs[2]); !s.Published {
			t.Errorf("%s, published a moment ago, was made pending again inside the grace", goIDs[2])
		}
		if n := sweepAll(t, f); n != 1 {
			t.Errorf("relayed %d after republish, want 1", n)
		}
		drain(t, b, queue, 1, got)

		// A purge of what was published over 7 days ago.
		if n, err := store.PurgePublished(ctx, 7*day); err != nil || n != 1 {
			t.Errorf("purged %d (%v), want rb-old alone", n, err)
		}
		var left int
		if err := c.db.Get(&left, "SELECT COUNT(*) FROM acemq_outbox WHERE id IN ('rb-old', 'rb-week')"); err != nil || left != 1 {
			t.Errorf("%d of rb-old and rb-week left (%v), want rb-week", left, err)
		}

		// The operator retries the row Ruby's relay gave up on.
		c.ctl(t, "retry", "--all-stuck")
		if n := sweepAll(t, f); n != 1 {
			t.Errorf("relayed %d after retry, want rb-stuck", n)
		}
		drain(t, b, queue, 1, got)

		// Ruby's lease runs out, and only then is its row relayed.
		eventually(t, foreignLease+30*time.Second, "the row of the expired lease to be relayed", func() bool {
			n, err := f.Sweep(ctx)
			if err != nil {
				t.Fatalf("sweep: %v", err)
			}
			if n > 0 && time.Now().Before(leaseUntil) {
				t.Fatalf("rb-leased relayed before Ruby's lease ran out at %s", leaseUntil)
			}
			return n > 0
		})
		drain(t, b, queue, 1, got)

		want := map[string]int{"rb-pending": 1, "rb-after": 1, "rb-unprocessed": 1, "rb-stuck": 1, "rb-leased": 1}
		for _, id := range goIDs {
			want[id] = 1
		}
		if !maps.Equal(got, want) {
			t.Errorf("delivered %v, want each of %v once", got, want)
		}
		if st, err := store.Stats(ctx); err != nil || st.Pending != 0 || st.Stuck != 0 || !st.OldestPending.IsZero() {
			t.Errorf("stats at the end %+v (%v), want nothing pending or stuck", st, err)
		}
		c.ctlJSON(t, &status, "status")
		if status.Pending != 0 || status.Stuck != 0 || status.OldestPendingAt != nil || status.PublishedHour != int64(len(want)) {
			t.Errorf("outboxctl status at the end %+v, want nothing pending or stuck, %d published in the last hour", status, len(want))
		}
	})
}

// drain reads want messages from queue, counts them by message id into
// got, and returns them.
func drain(t *testing.T, b *testamqp.Broker, queue string, want int, got map[string]int) []amqp.Delivery {
	t.Helper()
	ds := b.Drain(queue, want, 10*time.Second)
	if len(ds) != want {
		t.Errorf("%d messages arrived, want %d", len(ds), want)
	}
	for _, d := range ds {
		got[d.MessageId]++
	}
	return ds
}
