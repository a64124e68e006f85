package integration_test

// The keyed part of the end-to-end run, issue 16's proof of per-aggregate
// order: orders as aggregates, each with several events (placed, paid,
// packed, …) published in transactions of their own with the order id as
// ordering key, relayed by two relay processes at once, consumed by three
// instances with prefetch 50 behind an ordered inbox, under random nacks and
// the run's chaos. For every key the handler must see 1..n exactly once, in
// order.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"sort"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

const (
	keyedTopic    = "order.event"
	keyedConsumer = "e2e-order-history"
	// keyedConsumers instances of the keyed consumer, each with
	// keyedPrefetch deliveries unacked at once: a key's messages are spread
	// over them, and a nacked one comes back behind its successors.
	keyedConsumers = 3
	keyedPrefetch  = 50
	// keyedNackRate is the share of keyed deliveries the consumer fails at
	// random before the inbox runs.
	keyedNackRate = 0.2
	// keyedHeldFailureRate is the share of held messages whose handler
	// fails when their turn comes: they stay held, for the next delivery
	// of their key or the ApplyHeld ticker.
	keyedHeldFailureRate = 0.15
	// keyedRollbackRate is the share of keyed transactions rolled back
	// after the publish: the key's number goes back, and no gap may show.
	keyedRollbackRate = 0.1
	keyedPlacers      = 2
	keyedActive       = 4 // keys a placer has open at once
	applyHeldEvery    = 500 * time.Millisecond
)

var orderEvents = []string{"placed", "paid", "packed", "shipped", "delivered", "reviewed"}

type orderEvent struct {
	OrderID string `json:"order_id"`
	Event   string `json:"event"`
}

// keyedRun is the keyed part of one database's run.
type keyedRun struct {
	r        *run
	queue    string
	consumer *consumer

	insertEffect, lastSeq string
	heldFailures          atomic.Int64 // held messages whose handler was made to fail
	absorbed              int          // duplicates the inbox absorbed, once verify ran

	mu                                  sync.Mutex
	attempted, commitOK, rolled, failed int
	ambiguous, keys                     int
	errs                                map[string]int
	// committedIDs are the message ids of the keyed events whose commit
	// returned ok, by id their key: the client's own record of what must
	// exist, independent of the outbox table the rest of verify reads.
	committedIDs map[string]string
}

// keyedEffectsDDL has the table of the keyed handler's effects: one row per
// event applied, in the order applied (id), with the key's last applied
// sequence number the handler saw before it (prev_seq) and whether the
// message was held before it ran.
func keyedEffectsDDL(kind string) string {
	id := "id bigserial PRIMARY KEY"
	switch kind {
	case testdb.MySQL:
		id = "id bigint AUTO_INCREMENT PRIMARY KEY"
	case testdb.SQLite:
		id = "id INTEGER PRIMARY KEY AUTOINCREMENT"
	}
	return "CREATE TABLE keyed_effects (" + id + ", order_id varchar(64) NOT NULL, seq bigint NOT NULL, prev_seq bigint NOT NULL, " +
		"message_id varchar(64) NOT NULL, held integer NOT NULL, applied_us bigint NOT NULL)"
}

func startKeyed(t *testing.T, r *run, queue string) *keyedRun {
	r.db.MustExec(keyedEffectsDDL(r.sc.kind))
	k := &keyedRun{
		r: r, queue: queue,
		insertEffect: r.app.Rebind("INSERT INTO keyed_effects (order_id, seq, prev_seq, message_id, held, applied_us) VALUES (?, ?, ?, ?, ?, ?)"),
		lastSeq:      r.app.Rebind("SELECT COALESCE(MAX(seq), 0) FROM keyed_effects WHERE order_id = ?"),
	}
	inbox, err := outbox.NewInbox(r.app, outbox.InboxConfig{
		ConsumerName:        keyedConsumer,
		MarkOutboxProcessed: true,
		Ordered:             true,
	})
	if err != nil {
		t.Fatal(err)
	}
	k.consumer = startConsumer(t, consumerConfig{
		name: "keyed", instances: keyedConsumers, prefetch: keyedPrefetch, topic: keyedTopic, queue: queue, exchange: r.exchange,
		marshaler: outbox.AMQPMarshaler{}, inbox: inbox, handle: k.handle, nackRate: keyedNackRate,
		connName: func(i int) string { return r.connName("keyed-consumer-" + strconv.Itoa(i)) },
	})
	k.consumer.tickApplyHeld(applyHeldEvery)
	return k
}

var errHeldFailure = errors.New("e2e: a held message's handler failed")

// handle applies one event of an order: an effect row in the inbox's
// transaction, with the key's last applied event as the handler saw it.
func (k *keyedRun) handle(msg *message.Message) error {
	// A held message runs after its predecessor, in the predecessor's
	// delivery or from ApplyHeld: not the message delivered.
	d := deliveryOf(msg)
	held := d == nil || d.uuid != msg.UUID
	if !held {
		d.ran.Store(true)
	}
	tx, ok := outbox.TxFromContext(msg.Context())
	if !ok {
		return errors.New("no inbox transaction in the message context")
	}
	key := msg.Metadata.Get(outbox.HeaderAggregateID)
	seq, err := strconv.ParseInt(msg.Metadata.Get(outbox.HeaderSeq), 10, 64)
	if key == "" || err != nil {
		return fmt.Errorf("message %s: aggregateId %q, seq %q", msg.UUID, key, msg.Metadata.Get(outbox.HeaderSeq))
	}
	var ev orderEvent
	if err := json.Unmarshal(msg.Payload, &ev); err != nil || ev.OrderID != key {
		return fmt.Errorf("payload %q of key %q: %v", msg.Payload, key, err)
	}
	if held && rand.Float64() < keyedHeldFailureRate {
		k.heldFailures.Add(1)
		return errHeldFailure
	}
	ctx := msg.Context()
	var prev int64
	if err := tx.QueryRowContext(ctx, k.lastSeq, key).Scan(&prev); err != nil {
		return err
	}
	heldFlag := 0
	if held {
		heldFlag = 1
	}
	_, err = tx.ExecContext(ctx, k.insertEffect, key, seq, prev, msg.UUID, heldFlag, time.Now().UnixMicro())
	return err
}

// placer publishes the events of a few orders at a time, interleaved, at
// rate events per second, until ctx ends. An order's events go out in
// transactions of their own; an order that got all of its events makes
// room for a new one.
func (k *keyedRun) placer(ctx context.Context, rng *rand.Rand, p int, rate float64) {
	meanGap := time.Duration(float64(time.Second) / rate)
	type open struct {
		id         string
		next, last int // index into orderEvents
	}
	var active []*open
	n := 0
	for {
		for len(active) < keyedActive {
			n++
			active = append(active, &open{id: fmt.Sprintf("agg-%d-%04d", p, n), last: 2 + rng.IntN(len(orderEvents)-2)})
			k.mu.Lock()
			k.keys++
			k.mu.Unlock()
		}
		// A burst of the order's next events, back to back, each in a
		// transaction of its own (paid right after placed, say): they reach
		// the queue together and spread over the consumers, where a nack or
		// a restart puts one behind its successor.
		i := rng.IntN(len(active))
		o := active[i]
		burst := 1 + rng.IntN(3)
		for range burst {
			if k.place(o.id, orderEvents[o.next], rng.Float64() < keyedRollbackRate) {
				o.next++
				if o.next > o.last {
					active = append(active[:i], active[i+1:]...)
					break
				}
			}
		}
		if !sleepCtx(ctx, time.Duration(rng.Int64N(int64(2*time.Duration(burst)*meanGap)+1))) {
			return
		}
	}
}

// place publishes one event of an order, keyed by the order id, and
// commits (or rolls back on purpose); it says whether the commit returned
// ok.
func (k *keyedRun) place(orderID, event string, rollback bool) bool {
	ctx, cancel := context.WithTimeout(context.Background(), opTimeout)
	defer cancel()
	k.mu.Lock()
	k.attempted++
	k.mu.Unlock()
	fail := func(err error, ambiguous bool) bool {
		k.mu.Lock()
		defer k.mu.Unlock()
		if ambiguous {
			k.ambiguous++
		} else {
			k.failed++
		}
		if k.errs == nil {
			k.errs = map[string]int{}
		}
		k.errs[err.Error()]++
		return false
	}
	tx, err := k.r.app.BeginTxx(ctx, nil)
	if err != nil {
		return fail(fmt.Errorf("begin: %w", err), false)
	}
	defer func() { _ = tx.Rollback() }()
	pub, err := outbox.NewTxPublisher(tx, outbox.TxPublisherConfig{Exchange: k.r.exchange})
	if err != nil {
		k.r.t.Errorf("NewTxPublisher: %v", err)
		return fail(err, false)
	}
	payload, _ := json.Marshal(orderEvent{OrderID: orderID, Event: event})
	msgID := watermill.NewUUID()
	msg := message.NewMessage(msgID, payload)
	msg.Metadata.Set(outbox.MetadataAggregateID, orderID)
	msg.SetContext(ctx)
	if err := pub.Publish(keyedTopic, msg); err != nil {
		return fail(fmt.Errorf("publish: %w", err), false)
	}
	if rollback {
		_ = tx.Rollback()
		k.mu.Lock()
		k.rolled++
		k.mu.Unlock()
		return false
	}
	if err := tx.Commit(); err != nil {
		return fail(fmt.Errorf("commit: %w", err), true)
	}
	k.mu.Lock()
	k.commitOK++
	if k.committedIDs == nil {
		k.committedIDs = map[string]string{}
	}
	k.committedIDs[msgID] = orderID
	k.mu.Unlock()
	return true
}

// progress is what the catching-up wait watches: keyed outbox rows,
// effects, and messages held in the inbox.
func (k *keyedRun) progress() (rows, effects, held int64, err error) {
	db := k.r.db
	if err = db.Get(&rows, "SELECT COUNT(*) FROM acemq_outbox WHERE aggregate_id IS NOT NULL"); err != nil {
		return
	}
	if err = db.Get(&effects, "SELECT COUNT(*) FROM keyed_effects"); err != nil {
		return
	}
	err = db.Get(&held, "SELECT COUNT(*) FROM acemq_inbox_held")
	return
}

// verify checks, from the database, that the handler saw every key's
// events 1..n exactly once and in order, n being what the publisher
// numbered (itself checked gapless), and returns the table's lines.
func (k *keyedRun) verify() []string {
	t := k.r.t
	db := k.r.db
	var outboxRows []struct {
		Key       string `db:"aggregate_id"`
		Seq       int64  `db:"seq"`
		ID        string `db:"id"`
		Published int    `db:"published"`
		Processed int    `db:"processed"`
	}
	if err := db.Select(&outboxRows, "SELECT aggregate_id, seq, id, CASE WHEN published_at IS NULL THEN 0 ELSE 1 END AS published, "+
		"CASE WHEN processed_at IS NULL THEN 0 ELSE 1 END AS processed FROM acemq_outbox WHERE aggregate_id IS NOT NULL"); err != nil {
		t.Fatal(err)
	}
	var effectRows []struct {
		Key   string `db:"order_id"`
		Seq   int64  `db:"seq"`
		Prev  int64  `db:"prev_seq"`
		MsgID string `db:"message_id"`
		Held  int    `db:"held"`
	}
	if err := db.Select(&effectRows, "SELECT order_id, seq, prev_seq, message_id, held FROM keyed_effects ORDER BY id"); err != nil {
		t.Fatal(err)
	}
	var inboxKeys, heldLeft, seqRows int64
	if err := db.Get(&inboxKeys, db.Rebind("SELECT COUNT(*) FROM processed_messages WHERE consumer_name = ?"), keyedConsumer); err != nil {
		t.Fatal(err)
	}
	if err := db.Get(&heldLeft, "SELECT COUNT(*) FROM acemq_inbox_held"); err != nil {
		t.Fatal(err)
	}
	if err := db.Get(&seqRows, db.Rebind("SELECT COUNT(*) FROM acemq_inbox_sequences WHERE consumer_name = ?"), keyedConsumer); err != nil {
		t.Fatal(err)
	}

	// What the publisher numbered: per key 1..n, each once.
	published := map[string][]int64{}
	msgOf := map[string]string{} // key/seq → message id
	var gapless, unpublished, unprocessed []string
	for _, o := range outboxRows {
		published[o.Key] = append(published[o.Key], o.Seq)
		msgOf[o.Key+"/"+strconv.FormatInt(o.Seq, 10)] = o.ID
		if o.Published == 0 {
			unpublished = append(unpublished, o.ID)
		}
		if o.Processed == 0 {
			unprocessed = append(unprocessed, o.ID)
		}
	}
	for key, seqs := range published {
		sort.Slice(seqs, func(i, j int) bool { return seqs[i] < seqs[j] })
		for i, s := range seqs {
			if s != int64(i+1) {
				gapless = append(gapless, fmt.Sprintf("%s: %v", key, seqs))
				break
			}
		}
	}

	// What the client saw commit must be in the outbox and applied: the
	// checks above read the outbox table alone, and a keyed event that
	// committed without its row (a publisher that dropped it and took no
	// number) would leave every key gapless and every row applied.
	rowIDs := map[string]bool{}
	for _, o := range outboxRows {
		rowIDs[o.ID] = true
	}
	appliedIDs := map[string]bool{}
	for _, e := range effectRows {
		appliedIDs[e.MsgID] = true
	}
	var noRow, notApplied []string
	k.mu.Lock()
	for id, key := range k.committedIDs {
		if !rowIDs[id] {
			noRow = append(noRow, key+"/"+id)
		}
		if !appliedIDs[id] {
			notApplied = append(notApplied, key+"/"+id)
		}
	}
	committedByClient := len(k.committedIDs)
	k.mu.Unlock()

	// What the handler saw, in the order it committed.
	seen := map[string][]int64{}
	var outOfOrder, wrongMsg, phantom []string
	heldApplied := 0
	for _, e := range effectRows {
		seen[e.Key] = append(seen[e.Key], e.Seq)
		if e.Prev != e.Seq-1 {
			outOfOrder = append(outOfOrder, fmt.Sprintf("%s seq %d after %d", e.Key, e.Seq, e.Prev))
		}
		if id, ok := msgOf[e.Key+"/"+strconv.FormatInt(e.Seq, 10)]; !ok {
			phantom = append(phantom, fmt.Sprintf("%s/%d", e.Key, e.Seq))
		} else if id != e.MsgID {
			wrongMsg = append(wrongMsg, fmt.Sprintf("%s/%d", e.Key, e.Seq))
		}
		heldApplied += e.Held
	}
	var lost, dup, misordered []string
	events := 0
	for key, seqs := range published {
		n := int64(len(seqs))
		events += len(seqs)
		got := seen[key]
		count := map[int64]int{}
		for _, s := range got {
			count[s]++
		}
		for s := int64(1); s <= n; s++ {
			switch c := count[s]; {
			case c == 0:
				lost = append(lost, fmt.Sprintf("%s/%d", key, s))
			case c > 1:
				dup = append(dup, fmt.Sprintf("%s/%d×%d", key, s, c))
			}
		}
		for i, s := range got {
			if s != int64(i+1) {
				misordered = append(misordered, fmt.Sprintf("%s: %v", key, got))
				break
			}
		}
	}

	k.mu.Lock()
	attempted, commitOK, rolled, failed, ambiguous, opened := k.attempted, k.commitOK, k.rolled, k.failed, k.ambiguous, k.keys
	errs := k.errs
	k.mu.Unlock()
	c := k.consumer
	deliveries := c.deliveries.Load()
	k.absorbed = max(0, int(c.duplicates.Load())-heldApplied)
	lines := []string{
		fmt.Sprintf("  per-aggregate order: %d relays at once, %d consumers with prefetch %d behind an ordered inbox, %.0f%% random nacks",
			k.r.relay.slots(), keyedConsumers, keyedPrefetch, 100*keyedNackRate),
		row("keys", len(published), fmt.Sprintf("orders opened %d, each 3 to %d events in transactions of their own", opened, len(orderEvents))),
		row("keyed events committed", events, fmt.Sprintf("attempted %d: commit ok %d, rolled back on purpose %d, failed %d, ambiguous %d", attempted, commitOK, rolled, failed, ambiguous)),
		row("deliveries", int(deliveries), fmt.Sprintf("random nacks %d, nacked in all %d; handler runs %d", c.randomNacks.Load(), c.nacked.Load(), c.handlerRuns.Load())),
		row("held, then applied", heldApplied, fmt.Sprintf("held handlers failed on purpose %d, applied by the ApplyHeld ticker %d", k.heldFailures.Load(), c.heldApplied.Load())),
		row("duplicates absorbed", k.absorbed, "acked without running, less the holds"),
		row("events applied", len(effectRows), fmt.Sprintf("inbox keys %d, sequences %d, still held %d", inboxKeys, seqRows, heldLeft)),
		row("keys seen 1..n in order", len(published)-len(misordered), fmt.Sprintf("out of order %d, applied after a seq not its predecessor %d", len(misordered), len(outOfOrder))),
		row("lost", len(lost), "committed keyed events the handler never saw"),
		row("duplicated", len(dup), "keyed events the handler saw twice"),
	}
	for msg, n := range errs {
		t.Logf("a keyed event's transaction failed %d× with: %s", n, msg)
	}
	check := func(what string, ids []string) {
		t.Helper()
		if len(ids) > 0 {
			sort.Strings(ids)
			t.Errorf("keyed: %s: %d, e.g. %v", what, len(ids), ids[:min(len(ids), 5)])
		}
	}
	check("the publisher's numbers are not 1..n per key", gapless)
	check("LOST: keyed events whose commit returned ok, without their outbox row", noRow)
	check("LOST: keyed events whose commit returned ok, never applied", notApplied)
	if events < committedByClient || events > committedByClient+ambiguous {
		t.Errorf("keyed: %d keyed outbox rows, but %d commits returned ok and %d were ambiguous: want between %d and %d",
			events, committedByClient, ambiguous, committedByClient, committedByClient+ambiguous)
	}
	check("LOST: committed keyed events the handler never saw", lost)
	check("DUPLICATED: keyed events the handler saw more than once", dup)
	check("OUT OF ORDER: keys the handler saw in another order than 1..n", misordered)
	check("OUT OF ORDER: events applied after a seq not their predecessor", outOfOrder)
	check("effects of events never committed", phantom)
	check("effects carrying another message's id", wrongMsg)
	check("keyed outbox rows never published", unpublished)
	check("keyed outbox rows no consumer marked processed", unprocessed)
	if heldLeft != 0 {
		t.Errorf("keyed: %d messages still held in the inbox at the end", heldLeft)
	}
	if inboxKeys != int64(len(effectRows)) {
		t.Errorf("keyed: %d inbox keys for %d effects: the key and the effect must commit together", inboxKeys, len(effectRows))
	}
	// A run that reordered nothing proves nothing.
	if events < 60 || len(published) < 15 {
		t.Errorf("keyed: %d events of %d keys: too few to prove anything", events, len(published))
	}
	if heldApplied == 0 {
		// Chance decides whether a run reorders (3 consumers, nacks): most
		// do, some do not, more often since the relay claims each commit at
		// once. Holding itself is proved without chance by the ordered
		// inbox's own tests (inbox_ordered_test.go); a run that held
		// nothing still proves order, loss and duplicates.
		t.Log("keyed: no message was held in this run: nothing arrived out of order")
	}
	if rolled == 0 {
		t.Error("keyed: no keyed transaction rolled back: the gapless numbers proved nothing of a rollback")
	}
	return lines
}
