package outbox_test

import (
	"bytes"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"maps"
	"math/rand"
	"reflect"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/prometheus/client_golang/prometheus"
	amqp "github.com/rabbitmq/amqp091-go"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testamqp"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// keyedMsg is the message a relay delivers for seq of aggregate key: its id
// derived from both, so that a second delivery is a copy.
func keyedMsg(key string, seq int) *message.Message {
	msg := message.NewMessage(key+"-"+strconv.Itoa(seq), []byte("event "+strconv.Itoa(seq)))
	msg.Metadata.Set(outbox.HeaderAggregateID, key)
	msg.Metadata.Set(outbox.HeaderSeq, strconv.Itoa(seq))
	return msg
}

// applyLog is a handler that makes its effect in the inbox's transaction
// and notes, per key, the sequence numbers it ran for, in the order their
// transactions held the key's lock.
type applyLog struct {
	mu   sync.Mutex
	seqs map[string][]int
	// fail, if set, fails the handler for a message before its effect.
	fail func(msg *message.Message) error
}

func (l *applyLog) handler(t testing.TB, db *testdb.DB) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		if l.fail != nil {
			if err := l.fail(msg); err != nil {
				return nil, err
			}
		}
		tx, ok := outbox.TxFromContext(msg.Context())
		if !ok {
			return nil, errors.New("no transaction in the message context")
		}
		if _, err := tx.ExecContext(msg.Context(), db.Rebind("INSERT INTO effects (message_id, note) VALUES (?, ?)"), msg.UUID, string(msg.Payload)); err != nil {
			return nil, err
		}
		seq, err := strconv.Atoi(msg.Metadata.Get(outbox.HeaderSeq))
		if err != nil {
			return nil, err
		}
		l.mu.Lock()
		defer l.mu.Unlock()
		if l.seqs == nil {
			l.seqs = map[string][]int{}
		}
		key := msg.Metadata.Get(outbox.HeaderAggregateID)
		l.seqs[key] = append(l.seqs[key], seq)
		return nil, nil
	}
}

func (l *applyLog) of(key string) []int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]int(nil), l.seqs[key]...)
}

func upTo(n int) []int {
	s := make([]int, n)
	for i := range s {
		s[i] = i + 1
	}
	return s
}

// deliver feeds the messages of key's seqs to h in that order, each acked.
func deliver(t testing.TB, h message.HandlerFunc, key string, seqs ...int) {
	t.Helper()
	for _, s := range seqs {
		if _, err := h(keyedMsg(key, s)); err != nil {
			t.Fatalf("delivery of %s seq %d: %v, want nil (ack)", key, s, err)
		}
	}
}

func countHeld(t testing.TB, db *testdb.DB) int {
	t.Helper()
	var n int
	if err := db.Get(&n, "SELECT COUNT(*) FROM acemq_inbox_held"); err != nil {
		t.Fatal(err)
	}
	return n
}

// assertEffectsOnce checks that every message of key up to n made exactly
// one effect.
func assertEffectsOnce(t testing.TB, db *testdb.DB, key string, n int) {
	t.Helper()
	for s := 1; s <= n; s++ {
		if c := countEffects(t, db, keyedMsg(key, s).UUID); c != 1 {
			t.Errorf("%s seq %d: %d effects, want 1", key, s, c)
		}
	}
}

func orderedInbox(t testing.TB, db *testdb.DB, cfg outbox.InboxConfig) *outbox.Inbox {
	t.Helper()
	cfg.Ordered = true
	return newInbox(t, db, cfg)
}

func TestOrderedInbox_InOrder_AppliedInOrderNothingHeld(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		createEffects(t, db)
		var l applyLog
		h := orderedInbox(t, db, outbox.InboxConfig{}).Middleware(l.handler(t, db))
		deliver(t, h, "order-1", upTo(5)...)
		deliver(t, h, "order-2", 1, 2)
		if got := l.of("order-1"); !reflect.DeepEqual(got, upTo(5)) {
			t.Errorf("order-1 applied %v, want %v", got, upTo(5))
		}
		if got := l.of("order-2"); !reflect.DeepEqual(got, upTo(2)) {
			t.Errorf("order-2 applied %v, want [1 2]: keys are independent", got)
		}
		if n := countHeld(t, db); n != 0 {
			t.Errorf("%d held, want 0", n)
		}
	})
}

func TestOrderedInbox_OutOfOrder_HandlerSeesEachSeqOnceInOrder(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		createEffects(t, db)
		var l applyLog
		h := orderedInbox(t, db, outbox.InboxConfig{}).Middleware(l.handler(t, db))

		deliver(t, h, "a", 3)
		if got := l.of("a"); len(got) != 0 {
			t.Fatalf("seq 3 before 1 and 2 applied %v, want it held", got)
		}
		deliver(t, h, "a", 1)
		if got := l.of("a"); !reflect.DeepEqual(got, []int{1}) {
			t.Fatalf("after 3, 1: applied %v, want [1] (3 waits for 2)", got)
		}
		deliver(t, h, "a", 2)
		if got := l.of("a"); !reflect.DeepEqual(got, upTo(3)) {
			t.Fatalf("after 3, 1, 2: applied %v, want [1 2 3]", got)
		}

		seed := time.Now().UnixNano()
		rng := rand.New(rand.NewSource(seed))
		var order []int
		for _, s := range rng.Perm(50) {
			order = append(order, s+1)
			if rng.Intn(4) == 0 { // a copy, at once or later
				order = append(order, s+1)
			}
		}
		for i := 0; i < 10; i++ {
			order = append(order, order[rng.Intn(len(order))])
		}
		deliver(t, h, "b", order...)
		if got := l.of("b"); !reflect.DeepEqual(got, upTo(50)) {
			t.Fatalf("seed %d, delivered %v: applied %v, want 1..50 once each in order", seed, order, got)
		}
		assertEffectsOnce(t, db, "b", 50)
		if n := countHeld(t, db); n != 0 {
			t.Errorf("%d held after all applied, want 0", n)
		}
	})
}

// A held message reaches the handler as it arrived: its id, payload and
// metadata byte for byte, also metadata that is not UTF-8 (AMQP header strings are
// bytes; another language's producer may send any), which JSON in the held
// row would have turned into U+FFFD.
func TestOrderedInbox_HeldMessage_AppliedWithItsPayloadAndMetadataByteForByte(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		createEffects(t, db)
		var (
			l    applyLog
			seen []*message.Message
		)
		inner := l.handler(t, db)
		h := orderedInbox(t, db, outbox.InboxConfig{}).Middleware(func(msg *message.Message) ([]*message.Message, error) {
			seen = append(seen, msg)
			return inner(msg)
		})
		held := keyedMsg("bytes", 2)
		held.Metadata.Set("raw", "\xff\xfe\x00")
		held.Metadata.Set("\xc3(", "key not UTF-8")
		held.Metadata.Set("text", "<é & \u00a0>")
		// The name the held row keeps its handler's under, and the names
		// it escapes a message's own keys of that name to.
		held.Metadata.Set("x-acemq-inbox-handler", "the sender's")
		held.Metadata.Set("x-acemq-inbox-handler~", "the sender's too")
		held.Metadata.Set("x-acemq-inbox-handler~~", "")
		want := maps.Clone(held.Metadata)
		if _, err := h(held); err != nil {
			t.Fatal(err)
		}
		if n := countHeld(t, db); n != 1 {
			t.Fatalf("%d held, want seq 2 held", n)
		}
		deliver(t, h, "bytes", 1)
		if got := l.of("bytes"); !reflect.DeepEqual(got, upTo(2)) {
			t.Fatalf("applied %v, want [1 2]", got)
		}
		applied := seen[len(seen)-1]
		if applied.UUID != held.UUID || !bytes.Equal(applied.Payload, held.Payload) {
			t.Errorf("held message applied as %s %q, want %s %q", applied.UUID, applied.Payload, held.UUID, held.Payload)
		}
		if !maps.Equal(map[string]string(applied.Metadata), map[string]string(want)) {
			t.Errorf("held message applied with metadata %q, want %q", applied.Metadata, want)
		}
	})
}

func TestOrderedInbox_DuplicateOfAppliedSeq_AckedWithoutRunning(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		createEffects(t, db)
		var l applyLog
		h := orderedInbox(t, db, outbox.InboxConfig{}).Middleware(l.handler(t, db))
		deliver(t, h, "a", 1, 2, 2, 1)
		// Another id under an applied seq (a sender that lost its sequence
		// row): order, not the id, makes it a duplicate.
		other := keyedMsg("a", 2)
		other.UUID = watermill.NewUUID()
		if _, err := h(other); err != nil {
			t.Fatalf("seq 2 under another id: %v, want nil (ack)", err)
		}
		if got := l.of("a"); !reflect.DeepEqual(got, upTo(2)) {
			t.Fatalf("applied %v, want [1 2]", got)
		}
		assertEffectsOnce(t, db, "a", 2)
	})
}

func TestOrderedInbox_EarlyMessageRedelivered_HeldOnce(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		createEffects(t, db)
		var l applyLog
		h := orderedInbox(t, db, outbox.InboxConfig{}).Middleware(l.handler(t, db))
		deliver(t, h, "a", 3, 3, 3)
		if n := countHeld(t, db); n != 1 {
			t.Fatalf("%d held rows after three deliveries of seq 3, want 1", n)
		}
		deliver(t, h, "a", 1, 2)
		if got := l.of("a"); !reflect.DeepEqual(got, upTo(3)) {
			t.Fatalf("applied %v, want [1 2 3]", got)
		}
		assertEffectsOnce(t, db, "a", 3)
		if n := countHeld(t, db); n != 0 {
			t.Errorf("%d held after 3 was applied, want 0", n)
		}
	})
}

// A held message whose drain failed, delivered again in its turn (a copy
// the relay sent twice) runs from that delivery, and its held copy goes
// with the commit: it is not run twice, nor left behind as a gap.
func TestOrderedInbox_HeldCopyDeliveredInTurn_AppliedOnceHeldCopyGone(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		createEffects(t, db)
		var failing atomic.Bool
		failing.Store(true)
		l := applyLog{fail: func(msg *message.Message) error {
			if failing.Load() && msg.Metadata.Get(outbox.HeaderSeq) == "2" {
				return errors.New("downstream unavailable")
			}
			return nil
		}}
		in := orderedInbox(t, db, outbox.InboxConfig{})
		h := in.Middleware(l.handler(t, db))
		deliver(t, h, "a", 2, 1) // 2 held; its drain behind 1 fails
		failing.Store(false)
		deliver(t, h, "a", 2)
		deliver(t, h, "a", 4, 3, 2)
		if got := l.of("a"); !reflect.DeepEqual(got, upTo(4)) {
			t.Fatalf("applied %v, want [1 2 3 4]", got)
		}
		assertEffectsOnce(t, db, "a", 4)
		if n := countHeld(t, db); n != 0 {
			t.Errorf("%d held, want 0", n)
		}
		if gaps, err := in.Gaps(context.Background(), 0); err != nil || len(gaps) != 0 {
			t.Errorf("gaps %v, %v; want none", gaps, err)
		}
	})
}

// The key's next message runs its handler and advances the key in one
// transaction: a handler that fails takes the advance back with it, and the
// redelivery runs the handler. Advanced in a transaction of its own (the
// mutant commits the advance, then runs the handler in a second one), the
// key moved past a message whose handler failed: its redelivery was acked
// as a duplicate and never applied.
func TestOrderedInbox_InOrderHandlerFails_KeyNotAdvancedRedeliveryApplied(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		createEffects(t, db)
		failing := true
		l := applyLog{fail: failSeq2(&failing)}
		h := orderedInbox(t, db, outbox.InboxConfig{}).Middleware(l.handler(t, db))
		deliver(t, h, "k", 1)
		if _, err := h(keyedMsg("k", 2)); err == nil {
			t.Fatal("seq 2 acked, want the handler's error (nack)")
		}
		failing = false
		deliver(t, h, "k", 2, 3)
		if got := l.of("k"); !reflect.DeepEqual(got, upTo(3)) {
			t.Fatalf("applied %v, want [1 2 3]", got)
		}
		assertEffectsOnce(t, db, "k", 3)
	})
}

func TestOrderedInbox_HeldMessageHandlerFails_StaysHeldAppliedLaterInOrder(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		createEffects(t, db)
		l := applyLog{}
		failing := true
		var mu sync.Mutex
		l.fail = func(msg *message.Message) error {
			mu.Lock()
			defer mu.Unlock()
			if failing && msg.Metadata.Get(outbox.HeaderSeq) == "2" {
				return errors.New("downstream unavailable")
			}
			return nil
		}
		in := orderedInbox(t, db, outbox.InboxConfig{})
		h := in.Middleware(l.handler(t, db))
		deliver(t, h, "a", 2, 3)
		deliver(t, h, "a", 1) // applied, acked; the drain of 2 fails
		if got := l.of("a"); !reflect.DeepEqual(got, []int{1}) {
			t.Fatalf("applied %v, want [1]: 2 failed, and 3 must wait for it", got)
		}
		if n := countHeld(t, db); n != 2 {
			t.Fatalf("%d held, want 2 (2 and 3)", n)
		}
		if c := countEffects(t, db, keyedMsg("a", 2).UUID); c != 0 {
			t.Fatalf("failed seq 2 left %d effects, want its transaction rolled back", c)
		}
		mu.Lock()
		failing = false
		mu.Unlock()
		n, err := in.ApplyHeld(context.Background())
		if err != nil || n != 2 {
			t.Fatalf("ApplyHeld: %d, %v; want 2 applied", n, err)
		}
		if got := l.of("a"); !reflect.DeepEqual(got, upTo(3)) {
			t.Fatalf("applied %v, want [1 2 3]", got)
		}
		assertEffectsOnce(t, db, "a", 3)
	})
}

// failSeq2 fails the handler for every message of seq 2 while *on, as a
// downstream that is down would.
func failSeq2(on *bool) func(msg *message.Message) error {
	return func(msg *message.Message) error {
		if *on && msg.Metadata.Get(outbox.HeaderSeq) == "2" {
			return errors.New("downstream unavailable")
		}
		return nil
	}
}

// poisonSeq2 fails every key's seq 2 with "poison" while down is true, and
// after that every key's but good's.
func poisonSeq2(down *bool, good string) func(msg *message.Message) error {
	return func(msg *message.Message) error {
		if msg.Metadata.Get(outbox.HeaderSeq) == "2" && (*down || msg.Metadata.Get(outbox.HeaderAggregateID) != good) {
			return errors.New("poison")
		}
		return nil
	}
}

// Another service sharing the tables, whose consumer has 100 ready keys
// held longer than this one's: ApplyHeld reads this process's consumers
// only, and applies its key.
func TestOrderedInbox_ApplyHeld_OtherConsumersOlderReadyKeys_OwnKeyApplied(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		createEffects(t, db)
		// "billing": 100 keys whose held seq 2 failed when its turn came, so
		// they are ready, and stay so.
		billingDown := true
		bl := applyLog{fail: failSeq2(&billingDown)}
		bh := orderedInbox(t, db, outbox.InboxConfig{ConsumerName: "billing"}).Middleware(bl.handler(t, db))
		for i := 0; i < 100; i++ {
			deliver(t, bh, fmt.Sprintf("b%03d", i), 2, 1)
		}

		down := true
		l := applyLog{fail: failSeq2(&down)}
		in := orderedInbox(t, db, outbox.InboxConfig{ConsumerName: "fulfilment"})
		h := in.Middleware(l.handler(t, db))
		deliver(t, h, "mine", 2, 1)
		down = false

		n, err := in.ApplyHeld(context.Background())
		if err != nil || n != 1 {
			t.Fatalf("ApplyHeld: %d, %v; want 1 applied: fulfilment's ready key behind billing's older ones", n, err)
		}
		if got := l.of("mine"); !reflect.DeepEqual(got, upTo(2)) {
			t.Fatalf("applied %v, want [1 2]", got)
		}
		if n := countHeld(t, db); n != 100 {
			t.Errorf("%d held, want billing's 100: its handler is not this process's", n)
		}
	})
}

// More keys than a page whose held message keeps failing, held before a
// key of the same consumer whose message would now apply: one ApplyHeld
// reaches that key, and says which failed.
func TestOrderedInbox_ApplyHeld_ManyFailingKeysAhead_KeyBehindThemApplied(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		createEffects(t, db)
		const poison = 101 // a page is 100
		down := true
		l := applyLog{fail: poisonSeq2(&down, "good")}
		in := orderedInbox(t, db, outbox.InboxConfig{})
		h := in.Middleware(l.handler(t, db))
		for i := 0; i < poison; i++ {
			deliver(t, h, fmt.Sprintf("bad-%03d", i), 2, 1)
		}
		deliver(t, h, "good", 2, 1)
		down = false

		n, err := in.ApplyHeld(context.Background())
		if n != 1 {
			t.Fatalf("ApplyHeld applied %d (%v), want 1: the key after %d failing ones", n, err, poison)
		}
		if err == nil || !strings.Contains(err.Error(), "poison") || !strings.Contains(err.Error(), fmt.Sprintf("%d more keys", poison-10)) {
			t.Errorf("ApplyHeld error %v; want the first failures and a count of the rest", err)
		}
		if got := l.of("good"); !reflect.DeepEqual(got, upTo(2)) {
			t.Fatalf("applied %v, want [1 2]", got)
		}
		if n := countHeld(t, db); n != poison {
			t.Errorf("%d held, want the %d failing", n, poison)
		}
	})
}

func TestOrderedInbox_ConcurrentDeliveriesOfOneKey_AppliedInOrderExactlyOnce(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		createEffects(t, db)
		var l applyLog
		h := orderedInbox(t, db, outbox.InboxConfig{}).Middleware(l.handler(t, db))
		const n, workers = 20, 6
		var wg sync.WaitGroup
		start := make(chan struct{})
		errs := make(chan error, n*workers)
		for w := 0; w < workers; w++ {
			wg.Add(1)
			go func(seed int64) {
				defer wg.Done()
				<-start
				for _, s := range rand.New(rand.NewSource(seed)).Perm(n) {
					if _, err := h(keyedMsg("hot", s+1)); err != nil {
						errs <- err
					}
				}
			}(int64(w))
		}
		close(start)
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Errorf("delivery: %v", err)
		}
		if got := l.of("hot"); !reflect.DeepEqual(got, upTo(n)) {
			t.Fatalf("applied %v, want 1..%d once each in order", got, n)
		}
		assertEffectsOnce(t, db, "hot", n)
	})
}

func TestOrderedInbox_GapOlderThanGapAfter_ListedMeasuredSkippedNeverAppliedOutOfOrder(t *testing.T) {
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		createEffects(t, db)
		var l applyLog
		reg := prometheus.NewRegistry()
		m, err := outbox.NewMetrics(reg)
		if err != nil {
			t.Fatal(err)
		}
		// GapAfter of a nanosecond: every held message is overdue at once,
		// with no waiting in the test.
		in := orderedInbox(t, db, outbox.InboxConfig{GapAfter: time.Nanosecond, Metrics: m})
		h := in.Middleware(l.handler(t, db))
		deliver(t, h, "a", 1, 3, 4)
		if gaps, err := in.Gaps(context.Background(), time.Hour); err != nil || len(gaps) != 0 {
			t.Fatalf("gaps older than an hour: %v, %v; want none", gaps, err)
		}
		gaps, err := in.Gaps(context.Background(), 0)
		if err != nil {
			t.Fatal(err)
		}
		if len(gaps) != 1 {
			t.Fatalf("gaps %+v, want one", gaps)
		}
		g := gaps[0]
		if g.Consumer != "fulfilment" || g.AggregateID != "a" || g.LastApplied != 1 || g.Held != 2 || g.LowestHeld != 3 || g.Missing() != 1 || g.OldestHeldAt.IsZero() {
			t.Errorf("gap %+v, want fulfilment/a, last 1, 2 held from 3, 1 missing, a held time", g)
		}
		if age := time.Since(g.OldestHeldAt); age < 0 || age > time.Minute {
			t.Errorf("oldest held %s ago, want just now", age)
		}
		if applied, err := in.ApplyHeld(context.Background()); err != nil || applied != 0 {
			t.Fatalf("ApplyHeld: %d, %v; want 0: nothing is next in order", applied, err)
		}
		if got := metricValue(t, reg, "outbox_inbox_held", ""); got != 2 {
			t.Errorf("outbox_inbox_held %v, want 2", got)
		}
		if got := metricValue(t, reg, "outbox_inbox_gaps", ""); got != 1 {
			t.Errorf("outbox_inbox_gaps %v, want 1", got)
		}
		if got := metricValue(t, reg, "outbox_inbox_oldest_gap_age_seconds", ""); got <= 0 {
			t.Errorf("outbox_inbox_oldest_gap_age_seconds %v, want above 0", got)
		}
		if got := metricValue(t, reg, "outbox_inbox_held_total", "fulfilment"); got != 2 {
			t.Errorf("outbox_inbox_held_total %v, want 2", got)
		}
		if got := l.of("a"); !reflect.DeepEqual(got, []int{1}) {
			t.Fatalf("before the skip: applied %v, want [1]", got)
		}

		if err := in.SkipGap(context.Background(), g.Consumer, g.AggregateID, g.LastApplied+1, g.LowestHeld-1); err != nil {
			t.Fatalf("SkipGap %d..%d: %v; want 2 skipped", g.LastApplied+1, g.LowestHeld-1, err)
		}
		if got := l.of("a"); !reflect.DeepEqual(got, []int{1, 3, 4}) {
			t.Fatalf("after the skip: applied %v, want [1 3 4]", got)
		}
		deliver(t, h, "a", 2) // the skipped one, late
		if got := l.of("a"); !reflect.DeepEqual(got, []int{1, 3, 4}) {
			t.Fatalf("skipped seq 2 arriving late ran: applied %v", got)
		}
		if err := in.SkipGap(context.Background(), "fulfilment", "a", 2, 2); !errors.Is(err, outbox.ErrGapChanged) {
			t.Errorf("SkipGap 2 again: %v, want ErrGapChanged", err)
		}
		if err := in.SkipGap(context.Background(), "fulfilment", "a", 5, 5); !errors.Is(err, outbox.ErrNoHeld) {
			t.Errorf("SkipGap 5 with nothing held: %v, want ErrNoHeld", err)
		}
		if err := in.RefreshStats(context.Background()); err != nil {
			t.Fatal(err)
		}
		if got := metricValue(t, reg, "outbox_inbox_held", ""); got != 0 {
			t.Errorf("outbox_inbox_held %v after the skip, want 0", got)
		}
	})
}

// The operator sees a key waiting for 2 (3 and 6 held) and skips 2;
// meanwhile 2 arrives and 2 and 3 are applied. The skip refuses, with
// no change, instead of skipping 4 and 5, which nobody saw missing (they
// were in flight) and which run when they arrive.
func TestOrderedInbox_SkipGap_GapFilledMeanwhile_RefusesAndSkipsNothingUnseen(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		createEffects(t, db)
		l := applyLog{}
		in := orderedInbox(t, db, outbox.InboxConfig{})
		h := in.Middleware(l.handler(t, db))
		deliver(t, h, "a", 1, 3, 6)
		gaps, err := in.Gaps(context.Background(), 0)
		if err != nil || len(gaps) != 1 || gaps[0].LowestHeld-1 != 2 {
			t.Fatalf("gaps %+v, %v; want a waiting for 2", gaps, err)
		}
		deliver(t, h, "a", 2) // the missing one arrives; 3 is drained
		g := gaps[0]
		err = in.SkipGap(context.Background(), g.Consumer, g.AggregateID, g.LastApplied+1, g.LowestHeld-1)
		if !errors.Is(err, outbox.ErrGapChanged) {
			t.Fatalf("SkipGap 2 after 2 and 3 were applied: %v, want ErrGapChanged", err)
		}
		deliver(t, h, "a", 4, 5) // in flight all along
		if got := l.of("a"); !reflect.DeepEqual(got, upTo(6)) {
			t.Fatalf("applied %v, want [1..6]: nothing but 2 was named, and 2 came", got)
		}
		assertEffectsOnce(t, db, "a", 6)
	})
}

// The operator sees a key waiting for 2..4 (1 applied, 5 held); then 2
// arrives and is applied, and the skip of 2..4 comes. It must refuse,
// saying what changed, and skip nothing: 3 and 4 were merely in flight,
// and a skip that checked only its end (4 is below every held number)
// would skip them and ack them as duplicates when they come.
func TestOrderedInbox_SkipGap_PredecessorArrivedMeanwhile_RefusesAndSkipsNothingInFlight(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		createEffects(t, db)
		l := applyLog{}
		in := orderedInbox(t, db, outbox.InboxConfig{})
		h := in.Middleware(l.handler(t, db))
		deliver(t, h, "a", 1, 5)
		gaps, err := in.Gaps(context.Background(), 0)
		if err != nil || len(gaps) != 1 || gaps[0].LastApplied != 1 || gaps[0].LowestHeld != 5 {
			t.Fatalf("gaps %+v, %v; want a waiting for 2..4", gaps, err)
		}
		g := gaps[0]
		deliver(t, h, "a", 2) // the first missing one arrives
		err = in.SkipGap(context.Background(), g.Consumer, g.AggregateID, g.LastApplied+1, g.LowestHeld-1)
		if !errors.Is(err, outbox.ErrGapChanged) {
			t.Fatalf("SkipGap 2..4 after 2 was applied: %v, want ErrGapChanged", err)
		}
		for _, want := range []string{"last applied is now 2", "lowest held 5", "waiting for 3..4"} {
			if !strings.Contains(err.Error(), want) {
				t.Errorf("SkipGap error %q does not say %q", err, want)
			}
		}
		if now, err := in.Gaps(context.Background(), 0); err != nil || len(now) != 1 || now[0].LastApplied != 2 || now[0].LowestHeld != 5 {
			t.Fatalf("gaps after the refused skip %+v, %v; want a at 2, 5 held: nothing skipped", now, err)
		}
		deliver(t, h, "a", 3, 4) // in flight all along
		if got := l.of("a"); !reflect.DeepEqual(got, upTo(5)) {
			t.Fatalf("applied %v, want [1..5] in order: nothing was missing but 2, and 2 came", got)
		}
		assertEffectsOnce(t, db, "a", 5)
	})
}

// The skip of the gap as it was seen, nothing having moved: exactly those
// numbers are skipped, the held messages are applied after them in order,
// and a skipped number arriving late does not run.
func TestOrderedInbox_SkipGap_TheGapAsSeen_SkippedAndHeldAppliedInOrder(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		createEffects(t, db)
		l := applyLog{}
		in := orderedInbox(t, db, outbox.InboxConfig{})
		h := in.Middleware(l.handler(t, db))
		deliver(t, h, "a", 1, 5, 6)
		gaps, err := in.Gaps(context.Background(), 0)
		if err != nil || len(gaps) != 1 {
			t.Fatalf("gaps %+v, %v; want one", gaps, err)
		}
		g := gaps[0]
		if err := in.SkipGap(context.Background(), g.Consumer, g.AggregateID, g.LastApplied+1, g.LowestHeld-1); err != nil {
			t.Fatalf("SkipGap %d..%d: %v, want nil", g.LastApplied+1, g.LowestHeld-1, err)
		}
		if got := l.of("a"); !reflect.DeepEqual(got, []int{1, 5, 6}) {
			t.Fatalf("after the skip: applied %v, want [1 5 6]", got)
		}
		if n := countHeld(t, db); n != 0 {
			t.Errorf("%d held after the skip, want 0", n)
		}
		deliver(t, h, "a", 3, 7) // 3 skipped, late; 7 next
		if got := l.of("a"); !reflect.DeepEqual(got, []int{1, 5, 6, 7}) {
			t.Fatalf("applied %v, want [1 5 6 7]: skipped 3 arriving late must not run", got)
		}
	})
}

// A skip names both ends: its start must follow the key's last applied
// and its end must be below every held number, else it refuses; a skip of
// the gap's start alone skips that far, and the key waits for the rest.
func TestOrderedInbox_SkipGap_FromAndThroughNameTheSkip_HeldOrUnseenNumbersRefused(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		createEffects(t, db)
		l := applyLog{}
		in := orderedInbox(t, db, outbox.InboxConfig{})
		h := in.Middleware(l.handler(t, db))
		deliver(t, h, "a", 1, 5)
		for _, r := range [][2]int64{{2, 5}, {2, 6}, {3, 4}, {1, 4}} {
			if err := in.SkipGap(context.Background(), "fulfilment", "a", r[0], r[1]); !errors.Is(err, outbox.ErrGapChanged) {
				t.Fatalf("SkipGap %d..%d of a gap 2..4: %v, want ErrGapChanged", r[0], r[1], err)
			}
		}
		for _, r := range [][2]int64{{0, 3}, {3, 2}} {
			err := in.SkipGap(context.Background(), "fulfilment", "a", r[0], r[1])
			if err == nil || errors.Is(err, outbox.ErrGapChanged) {
				t.Fatalf("SkipGap %d..%d: %v, want an error of its arguments", r[0], r[1], err)
			}
		}
		if err := in.SkipGap(context.Background(), "fulfilment", "a", 2, 3); err != nil {
			t.Fatalf("SkipGap 2..3: %v, want nil", err)
		}
		gaps, err := in.Gaps(context.Background(), 0)
		if err != nil || len(gaps) != 1 || gaps[0].LastApplied != 3 || gaps[0].LowestHeld != 5 {
			t.Fatalf("gaps %+v, %v; want a at 3, waiting for 4", gaps, err)
		}
		deliver(t, h, "a", 4, 2, 3) // 4 not skipped; 2 and 3 late
		if got := l.of("a"); !reflect.DeepEqual(got, []int{1, 4, 5}) {
			t.Fatalf("applied %v, want [1 4 5]", got)
		}
	})
}

// A skip racing the delivery of the very number it skips: whichever takes
// the key's row first wins, the other sees what it did. Either the message
// runs and the skip refuses, or the skip wins and the message is a
// duplicate; either way the held messages run once, in order, and nothing
// but the named number is skipped.
func TestOrderedInbox_SkipGapRacingTheMissingMessage_OneWinsNothingElseSkipped(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		createEffects(t, db)
		for round := 0; round < 10; round++ {
			key := "race-" + strconv.Itoa(round)
			l := applyLog{}
			in := orderedInbox(t, db, outbox.InboxConfig{})
			h := in.Middleware(l.handler(t, db))
			deliver(t, h, key, 1, 3, 4)
			start := make(chan struct{})
			var wg sync.WaitGroup
			var skipErr, deliverErr error
			wg.Add(2)
			go func() {
				defer wg.Done()
				<-start
				skipErr = in.SkipGap(context.Background(), "fulfilment", key, 2, 2)
			}()
			go func() {
				defer wg.Done()
				<-start
				_, deliverErr = h(keyedMsg(key, 2))
			}()
			close(start)
			wg.Wait()
			if deliverErr != nil {
				t.Fatalf("%s: delivery of 2: %v", key, deliverErr)
			}
			want := []int{1, 2, 3, 4}
			if skipErr == nil {
				want = []int{1, 3, 4}
			} else if !errors.Is(skipErr, outbox.ErrGapChanged) {
				t.Fatalf("%s: SkipGap: %v, want nil or ErrGapChanged", key, skipErr)
			}
			deliver(t, h, key, 5)
			if got := l.of(key); !reflect.DeepEqual(got, append(want, 5)) {
				t.Fatalf("%s: applied %v, want %v (skip: %v)", key, got, append(want, 5), skipErr)
			}
		}
	})
}

func TestOrderedInbox_UnkeyedMessage_TakesUnorderedPath(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		createEffects(t, db)
		var ran atomic.Int32
		h := orderedInbox(t, db, outbox.InboxConfig{}).Middleware(writeEffect(t, db, &ran))
		msg := message.NewMessage(watermill.NewUUID(), []byte("x"))
		msg.Metadata.Set(outbox.HeaderSeq, "7") // a seq alone keys nothing
		for i := 0; i < 2; i++ {
			if _, err := h(msg.Copy()); err != nil {
				t.Fatal(err)
			}
		}
		if countEffects(t, db, msg.UUID) != 1 || countProcessed(t, db, msg.UUID) != 1 {
			t.Fatal("unkeyed message: want one effect and one key, as without Ordered")
		}
		var n int
		if err := db.Get(&n, "SELECT COUNT(*) FROM acemq_inbox_sequences"); err != nil || n != 0 {
			t.Errorf("%d sequence rows (%v), want none for an unkeyed message", n, err)
		}
	})
}

func TestOrderedInbox_KeyedMessageWithoutValidSeq_FailsNamingItHandlerNotRun(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.SQLite)
	createEffects(t, db)
	var l applyLog
	h := orderedInbox(t, db, outbox.InboxConfig{}).Middleware(l.handler(t, db))
	for _, seq := range []string{"", "0", "-1", "seven", "1.5"} {
		msg := keyedMsg("a", 1)
		msg.Metadata.Set(outbox.HeaderSeq, seq)
		if _, err := h(msg); !errors.Is(err, outbox.ErrInvalidSeq) {
			t.Errorf("seq %q: %v, want ErrInvalidSeq", seq, err)
		}
	}
	// No seq at all: an application's own aggregateId metadata, most
	// likely, which the error says.
	msg := keyedMsg("a", 1)
	delete(msg.Metadata, outbox.HeaderSeq)
	if _, err := h(msg); !errors.Is(err, outbox.ErrInvalidSeq) || !strings.Contains(err.Error(), "MetadataAggregateID") {
		t.Errorf("no seq: %v, want ErrInvalidSeq saying how to publish a keyed message", err)
	}
	if got := l.of("a"); len(got) != 0 {
		t.Errorf("handler ran for %v", got)
	}
}

// A key the database cannot hold fails, naming the message and the key,
// as ErrInvalidKey, which a poison queue middleware can take aside, rather
// than with the driver's error on every delivery: over 255 bytes anywhere,
// and on PostgreSQL (text columns) a NUL or bytes that are not UTF-8.
// MySQL (varbinary) and SQLite hold those, and apply them in order.
func TestOrderedInbox_KeyTheDatabaseCannotHold_ErrInvalidKeyNothingWritten(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, d outbox.Dialect) {
		createEffects(t, db)
		var l applyLog
		h := orderedInbox(t, db, outbox.InboxConfig{}).Middleware(l.handler(t, db))
		refused := []string{strings.Repeat("k", 256)}
		held := []string{"k\x00nul", "k\xff\xfe"}
		if d == outbox.Postgres {
			refused = append(refused, held...)
			held = nil
		}
		for i, key := range refused {
			m := message.NewMessage(fmt.Sprintf("refused-%d", i), []byte("event"))
			m.Metadata.Set(outbox.HeaderAggregateID, key)
			m.Metadata.Set(outbox.HeaderSeq, "1")
			_, err := h(m)
			if !errors.Is(err, outbox.ErrInvalidKey) || !strings.Contains(err.Error(), m.UUID) {
				t.Errorf("key %.20q: %v, want ErrInvalidKey naming %s", key, err, m.UUID)
			}
			if got := l.of(key); len(got) != 0 {
				t.Errorf("key %.20q: handler ran for %v", key, got)
			}
			if n := countProcessed(t, db, m.UUID); n != 0 {
				t.Errorf("key %.20q: %d dedupe rows, want none", key, n)
			}
		}
		for i, key := range held {
			for _, seq := range []int{1, 3, 2} {
				m := message.NewMessage(fmt.Sprintf("bytes-%d-%d", i, seq), []byte("event"))
				m.Metadata.Set(outbox.HeaderAggregateID, key)
				m.Metadata.Set(outbox.HeaderSeq, strconv.Itoa(seq))
				if _, err := h(m); err != nil {
					t.Fatalf("key %q seq %d: %v", key, seq, err)
				}
			}
			if got := l.of(key); !reflect.DeepEqual(got, upTo(3)) {
				t.Errorf("key %q: applied %v, want [1 2 3]", key, got)
			}
		}
		var n int
		if err := db.Get(&n, "SELECT COUNT(*) FROM acemq_inbox_sequences"); err != nil || n != len(held) {
			t.Errorf("%d sequence rows (%v), want %d", n, err, len(held))
		}
	})
}

func TestOrderedInbox_WithoutOrdered_KeyedMessagesRunAsTheyCome(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.SQLite)
	createEffects(t, db)
	var l applyLog
	h := newInbox(t, db, outbox.InboxConfig{}).Middleware(l.handler(t, db))
	deliver(t, h, "a", 3, 1, 2)
	if got := l.of("a"); !reflect.DeepEqual(got, []int{3, 1, 2}) {
		t.Errorf("applied %v, want [3 1 2]: ordering is opt-in", got)
	}
}

func TestOrderedInbox_WithAtMostOnce_ConfigError(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.SQLite)
	_, err := outbox.NewInbox(db.DB, outbox.InboxConfig{Ordered: true, AtMostOnce: true})
	var ce *outbox.ConfigError
	if !errors.As(err, &ce) || ce.Field != "Ordered" {
		t.Errorf("Ordered with AtMostOnce: %v, want a ConfigError naming Ordered", err)
	}
}

// Through a router: the broker hands the messages over out of order, and
// the handler sees them in order.
func TestOrderedInbox_Router_OutOfOrderDeliveries_HandlerSeesOrder(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.SQLite)
	createEffects(t, db)
	var l applyLog
	in := orderedInbox(t, db, outbox.InboxConfig{})
	pubsub := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 16}, watermill.NopLogger{})
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	router.AddMiddleware(in.Middleware)
	apply := l.handler(t, db)
	router.AddConsumerHandler("apply", "orders", pubsub, func(msg *message.Message) error { _, err := apply(msg); return err })
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- router.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
		_ = pubsub.Close()
	})
	<-router.Running()
	for _, s := range []int{4, 2, 5, 1, 3, 2} {
		if err := pubsub.Publish("orders", keyedMsg("a", s)); err != nil {
			t.Fatal(err)
		}
	}
	// The handler logs a message before the middleware commits its effect;
	// the fifth effect committed, all five are.
	waitFor(t, 10*time.Second, "five applied and committed", func() bool {
		return len(l.of("a")) >= 5 && countEffects(t, db, keyedMsg("a", 5).UUID) > 0
	})
	if got := l.of("a"); !reflect.DeepEqual(got, upTo(5)) {
		t.Fatalf("applied %v, want [1 2 3 4 5]", got)
	}
	assertEffectsOnce(t, db, "a", 5)
}

// On MySQL the in-order path reads what its one statement did from the
// result's counts, which clientFoundRows=true changes (an untouched row
// counts 1, as a new one does): first messages, next ones, copies, holds and
// the drain must come out as without it.
func TestOrderedInbox_MySQLClientFoundRows_OrderAndDuplicatesAsWithout(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.MySQL)
	createEffects(t, db)
	found := withClientFoundRows(t, db)
	var l applyLog
	h := orderedInbox(t, found, outbox.InboxConfig{}).Middleware(l.handler(t, found))
	deliver(t, h, "a", 1, 1, 2, 2, 1)
	deliver(t, h, "b", 2, 2, 1, 1, 3)
	deliver(t, h, "c", 1, 3, 3, 2, 4, 3)
	for key, n := range map[string]int{"a": 2, "b": 3, "c": 4} {
		if got := l.of(key); !reflect.DeepEqual(got, upTo(n)) {
			t.Errorf("%s applied %v, want %v", key, got, upTo(n))
		}
		assertEffectsOnce(t, db, key, n)
	}
	if n := countHeld(t, db); n != 0 {
		t.Errorf("%d held, want 0", n)
	}
}

// The key's count of held messages, which lets the in-order path skip the
// held table, follows holds and applies exactly, and a count an operator's
// hand made wrong (a held row deleted) is set right by the next apply.
func TestOrderedInbox_HeldCount_FollowsHoldsAndAppliesHealsWhenDeletedByHand(t *testing.T) {
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		createEffects(t, db)
		var l applyLog
		h := orderedInbox(t, db, outbox.InboxConfig{}).Middleware(l.handler(t, db))
		heldCount := func() int {
			t.Helper()
			var n int
			if err := db.Get(&n, db.Rebind("SELECT held FROM acemq_inbox_sequences WHERE aggregate_id = ?"), "a"); err != nil {
				t.Fatal(err)
			}
			return n
		}
		deliver(t, h, "a", 3, 4, 4, 6)
		if n := heldCount(); n != 3 {
			t.Fatalf("held count %d after holding 3, 4 (twice) and 6, want 3", n)
		}
		deliver(t, h, "a", 1, 2) // applies 1, 2, then 3 and 4 from the held table
		if n := heldCount(); n != 1 {
			t.Fatalf("held count %d with 6 held, want 1", n)
		}
		if _, err := db.Exec(db.Rebind("DELETE FROM acemq_inbox_held WHERE aggregate_id = ?"), "a"); err != nil {
			t.Fatal(err)
		}
		deliver(t, h, "a", 5, 6, 7)
		if got := l.of("a"); !reflect.DeepEqual(got, upTo(7)) {
			t.Fatalf("applied %v, want 1..7", got)
		}
		if n := heldCount(); n != 0 {
			t.Errorf("held count %d after the next apply, want 0", n)
		}
	})
}

// The reference relay sends aggregateId and seq on every row, void for an
// unkeyed one, which AMQPMarshaler renders as "null". The ordered inbox took
// "null" for an ordering key, refused seq "null", and nacked the message on
// every delivery (29,896 times in three seconds when a review found it); it
// is an unkeyed message, and runs once.
func TestOrderedInbox_ViaAMQP_VoidAggregateIDAndSeq_IsUnkeyed(t *testing.T) {
	db := migrated(t, testdb.Postgres)
	createEffects(t, db)
	b := testamqp.New(t)
	input := b.Queue()
	in := newInbox(t, db, outbox.InboxConfig{ConsumerName: "ledger", Ordered: true})
	var ran, failed atomic.Int32
	router := newRouter(t)
	router.AddMiddleware(func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			out, err := h(msg)
			if err != nil {
				failed.Add(1)
			}
			return out, err
		}
	}, in.Middleware)
	router.AddConsumerHandler("ledger", input, amqpSubscriber(t), func(msg *message.Message) error {
		ran.Add(1)
		return nil
	})
	startRouter(t, router)

	id := "pay-" + testdb.RandomName()
	b.With(func(ch *amqp.Channel) error {
		return ch.PublishWithContext(context.Background(), "", input, true, false, amqp.Publishing{
			MessageId: id, DeliveryMode: amqp.Persistent, Body: []byte(`{"amount":"42.50"}`),
			Headers: amqp.Table{outbox.HeaderMessageID: id, "aggregateId": nil, "seq": nil}, // as amqplib sends an unkeyed row's
		})
	})
	waitFor(t, 10*time.Second, "the handler to run", func() bool { return ran.Load() > 0 || failed.Load() > 0 })
	time.Sleep(200 * time.Millisecond) // a redelivery, if there were one, would show by now
	if ran.Load() != 1 || failed.Load() != 0 {
		t.Errorf("handler ran %d times, the inbox failed %d deliveries; want 1 and 0", ran.Load(), failed.Load())
	}
}

// ApplyHeld reaches keys that sort at or below the empty string where the
// collation pads with spaces (MySQL's _bin): a key of spaces equals ”, and
// one starting with a control byte sorts below it. Its first page had the
// lower bound ”, and never read them.
func TestOrderedInbox_ApplyHeld_KeysOfSpacesOrControlBytes_Reached(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		createEffects(t, db)
		keys := []string{"a", " ", "\tx", "\x01k", " \x01"}
		down := true
		l := applyLog{fail: failSeq2(&down)}
		in := orderedInbox(t, db, outbox.InboxConfig{ConsumerName: "c"})
		h := in.Middleware(l.handler(t, db))
		for i, k := range keys {
			for _, seq := range []int{2, 1} {
				msg := keyedMsg(k, seq)
				msg.UUID = fmt.Sprintf("k%d-%d", i, seq)
				if _, err := h(msg); err != nil {
					t.Fatalf("delivery of %q seq %d: %v", k, seq, err)
				}
			}
		}
		down = false
		n, err := in.ApplyHeld(context.Background())
		if err != nil {
			t.Fatalf("ApplyHeld: %v", err)
		}
		var missed []string
		for _, k := range keys {
			if got := l.of(k); !reflect.DeepEqual(got, upTo(2)) {
				missed = append(missed, k)
			}
		}
		if n != len(keys) || len(missed) > 0 {
			t.Errorf("ApplyHeld applied %d of %d ready keys; never reached %q", n, len(keys), missed)
		}
	})
}

// Rolling back past 0006 and migrating up again keeps the ordered inbox's
// state: its down dropped the held messages (acked to the broker already)
// and every key's last applied number.
func TestMigrations_DownPast0006ThenUp_OrderedInboxKeepsItsState(t *testing.T) {
	t.Parallel()
	testdb.Each(t, func(t *testing.T, db *testdb.DB) {
		d := migrate(t, db)
		createEffects(t, db)
		var l applyLog
		in := orderedInbox(t, db, outbox.InboxConfig{ConsumerName: "c"})
		h := in.Middleware(l.handler(t, db))
		deliver(t, h, "k", 1, 2, 4) // 4 held
		downAndUpAgain(t, db, d, 6)
		in2 := orderedInbox(t, db, outbox.InboxConfig{ConsumerName: "c"})
		deliver(t, in2.Middleware(l.handler(t, db)), "k", 3)
		if got := l.of("k"); !reflect.DeepEqual(got, upTo(4)) {
			t.Errorf("key k applied %v after a down past 0006 and an up, want [1 2 3 4]", got)
		}
	})
}

// Keys that differ only in trailing spaces are two keys on every database.
// MySQL's _bin collations ignore trailing spaces, so before 0009 "k " seq 1
// from a publisher on PostgreSQL (another language's, say) was "k" seq 1 on
// a MariaDB consumer: acked as a duplicate without running, lost. Held
// messages too are kept apart.
func TestOrderedInbox_KeysDifferingInTrailingSpaces_AreTwoKeys(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		createEffects(t, db)
		var l applyLog
		h := orderedInbox(t, db, outbox.InboxConfig{}).Middleware(l.handler(t, db))
		keys := []string{"k", "k ", "k  "}
		msg := func(k, seq int) *message.Message {
			m := message.NewMessage(fmt.Sprintf("key%d-seq%d", k, seq), []byte("event"))
			m.Metadata.Set(outbox.HeaderAggregateID, keys[k])
			m.Metadata.Set(outbox.HeaderSeq, strconv.Itoa(seq))
			return m
		}
		// Key 2's seq 2 first: held under its own key, not "k"'s.
		for _, d := range [][2]int{{0, 1}, {2, 2}, {1, 1}, {1, 2}, {0, 2}, {2, 1}} {
			if _, err := h(msg(d[0], d[1])); err != nil {
				t.Fatalf("key %q seq %d: %v", keys[d[0]], d[1], err)
			}
		}
		for _, k := range keys {
			if got := l.of(k); !reflect.DeepEqual(got, upTo(2)) {
				t.Errorf("key %q applied %v, want [1 2]", k, got)
			}
		}
		if n := countHeld(t, db); n != 0 {
			t.Errorf("%d held, want 0", n)
		}
	})
}

// A crash between a message's commit and the apply of the message held
// behind it (played by that apply failing once): the broker redelivers
// the committed message, a duplicate now. Its delivery acked without
// applying the held one, which then waited for ApplyHeld or the key's
// next number. Any delivery of the key now applies it. (From an audit.)
func TestOrderedInbox_CrashBeforeTheHeldApply_RedeliveryAppliesIt(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		createEffects(t, db)
		crashed := false
		var l applyLog
		l.fail = func(msg *message.Message) error {
			if msg.Metadata.Get(outbox.HeaderSeq) == "2" && !crashed {
				crashed = true
				return errors.New("the process died here")
			}
			return nil
		}
		deliver(t, orderedInbox(t, db, outbox.InboxConfig{}).Middleware(l.handler(t, db)), "k", 2, 1)
		if n := countHeld(t, db); n != 1 {
			t.Fatalf("%d held after the crash, want 1", n)
		}
		restarted := orderedInbox(t, db, outbox.InboxConfig{}).Middleware(l.handler(t, db))
		deliver(t, restarted, "k", 1) // the redelivery of the committed one
		if n := countHeld(t, db); n != 0 {
			t.Errorf("%d held after the predecessor's redelivery, want 0", n)
		}
		if got := l.of("k"); !reflect.DeepEqual(got, []int{1, 2}) {
			t.Errorf("applied %v, want [1 2]", got)
		}
		assertEffectsOnce(t, db, "k", 2)
	})
}

// A seq of 2^63-1 (another publisher's garbage) has no successor: held and
// then applied by a skip of the gap, it made every later delivery of its
// key fail on MySQL (last_seq + 1 out of range). It is refused as invalid.
// (From an audit.)
func TestOrderedInbox_SeqMaxInt64_RefusedAsInvalid(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		in := orderedInbox(t, db, outbox.InboxConfig{})
		h := in.Middleware(func(*message.Message) ([]*message.Message, error) {
			t.Error("the handler ran")
			return nil, nil
		})
		m := message.NewMessage("huge-1", []byte("x"))
		m.Metadata.Set(outbox.HeaderAggregateID, "big")
		m.Metadata.Set(outbox.HeaderSeq, "9223372036854775807")
		if _, err := h(m); !errors.Is(err, outbox.ErrInvalidSeq) {
			t.Fatalf("error %v, want ErrInvalidSeq", err)
		}
		if n := countHeld(t, db); n != 0 {
			t.Errorf("%d held, want 0", n)
		}
	})
}

// Under REPEATABLE READ (InboxConfig.Isolation) a delivery whose key's row
// another transaction changed since its snapshot is refused with a
// serialization failure (SQLSTATE 40001). It was nacked, and a hot key's
// delivery was nacked up to 21 times in an audit, past RabbitMQ 4's
// delivery limit for quorum queues. The inbox now runs such a delivery
// again itself: the transaction was rolled back whole.
func TestOrderedInbox_Postgres_RepeatableRead_SerializationFailureRunAgain(t *testing.T) {
	db := migrated(t, testdb.Postgres)
	createEffects(t, db)
	var l applyLog
	in := orderedInbox(t, db, outbox.InboxConfig{ConsumerName: "ledger", Isolation: sql.LevelRepeatableRead})
	h := in.Middleware(l.handler(t, db))
	deliver(t, h, "acct-1", 1)

	// Another transaction changes the key's row and holds it; the delivery
	// of 2 takes its snapshot and waits for the row; the other commits.
	other, err := db.Beginx()
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = other.Rollback() }()
	if _, err := other.Exec("UPDATE acemq_inbox_sequences SET held = held WHERE consumer_name = 'ledger' AND aggregate_id = 'acct-1'"); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		_, err := h(keyedMsg("acct-1", 2))
		done <- err
	}()
	time.Sleep(500 * time.Millisecond)
	if err := other.Commit(); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatalf("delivery of 2: %v, want it run again and acked", err)
	}
	if got := l.of("acct-1"); !reflect.DeepEqual(got, []int{1, 2}) {
		t.Errorf("applied %v, want [1 2]", got)
	}
	assertEffectsOnce(t, db, "acct-1", 2)
}

// ApplyHeld's pages continue after a key that is not UTF-8 (MySQL's
// varbinary and SQLite hold one; PostgreSQL refuses it, see
// TestOrderedInbox_KeyTheDatabaseCannotHold_…): the first page ends at
// "bad-\xff", and the next page's bound is that key's bytes, as they are.
func TestOrderedInbox_ApplyHeld_PageEndingAtAKeyThatIsNotUTF8_NextPageReached(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, d outbox.Dialect) {
		if d == outbox.Postgres {
			t.Skip("PostgreSQL's text columns refuse a key that is not UTF-8 (ErrInvalidKey)")
		}
		createEffects(t, db)
		down := true
		l := applyLog{fail: poisonSeq2(&down, "good")}
		in := orderedInbox(t, db, outbox.InboxConfig{})
		h := in.Middleware(l.handler(t, db))
		for i := 0; i < 99; i++ {
			deliver(t, h, fmt.Sprintf("bad-%03d", i), 2, 1)
		}
		for _, seq := range []int{2, 1} { // the 100th key, the page's last
			msg := keyedMsg("bad-\xff\xfe", seq)
			msg.UUID = fmt.Sprintf("bytes-%d", seq)
			if _, err := h(msg); err != nil {
				t.Fatalf("delivery of seq %d: %v", seq, err)
			}
		}
		deliver(t, h, "good", 2, 1)
		down = false

		n, err := in.ApplyHeld(context.Background())
		if n != 1 || err == nil || !strings.Contains(err.Error(), "poison") {
			t.Fatalf("ApplyHeld applied %d (%v), want 1, the key on the second page, and the failures", n, err)
		}
		if got := l.of("good"); !reflect.DeepEqual(got, upTo(2)) {
			t.Fatalf("applied %v, want [1 2]", got)
		}
	})
}
