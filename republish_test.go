package outbox_test

import (
	"context"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"
	amqp "github.com/rabbitmq/amqp091-go"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testamqp"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// ageRecords sets published_at of ids to age ago, as if time had passed.
func ageRecords(t testing.TB, db *testdb.DB, age time.Duration, ids ...string) {
	t.Helper()
	at := time.Now().Add(-age).UTC()
	var arg any = at
	if db.Kind != testdb.Postgres {
		arg = at.Format("2006-01-02 15:04:05.000000")
	}
	for _, id := range ids {
		db.MustExec(db.Rebind("UPDATE acemq_outbox SET published_at = ? WHERE id = ?"), arg, id)
	}
}

type outboxState struct {
	Published bool `db:"published"`
	Processed bool `db:"processed"`
}

func outboxStateOf(t testing.TB, db *testdb.DB, id string) outboxState {
	t.Helper()
	var s outboxState
	if err := db.Get(&s, db.Rebind("SELECT published_at IS NOT NULL AS published, processed_at IS NOT NULL AS processed FROM acemq_outbox WHERE id = ?"), id); err != nil {
		t.Fatal(err)
	}
	return s
}

// A published record whose message nobody consumed (its queue purged) is
// sent again at the next boot, before the handlers start, and processed
// once; processed records, untracked topics and records younger than the
// grace are left alone.
func TestRepublish_RouterBoot_LostMessageResentAndProcessedOnce_OthersUntouched(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		testdb.Require(t, "amqp")
		createEffects(t, db)
		tracked, untracked := "orders-"+testdb.RandomName(), "audit-"+testdb.RandomName()
		b := testamqp.New(t)
		for _, q := range []string{tracked, untracked} {
			b.With(func(ch *amqp.Channel) error { _, err := ch.QueueDeclare(q, true, false, false, false, nil); return err })
			defer testamqpDeleteQueue(t, q)
		}
		lost := publishN(t, db, "", tracked, 1)[0]
		processed := publishN(t, db, "", tracked, 1)[0]
		young := publishN(t, db, "", tracked, 1)[0]
		other := publishN(t, db, "", untracked, 1)[0]

		// The first life of the service: everything is published, and then
		// the tracked queue loses its messages.
		f := newForwarder(t, db, outbox.ForwarderConfig{})
		if n := sweepAll(t, f); n != 4 {
			t.Fatalf("published %d, want 4", n)
		}
		b.With(func(ch *amqp.Channel) error { _, err := ch.QueuePurge(tracked, false); return err })
		db.MustExec(db.Rebind("UPDATE acemq_outbox SET processed_at = published_at WHERE id = ?"), processed)
		ageRecords(t, db, time.Hour, lost, processed, other)

		// The next boot.
		go func() { _ = f.Run(context.Background()) }()
		track := outbox.NewTrackedTopics(tracked)
		rp, err := outbox.NewRepublisher(db.DB, outbox.RepublisherConfig{TrackedTopics: track, Grace: 10 * time.Minute, Notify: f.Notify})
		if err != nil {
			t.Fatal(err)
		}
		in, err := outbox.NewInbox(db.DB, outbox.InboxConfig{MarkOutboxProcessed: true, TrackedTopics: track})
		if err != nil {
			t.Fatal(err)
		}
		router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
		if err != nil {
			t.Fatal(err)
		}
		var pluginDone, handledBeforePlugin atomic.Bool
		router.AddPlugin(func(r *message.Router) error {
			err := rp.Plugin()(r)
			pluginDone.Store(true)
			return err
		})
		router.AddMiddleware(in.Middleware)
		var ran atomic.Int32
		effect := writeEffect(t, db, &ran)
		for _, topic := range []string{tracked, untracked} {
			sub, err := wamqp.NewSubscriber(wamqp.NewDurableQueueConfig(testdb.AMQPURL()), watermill.NopLogger{})
			if err != nil {
				t.Fatal(err)
			}
			router.AddConsumerHandler("consume-"+topic, topic, sub, func(msg *message.Message) error {
				if !pluginDone.Load() {
					handledBeforePlugin.Store(true)
				}
				_, err := effect(msg)
				return err
			})
		}
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		go func() { _ = router.Run(ctx) }()
		defer router.Close()
		<-router.Running()

		waitFor(t, 20*time.Second, "the lost message to be resent and processed", func() bool {
			return outboxStateOf(t, db, lost).Processed
		})
		waitFor(t, 10*time.Second, "the untracked message to be consumed", func() bool { return countEffects(t, db, other) == 1 })
		if handledBeforePlugin.Load() {
			t.Error("a handler ran before the republish plugin finished")
		}
		if n := countEffects(t, db, lost); n != 1 {
			t.Errorf("the lost message had %d effects, want 1", n)
		}
		if countEffects(t, db, processed) != 0 || countEffects(t, db, young) != 0 {
			t.Error("a processed or a young record was sent again")
		}
		if s := outboxStateOf(t, db, young); !s.Published || s.Processed {
			t.Errorf("the young record: %+v, want published and untouched", s)
		}
		if s := outboxStateOf(t, db, other); !s.Published || s.Processed {
			t.Errorf("the untracked record: %+v, want published, and not marked (its topic is not tracked)", s)
		}
	})
}

// Two instances boot together: each record is made pending once, also
// over more records than one of Republish's batches (DefaultPurgeBatch),
// all published at the same instant (the walk goes on by id), with every
// third processed among them (left alone, and walked past once).
func TestRepublish_TwoInstancesRacing_EachRecordResentOnce(t *testing.T) {
	t.Parallel()
	for _, n := range []int{40, 2*outbox.DefaultPurgeBatch + 500} {
		t.Run(strconv.Itoa(n), func(t *testing.T) { republishRacing(t, n) })
	}
}

func republishRacing(t *testing.T, n int) {
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		var ids []string
		for _, m := range publishBatch(t, db, "", "orders", n) {
			ids = append(ids, m.UUID)
		}
		db.MustExec("UPDATE acemq_outbox SET attempts = 3")
		at := time.Now().Add(-time.Hour).UTC()
		var arg any = at
		if db.Kind != testdb.Postgres {
			arg = at.Format("2006-01-02 15:04:05.000000")
		}
		db.MustExec(db.Rebind("UPDATE acemq_outbox SET published_at = ?"), arg)
		processed := map[string]bool{}
		for i := 0; i < len(ids); i += 3 {
			db.MustExec(db.Rebind("UPDATE acemq_outbox SET processed_at = published_at WHERE id = ?"), ids[i])
			processed[ids[i]] = true
		}
		want := len(ids) - len(processed)
		track := outbox.NewTrackedTopics("orders")
		var (
			wg    sync.WaitGroup
			total atomic.Int64
			start = make(chan struct{})
		)
		for i := 0; i < 2; i++ {
			pool := sqlx.MustOpen(db.DriverName(), db.DSN)
			defer pool.Close()
			rp, err := outbox.NewRepublisher(pool, outbox.RepublisherConfig{TrackedTopics: track})
			if err != nil {
				t.Fatal(err)
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-start
				n, err := rp.Republish(context.Background())
				if err != nil {
					t.Error(err)
				}
				total.Add(n)
			}()
		}
		close(start)
		wg.Wait()
		if total.Load() != int64(want) {
			t.Fatalf("the two instances made %d records pending, want %d: each unprocessed one once", total.Load(), want)
		}
		var pending, attempts, processedPending int
		if err := db.Get(&pending, "SELECT COUNT(*) FROM acemq_outbox WHERE published_at IS NULL"); err != nil {
			t.Fatal(err)
		}
		if err := db.Get(&attempts, "SELECT COALESCE(MAX(attempts), 0) FROM acemq_outbox WHERE published_at IS NULL"); err != nil {
			t.Fatal(err)
		}
		if err := db.Get(&processedPending, "SELECT COUNT(*) FROM acemq_outbox WHERE published_at IS NULL AND processed_at IS NOT NULL"); err != nil {
			t.Fatal(err)
		}
		if pending != want || attempts != 0 || processedPending != 0 {
			t.Fatalf("%d pending (%d of them processed) with attempts up to %d; want the %d unprocessed pending, attempts reset", pending, processedPending, attempts, want)
		}
	})
}

// A shared acemq_outbox: another service's records under a tracked routing
// key, to an exchange of its own, that no consumer of this service
// processes. With Exchanges set, a boot sends only this service's records
// again; without it, both (as before).
func TestRepublish_Exchanges_AnotherServicesRecordsOfTheTopicLeftAlone(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		ours := publishN(t, db, "shop", "orders", 3)
		theirs := publishN(t, db, "billing", "orders", 2)
		ageRecords(t, db, time.Hour, append(ours, theirs...)...)
		rp, err := outbox.NewRepublisher(db.DB, outbox.RepublisherConfig{TrackedTopics: outbox.NewTrackedTopics("orders"), Exchanges: []string{"shop", ""}})
		if err != nil {
			t.Fatal(err)
		}
		if n, err := rp.Republish(context.Background()); err != nil || n != int64(len(ours)) {
			t.Fatalf("Republish = %d, %v; want this service's %d records", n, err, len(ours))
		}
		for _, id := range theirs {
			if s := stateOf(t, db, id); !s.Published {
				t.Errorf("another service's record %s was made pending", id)
			}
		}
		all, err := outbox.NewRepublisher(db.DB, outbox.RepublisherConfig{TrackedTopics: outbox.NewTrackedTopics("orders")})
		if err != nil {
			t.Fatal(err)
		}
		if n, err := all.Republish(context.Background()); err != nil || n != int64(len(theirs)) {
			t.Fatalf("Republish without Exchanges = %d, %v; want the other %d", n, err, len(theirs))
		}
		if _, err := outbox.NewRepublisher(db.DB, outbox.RepublisherConfig{TrackedTopics: outbox.NewTrackedTopics("orders"), Exchanges: []string{"bad\x00"}}); err == nil {
			t.Error("an exchange name with a NUL was accepted")
		}
	})
}

func TestTrackedTopics_UntrackedLookup_NoAllocation(t *testing.T) {
	track := outbox.NewTrackedTopics("orders", "payments")
	topic := "audit.events"
	if allocs := testing.AllocsPerRun(1000, func() { _ = track.Tracked(topic) }); allocs != 0 {
		t.Fatalf("%v allocations per lookup, want 0", allocs)
	}
	if !track.Tracked("orders") || track.Tracked(topic) || (*outbox.TrackedTopics)(nil).Tracked("orders") {
		t.Fatal("wrong answers")
	}
}

func TestNewRepublisher_NoTopics_ConfigError(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, testdb.SQLite)
	if _, err := outbox.NewRepublisher(db.DB, outbox.RepublisherConfig{}); err == nil {
		t.Fatal("a republisher tracking nothing was accepted")
	}
}

// A record whose consumer processed it before MarkOutboxProcessed was on
// (the quick start's second step, then its third) stayed unprocessed: its
// redelivery is a duplicate, and the duplicate path did not mark it. So
// every boot's Republish made it pending again and sent it again, to every
// consumer of its routing key. A duplicate now marks its record. (From an
// audit of the README.)
func TestRepublish_RecordProcessedBeforeMarkingWasOn_SentAgainOnceOnly(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		createEffects(t, db)
		topic := "order.placed"
		id := publishN(t, db, "", topic, 1)[0]
		ageRecords(t, db, time.Hour, id)
		var ran atomic.Int32
		deliver := func(in *outbox.Inbox) {
			msg := message.NewMessage(id, []byte("x"))
			if _, err := in.Middleware(writeEffect(t, db, &ran))(msg); err != nil {
				t.Fatal(err)
			}
		}
		deliver(newInbox(t, db, outbox.InboxConfig{})) // processed, not marked

		in := newInbox(t, db, outbox.InboxConfig{MarkOutboxProcessed: true})
		rp, err := outbox.NewRepublisher(db.DB, outbox.RepublisherConfig{TrackedTopics: outbox.NewTrackedTopics(topic), Grace: time.Minute})
		if err != nil {
			t.Fatal(err)
		}
		sent := 0
		for boot := 1; boot <= 3; boot++ {
			n, err := rp.Republish(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			sent += int(n)
			ageRecords(t, db, time.Hour, id) // the relay sent it an hour ago
			deliver(in)                      // a duplicate
		}
		if sent != 1 || ran.Load() != 1 {
			t.Errorf("Republish sent the record %d times over 3 boots, the handler ran %d times; want 1 and 1", sent, ran.Load())
		}
		if !outboxStateOf(t, db, id).Processed {
			t.Errorf("record %s still not processed after its duplicates", id)
		}
	})
}

// A nil registry tracks nothing (Tracked answers false), and lists no
// topic: Topics on it panicked with a nil pointer dereference.
func TestTrackedTopics_NilRegistry_NoTopicsNoPanic(t *testing.T) {
	t.Parallel()
	var track *outbox.TrackedTopics
	if got := track.Topics(); got != nil {
		t.Fatalf("Topics() = %v, want nil", got)
	}
}
