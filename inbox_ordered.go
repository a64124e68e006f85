package outbox

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"
	"weak"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"
	"go.opentelemetry.io/otel/trace"

	"github.com/acemq/watermill-outbox/internal/rowcodec"
	"github.com/acemq/watermill-outbox/internal/sqldialect"
)

// DefaultGapAfter is the default of InboxConfig.GapAfter.
const DefaultGapAfter = 5 * time.Minute

// maxAggregateID is the length of acemq_inbox_sequences.aggregate_id, as of
// acemq_outbox.aggregate_id.
const maxAggregateID = 255

// ErrInvalidSeq is returned (and the message nacked) for a keyed message,
// one with aggregateId metadata, whose seq metadata is missing or not a
// positive integer, under InboxConfig.Ordered. Running it would apply it in
// no known place in its key's order, and dropping it would lose it; a
// router's poison queue middleware can take it aside.
var ErrInvalidSeq = errors.New("outbox: inbox: keyed message without a valid seq")

// ErrInvalidKey is returned (and the message nacked) for a keyed message
// whose aggregateId the ordered inbox cannot hold: longer than 255 bytes,
// or, on PostgreSQL, whose text columns refuse them, not valid UTF-8 or
// holding a NUL. This library's publisher never sends such a key; another
// language's, on an outbox in MySQL or SQLite, can. Running the message
// would apply it out of its key's order, and dropping it would lose it; a
// router's poison queue middleware can take it aside.
var ErrInvalidKey = errors.New("outbox: inbox: keyed message whose aggregateId the inbox cannot hold")

// ErrNoHeld is returned by SkipGap for a key with no held message: there is
// no gap to skip.
var ErrNoHeld = errors.New("outbox: inbox: no held message for this key")

// ErrGapChanged is returned by SkipGap and SkipHeld, which then skip
// nothing, when the gap or the message they name is not the key's now:
// the key applied or held a number since it was looked at, or the numbers
// given were never its gap (a --from that is not last applied + 1). Its
// text says where the key is. Look again (Gaps, outboxctl held).
var ErrGapChanged = errors.New("outbox: inbox: the key is not as the skip expects")

// ErrConsumerShared is returned (and the message nacked, before any
// statement: nothing is run, held or recorded) for a keyed message of an
// Ordered inbox whose ConsumerName is used in this process in a way that
// mixes up its keys:
//
//   - by two handlers of one Inbox (two functions wrapped by its
//     Middleware) for deliveries outside a router, which name no handler:
//     they share the consumer's held messages then, so a message held for
//     one would run in the other, and a copy both get would be taken for a
//     duplicate by the second and acked without running. The handler of
//     the consumer's first such delivery keeps the name. One function
//     wrapped again (per worker, at a consume loop's reconnect) is the same
//     handler; two closures of one function literal are too, and are not
//     told apart.
//   - by two Inboxes over one *sql.DB with different InboxTables: the
//     ordered state is keyed by consumer name alone, and the second one's
//     messages would be taken for duplicates of numbers the first applied.
//     The InboxTable of the consumer's first keyed delivery keeps it.
//
// Give the other handler or Inbox a ConsumerName of its own, or run the
// handlers under a router, whose handler names tell them apart. Not
// caught: two Inboxes over one *sql.DB with one InboxTable, each wrapping
// a handler outside a router (a new Inbox is also how a restart in the
// process looks), and Inboxes over two pools of one database.
var ErrConsumerShared = errors.New("outbox: inbox: ordered consumer name shared by two handlers without a router handler name, or by two inbox tables")

// orderedRoute is what the inbox needs to apply a held message outside its
// own delivery (after its predecessor's, ApplyHeld, SkipGap): the handler
// it was delivered to, behind the middleware, and a router context holding
// that handler's name and topics.
type orderedRoute struct {
	h   message.HandlerFunc
	ctx context.Context
}

// gone reports whether the route's router has closed (its handler's run,
// as Plugin's decorator put it in the delivery's context, has ended): its
// handler is that router's chain, and a held message run in it would run
// in a router that is gone. Never without the plugin.
func (r orderedRoute) gone() bool {
	run, _ := r.ctx.Value(routerRunKey{}).(context.Context)
	return run != nil && run.Err() != nil
}

// routeKey names a route: the consumer and the router's handler name. Two
// handlers may share a consumer (InboxConfig.ConsumerName), and so a key's
// sequence, when a key's events come on several topics: each held message
// is applied by the handler it was delivered to.
type routeKey struct{ consumer, handler string }

// heldHandlerKey is the metadata key under which a held message keeps the
// name of the handler it was delivered to, in acemq_inbox_held.metadata;
// it is taken out before the handler sees the message. A row held by an
// earlier version has none, and goes to the consumer's first handler seen.
// A message that arrives with a key of that name (or of that name and
// tildes) keeps it: see heldMetadata.
const heldHandlerKey = "x-acemq-inbox-handler"

// heldTopicKey is the metadata key under which a held message keeps the
// topic it was delivered from (the router's subscribe topic), taken out
// as heldHandlerKey is: where its handler is gone (renamed, or one of
// several workers of a topic named apart, scaled down), a handler of the
// same consumer and topic runs it. A consumer dedupes a message once, so
// two handlers of one consumer and one topic are workers of one handler.
const heldTopicKey = "x-acemq-inbox-topic"

// heldIDKey is the metadata key under which a held message whose row keeps
// its id under its digest (an id the key column cannot hold as it is: see
// sqldialect.InboxKey) keeps the id itself, for its handler, which is
// given it as the message's UUID, as every message is given the id it is
// deduped on. Taken out, and a message's own key of that name kept, as
// heldHandlerKey is.
const heldIDKey = "x-acemq-inbox-id"

// heldErrorKey is the metadata key under which a held message whose
// handler failed when its turn came keeps that failure, written after
// each failed apply (noteHeldFailure), for outboxctl held and skip-held:
// held showed such a key waiting for "nothing: next held" with no word
// of why (a user review). Taken out before the handler sees the message,
// and a message's own key of that name kept, as heldHandlerKey is.
const heldErrorKey = sqldialect.HeldErrorKey

// heldMetadata is md as a held row keeps it: heldHandlerKey set to handler,
// heldTopicKey to topic (if any), heldIDKey to id where the row keeps a
// digest of it, and the message's
// own keys of those names followed by none or more tildes given one tilde
// more, which heldRelease takes off again. Before, a message that arrived
// with the key lost its value to the handler's name.
func heldMetadata(md message.Metadata, handler, topic, id string) message.Metadata {
	kept := make(message.Metadata, len(md)+3)
	for k, v := range md {
		if isHeldKey(k) {
			k += "~"
		}
		kept[k] = v
	}
	kept[heldHandlerKey] = handler
	if topic != "" {
		kept[heldTopicKey] = topic
	}
	if sqldialect.InboxKey(id) != id {
		kept[heldIDKey] = id
	}
	return kept
}

// heldRelease is the metadata a held row kept (see heldMetadata) as the
// message came, the name of the handler it was held for (byName: whether
// the row names one; an earlier version's may not) and the topic it came
// from ("" if the row names none), and the id it was deduped on, stored
// (the row's message_id, a digest where the row keeps one).
func heldRelease(kept message.Metadata, stored string) (md message.Metadata, handler string, byName bool, topic, id string) {
	id = stored
	if kept == nil {
		return nil, "", false, "", id
	}
	md = make(message.Metadata, len(kept))
	for k, v := range kept {
		switch {
		case k == heldHandlerKey:
			handler, byName = v, true
		case k == heldTopicKey:
			topic = v
		case k == heldIDKey:
			if sqldialect.InboxKey(v) == stored {
				id = v
			}
		case k == heldErrorKey:
		case isHeldKey(k):
			md[k[:len(k)-1]] = v
		default:
			md[k] = v
		}
	}
	return md, handler, byName, topic, id
}

// isHeldKey: k is heldHandlerKey, heldTopicKey, heldIDKey or heldErrorKey
// followed by none or more tildes.
func isHeldKey(k string) bool {
	for _, held := range []string{heldHandlerKey, heldTopicKey, heldIDKey, heldErrorKey} {
		if rest, ok := strings.CutPrefix(k, held); ok && strings.Trim(rest, "~") == "" {
			return true
		}
	}
	return false
}

// orderedState is the ordered inbox's part of an Inbox.
type orderedState struct {
	q      *sqldialect.OrderedInbox
	mu     sync.Mutex
	routes map[routeKey]orderedRoute
	first  map[string]routeKey // by consumer, its first handler seen
	// bare holds, by consumer, the code of the handler that had the
	// consumer's first keyed delivery without a router handler name: the
	// route of "" is that handler's alone.
	bare map[string]handlerCode
	// pool and table: what claimTable takes a consumer for.
	pool  *sql.DB
	table string
	// told holds the routes whose held messages were found waiting for
	// their handler, logged once each (see applyNext).
	told map[routeKey]bool
	// scans holds, by consumer, the turn of its wakes (see scanTurn).
	scans map[string]chan struct{}
	// nameless holds the consumers that held a message without a router
	// handler name under a plugged inbox, logged once each.
	nameless map[string]bool
	// failed has a value when a held message's handler failed since the
	// plugin's ticks last looked: they try again sooner (see
	// heldSubscriber.tick).
	failed chan struct{}
	// failedLog: when each held message that failed was last logged at
	// ERROR (see logHeldFailure).
	failedLog logEvery
	// numberTaken: when each key last logged a message acked for a number
	// another id took (see logNumberTaken).
	numberTaken logEvery
	// unplugged: a keyed delivery came from a router without the inbox's
	// Plugin, logged once (see sayUnplugged).
	unplugged sync.Once
}

// sayUnplugged warns, once an inbox, of a keyed delivery from a router
// that does not run the inbox's Plugin: a key whose last message failed
// when its turn came waits for good unless the service calls ApplyHeld
// itself (an API review: four calls wire an inbox, and the one left out
// said nothing).
func (in *Inbox) sayUnplugged(msg *message.Message) {
	if in.plugged.Load() || message.HandlerNameFromCtx(msg.Context()) == "" {
		return
	}
	in.ordered.unplugged.Do(func() {
		in.log.Info("Ordered inbox under a router that does not run its Plugin (router.AddPlugin(inbox.Plugin())): a held message whose handler fails "+
			"when its turn comes is tried again only at its key's next delivery, for good for a key's last one, unless the service calls ApplyHeld itself; "+
			"and held messages wait for their handler's first delivery after a restart", watermill.LogFields{"handler": message.HandlerNameFromCtx(msg.Context())})
	})
}

// logEvery says of a key whether it is due a log line, once a minute at
// most: its first time, and a minute after its last. It forgets keys not
// logged for a minute once it holds many.
type logEvery struct {
	mu   sync.Mutex
	last map[string]time.Time
}

// logEveryPeriod is how often logEvery lets a key's line through.
const logEveryPeriod = time.Minute

func (l *logEvery) due(key string, now time.Time) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if at, ok := l.last[key]; ok && now.Sub(at) < logEveryPeriod {
		return false
	}
	if l.last == nil {
		l.last = make(map[string]time.Time)
	}
	if len(l.last) >= 1024 {
		for k, at := range l.last {
			if now.Sub(at) >= logEveryPeriod {
				delete(l.last, k)
			}
		}
	}
	l.last[key] = now
	return true
}

func newOrderedState(d sqldialect.Dialect, pool *sql.DB, table string) *orderedState {
	return &orderedState{q: sqldialect.NewOrderedInbox(d), routes: map[routeKey]orderedRoute{}, first: map[string]routeKey{}, bare: map[string]handlerCode{},
		pool: pool, table: table, failed: make(chan struct{}, 1)}
}

// consumerTables are the InboxTables of the process's ordered consumers,
// by pool: the ordered state is the database's, keyed by consumer name
// alone, so Inboxes over one pool share a consumer's state whatever their
// InboxTable.
// An Inbox asks here at the first keyed delivery of each consumer; its own
// map answers after that.
var consumerTables struct {
	mu sync.Mutex
	m  map[poolConsumer]string
}

// poolConsumer holds its pool weakly: the entry goes with the pool it is
// on, and keeps no closed pool in memory.
type poolConsumer struct {
	pool     weak.Pointer[sql.DB]
	consumer string
}

// claimTable claims consumer, on pool, for the Inbox of table, or fails
// with ErrConsumerShared if an Inbox of another InboxTable has it.
func claimTable(pool *sql.DB, table, consumer string) error {
	k := poolConsumer{weak.Make(pool), consumer}
	consumerTables.mu.Lock()
	defer consumerTables.mu.Unlock()
	had, ok := consumerTables.m[k]
	if !ok {
		if consumerTables.m == nil {
			consumerTables.m = map[poolConsumer]string{}
		}
		consumerTables.m[k] = table
		runtime.AddCleanup(pool, func(k poolConsumer) {
			consumerTables.mu.Lock()
			defer consumerTables.mu.Unlock()
			delete(consumerTables.m, k)
		}, k)
		return nil
	}
	if had != table {
		return fmt.Errorf("%w: consumer %q is ordered by another Inbox over this *sql.DB, of InboxTable %q, not %q: the ordered state is keyed by consumer name alone, "+
			"and this one's messages would be taken for duplicates of the other's; give each its own ConsumerName", ErrConsumerShared, consumer, had, table)
	}
	return nil
}

// voidHeader is how AMQPMarshaler renders a void header in metadata.
const voidHeader = "null"

// orderKey reads a message's ordering key and sequence number: keyed is
// false for a message without aggregateId metadata, which takes the
// unordered path, and for one whose aggregateId and seq are both void: the
// reference relay sends them on every row, void for an unkeyed one, and
// AMQPMarshaler renders void as "null". textKeys: the database holds a
// key as text (sqldialect.Dialect.TextKeys).
func orderKey(msg *message.Message, textKeys bool) (key string, seq int64, keyed bool, err error) {
	key = msg.Metadata.Get(HeaderAggregateID)
	if key == "" {
		return "", 0, false, nil
	}
	if text := msg.Metadata.Get(HeaderSeq); key == voidHeader && (text == "" || text == voidHeader) {
		return "", 0, false, nil
	}
	if len(key) > maxAggregateID {
		return key, 0, true, fmt.Errorf("%w: message %s, aggregateId %.80q… is %d bytes, over %d", ErrInvalidKey, idText(dedupeKey(msg)), key, len(key), maxAggregateID)
	}
	if textKeys {
		if err := checkName(key); err != nil {
			return key, 0, true, fmt.Errorf("%w: message %s, aggregateId %.80q %v, which PostgreSQL's text columns refuse", ErrInvalidKey, idText(dedupeKey(msg)), key, err)
		}
	}
	text, hasSeq := msg.Metadata[HeaderSeq]
	if !hasSeq {
		return key, 0, true, fmt.Errorf("%w: message %s, aggregateId %.80q, and no seq: not numbered by an ordering relay (application metadata named aggregateId? name it otherwise, or publish with MetadataAggregateID)", ErrInvalidSeq, idText(dedupeKey(msg)), key)
	}
	seq, perr := strconv.ParseInt(text, 10, 64)
	// The largest int64 has no successor: applied, it would make every
	// later last_seq + 1 of its key overflow.
	if perr != nil || seq < 1 || seq == math.MaxInt64 {
		return key, 0, true, fmt.Errorf("%w: message %s, aggregateId %.80q, seq %.40q; want a positive integer below 2^63-1", ErrInvalidSeq, idText(dedupeKey(msg)), key, text)
	}
	return key, seq, true, nil
}

// remember keeps h (its code: code) as the route of consumer's held
// messages delivered to its router handler, or refuses with
// ErrConsumerShared a handler without a router handler name whose code is
// not that of the consumer's first such handler (see orderedState.bare
// and handlerCode), and an Inbox
// whose InboxTable is not the consumer's (see claimTable). A map lookup on
// the common paths, claimTable's the first time only; the refusal comes
// before any statement.
func (in *Inbox) remember(consumer string, h message.HandlerFunc, code handlerCode, ctx context.Context) error {
	o := in.ordered
	k := routeKey{consumer, message.HandlerNameFromCtx(ctx)}
	o.mu.Lock()
	defer o.mu.Unlock()
	_, seen := o.first[consumer]
	if !seen {
		if err := claimTable(o.pool, o.table, consumer); err != nil {
			return err
		}
	}
	if k.handler == "" {
		if owner, ok := o.bare[consumer]; !ok {
			o.bare[consumer] = code
		} else if owner != code {
			return fmt.Errorf("%w: consumer %q had keyed deliveries outside a router from another handler function of this Inbox; "+
				"a message held for one would run in the other: give each handler its own ConsumerName, or run them under a router", ErrConsumerShared, consumer)
		}
	}
	// Without its cancellation: the route outlives the delivery. It keeps
	// the router's handler name and topics, which a held message's handler
	// and its returned messages need. The latest delivery's: a router
	// closed and another built (a restart in the process, or two routers
	// with one handler name) must not leave held messages to the handler
	// of a router that is gone.
	o.routes[k] = orderedRoute{h: h, ctx: context.WithoutCancel(ctx)}
	if !seen {
		o.first[consumer] = k
	}
	return nil
}

// routedConsumers lists, sorted, the consumers with a handler this inbox
// has seen.
func (in *Inbox) routedConsumers() []string {
	o := in.ordered
	o.mu.Lock()
	defer o.mu.Unlock()
	names := make([]string, 0, len(o.first))
	for name := range o.first {
		names = append(names, name)
	}
	sort.Strings(names)
	return names
}

// firstNameless reports whether this is consumer's first message held
// without a router handler name on an inbox a router runs (see
// processOrdered).
func (o *orderedState) firstNameless(consumer string) bool {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.nameless[consumer] {
		return false
	}
	if o.nameless == nil {
		o.nameless = map[string]bool{}
	}
	o.nameless[consumer] = true
	return true
}

// firstWait reports whether this is the first time in this process that a
// held message of consumer was found waiting for handler.
func (in *Inbox) firstWait(consumer, handler string) bool {
	o := in.ordered
	o.mu.Lock()
	defer o.mu.Unlock()
	k := routeKey{consumer: consumer, handler: handler}
	if o.told[k] {
		return false
	}
	if o.told == nil {
		o.told = make(map[routeKey]bool)
	}
	o.told[k] = true
	return true
}

// route is the route of a held message of consumer delivered to handler
// from topic; ok false when this inbox has not seen that handler (yet),
// nor another of consumer's from topic (see heldTopicKey; the one first
// by name, where several are). byName false: the row names no handler
// (held by an earlier version), and the consumer's first handler seen
// takes it. A route whose router has closed is none (see gone): the
// message waits for the handler of a router that runs.
func (in *Inbox) route(consumer, handler string, byName bool, topic string) (r orderedRoute, ok bool) {
	o := in.ordered
	o.mu.Lock()
	defer o.mu.Unlock()
	k := routeKey{consumer, handler}
	if !byName {
		if k, ok = o.first[consumer]; !ok {
			return orderedRoute{}, false
		}
	}
	if r, ok = o.routes[k]; ok && r.gone() {
		r, ok = orderedRoute{}, false
	}
	if ok || topic == "" {
		return r, ok
	}
	sibling := ""
	for rk, rt := range o.routes {
		if rk.consumer == consumer && rk.handler != "" && message.SubscribeTopicFromCtx(rt.ctx) == topic && !rt.gone() && (!ok || rk.handler < sibling) {
			r, ok, sibling = rt, true, rk.handler
		}
	}
	return r, ok
}

// lockSequence writes the key's row if it is missing and locks it (on
// SQLite the write takes the database's write lock): from here to the end
// of tx no other delivery of the key runs. It returns the key's last
// applied and its count of held messages.
func (in *Inbox) lockSequence(ctx context.Context, tx *sqlx.Tx, consumer, key string) (last, held int64, err error) {
	ensure := in.ordered.q.EnsureSequence(consumer, key)
	if _, err := in.exec(ctx, tx, ensure); err != nil {
		return 0, 0, fmt.Errorf("outbox: inbox: sequence of %q for %s: %w", key, consumer, err)
	}
	lock := in.ordered.q.LockSequence(consumer, key)
	if err := in.queryRow(ctx, tx, lock).Scan(&last, &held); err != nil {
		return 0, 0, fmt.Errorf("outbox: inbox: lock sequence of %q for %s: %w", key, consumer, err)
	}
	return last, held, nil
}

// processOrdered applies a keyed message in its key's order: a sequence
// number applied already is a duplicate; the next one runs the handler and
// advances the key in one transaction, then applies the messages held
// behind it; a later one is held in the database and acked.
func (in *Inbox) processOrdered(ctx context.Context, h message.HandlerFunc, code handlerCode, msg *message.Message, consumer, id, key string, seq int64) (inboxOutcome, error) {
	if err := in.remember(consumer, h, code, msg.Context()); err != nil {
		return inboxFailed, err
	}
	in.sayUnplugged(msg)
	// The common case, the key's next message with nothing held, costs the
	// statements of the plain inbox's key, or one more (see
	// sqldialect.OrderedInbox.Apply).
	now := time.Now()
	m := sqldialect.InOrder{Consumer: consumer, Key: key, Seq: seq, MessageID: id, At: now}
	steps := in.ordered.q.Apply(in.q, m)
	tx, err := in.db.BeginTxx(ctx, &sql.TxOptions{Isolation: in.cfg.Isolation})
	if err != nil {
		return inboxFailed, fmt.Errorf("outbox: inbox: begin: %w", err)
	}
	committed := false
	defer func() {
		if !committed {
			_ = tx.Rollback()
		}
	}()
	applied, err := in.applyInOrder(ctx, tx, m, steps)
	if err != nil {
		return inboxFailed, err
	}
	if applied {
		if err := in.markApplied(ctx, tx, id, now); err != nil {
			return inboxFailed, err
		}
		if err := in.runInTx(ctx, tx, h, msg, consumer, id); err != nil {
			return inboxFailed, err
		}
		if err := tx.Commit(); err != nil {
			return inboxFailed, in.handledCommitErr(ctx, err, id, consumer)
		}
		committed = true
		return inboxProcessed, nil
	}
	last, heldBefore, err := in.lockSequence(ctx, tx, consumer, key)
	if err != nil {
		return inboxFailed, err
	}
	fields := watermill.LogFields{"message_uuid": idText(id), "consumer": consumer, "aggregate_id": key, "seq": seq, "last_applied": last}
	switch {
	case seq <= last:
		// Committed, not rolled back: the in-order statements move the key
		// past a message that is its next but whose id was processed
		// already (before the consumer was ordered, or under another seq).
		// That id must be this message's byte for byte (see sameKey): a
		// processed_messages comparing without case took "ORDER-1" for
		// "order-1", and the in-order statements moved the key past a
		// message that never ran.
		var found bool
		if seq == last {
			if found, err = in.sameKey(ctx, tx, consumer, id); err != nil {
				return inboxFailed, err
			}
		} else if found, err = in.keyFound(ctx, tx, consumer, id); err != nil {
			return inboxFailed, err
		}
		ready, err := in.nextHeld(ctx, tx, consumer, key, last, heldBefore)
		if err != nil {
			return inboxFailed, err
		}
		if err := tx.Commit(); err != nil {
			return inboxFailed, fmt.Errorf("outbox: inbox: commit duplicate %s for %s: %w", idText(id), consumer, err)
		}
		committed = true
		// The redelivery of a message whose commit came before a crash, and
		// so before the apply of what was held behind it, applies that.
		in.drainReady(msg, ready, consumer, key, fields)
		if !found {
			in.logNumberTaken(fields)
		}
		in.log.Debug("Message of a sequence number applied already acked without running the handler", fields)
		return inboxDuplicate, nil
	case seq > last+1:
		if in.plugged.Load() && message.HandlerNameFromCtx(msg.Context()) == "" && in.ordered.firstNameless(consumer) {
			// Held so, it runs in the handler of "" (see remember): under a
			// router, whichever handler's delivery came through such a
			// middleware last (a review's ledger, behind a middleware that
			// handed on msg.Copy(), applied 251 of 300 order.paid events in
			// its order.placed handler). A copy the inbox could tell has its
			// name back (restoreDelivery); this one it could not (its
			// payload rebuilt, or its delivery acked before the inbox).
			// Said once a consumer: refused, the README's chain set it aside
			// on the poison topic, and a message handed to the inbox outside
			// the router is held rightly so.
			in.log.Error("Outbox inbox: a keyed message held without a router handler name, on an inbox a router runs: "+
				"if a middleware before the inbox hands on a copy without the delivery's context (msg.Copy()) and a payload of its own, its held messages may run in another handler of the consumer; "+
				"hand on msg.CopyWithContext()", nil, fields)
		}
		fresh, err := in.hold(ctx, tx, consumer, key, seq, id, msg)
		if err != nil {
			return inboxFailed, err
		}
		// Held, the message is in the consumer's database for good, and
		// acked: Republish has nothing to send again, and a copy it sent
		// would only be held again, at every boot while the key waits. So
		// its record is processed with the hold, also at a copy (held
		// before MarkOutboxProcessed was on). Its apply marks nothing more.
		if err := in.markProcessed(ctx, tx, id, now); err != nil {
			return inboxFailed, err
		}
		ready, err := in.nextHeld(ctx, tx, consumer, key, last, heldBefore)
		if err != nil {
			return inboxFailed, err
		}
		if err := tx.Commit(); err != nil {
			return inboxFailed, fmt.Errorf("outbox: inbox: commit held message %s for %s: %w", idText(id), consumer, err)
		}
		committed = true
		in.drainReady(msg, ready, consumer, key, fields)
		if !fresh {
			in.log.Debug("Message held already acked again", fields)
			return inboxHeldAgain, nil
		}
		in.log.Debug("Message ahead of its predecessor held", fields)
		return inboxHeld, nil
	}

	// seq is the key's next, and the key holds messages. Checked before the
	// handler runs, so that a held copy of this very message (held before
	// its predecessor came) is deleted with the commit, and the messages
	// held behind it are applied.
	var held int64
	count := in.ordered.q.HeldUpTo(consumer, key, seq+1)
	if err := in.queryRow(ctx, tx, count).Scan(&held); err != nil {
		return inboxFailed, fmt.Errorf("outbox: inbox: held messages of %q for %s: %w", key, consumer, err)
	}
	outcome, err := in.applyInTx(ctx, tx, h, msg, consumer, id, key, seq, held > 0)
	if err != nil {
		return inboxFailed, err
	}
	if err := tx.Commit(); err != nil {
		return inboxFailed, in.handledCommitErr(ctx, err, id, consumer)
	}
	committed = true
	// Each held message in a transaction of its own: its handler failing
	// leaves it held and this message applied and acked.
	in.drainReady(msg, held > 0, consumer, key, fields)
	return outcome, nil
}

// keyFound reads whether consumer's key of id is in the inbox table, byte
// for byte: a table another library created comparing without case finds
// the key of "go-1" for "GO-1", another message.
func (in *Inbox) keyFound(ctx context.Context, tx *sqlx.Tx, consumer, id string) (bool, error) {
	var gotConsumer, gotKey string
	switch err := in.queryRow(ctx, tx, in.q.Key(consumer, id)).Scan(&gotConsumer, &gotKey); {
	case errors.Is(err, sql.ErrNoRows):
		return false, nil
	case err != nil:
		return false, fmt.Errorf("outbox: inbox: read the key of %s for %s: %w", idText(id), consumer, err)
	}
	return keyIs(gotConsumer, gotKey, consumer, id), nil
}

// logNumberTaken says, once a minute a key, that a message was acked as a
// duplicate by its number though its id was never processed here:
// another message had its number. A user review's foreign producer keyed
// rows in their headers, which the publisher's numbering does not see: a
// message published from Go then got a number the key had applied, and
// was acked without running, with no word (and outboxctl show read
// "processed"). Or an operator skipped its number (skip-gap, skip-held),
// or processed_messages was purged since it was processed.
func (in *Inbox) logNumberTaken(fields watermill.LogFields) {
	if !in.ordered.numberTaken.due(fmt.Sprint(fields["consumer"], "\x00", fields["aggregate_id"]), time.Now()) {
		return
	}
	in.log.Error("Ordered inbox: a message whose number the key applied already, under another id, acked without running: two writers number the key "+
		"(a producer keying rows in their headers beside one numbering aggregate_id and seq from acemq_outbox_sequences?), or its number was skipped "+
		"(outboxctl skip-gap, skip-held), or processed_messages was purged since; logged once a minute a key", nil, fields)
}

// nextHeld reports whether the key's next message (last+1) is held
// already: its handler failed when its turn came, had not run here yet, or
// the process stopped between its predecessor's commit and its apply. Any
// delivery of the key then retries it (drainReady), whatever its own
// number. Only a key that held something before this delivery can hold
// its next.
func (in *Inbox) nextHeld(ctx context.Context, tx *sqlx.Tx, consumer, key string, last, heldBefore int64) (bool, error) {
	if heldBefore == 0 {
		return false, nil
	}
	var ready int64
	count := in.ordered.q.HeldUpTo(consumer, key, last+1)
	if err := in.queryRow(ctx, tx, count).Scan(&ready); err != nil {
		return false, fmt.Errorf("outbox: inbox: held messages of %q for %s: %w", key, consumer, err)
	}
	return ready > 0, nil
}

// drainReady applies, after the delivery's commit, what is held ready
// behind it, under the delivery's context, for its router values. A failure
// is logged, not returned: the delivery is committed, and a nack would only
// redeliver a duplicate. The delivery's context ending (watermill-amqp ends
// it as the router closes) ends the drain between two held messages, not
// within one (see finishing): the rest run at the next start or delivery.
func (in *Inbox) drainReady(msg *message.Message, ready bool, consumer, key string, fields watermill.LogFields) {
	if !ready {
		return
	}
	handler := message.HandlerNameFromCtx(msg.Context())
	work, cancel := finishing(msg.Context())
	defer cancel()
	_, err := in.drain(work, msg.Context(), &handler, consumer, key)
	switch {
	case err == nil:
	case msg.Context().Err() != nil:
		in.log.Debug("Held messages left for the next start or delivery: the delivery that released them ended", fields)
	default:
		in.logHeldFailure(err, fields)
	}
}

// logHeldFailure logs err, a drain's failure, under the fields of the held
// message that failed where it names one (heldFailure), the delivery that
// released it as released_by. A held message whose handler keeps failing
// fails again at each delivery of its key: logged at ERROR once a minute
// (a user review: 1,871 of 2,446 lines of a consumer's log), and at DEBUG
// between.
func (in *Inbox) logHeldFailure(err error, fields watermill.LogFields) {
	var hf *heldFailure
	if !errors.As(err, &hf) {
		in.log.Error("Held message could not be applied; it stays held until the next delivery of its key or ApplyHeld", err, fields)
		return
	}
	failed := watermill.LogFields{"message_uuid": idText(hf.id), "consumer": hf.consumer, "aggregate_id": hf.key, "seq": hf.seq}
	if by, ok := fields["message_uuid"]; ok {
		failed["released_by"] = by
	}
	if !in.ordered.failedLog.due(hf.consumer+"\x00"+hf.key+"\x00"+strconv.FormatInt(hf.seq, 10), time.Now()) {
		in.log.Debug("Held message could not be applied again", failed.Add(watermill.LogFields{"error": err.Error()}))
		return
	}
	in.log.Error("Held message could not be applied; it stays held, its key's later messages behind it, and is tried again at each delivery of its key and ApplyHeld "+
		"(outboxctl held shows the key waiting for nothing; skip-held gives it up; logged once a minute while it fails)", err, failed)
}

// applyInOrder runs the in-order statements of m in tx, and reports whether
// they moved the key to m.Seq and recorded m's dedupe key.
func (in *Inbox) applyInOrder(ctx context.Context, tx *sqlx.Tx, m sqldialect.InOrder, steps []sqldialect.ApplyStep) (bool, error) {
	for _, step := range steps {
		res, err := in.exec(ctx, tx, step.Query)
		if err != nil {
			return false, fmt.Errorf("outbox: inbox: apply %s (%q seq %d) for %s: %w", idText(m.MessageID), m.Key, m.Seq, m.Consumer, err)
		}
		done, err := step.Done(res)
		if err != nil {
			return false, fmt.Errorf("outbox: inbox: apply %s (%q seq %d) for %s: %w", idText(m.MessageID), m.Key, m.Seq, m.Consumer, err)
		}
		if !done {
			return false, nil
		}
	}
	return true, nil
}

// applyInTx applies the key's next message, seq, in tx, on the path that
// reads the key's row first: the dedupe key, the handler, the messages it
// returns, the key's new last applied and held count, with clearHeld after
// the held messages up to seq are deleted.
func (in *Inbox) applyInTx(ctx context.Context, tx *sqlx.Tx, h message.HandlerFunc, msg *message.Message, consumer, id, key string, seq int64, clearHeld bool) (inboxOutcome, error) {
	outcome := inboxProcessed
	fresh, err := in.record(ctx, tx, consumer, id)
	if err != nil {
		return inboxFailed, err
	}
	if fresh {
		if err := in.runInTx(ctx, tx, h, msg, consumer, id); err != nil {
			return inboxFailed, err
		}
		// Statements follow the handler here (the held rows' delete, the
		// key's advance). On SQLite a rollback under the handler (a write
		// its context interrupted) leaves them each committed on its own:
		// the key moved past a message whose effect was rolled back, and a
		// held row, the message's only copy, deleted. MySQL's runInTx
		// checked already.
		if !in.dialect.sql().SilentRollbacks() {
			if err := in.stillInTx(ctx, tx, consumer, id, true); err != nil {
				return inboxFailed, endedUnderHandler(ctx, err)
			}
		}
	} else {
		// Its id was processed, before the consumer was ordered or under
		// another seq: its effect happened, and the key moves on past it.
		outcome = inboxDuplicate
	}
	// After the handler: a transaction it ended fails these statements
	// with sql.ErrTxDone, named as the handler's doing (endedUnderHandler).
	var removed int64
	if clearHeld {
		del := in.ordered.q.DeleteHeldUpTo(consumer, key, seq)
		res, err := in.exec(ctx, tx, del)
		if err == nil {
			removed, err = res.RowsAffected()
		}
		if err != nil {
			return inboxFailed, endedUnderHandler(ctx, fmt.Errorf("outbox: inbox: delete held messages of %q up to %d for %s: %w", key, seq, consumer, err))
		}
	}
	set := in.ordered.q.Advance(consumer, key, seq, removed)
	if _, err := in.exec(ctx, tx, set); err != nil {
		return inboxFailed, endedUnderHandler(ctx, fmt.Errorf("outbox: inbox: advance %q to %d for %s: %w", key, seq, consumer, err))
	}
	return outcome, nil
}

// runInTx runs h for msg with tx in its context, and writes the messages it
// returns into the outbox through tx. key is the message's dedupe key for
// consumer, recorded in tx before.
func (in *Inbox) runInTx(ctx context.Context, tx *sqlx.Tx, h message.HandlerFunc, msg *message.Message, consumer, key string) error {
	orig := msg.Context()
	hctx := context.WithValue(ctx, txKey{}, tx)
	msg.SetContext(hctx)
	out, err := in.runRecovering(h, msg)
	msg.SetContext(orig)
	if err != nil {
		return err
	}
	if err := in.stillInTx(ctx, tx, consumer, key, len(out) > 0); err != nil {
		return endedUnderHandler(ctx, err)
	}
	return endedUnderHandler(ctx, in.writeReturned(hctx, stdTx{tx.Tx}, out))
}

// endedUnderHandler names ErrHandlerTxDone in err where database/sql says
// the handler's transaction is over (sql.ErrTxDone): a bare "transaction
// has already been committed or rolled back" said nothing of why. Where
// ctx, the transaction's, has ended (database/sql rolled it back then), it
// wraps ctx's cause too: a Timeout middleware's delivery matches
// context.DeadlineExceeded (an API review).
func endedUnderHandler(ctx context.Context, err error) error {
	// A context that ended before database/sql rolled the transaction back
	// fails the statement with the context's error rather than ErrTxDone.
	ended := ctx.Err() != nil && errors.Is(err, ctx.Err())
	if (!errors.Is(err, sql.ErrTxDone) && !ended) || errors.Is(err, ErrHandlerTxDone) {
		return err
	}
	if ctx.Err() != nil && !ended {
		return fmt.Errorf("%w: %w (the message's context ended: %w)", ErrHandlerTxDone, err, context.Cause(ctx))
	}
	return fmt.Errorf("%w: %w", ErrHandlerTxDone, err)
}

// stillInTx fails with ErrTxRolledBackUnderHandler where the database may
// have rolled tx back under the handler with the statements after it each
// committed on its own: the key recorded in tx before the handler ran is then gone. On
// MySQL, whose COMMIT then succeeds, always (one more round trip); on
// SQLite, whose COMMIT fails, only before the messages the handler
// returned are written (returning), which would otherwise commit, sent
// for a delivery that is run again.
func (in *Inbox) stillInTx(ctx context.Context, tx *sqlx.Tx, consumer, key string, returning bool) error {
	d := in.dialect.sql()
	if !d.SilentRollbacks() && !(returning && d.AsksByBegin()) {
		return nil
	}
	var at any
	switch err := in.queryRow(ctx, tx, in.q.Stamp(consumer, key)).Scan(&at); {
	case errors.Is(err, sql.ErrNoRows):
		return fmt.Errorf("%w: message %s for %s (an error that rolls a transaction back, such as a deadlock, taken by the handler or by a middleware after inbox.Middleware such as Retry or PoisonQueue; add those before inbox.Middleware)", ErrTxRolledBackUnderHandler, idText(key), consumer)
	case err != nil && ctx.Err() != nil:
		// The message's context ended under the handler: database/sql
		// rolls the transaction back, as ErrHandlerTxDone says.
		return fmt.Errorf("%w: read back the key of %s for %s: %w (the message's context ended: %w)", ErrHandlerTxDone, idText(key), consumer, err, context.Cause(ctx))
	case err != nil:
		return fmt.Errorf("outbox: inbox: read back the key of %s for %s: %w", idText(key), consumer, err)
	}
	return nil
}

// hold writes msg into acemq_inbox_held, with the name of the handler it
// was delivered to (heldHandlerKey); false if it is there already.
func (in *Inbox) hold(ctx context.Context, tx *sqlx.Tx, consumer, key string, seq int64, id string, msg *message.Message) (bool, error) {
	md, err := rowcodec.EncodeMetadata(heldMetadata(msg.Metadata, message.HandlerNameFromCtx(msg.Context()), message.SubscribeTopicFromCtx(msg.Context()), id))
	if err != nil {
		return false, fmt.Errorf("outbox: inbox: hold %s: metadata: %w", idText(id), err)
	}
	body, enc := rowcodec.EncodeBody(msg.Payload)
	q := in.ordered.q.Hold(sqldialect.HeldRow{
		Consumer: consumer, Key: key, Seq: seq, MessageID: id,
		Payload: body, PayloadEncoding: enc, Metadata: md, HeldAt: time.Now(),
	})
	res, err := in.exec(ctx, tx, q)
	if err != nil {
		return false, fmt.Errorf("outbox: inbox: hold %s (%q seq %d) for %s: %w", idText(id), key, seq, consumer, err)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return false, fmt.Errorf("outbox: inbox: %w", err)
	}
	if n == 0 {
		return false, nil
	}
	count := in.ordered.q.CountHold(consumer, key)
	if _, err := in.exec(ctx, tx, count); err != nil {
		return false, fmt.Errorf("outbox: inbox: count held %s (%q seq %d) for %s: %w", idText(id), key, seq, consumer, err)
	}
	return true, nil
}

// drain applies the key's held messages that are next in order, each in a
// transaction of its own, until the next is not held, its handler has not
// been seen here, or one fails. delivery, if not nil, names the handler of
// the delivery whose context ctx is: a held message of that handler runs
// under ctx, one of another handler under that handler's route.
//
// A held message's transaction that the database refused for a concurrent
// one, or whose connection was lost, runs again here as a delivery's does
// (retryConflicts, for as long as halt lasts): under REPEATABLE READ a
// key's next delivery and its held apply meet on the key's row, and held
// messages whose connection was lost waited for ApplyHeld's next tick,
// each failure logged at ERROR.
//
// halt, checked before each held message, ends the drain between two:
// the one under way finishes under ctx (see finishing), and the rest wait
// for the next start or delivery.
//
// A held message counts once, by what became of it in the end: a try
// refused and run again is not a failure.
func (in *Inbox) drain(ctx, halt context.Context, delivery *string, consumer, key string) (int, error) {
	n := 0
	for {
		if err := halt.Err(); err != nil {
			return n, err
		}
		var applied, ran bool
		err := in.retryConflicts(halt, func() (err error) {
			applied, ran, err = in.applyNextHeld(ctx, halt, delivery, consumer, key)
			return err
		})
		if err != nil && ran {
			in.cfg.Metrics.inbox(consumer, inboxFailed)
			select {
			case in.ordered.failed <- struct{}{}:
			default:
			}
		}
		if err != nil || !applied {
			return n, err
		}
		n++
	}
}

// applyNextHeld applies the key's next message if it is held and its
// handler is known here, and says whether it did, and whether a failure
// came from running it (its handler, its transaction's commit) rather than
// from finding it. It counts the applied message; drain counts failures.
//
// A held message whose id the inbox keeps under its digest is first
// looked for as it is (carryAsIs): another library's inbox may have
// processed it so since it was held (two consumers on one queue while a
// service moves), or held it without looking at its arrival (another
// AceMQ library sharing acemq_inbox_held, an earlier version of this
// one). Found, its digest is recorded and the apply moves the key past it
// without running it. The look is a read on the pool, which must not run
// while the apply's transaction is open (on SQLite it holds the write
// lock, and a pool of one connection would wait on itself): the first
// transaction reads the message and ends, the look runs, and a second
// applies. Only such ids pay for it.
//
// The second transaction applies the key's next as it finds it: where
// that is another message than the one looked for (a delivery or another
// consumer moved the key meanwhile), it is looked for in turn, and applied
// in a third, and so on while the key moves.
func (in *Inbox) applyNextHeld(ctx, halt context.Context, delivery *string, consumer, key string) (applied, ran bool, err error) {
	looked := ""
	for {
		applied, ran, asIs, err := in.applyHeld(ctx, halt, delivery, consumer, key, looked)
		if asIs == "" || err != nil {
			return applied, ran, err
		}
		if err := in.carryAsIs(halt, consumer, asIs); err != nil {
			return false, false, err
		}
		looked = asIs
	}
}

// applyHeld is applyNextHeld's transaction. Where the held message's id is
// one to look for as it is (digested) and not the one looked for already
// (looked), it applies nothing and returns that id as asIs, for
// applyNextHeld to look for.
//
// The statements before the handler (the key's lock, the held row's read)
// run under halt: a lock wait is cut short as the router closes, which
// costs nothing, since the handler has not run; from the handler on, the
// transaction runs under ctx (see finishing).
func (in *Inbox) applyHeld(ctx, halt context.Context, delivery *string, consumer, key, looked string) (applied, ran bool, asIs string, err error) {
	tx, err := in.db.BeginTxx(ctx, &sql.TxOptions{Isolation: in.cfg.Isolation})
	if err != nil {
		return false, false, "", fmt.Errorf("outbox: inbox: begin: %w", err)
	}
	defer func() { _ = tx.Rollback() }() // a no-op after the commit
	last, _, err := in.lockSequence(halt, tx, consumer, key)
	if err != nil {
		return false, false, "", err
	}
	next := last + 1
	var id, payload, encoding, metadata string
	q := in.ordered.q.Held(consumer, key, next)
	switch err := in.queryRow(halt, tx, q).Scan(&id, &payload, &encoding, &metadata); {
	case errors.Is(err, sql.ErrNoRows):
		return false, false, "", nil
	case err != nil:
		return false, false, "", fmt.Errorf("outbox: inbox: read held %q seq %d for %s: %w", key, next, consumer, err)
	}
	msg, err := heldMessage(id, payload, encoding, metadata)
	if err != nil {
		// A row no handler can be given: it stays, and the key with it, for
		// an operator (Gaps lists it; SkipHeld gives up on it and hands
		// back what it holds).
		return false, false, "", fmt.Errorf("outbox: inbox: held %q seq %d for %s: %w", key, next, consumer, err)
	}
	var heldBy string
	var byName bool
	var topic string
	stored := id // the row's message_id, the key noteHeldFailure finds it by
	msg.Metadata, heldBy, byName, topic, id = heldRelease(msg.Metadata, id)
	msg.UUID = id // the id itself where the row keeps its digest
	rt, ok := in.route(consumer, heldBy, byName, topic)
	if !ok {
		// Its handler has not run behind this inbox in this process: it
		// stays held, and its key with it, until that handler's next
		// delivery, or an ApplyHeld after it.
		fields := watermill.LogFields{"message_uuid": idText(id), "consumer": consumer, "aggregate_id": key, "seq": next, "handler": heldBy}
		if in.firstWait(consumer, heldBy) {
			// Once a handler: a restarted service that held many messages
			// of a quiet topic waits as long as the topic stays quiet, and
			// an operator saw only outboxctl held's keys waiting.
			in.log.Info("Held messages wait for their handler, which has had no delivery in this process since it started: they run at its next delivery "+
				"(or its process's, where it runs in another), or as the router starts where inbox.Subscriber wraps the handler's subscriber "+
				"(outboxctl held lists them; skip-held gives one up)", fields)
		}
		in.log.Debug("Held message waits for its handler", fields)
		return false, false, "", nil
	}
	if digested(id) && id != looked {
		return false, false, id, nil // the deferred rollback ends the transaction first
	}
	mctx, h := rt.ctx, rt.h // the latest delivery's handler (see remember)
	if byName && delivery != nil && heldBy == *delivery {
		mctx = ctx // the delivery's own handler: its context (without its cancellation: see finishing)
	} else {
		// Another handler's values, ended as the transaction's context
		// ends: the handler ran on, told nothing, past its transaction's
		// rollback at the releasing delivery's deadline, and ran whole
		// again at the next apply (a review).
		var stop context.CancelFunc
		mctx, stop = endingWith(mctx, ctx)
		defer stop()
	}
	var links []trace.Link
	if in.tracer != nil {
		// Not a child of the delivery that releases it (another message's,
		// in another trace), nor of the one remembered (ended long ago):
		// the apply's span is its own publisher's child, or a trace's
		// root, linked to the delivery that released it.
		if sc := trace.SpanContextFromContext(ctx); sc.IsValid() {
			links = append(links, trace.Link{SpanContext: sc})
		}
		mctx = trace.ContextWithSpanContext(mctx, trace.SpanContext{})
	}
	if in.cfg.Propagator != nil {
		mctx = in.cfg.Propagator.Extract(mctx, metadataCarrier(msg.Metadata))
	}
	msg.SetContext(mctx)
	var span trace.Span
	if in.tracer != nil {
		span = in.startProcessSpan(msg, links...) // its own, at its turn: the delivery that held it ended
		mctx = msg.Context()
	}
	outcome, err := in.applyInTx(mctx, tx, h, msg, consumer, id, key, next, true)
	if err != nil && ctx.Err() != nil && errors.Is(err, ErrHandlerTxDone) && !errors.Is(err, context.Cause(ctx)) {
		// The transaction's context, not mctx (the handler's, which may
		// never end), ended under the handler: its cause, as for a
		// delivery (a code review).
		err = fmt.Errorf("%w (the transaction's context ended: %w)", err, context.Cause(ctx))
	}
	if err == nil {
		if err = tx.Commit(); err != nil {
			err = in.handledCommitErr(ctx, err, id, consumer)
		}
	}
	if span != nil {
		endProcessSpan(span, outcome, err)
	}
	if err != nil {
		_ = tx.Rollback()
		in.noteHeldFailure(ctx, consumer, key, next, stored, metadata, err)
		return false, true, "", &heldFailure{consumer: consumer, key: key, id: id, seq: next, err: err}
	}
	in.cfg.Metrics.inbox(consumer, outcome)
	return true, true, "", nil
}

// noteHeldFailure writes err, the failure of the apply of the key's held
// message seq, into its row's metadata (heldErrorKey), on the pool, after
// the apply's transaction ended. A lost connection, an ended context or a
// conflict with another transaction is no failure of the message's, and
// is not written; nor is anything when the row is gone (applied meanwhile)
// or holds another message. Under REPEATABLE READ or SERIALIZABLE nothing
// is written either: a concurrent apply of the key that read the row
// before the write would fail its delete of it as a serialization failure
// after its handler ran, and run the handler again (a code review). A
// write that fails is logged at DEBUG: the apply's failure is logged
// anyway.
func (in *Inbox) noteHeldFailure(ctx context.Context, consumer, key string, seq int64, stored, metadata string, err error) {
	d := in.dialect.sql()
	if ctx.Err() != nil || in.databaseDown(err) || d.Conflict(err) || in.cfg.Isolation >= sql.LevelRepeatableRead {
		return
	}
	if in.cfg.Isolation == sql.LevelDefault && in.dialect == Postgres {
		// The database's own default, which a role, a database or the DSN
		// may set to REPEATABLE READ: Isolation left at its default wrote
		// the note there, and a concurrent apply that had read the row
		// before it ran its handler again (a review). MySQL's REPEATABLE
		// READ (its default) deletes the row as it is now, unrefused
		// (MariaDB's innodb_snapshot_isolation, which would refuse it, not
		// tried here).
		var level string
		if err := in.db.QueryRowContext(ctx, sqldialect.PostgresDefaultIsolation).Scan(&level); err != nil || level != "read committed" && level != "read uncommitted" {
			return
		}
	}
	md, derr := rowcodec.DecodeMetadata(metadata)
	if derr != nil {
		return // a row no handler was given: never here
	}
	if md == nil {
		md = make(map[string]string, 1) // JSON null: another library's row, or a hand's
	}
	md[heldErrorKey] = storableError(time.Now().UTC().Format(time.RFC3339) + " " + err.Error())
	text, eerr := rowcodec.EncodeMetadata(md)
	if eerr != nil {
		return
	}
	q := in.ordered.q.NoteHeld(consumer, key, seq, stored, text)
	if _, werr := in.db.ExecContext(ctx, q.SQL, q.Args...); werr != nil {
		in.log.Debug("Held message's failure not written into its row", watermill.LogFields{"consumer": consumer, "aggregate_id": key, "seq": seq, "error": werr.Error()})
	}
}

// heldFailure is the failure of a held message's apply (its handler, its
// transaction), naming the message: a drain that a delivery of its key
// released was logged with the delivery's id and seq, another message's
// (a user review on-call chased seq 257 for a handler failing on seq 209).
type heldFailure struct {
	consumer, key, id string
	seq               int64
	err               error
}

func (e *heldFailure) Error() string {
	return fmt.Sprintf("held message %s (key %.80q seq %d of %s): %v", idText(e.id), e.key, e.seq, e.consumer, e.err)
}
func (e *heldFailure) Unwrap() error { return e.err }

// heldMessage rebuilds a held message from its row.
func heldMessage(id, payload, encoding, metadata string) (*message.Message, error) {
	body, err := rowcodec.DecodeBody(payload, encoding)
	if err != nil {
		return nil, err
	}
	md, err := rowcodec.DecodeMetadata(metadata)
	if err != nil {
		return nil, err
	}
	msg := message.NewMessage(id, body)
	msg.Metadata = md
	return msg, nil
}

// applyHeldBatch is how many ready keys one query of ApplyHeld reads; it
// reads page after page until it has seen every ready key of a consumer.
const applyHeldBatch = 100

// applyHeldErrs is how many failed keys ApplyHeld's error spells out; it
// counts the rest. A hundred keys whose handler keeps failing must not make
// the error of every tick a hundred lines long.
const applyHeldErrs = 10

// ApplyHeld applies every held message whose predecessor is applied, each
// key's in order (four keys at once, one on SQLite), each message in a
// transaction of its own, and then refreshes the
// held-message gauges (see RefreshStats). A held message is normally
// applied right after its predecessor commits; this retries those whose
// handler failed then, and applies what SkipGap released from outboxctl.
// Each held message runs in the handler it was delivered to, so it applies
// the held messages of the handlers that have run behind this inbox in this
// process (it needs the handler and its router context; a handler whose
// subscriber Subscriber wraps counts from the router's start), and reads only
// their consumers' keys: keys of other consumers sharing the tables cost it
// nothing. It reaches every ready key
// of those consumers in one call: a key whose handler fails stays held, the
// error says so, and the keys after it are applied all the same. It returns
// how many it applied. Plugin calls it every ApplyHeldEvery while a router
// runs; or call it from a ticker in the service. A lost database
// connection is retried, as a delivery's is, while ctx lives: give it a
// context with a deadline, or it waits out an outage.
func (in *Inbox) ApplyHeld(ctx context.Context) (int, error) {
	// ctx's end stops it between keys; a held message under way finishes
	// (see finishing): rolled back beneath its handler, it ran whole again
	// at the next ApplyHeld (a review).
	work, cancel := finishing(ctx)
	defer cancel()
	return in.applyAllHeld(work, ctx)
}

// applyAllHeld is ApplyHeld: its statements and held messages run under ctx,
// and halt, checked before each key, ends it between keys.
func (in *Inbox) applyAllHeld(ctx, halt context.Context) (int, error) {
	if in.ordered == nil {
		return 0, nil
	}
	applied := 0
	var errs heldErrs
	for _, consumer := range in.routedConsumers() {
		n, stop := in.applyReady(ctx, halt, consumer, in.drainsAtOnce(), &errs)
		applied += n
		if stop != nil {
			return applied, errors.Join(append(errs.list(), stop)...)
		}
	}
	all := errs.list()
	if err := in.RefreshStats(halt); err != nil {
		all = append(all, err)
	}
	return applied, errors.Join(all...)
}

// applyHeldOf applies consumer's held messages whose turn has come, as
// ApplyHeld does those of every consumer it has seen (without refreshing
// the gauges).
//
// ctx is a wake's, the handler's run, which the router cancels as its
// Close begins: that ends the apply between two keys, as a delivery's
// context does not end a delivery, and a held message under way finishes
// (see finishing).
func (in *Inbox) applyHeldOf(ctx context.Context, consumer string) (int, error) {
	var errs heldErrs
	work, cancel := finishing(ctx)
	defer cancel()
	n, stop := in.applyReady(work, ctx, consumer, in.drainsAtOnce(), &errs)
	return n, errors.Join(append(errs.list(), stop)...)
}

// drainsAtOnce is how many keys a wake or an ApplyHeld applies at once:
// heldDrains, or one on SQLite, which writes one transaction at a time.
func (in *Inbox) drainsAtOnce() int {
	if in.dialect.sql().WatchesFile() {
		return 1
	}
	return heldDrains
}

// heldDrains is how many keys a wake or an ApplyHeld applies at once on a
// database server: a restart's ready keys went one at a time (a review:
// 2,000 keys in 6–10 s), and keys are independent, each under its own
// lock. ApplyHeld's ticks kept one: the held messages another process
// released, or whose handler had failed, went at a wake's quarter speed.
const heldDrains = 4

// endingWith is values' context (a handler's remembered one) ended when
// ends ends: at its deadline, or with its cancellation's cause.
func endingWith(values, ends context.Context) (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithCancelCause(values)
	cancelDeadline := context.CancelFunc(func() {})
	if d, ok := ends.Deadline(); ok {
		// Its own deadline's error, DeadlineExceeded, whichever of the two
		// ends it first.
		ctx, cancelDeadline = context.WithDeadlineCause(ctx, d, context.DeadlineExceeded)
	}
	stop := context.AfterFunc(ends, func() { cancel(context.Cause(ends)) })
	return ctx, func() { stop(); cancelDeadline(); cancel(nil) }
}

// finishing is ctx without its cancellation but with its deadline (a
// Timeout's before the inbox): a held message's transaction begun under a
// router's context was rolled back beneath its handler as the router's
// Close began, and the handler, which runs under a context without the
// cancellation and cannot tell, ran again whole at the next start (its
// effects outside the transaction twice).
func finishing(ctx context.Context) (context.Context, context.CancelFunc) {
	work := context.WithoutCancel(ctx)
	if d, ok := ctx.Deadline(); ok {
		return context.WithDeadline(work, d)
	}
	return work, func() {}
}

// heldErrs gathers the failed keys' errors of an apply of held messages,
// the first applyHeldErrs of them, and counts the rest.
type heldErrs struct {
	errs   []error
	failed int
}

func (e *heldErrs) add(err error) {
	if e.failed++; len(e.errs) < applyHeldErrs {
		e.errs = append(e.errs, err)
	}
}

func (e *heldErrs) list() []error {
	if e.failed > len(e.errs) {
		return append(e.errs, fmt.Errorf("outbox: inbox: held messages of %d more keys failed", e.failed-len(e.errs)))
	}
	return e.errs
}

// applyReady applies, key by key (workers keys at once), consumer's held
// messages whose turn has come, adding each failed key's error to errs; stop is what ended it
// before it saw every ready key (halt, ctx, the read of the keys). ctx is
// the statements' and held messages' context; halt, checked before each
// key, ends the apply between keys.
func (in *Inbox) applyReady(ctx, halt context.Context, consumer string, workers int, errs *heldErrs) (applied int, stop error) {
	// Paged on the key, not re-read from the start: the keys whose
	// handler fails stay ready, and a first page full of them would
	// otherwise be all that any call ever reached.
	var after *string
	for {
		if err := halt.Err(); err != nil {
			return applied, err
		}
		q := in.ordered.q.Ready(consumer, after, applyHeldBatch)
		var keys []string
		if err := in.db.SelectContext(halt, &keys, q.SQL, q.Args...); err != nil {
			return applied, fmt.Errorf("outbox: inbox: ready held messages of %s: %w", consumer, err)
		}
		var (
			mu   sync.Mutex
			wg   sync.WaitGroup
			turn = make(chan struct{}, workers)
		)
		for _, key := range keys {
			if halt.Err() != nil {
				break
			}
			turn <- struct{}{}
			wg.Add(1)
			go func() {
				defer func() { <-turn; wg.Done() }()
				n, err := in.drain(ctx, halt, nil, consumer, key)
				mu.Lock()
				defer mu.Unlock()
				applied += n
				if err != nil {
					errs.add(err)
				}
			}()
		}
		wg.Wait()
		if err := halt.Err(); err != nil {
			return applied, err
		}
		if len(keys) < applyHeldBatch {
			return applied, nil
		}
		after = &keys[len(keys)-1]
	}
}

// Gap is a key with held messages: the ones after a sequence number that
// has not arrived, or (Ready) ones whose handler failed when their turn
// came.
type Gap struct {
	Consumer    string
	AggregateID string
	// LastApplied is the key's last applied sequence number.
	LastApplied int64
	// Held counts the key's held messages; LowestHeld is the first of them.
	Held       int64
	LowestHeld int64
	// OldestHeldAt is when the key's longest-held message was held.
	OldestHeldAt time.Time
	// NextError, for a key whose next message is held (Missing 0), is the
	// last failure of its handler when its turn came: its time (RFC 3339)
	// and the error; "" if none was written (its handler has not run here
	// since it was held, or the row was written by another library).
	NextError string
}

// Missing is how many sequence numbers the key waits for.
func (g Gap) Missing() int64 { return g.LowestHeld - g.LastApplied - 1 }

// gapsLimit bounds what one Gaps call reads: the gauges' log needs the
// longest-held few; ListGaps takes a limit of the caller's.
const gapsLimit = 1000

// Gaps lists the keys (of every consumer of the database) with a message
// held longer than olderThan, longest-held first, at most 1000: 0 lists
// every key with a held message. ListGaps says how many were left out.
func (in *Inbox) Gaps(ctx context.Context, olderThan time.Duration) ([]Gap, error) {
	gs, _, err := in.ListGaps(ctx, olderThan, gapsLimit)
	return gs, err
}

// ListGaps is Gaps with a limit of the caller's (0: none), and total, the
// number of keys with a message held longer than olderThan, listed or
// not: total - len(gaps) were left out. One statement reads both, so they
// agree.
func (in *Inbox) ListGaps(ctx context.Context, olderThan time.Duration, limit int) (gaps []Gap, total int, err error) {
	if limit < 0 {
		return nil, 0, fmt.Errorf("outbox: inbox: gaps: limit %d; want 0 (none) or more", limit)
	}
	q := sqldialect.NewOrderedInbox(in.dialect.sql()).Gaps(time.Now().Add(-olderThan), limit)
	rows, err := in.db.QueryContext(ctx, q.SQL, q.Args...)
	if err != nil {
		return nil, 0, fmt.Errorf("outbox: inbox: gaps: %w", err)
	}
	defer rows.Close()
	for rows.Next() {
		var g Gap
		at := sqldialect.NewTime(in.dialect.sql())
		if err := rows.Scan(&g.Consumer, &g.AggregateID, &g.LastApplied, &g.Held, &g.LowestHeld, at, &total); err != nil {
			return nil, 0, fmt.Errorf("outbox: inbox: gaps: %w", err)
		}
		g.OldestHeldAt = at.T
		gaps = append(gaps, g)
	}
	if err := rows.Err(); err != nil {
		return nil, 0, fmt.Errorf("outbox: inbox: gaps: %w", err)
	}
	_ = rows.Close() // before the reads below: a pool of one connection
	for i := range gaps {
		if gaps[i].Missing() > 0 {
			continue
		}
		if gaps[i].NextError, err = in.heldError(ctx, gaps[i].Consumer, gaps[i].AggregateID, gaps[i].LastApplied+1); err != nil {
			return nil, 0, err
		}
	}
	return gaps, total, nil
}

// heldError reads the last failure written into the key's held message
// seq (see noteHeldFailure), "" if none.
func (in *Inbox) heldError(ctx context.Context, consumer, key string, seq int64) (string, error) {
	q := sqldialect.NewOrderedInbox(in.dialect.sql()).Held(consumer, key, seq)
	var id, payload, encoding, metadata string
	switch err := in.db.QueryRowContext(ctx, q.SQL, q.Args...).Scan(&id, &payload, &encoding, &metadata); {
	case errors.Is(err, sql.ErrNoRows):
		return "", nil // applied meanwhile
	case err != nil:
		return "", fmt.Errorf("outbox: inbox: gaps: held %q seq %d for %s: %w", key, seq, consumer, err)
	}
	md, err := rowcodec.DecodeMetadata(metadata)
	if err != nil {
		return "", nil // a row no handler can be given: its skip says why
	}
	return md[heldErrorKey], nil
}

// SkipGap gives up on the sequence numbers from..through, the ones a key
// waits for: the key's last applied becomes through, and the messages held
// after it are applied in order, if this inbox has run the consumer's
// handler (otherwise at the consumer's next ApplyHeld or delivery of the
// key). A message of a skipped number that arrives later is acked as a
// duplicate without running. Once the skip is committed it returns nil: a
// held message behind it whose handler fails stays held, and its failure
// is logged (Gaps lists it; ApplyHeld or the key's next delivery runs it
// again).
//
// from and through name the gap by both ends, as it was seen: a listed Gap
// g is skipped whole with SkipGap(ctx, g.Consumer, g.AggregateID,
// g.LastApplied+1, g.LowestHeld-1), and its start alone with a smaller
// through. The key may have moved on since it was seen (its next number
// arrived), and a skip that named less would then skip numbers nobody saw
// missing, merely in flight, and lose them. So it skips nothing and
// returns ErrGapChanged unless the key's last applied is still from-1 and
// no number up to through is held. It returns ErrNoHeld when the key holds
// nothing and has applied none of from..through.
func (in *Inbox) SkipGap(ctx context.Context, consumer, key string, from, through int64) error {
	err := in.retryConflicts(ctx, notWaiting(func() error { return skipGap(ctx, in.db, in.dialect, in.cfg.Isolation, consumer, key, from, through) }))
	if err != nil {
		return err
	}
	in.log.Info("Gap skipped by request", watermill.LogFields{"consumer": consumer, "aggregate_id": key, "from": from, "through": through})
	defer in.refreshAfterSkip(ctx)
	if in.cfg.MarkOutboxProcessed && in.keyFromHere(ctx, consumer, key) {
		in.noteSkipped(ctx, in.outbox.MarkSkippedSeqs(key, from, through, time.Now(), skippedNote(consumer, fmt.Sprintf("gap %s of key %s (SkipGap)", seqRange(from, through), key))),
			watermill.LogFields{"consumer": consumer, "aggregate_id": key, "from": from, "through": through})
	}
	in.drainAfterSkip(ctx, consumer, key)
	return nil
}

// noteSkipped, with MarkOutboxProcessed, writes a committed skip into the
// records of this database's outbox it gave up on (q: MarkSkipped or
// MarkSkippedSeqs), marking them processed if not yet: the hold had marked
// a held message's record, and outboxctl show said "processed" of a
// payment an operator gave up on, never applied. The note tells; the skip
// is done whatever it does, so a failure is logged, not returned.
func (in *Inbox) noteSkipped(ctx context.Context, q sqldialect.Query, fields watermill.LogFields) {
	if !in.cfg.MarkOutboxProcessed {
		return
	}
	q = sqldialect.Inline(in.dialect.sql(), q)
	if _, err := in.db.ExecContext(ctx, q.SQL, q.Args...); err != nil {
		in.log.Error("Ordered inbox: the skip could not be noted in the outbox's records (it is done; outboxctl show reads them processed)", err, fields)
	}
}

// keyFromHere reports whether key's messages come from this database's
// outbox: its lowest held message is the outbox's record of that number,
// by id. Keys are not unique across services, and a skip of a gap in
// another service's messages of a key marked this outbox's own records
// of the same key and numbers skipped (a review). A failed read says no:
// the note is left out, the skip is done.
func (in *Inbox) keyFromHere(ctx context.Context, consumer, key string) bool {
	d := in.dialect.sql()
	q := sqldialect.NewOrderedInbox(d)
	row := func(q sqldialect.Query, dest ...any) error {
		q = sqldialect.Inline(d, q)
		return in.db.QueryRowContext(ctx, q.SQL, q.Args...).Scan(dest...)
	}
	var lowest sql.NullInt64
	if err := row(q.LowestHeld(consumer, key), &lowest); err != nil || !lowest.Valid {
		return false
	}
	var held, id string
	if err := row(q.HeldID(consumer, key, lowest.Int64), &held); err != nil {
		return false
	}
	if err := row(in.outbox.KeySeq(key, lowest.Int64), &id); err != nil {
		return false
	}
	return sqldialect.InboxKey(id) == held
}

// skippedNote is the last_error of a record consumer gave up on, what
// naming the skip: plain ASCII, as asideNote's.
func skippedNote(consumer, what string) string {
	return asciiError(storableError(fmt.Sprintf("%s%s, %s at %s: never applied; sent again, it is dropped as a duplicate",
		sqldialect.SkippedNote, consumer, what, time.Now().UTC().Format(time.RFC3339))))
}

// drainAfterSkip applies what a committed skip freed. A failure is logged,
// not returned: the skip is done, and an error would read as a skip that
// failed (retried, it finds the gap changed; SkipHeld's message, whose row
// is deleted, would be dropped with its error).
func (in *Inbox) drainAfterSkip(ctx context.Context, consumer, key string) {
	if in.ordered == nil {
		return
	}
	work, cancel := finishing(ctx) // as ApplyHeld
	defer cancel()
	if _, err := in.drain(work, ctx, nil, consumer, key); err != nil {
		in.logHeldFailure(err, watermill.LogFields{"consumer": consumer, "aggregate_id": key})
	}
}

// refreshAfterSkip reads the held messages into the gauges after a skip in
// this process, so that an alert on a gap ends with the skip rather than
// at the next RefreshStats; the other keys' gaps are not logged again. The
// skip is done whatever the reading says: a failure is logged.
func (in *Inbox) refreshAfterSkip(ctx context.Context) {
	if in.cfg.Metrics == nil {
		return
	}
	if _, err := in.readHeld(ctx); err != nil {
		in.log.Error("Ordered inbox: the held messages' gauges could not be read after a skip", err, nil)
	}
}

// skipGap decides on the key's row, locked as every delivery of the key
// locks it, so that no message of the key is applied or held between what
// it reads and what it writes.
func skipGap(ctx context.Context, db *sqlx.DB, d Dialect, iso sql.IsolationLevel, consumer, key string, from, through int64) error {
	if from < 1 || through < from {
		return fmt.Errorf("outbox: inbox: skip gap %d..%d of %q for %s: want 1 <= from <= through", from, through, key, consumer)
	}
	q := sqldialect.NewOrderedInbox(d.sql())
	tx, err := db.BeginTxx(ctx, &sql.TxOptions{Isolation: iso})
	if err != nil {
		return fmt.Errorf("outbox: inbox: begin: %w", err)
	}
	defer func() { _ = tx.Rollback() }()
	in := &Inbox{dialect: d, ordered: &orderedState{q: q}}
	last, _, err := in.lockSequence(ctx, tx, consumer, key)
	if err != nil {
		return err
	}
	var lowest sql.NullInt64
	low := q.LowestHeld(consumer, key)
	if err := in.queryRow(ctx, tx, low).Scan(&lowest); err != nil {
		return fmt.Errorf("outbox: inbox: lowest held of %q for %s: %w", key, consumer, err)
	}
	// Both ends, not through alone: with 1 applied and 5 held, a skip of
	// 2..4 after 2 arrived would pass a check of through and skip 3 and 4,
	// which are in flight. A key that moved into the skip is a changed gap
	// even when it holds nothing now: the skip was meant for what the
	// operator saw.
	if !lowest.Valid && last < from {
		return fmt.Errorf("%w: %q for %s (last applied %d)", ErrNoHeld, key, consumer, last)
	}
	if last != from-1 || !lowest.Valid || lowest.Int64 <= through {
		now := "nothing held"
		if lowest.Valid {
			now = fmt.Sprintf("lowest held %d (waiting for %s)", lowest.Int64, seqRange(last+1, lowest.Int64-1))
		}
		return fmt.Errorf("%w: %q for %s: a skip of %s expects last applied %d and nothing held up to %d; last applied is now %d, %s",
			ErrGapChanged, key, consumer, seqRange(from, through), from-1, through, last, now)
	}
	set := q.SetSequence(consumer, key, through)
	if _, err := in.exec(ctx, tx, set); err != nil {
		return fmt.Errorf("outbox: inbox: skip gap of %q for %s: %w", key, consumer, err)
	}
	if err := tx.Commit(); err != nil {
		return fmt.Errorf("outbox: inbox: commit skip gap of %q for %s: %w", key, consumer, err)
	}
	return nil
}

// seqRange is the numbers from..through as an operator reads them: "2..4",
// "2", or "nothing" when through is below from (a key whose next number is
// held: its handler failed).
func seqRange(from, through int64) string {
	switch {
	case through < from:
		return "nothing"
	case through == from:
		return strconv.FormatInt(from, 10)
	}
	return fmt.Sprintf("%d..%d", from, through)
}

// RefreshStats reads the held messages into the Metrics gauges:
// outbox_inbox_held (messages), outbox_inbox_gaps (keys with a message held
// longer than GapAfter) and outbox_inbox_oldest_gap_age_seconds, counted
// over every held message in one statement. The longest-held keys past
// GapAfter (up to gapLogs of them) are each logged as an error. ApplyHeld
// calls it; without Metrics it only logs.
func (in *Inbox) RefreshStats(ctx context.Context) error {
	overdue, err := in.readHeld(ctx)
	if err != nil || overdue == 0 {
		return err
	}
	return in.logGaps(ctx)
}

// readHeld reads the held messages into the gauges and returns how many
// keys hold one past GapAfter.
func (in *Inbox) readHeld(ctx context.Context) (int64, error) {
	now := time.Now()
	q := sqldialect.NewOrderedInbox(in.dialect.sql()).HeldStats(now.Add(-in.cfg.GapAfter))
	var held, overdue int64
	first := sqldialect.NewTime(in.dialect.sql())
	if err := in.db.QueryRowContext(ctx, q.SQL, q.Args...).Scan(&held, &overdue, first); err != nil {
		return 0, fmt.Errorf("outbox: inbox: held messages: %w", err)
	}
	if first.Err != nil {
		return 0, fmt.Errorf("outbox: inbox: held messages: the oldest held_at: %w", first.Err)
	}
	var oldest time.Duration
	if !first.T.IsZero() {
		oldest = max(0, now.Sub(first.T))
	}
	in.cfg.Metrics.held(held, overdue, oldest)
	return overdue, nil
}

// gapLogs is how many keys held past GapAfter one RefreshStats logs, the
// longest-held first; outboxctl held lists the 1000 longest-held and counts
// the rest, and with --limit 0 lists them all.
const gapLogs = 20

// logGaps logs the longest-held of the overdue keys held past GapAfter.
func (in *Inbox) logGaps(ctx context.Context) error {
	gs, total, err := in.ListGaps(ctx, in.cfg.GapAfter, gapLogs)
	if err != nil {
		return err
	}
	now := time.Now()
	for _, g := range gs {
		age := now.Sub(g.OldestHeldAt)
		why := "Ordered inbox: messages held past GapAfter; their predecessor has not been applied: it has not arrived, or was set aside by a poison queue " +
			"(once its cause is fixed, outboxctl resend --key K --seq N sends it again from its outbox; outboxctl held, skip-gap)"
		aside, wasAside := in.aside.recall(g.Consumer, g.AggregateID, g.LastApplied+1, g.LowestHeld-1)
		switch {
		case wasAside:
			why = fmt.Sprintf("Ordered inbox: messages held past GapAfter; their predecessor, seq %d, was set aside on %s by this process at %s: "+
				"once its cause is fixed, outboxctl resend --key K --seq %d sends it again from its outbox (skip-gap would give it up)",
				aside.seq, aside.topic, aside.at.UTC().Format(time.RFC3339), aside.seq)
		case g.LastApplied == 0 && g.Missing() > 0:
			why += "; the consumer applied none of the key's numbers: unless its first was set aside (a set-aside ERROR line with this aggregate_id says so), " +
				"a consumer new to the key, turned on over its history, or a router handler renamed " +
				"while ConsumerName defaults to the handler's name (skip-gap once; set ConsumerName)"
		}
		if g.Missing() <= 0 {
			why = "Ordered inbox: messages held past GapAfter; the key's next is held: its handler keeps failing, or the router handler it was delivered to has not run here since the service started (renamed or removed?) (outboxctl held, skip-held)"
		}
		fields := watermill.LogFields{
			"consumer": g.Consumer, "aggregate_id": g.AggregateID, "last_applied": g.LastApplied,
			"lowest_held": g.LowestHeld, "held": g.Held, "age": age.String(),
		}
		if g.NextError != "" {
			fields["next_error"] = g.NextError
		}
		if wasAside {
			fields["set_aside_id"] = idText(aside.id)
			if aside.copyID != "" {
				fields["poison_copy_id"] = aside.copyID
			}
		}
		in.log.Error(why, fmt.Errorf("held %s, longer than GapAfter %s", age.Round(time.Second), in.cfg.GapAfter), fields)
	}
	if total > len(gs) {
		in.log.Error("Ordered inbox: more keys hold messages past GapAfter (outboxctl held lists them)", fmt.Errorf("%d keys, %d logged", total, len(gs)), nil)
	}
	return nil
}

// SkippedMessage is a held message an operator gave up on (SkipHeld): what
// is needed to resend it by hand or park it elsewhere. Its row was the
// message's only copy, so nothing of it is left out: a part of the row that
// cannot be decoded (likely why its handler never ran) comes back as the
// row stored it, with the reason, and the other part decoded all the same.
type SkippedMessage struct {
	ID       string
	Payload  []byte
	Metadata message.Metadata
	// PayloadErr says why the row's payload could not be decoded (an
	// unknown payload_encoding, base64 that is not); Payload is nil then,
	// and StoredPayload and StoredEncoding are the row's payload and
	// payload_encoding as it held them.
	PayloadErr                    error
	StoredPayload, StoredEncoding string
	// MetadataErr likewise says why the row's metadata could not be
	// decoded; Metadata is nil then, and StoredMetadata is the row's text.
	MetadataErr    error
	StoredMetadata string
	// LastError is the last failure of its handler when its turn came
	// (its time, RFC 3339, and the error), "" if none was written.
	LastError string
}

// SkipHeld gives up on a key's held message seq that is the key's next
// (the last applied is seq-1), whose handler keeps failing: it deletes
// it, makes seq the key's last applied, applies the messages held behind
// it (if this inbox has run their handler; otherwise at their handler's
// next delivery or ApplyHeld), and returns it: what of it can be decoded,
// and the rest as its row stored it (see SkippedMessage). It is the way past a poison
// message the broker no longer has (a held message was acked): SkipGap
// skips missing numbers only. A copy of it that arrives later is acked as a
// duplicate without running.
//
// It skips nothing and returns ErrGapChanged when seq is not the key's
// next any more (applied since, or the key waits for a number before it),
// and ErrNoHeld when seq is not held. Once the skip is committed it returns
// the message and nil, whatever the messages behind it do (see SkipGap).
// Should the commit fail, it returns the message with the error: whether
// the skip committed is then unknown, and the message may be its only
// copy. SkipHeldKeeping hands the message over before the commit.
func (in *Inbox) SkipHeld(ctx context.Context, consumer, key string, seq int64) (SkippedMessage, error) {
	return in.SkipHeldKeeping(ctx, consumer, key, seq, nil)
}

// SkipHeldKeeping is SkipHeld that gives the message to keep before the
// skip, the held row being its only copy: when keep returns an error (a
// copy that could not be written), nothing is skipped, and that error is
// returned. keep runs with no transaction open, and the skip then skips
// nothing (ErrGapChanged, ErrNoHeld) unless the same message is still
// held and still the key's next. outboxctl skip-held prints the message so: a print
// that failed (a closed pipe, a full disk) deleted the row, and the
// message was lost. A nil keep is SkipHeld.
func (in *Inbox) SkipHeldKeeping(ctx context.Context, consumer, key string, seq int64, keep func(SkippedMessage) error) (SkippedMessage, error) {
	if seq < 1 {
		return SkippedMessage{}, fmt.Errorf("outbox: inbox: skip held %q seq %d for %s: want a positive sequence number", key, seq, consumer)
	}
	skipped, err := in.skipHeld(ctx, consumer, key, seq, keep)
	if err != nil {
		return skipped, err
	}
	in.log.Info("Held message skipped by request", watermill.LogFields{"consumer": consumer, "aggregate_id": key, "seq": seq, "message_uuid": idText(skipped.ID)})
	defer in.refreshAfterSkip(ctx)
	if in.markable(ctx, in.db, skipped.ID) {
		in.noteSkipped(ctx, in.outbox.MarkSkipped([]string{skipped.ID}, time.Now(), skippedNote(consumer, fmt.Sprintf("held seq %d of key %s (SkipHeld)", seq, key))),
			watermill.LogFields{"consumer": consumer, "aggregate_id": key, "seq": seq, "message_uuid": idText(skipped.ID)})
	}
	in.drainAfterSkip(ctx, consumer, key)
	return skipped, nil
}

// skipHeld decides on the key's row, locked as every delivery of the key
// locks it. in need not be Ordered (outboxctl's is not).
//
// keep runs with no transaction open: a look at the message in one rolled
// back at once, then keep, then the skip in another, which skips nothing
// (ErrGapChanged) unless the same message is still held there and still
// the key's next. Run inside the skip's transaction, keep held the key's
// row locked for as long as it took: outboxctl's print into a pipe whose
// reader paused held the service's deliveries of the key (on MySQL of its
// neighbours, on SQLite every write to the database) for as long.
//
// Each transaction the database refuses for a concurrent one (under
// REPEATABLE READ or SERIALIZABLE, a delivery of the key that changed its
// row since the snapshot) runs again, as a delivery's does, keep not: the
// operator got a serialization failure for a skip that nothing stood in
// the way of.
func (in *Inbox) skipHeld(ctx context.Context, consumer, key string, seq int64, keep func(SkippedMessage) error) (SkippedMessage, error) {
	q := sqldialect.NewOrderedInbox(in.dialect.sql())
	in = &Inbox{dialect: in.dialect, db: in.db, cfg: in.cfg, ordered: &orderedState{q: q}}
	kept := ""
	if keep != nil {
		var m SkippedMessage
		err := in.retryConflicts(ctx, notWaiting(func() (err error) {
			m, err = in.peekHeld(ctx, consumer, key, seq)
			return err
		}))
		if err != nil {
			return SkippedMessage{}, err
		}
		if err := keep(m); err != nil {
			return SkippedMessage{}, err // nothing skipped: still held
		}
		kept = m.ID
	}
	var skipped SkippedMessage
	err := in.retryConflicts(ctx, notWaiting(func() (err error) {
		skipped, err = in.skipHeldTx(ctx, consumer, key, seq, keep != nil, kept)
		return err
	}))
	return skipped, err
}

// peekHeld reads the key's held message seq, its next, in a transaction
// rolled back at once.
func (in *Inbox) peekHeld(ctx context.Context, consumer, key string, seq int64) (SkippedMessage, error) {
	tx, err := in.db.BeginTxx(ctx, &sql.TxOptions{Isolation: in.cfg.Isolation})
	if err != nil {
		return SkippedMessage{}, fmt.Errorf("outbox: inbox: begin: %w", err)
	}
	defer func() { _ = tx.Rollback() }()
	return in.heldNext(ctx, tx, consumer, key, seq)
}

// skipHeldTx is skipHeld's skip: it deletes the key's held messages up to
// seq and moves the key to seq, in one transaction. With kept, seq must
// still hold the message of id keptID.
func (in *Inbox) skipHeldTx(ctx context.Context, consumer, key string, seq int64, kept bool, keptID string) (SkippedMessage, error) {
	q := in.ordered.q
	tx, err := in.db.BeginTxx(ctx, &sql.TxOptions{Isolation: in.cfg.Isolation})
	if err != nil {
		return SkippedMessage{}, fmt.Errorf("outbox: inbox: begin: %w", err)
	}
	defer func() { _ = tx.Rollback() }()
	skipped, err := in.heldNext(ctx, tx, consumer, key, seq)
	if err != nil {
		return SkippedMessage{}, err
	}
	if kept && skipped.ID != keptID {
		return SkippedMessage{}, fmt.Errorf("%w: %q seq %d for %s is held as message %s now, not %s as kept", ErrGapChanged, key, seq, consumer, idText(skipped.ID), idText(keptID))
	}
	if _, err := in.exec(ctx, tx, q.DeleteHeldUpTo(consumer, key, seq)); err != nil {
		return SkippedMessage{}, fmt.Errorf("outbox: inbox: skip held %q seq %d for %s: %w", key, seq, consumer, err)
	}
	if _, err := in.exec(ctx, tx, q.SetSequence(consumer, key, seq)); err != nil {
		return SkippedMessage{}, fmt.Errorf("outbox: inbox: skip held %q seq %d for %s: %w", key, seq, consumer, err)
	}
	if err := tx.Commit(); err != nil {
		return skipped, fmt.Errorf("outbox: inbox: commit skip held %q seq %d for %s: %w", key, seq, consumer, err)
	}
	return skipped, nil
}

// heldNext locks the key's row in tx and reads its held message seq,
// which must be the key's next (ErrGapChanged) and held (ErrNoHeld).
func (in *Inbox) heldNext(ctx context.Context, tx *sqlx.Tx, consumer, key string, seq int64) (SkippedMessage, error) {
	q := in.ordered.q
	last, _, err := in.lockSequence(ctx, tx, consumer, key)
	if err != nil {
		return SkippedMessage{}, err
	}
	var id, payload, encoding, metadata string
	switch err := in.queryRow(ctx, tx, q.Held(consumer, key, seq)).Scan(&id, &payload, &encoding, &metadata); {
	case errors.Is(err, sql.ErrNoRows):
		return SkippedMessage{}, fmt.Errorf("%w: %q seq %d for %s (last applied %d)", ErrNoHeld, key, seq, consumer, last)
	case err != nil:
		return SkippedMessage{}, fmt.Errorf("outbox: inbox: read held %q seq %d for %s: %w", key, seq, consumer, err)
	}
	if last != seq-1 {
		return SkippedMessage{}, fmt.Errorf("%w: %q for %s: seq %d is not the key's next: last applied is %d", ErrGapChanged, key, consumer, seq, last)
	}
	// A row that cannot be decoded (the likely poison) is skipped all the
	// same: each part goes back to the operator decoded if it can be, else
	// as it is stored.
	m := SkippedMessage{ID: id}
	if m.Payload, err = rowcodec.DecodeBody(payload, encoding); err != nil {
		m.Payload, m.PayloadErr = nil, err
		m.StoredPayload, m.StoredEncoding = payload, encoding
	}
	if m.Metadata, err = rowcodec.DecodeMetadata(metadata); err != nil {
		m.Metadata, m.MetadataErr, m.StoredMetadata = nil, err, metadata
	}
	m.LastError = m.Metadata[heldErrorKey]
	m.Metadata, _, _, _, m.ID = heldRelease(m.Metadata, id)
	return m, nil
}
