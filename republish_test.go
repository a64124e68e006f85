package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
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
		// Nothing left: said, so that a Republish that found nothing is
		// told from one that did not run (a user review).
		logs := &recordingLogger{}
		again, err := outbox.NewRepublisher(db.DB, outbox.RepublisherConfig{TrackedTopics: outbox.NewTrackedTopics("orders"), Logger: logs})
		if err != nil {
			t.Fatal(err)
		}
		if n, err := again.Republish(context.Background()); err != nil || n != 0 {
			t.Fatalf("Republish of nothing = %d, %v", n, err)
		}
		if len(logs.find("Republish: no unprocessed outbox record to make pending again")) != 1 {
			t.Errorf("a Republish that found nothing said nothing: %v", logs.logs)
		}
		if _, err := outbox.NewRepublisher(db.DB, outbox.RepublisherConfig{TrackedTopics: outbox.NewTrackedTopics("orders"), Exchanges: []string{"bad\x00"}}); err == nil {
			t.Error("an exchange name with a NUL was accepted")
		}
	})
}

// PublishedAfter leaves alone the records published at or before it: a
// switch from another outbox, whose consumers without the inbox processed
// records and marked none, had every boot past Grace send those again, to
// handlers with no key of them (a review: 231 to 262 events applied
// twice). Those published after it are sent again, as without.
func TestRepublish_PublishedAfter_EarlierRecordsLeftAlone(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		before := publishN(t, db, "shop", "orders", 2)
		after := publishN(t, db, "shop", "orders", 3)
		ageRecords(t, db, 3*time.Hour, before...)
		ageRecords(t, db, time.Hour, after...)
		rp, err := outbox.NewRepublisher(db.DB, outbox.RepublisherConfig{TrackedTopics: outbox.NewTrackedTopics("orders"), PublishedAfter: time.Now().Add(-2 * time.Hour)})
		if err != nil {
			t.Fatal(err)
		}
		if n, err := rp.Republish(context.Background()); err != nil || n != int64(len(after)) {
			t.Fatalf("Republish = %d, %v; want the %d records published after PublishedAfter", n, err, len(after))
		}
		for _, id := range before {
			if s := stateOf(t, db, id); !s.Published {
				t.Errorf("record %s, published before PublishedAfter, was made pending", id)
			}
		}
		for _, id := range after {
			if s := stateOf(t, db, id); s.Published {
				t.Errorf("record %s, published after PublishedAfter, was left alone", id)
			}
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

// poisonRecorder is a poison topic: it keeps what PoisonQueue sets aside,
// or refuses it with err.
type poisonRecorder struct {
	mu   sync.Mutex
	msgs []*message.Message
	err  error
}

func (p *poisonRecorder) Publish(_ string, msgs ...*message.Message) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.err != nil {
		return p.err
	}
	for _, msg := range msgs {
		// As watermill-amqp's publisher, which publishes with the
		// message's context.
		if err := msg.Context().Err(); err != nil {
			return err
		}
	}
	p.msgs = append(p.msgs, msgs...)
	return nil
}

func (p *poisonRecorder) Close() error { return nil }

func (p *poisonRecorder) count() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.msgs)
}

// A message whose handler keeps failing goes to the poison topic and is
// acked. Its record stayed unprocessed: each boot's Republish sent it
// again, and the poison topic got a copy per boot (3 over 3 boots). Set
// aside through Inbox.PoisonPublisher, it counts as processed.
func TestRepublish_PoisonedMessage_NotSentAgainAtEveryBoot(t *testing.T) {
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		topic := "order.placed"
		id := publishN(t, db, "", topic, 1)[0]
		ageRecords(t, db, time.Hour, id)
		in := newInbox(t, db, outbox.InboxConfig{MarkOutboxProcessed: true})
		poison := &poisonRecorder{}
		pq, err := middleware.PoisonQueue(in.PoisonPublisher(poison), topic+".poison")
		if err != nil {
			t.Fatal(err)
		}
		var ran atomic.Int32
		// Behind Timeout, as the README orders them: it cancels the
		// message's context as it returns, before PoisonQueue publishes.
		h := pq(middleware.Timeout(30 * time.Second)(in.Middleware(func(*message.Message) ([]*message.Message, error) {
			ran.Add(1)
			return nil, errors.New("cannot process this order")
		})))
		deliver := func() {
			if _, err := h(message.NewMessage(id, []byte("x"))); err != nil {
				t.Fatalf("PoisonQueue did not take the failure: %v", err)
			}
		}
		deliver()
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
			if n > 0 {
				ageRecords(t, db, time.Hour, id) // the relay sent it again
				deliver()
			}
		}
		if sent != 0 || poison.count() != 1 || ran.Load() != 1 {
			t.Errorf("over 3 boots Republish sent the poisoned record %d times, the poison topic got %d copies, the handler ran %d times; want 0, 1 and 1",
				sent, poison.count(), ran.Load())
		}
		if !outboxStateOf(t, db, id).Processed {
			t.Errorf("record %s not processed after it went to the poison topic", id)
		}
	})
}

// The README's middleware chain (PoisonQueue through PoisonPublisher, Retry,
// Timeout, the inbox, CorrelationID): a handler that fails once is run
// again and applied once, and nothing is poisoned. Without Retry's
// ResetContextOnRetry, as the README first wrote it, Timeout's cancelled
// context reached every retry, each failed at the inbox's BEGIN, and
// PoisonQueue set aside (and PoisonPublisher marked processed) a message
// whose handler failed only once: the inbox's error now names that cause.
func TestInbox_ReadmeMiddlewareChain_TransientFailureRetriedNotPoisoned(t *testing.T) {
	t.Parallel()
	for _, reset := range []bool{true, false} {
		t.Run(fmt.Sprintf("ResetContextOnRetry=%v", reset), func(t *testing.T) {
			eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
				id, in, poison, pq := poisonedChainSetup(t, db, "order.paid")
				var ran atomic.Int32
				ship := func(msg *message.Message) ([]*message.Message, error) {
					if ran.Add(1) == 1 {
						return nil, errors.New("downstream blip")
					}
					tx, _ := outbox.TxFromContext(msg.Context())
					_, err := tx.ExecContext(msg.Context(), db.Rebind("INSERT INTO effects (message_id, note) VALUES (?, ?)"), msg.UUID, "shipped")
					return nil, err
				}
				chain := []message.HandlerMiddleware{ // in AddMiddleware's order, outermost first
					pq,
					middleware.Retry{MaxRetries: 3, InitialInterval: time.Millisecond, ResetContextOnRetry: reset}.Middleware,
					middleware.Timeout(30 * time.Second),
					in.Middleware,
					middleware.CorrelationID,
				}
				h := message.HandlerFunc(ship)
				for i := len(chain) - 1; i >= 0; i-- {
					h = chain[i](h)
				}
				msg := message.NewMessage(id, []byte("x"))
				msg.SetContext(context.Background())
				if _, err := h(msg); err != nil {
					t.Fatalf("delivery: %v, want nil (applied, or poisoned and acked)", err)
				}
				if !reset {
					// Pins why the README sets it, and the inbox's words.
					if poison.count() != 1 || !strings.Contains(poison.msgs[0].Metadata.Get(middleware.ReasonForPoisonedKey), "needs ResetContextOnRetry") {
						t.Fatalf("without ResetContextOnRetry: %d poisoned, want 1 whose reason names ResetContextOnRetry", poison.count())
					}
					return
				}
				if poison.count() != 0 || ran.Load() != 2 || countEffects(t, db, id) != 1 {
					t.Errorf("%d poisoned, handler ran %d times, %d effects; want 0, 2 and 1", poison.count(), ran.Load(), countEffects(t, db, id))
				}
				if !outboxStateOf(t, db, id).Processed {
					t.Errorf("record %s not processed after its retry applied it", id)
				}
			})
		})
	}
}

// A poison topic that refuses the message: nothing is marked, and the
// failure reaches PoisonQueue, which fails the message (nacked, delivered
// again), so the record stays Republish's to send.
func TestInbox_PoisonPublisher_RefusedPublish_MarksNothing(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	topic := "order.placed"
	id := publishN(t, db, "", topic, 1)[0]
	in := newInbox(t, db, outbox.InboxConfig{MarkOutboxProcessed: true})
	refused := errors.New("poison topic down")
	pq, err := middleware.PoisonQueue(in.PoisonPublisher(&poisonRecorder{err: refused}), topic+".poison")
	if err != nil {
		t.Fatal(err)
	}
	h := pq(in.Middleware(func(*message.Message) ([]*message.Message, error) {
		return nil, errors.New("cannot process this order")
	}))
	if _, err := h(message.NewMessage(id, []byte("x"))); !errors.Is(err, refused) {
		t.Fatalf("delivery: %v, want the poison topic's refusal", err)
	}
	if outboxStateOf(t, db, id).Processed {
		t.Errorf("record %s marked processed though the poison topic refused it", id)
	}
}

// handlerReads is the rows and index entries the one session of db's pool
// has read (MySQL's Handler_read_* counters).
func handlerReads(t testing.TB, db *testdb.DB) int64 {
	t.Helper()
	var total int64
	rows, err := db.Queryx("SHOW SESSION STATUS LIKE 'Handler_read%'")
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	for rows.Next() {
		var name string
		var n int64
		if err := rows.Scan(&name, &n); err != nil {
			t.Fatal(err)
		}
		total += n
	}
	return total
}

// On MySQL Republish walked every published record and read each row for
// its processed_at and routing key: its cost grew with the history a table
// keeps, and on MariaDB 1,000,000 processed records took over 100 s, past
// the plugin's 30 s Timeout, so the router never started. 0012's index
// puts the unprocessed records together by routing key: what it reads
// grows neither with the processed records nor with the unprocessed ones
// of a topic it does not track (another service's, which no consumer of
// this database marks).
func TestRepublish_MySQL_ReadsTheUnprocessedRecordsNotTheHistory(t *testing.T) {
	db := migrated(t, testdb.MySQL)
	const history = 20000
	old := time.Now().Add(-time.Hour).UTC().Format("2006-01-02 15:04:05.000000")
	for start := 0; start < history; start += 1000 {
		var b strings.Builder
		b.WriteString("INSERT INTO acemq_outbox (id, exchange_name, routing_key, body, headers, created_at, published_at, processed_at) VALUES ")
		for i := start; i < start+1000; i++ {
			if i > start {
				b.WriteString(", ")
			}
			if i%2 == 0 {
				fmt.Fprintf(&b, "('h-%06d', '', 'orders', 'x', '{}', '%s', '%s', '%s')", i, old, old, old)
			} else {
				fmt.Fprintf(&b, "('h-%06d', '', 'audit', 'x', '{}', '%s', '%s', NULL)", i, old, old)
			}
		}
		db.MustExec(b.String())
	}
	lost := publishN(t, db, "", "orders", 3)
	ageRecords(t, db, time.Hour, lost...)

	db.DB.SetMaxOpenConns(1) // one session, whose counters the test reads
	rp, err := outbox.NewRepublisher(db.DB, outbox.RepublisherConfig{TrackedTopics: outbox.NewTrackedTopics("orders"), Grace: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	before := handlerReads(t, db)
	n, err := rp.Republish(context.Background())
	if err != nil || n != 3 {
		t.Fatalf("Republish: %d, %v; want the 3 unprocessed records", n, err)
	}
	read := handlerReads(t, db) - before
	t.Logf("Republish of 3 records beside %d processed ones and as many unprocessed of another topic read %d rows and index entries", history/2, read)
	if read > 1000 {
		t.Errorf("Republish read %d rows and index entries to find 3 unprocessed records beside %d processed ones and as many unprocessed of another topic: it walks them", read, history/2)
	}
}

// The router's Close cancels the context of a handler in flight. Behind
// the README's chain, Retry (ResetContextOnRetry brings that context
// back) failed each retry at once, PoisonQueue set aside a message whose
// handler never failed and acked it, and PoisonPublisher marked its record
// processed: neither a redelivery nor Republish brought it back (a review
// lost an order so, under a router closed mid-stream). PoisonPublisher
// refuses such a message: PoisonQueue fails it, the router nacks it, and
// it is delivered again.
func TestInbox_PoisonPublisher_HandlerInterruptedByClose_NotSetAsideDeliveredAgain(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		id, in, poison, pq := poisonedChainSetup(t, db, "order.placed")
		routerCtx, closeRouter := context.WithCancel(context.Background())
		defer closeRouter()
		// The README's chain over a handler that writes its effect,
		// closing the router first where close is set.
		chain := func(close bool) message.HandlerFunc {
			return pq(middleware.Retry{MaxRetries: 3, InitialInterval: time.Millisecond, ResetContextOnRetry: true}.Middleware(
				middleware.Timeout(30 * time.Second)(in.Middleware(func(msg *message.Message) ([]*message.Message, error) {
					if close {
						closeRouter() // the router's Close, while the handler runs
					}
					tx, _ := outbox.TxFromContext(msg.Context())
					_, err := tx.Exec(db.Rebind("INSERT INTO effects (message_id, note) VALUES (?, ?)"), msg.UUID, "placed")
					return nil, err
				}))))
		}
		msg := message.NewMessage(id, []byte("x"))
		msg.SetContext(routerCtx)
		if _, err := chain(true)(msg); err == nil {
			t.Errorf("a message whose handler the router's Close interrupted was acked (poisoned %d)", poison.count())
		}
		if poison.count() != 0 || outboxStateOf(t, db, id).Processed || countEffects(t, db, id) != 0 {
			t.Errorf("interrupted: poisoned %d, record processed %v, effects %d; want 0, false, 0: it is delivered again",
				poison.count(), outboxStateOf(t, db, id).Processed, countEffects(t, db, id))
		}
		// Delivered again to a router that runs: applied once.
		h := chain(false)
		if _, err := h(message.NewMessage(id, []byte("x"))); err != nil {
			t.Fatal(err)
		}
		if n := countEffects(t, db, id); n != 1 || !outboxStateOf(t, db, id).Processed {
			t.Errorf("redelivered: %d effects, processed %v; want 1, true", n, outboxStateOf(t, db, id).Processed)
		}
	})
}

// poisonedChainSetup publishes one record of topic in db, with the effects
// table, and returns its id, an inbox marking records processed, and a
// PoisonQueue through its PoisonPublisher into a recorder.
func poisonedChainSetup(t *testing.T, db *testdb.DB, topic string) (string, *outbox.Inbox, *poisonRecorder, message.HandlerMiddleware) {
	t.Helper()
	createEffects(t, db)
	id := publishN(t, db, "", topic, 1)[0]
	in := newInbox(t, db, outbox.InboxConfig{MarkOutboxProcessed: true})
	poison := &poisonRecorder{}
	pq, err := middleware.PoisonQueue(in.PoisonPublisher(poison), topic+".poison")
	if err != nil {
		t.Fatal(err)
	}
	return id, in, poison, pq
}

// The router closes while Retry waits out its backoff after a handler's
// failure: Retry answers context.Canceled itself, and PoisonQueue set the
// message aside on it, acked it, and PoisonPublisher marked its record
// processed, though the next try might well have succeeded (a review lost
// one so in a service closed mid-stream). PoisonPublisher refuses it too.
func TestInbox_PoisonPublisher_RouterClosedDuringRetryBackoff_NotSetAsideDeliveredAgain(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		id, in, poison, pq := poisonedChainSetup(t, db, "order.placed")
		routerCtx, closeRouter := context.WithCancel(context.Background())
		defer closeRouter()
		retry := middleware.Retry{MaxRetries: 3, InitialInterval: time.Millisecond, ResetContextOnRetry: true,
			ShouldRetry: func(middleware.RetryParams) bool {
				closeRouter() // the router's Close, as Retry is about to back off
				return true
			}}
		h := pq(retry.Middleware(middleware.Timeout(30 * time.Second)(in.Middleware(func(*message.Message) ([]*message.Message, error) {
			return nil, errors.New("the payment service is down")
		}))))
		msg := message.NewMessage(id, []byte("x"))
		msg.SetContext(routerCtx)
		if _, err := h(msg); err == nil {
			t.Errorf("a message whose retry the router's Close cut short was acked (poisoned %d)", poison.count())
		}
		if poison.count() != 0 || outboxStateOf(t, db, id).Processed {
			t.Errorf("retry cut short: poisoned %d, record processed %v; want 0, false: it is delivered again", poison.count(), outboxStateOf(t, db, id).Processed)
		}
	})
}
