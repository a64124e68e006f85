package outbox

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math/rand/v2"
	"reflect"
	"runtime/debug"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/jmoiron/sqlx"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/acemq/watermill-outbox/internal/sqldialect"
)

// DefaultInboxTable is the inbox table's name in every AceMQ library.
const DefaultInboxTable = "processed_messages"

// InboxConfig configures an Inbox. The zero value of every field but
// Dialect (needed unless the handle is a *sqlx.DB) is a working default.
type InboxConfig struct {
	// Dialect of the database. Optional when the handle is a *sqlx.DB.
	Dialect Dialect
	// ConsumerName is the first half of the dedupe key. Default: the name of
	// the router handler the message arrived at, so that two handlers of
	// one message each process it once.
	//
	// The name is durable state: under the default, renaming the handler
	// starts a new consumer, which runs again the messages in flight at the
	// rename and, with Ordered, holds every key at its next number behind
	// the ones the old name applied (GapAfter's ERROR and outboxctl held
	// show them; skip-gap once each). Set it for an ordered consumer (an
	// API review).
	//
	// With Ordered, a held message runs in the handler it was delivered
	// to, told apart by the router's handler name. Outside a router there
	// is none (""), so one ConsumerName is one handler there: the keyed
	// deliveries of a second handler function the Inbox wraps fail with
	// ErrConsumerShared, nacked before any statement, since a message held
	// for one would run in the other. Give each handler a ConsumerName of
	// its own, as dedupe needs already when two handlers get the same
	// messages; a key whose numbers run across several handlers' topics
	// needs a router. Two
	// Inboxes over one database, each wrapping a handler outside a router
	// under one ConsumerName, mix up their held messages the same way but
	// are not refused: a new Inbox over the pool is also how a restart in
	// the process looks.
	ConsumerName string
	// InboxTable is the inbox table. Default processed_messages. (Table in
	// the other configs is the outbox table; here that is OutboxTable.)
	//
	// The ordered inbox's state (acemq_inbox_sequences, acemq_inbox_held)
	// is not in InboxTable: it is one per database, keyed by consumer name
	// alone. Two Ordered inboxes over different InboxTables of one database
	// with the same ConsumerName share it, and the second one's messages
	// would be taken for duplicates of numbers the first applied, acked
	// without running. Over one *sql.DB the second one's keyed
	// deliveries fail with ErrConsumerShared instead, nacked before any
	// statement; over two pools of one database nothing tells. Give them
	// distinct ConsumerNames.
	InboxTable string
	// MarkOutboxProcessed: the outbox table lives in this same database (a
	// service consuming its own events), and the transaction that processes
	// a message also sets its outbox record's processed_at, if still null.
	// Republish then leaves it alone. With Ordered, so does the transaction
	// that holds a message ahead of its predecessor: the held row is the
	// message's copy in this database, and one sent again would only be
	// held again. SkipHeld and SkipGap write into the published records
	// they give up on that they did ("skipped by …" in last_error, marked
	// processed), which outboxctl show reads as never applied. Off by
	// default: then no query touches the outbox table.
	MarkOutboxProcessed bool
	// OutboxTable is the outbox table MarkOutboxProcessed updates and the
	// messages a handler returns are written into. Default acemq_outbox.
	OutboxTable string
	// TrackedTopics, with MarkOutboxProcessed, limits the marking to
	// messages that arrived on a tracked topic (the router's subscribe
	// topic), the topics a Republisher resends. Another topic costs one map
	// lookup and no database call. Nil marks every message.
	TrackedTopics *TrackedTopics
	// Outbox says how the messages a handler returns are written into the
	// outbox: Exchange, TopicMapper, ContentType and Propagator (default
	// InboxConfig.Propagator), as for NewTxPublisher. Its Dialect and Table
	// are the inbox's Dialect and OutboxTable, because the rows go through
	// the inbox's transaction; leave them empty (another value is a
	// *ConfigError).
	Outbox TxPublisherConfig
	// AtMostOnce commits the key in a transaction of its own before the
	// handler runs, for an effect no transaction holds (an email, a call to
	// an API without an idempotency key): a crash after that commit drops
	// the redelivery as a duplicate rather than repeating the effect, so
	// the effect happens at most once, and a crash between the commit and
	// the effect loses it. The handler runs with no transaction
	// (TxFromContext reports none). Return an error only when the effect
	// did not happen: the key is then taken back and the message retried.
	// A copy delivered while the handler of the first runs, in this process
	// or another, waits for it, and runs if the key was taken back (see
	// AtMostOnceLease).
	// A handler's returned messages are written into the outbox in a
	// transaction of their own after the handler; if that fails the key
	// stays, so they are lost too, logged with the message's id.
	AtMostOnce bool
	// AtMostOnceLease is how long an at-most-once key stays running
	// without word from its handler's process. The key is committed as
	// running until now + AtMostOnceLease; the process renews that every
	// third of it while the handler runs, and stamps the key done when the
	// handler returns. A copy that finds it running (delivered to another
	// process after the first one's channel closed) waits, holding its
	// delivery, until the key is done (a duplicate, acked) or taken back
	// (it runs). A lease that runs out is a process that died in its
	// handler: the copy is a duplicate then, as the message is lost, at
	// most the lease after the crash. Default DefaultAtMostOnceLease (30 s).
	AtMostOnceLease time.Duration
	// Isolation of the handler's transaction (under AtMostOnce, of the
	// key's and of the returned messages'). Default: the database's.
	Isolation sql.IsolationLevel
	// AllowMissingID lets a message without an id (neither a UUID nor
	// x-acemq-id metadata) through, undeduplicated and outside any
	// transaction (what its handler returns is written into the outbox in
	// a transaction of its own). By default such a message fails with
	// ErrNoMessageID: without an id there is no way to tell a duplicate.
	AllowMissingID bool
	// Metrics, if set, counts processed, duplicate and failed messages by
	// consumer, and with AtMostOnce the keys committed before the handler.
	Metrics *Metrics
	// Propagator, if set, restores the trace context a TxPublisher with the
	// same Propagator stored in the message's metadata into the message's
	// context before the handler runs, so that one trace spans commit,
	// relay and handler; the messages the handler returns, and the copies
	// PoisonOutbox sets aside, carry the handler's on, unless
	// Outbox.Propagator is another (an empty
	// propagation.NewCompositeTextMapPropagator() carries none). Nil costs
	// nothing; with TracerProvider set, nil is W3C trace context
	// (propagation.TraceContext).
	Propagator propagation.TextMapPropagator
	// TracerProvider, if set, gives each delivery the inbox handles a span,
	// "process <topic>" of kind CONSUMER, whose parent is the publisher's
	// trace restored from the metadata (see Propagator), or the delivery's
	// context's span where the message carries none; the handler's context
	// carries it, so the handler's own spans (its queries) are its
	// children. It ends with the delivery, with OpenTelemetry's messaging
	// attributes (messaging.message.id is the dedupe id,
	// messaging.consumer.group.name the consumer) and acemq.outcome:
	// processed, duplicate (acked without running), held (an ordered
	// message ahead of its predecessor), failed (with the error). A held
	// message applied later, at its turn, gets a span of its own then,
	// whose parent is the publisher's too. Nil costs nothing.
	TracerProvider trace.TracerProvider
	// Ordered applies keyed messages (aggregateId and seq metadata, as
	// TxPublisher writes them for a message with an ordering key) in their
	// key's sequence order, per consumer: a sequence number applied already
	// is a duplicate, acked without running; the next one runs and records
	// itself as the key's last applied in the handler's transaction; a later
	// one is held in acemq_inbox_held and acked, and runs, in a transaction
	// of its own, right after its predecessor commits. A keyed message whose
	// seq is missing or not a positive integer fails with ErrInvalidSeq, and
	// one whose key the database cannot hold with ErrInvalidKey. Unkeyed messages take the unordered path. Needs sqlschema's 0006
	// tables; not with AtMostOnce (a held message's effect would have no
	// key committed before it). Its state is keyed by ConsumerName, not by
	// Table, and outside a router one ConsumerName is one handler (see
	// both, and ErrConsumerShared). See ApplyHeld, Gaps and SkipGap.
	Ordered bool
	// GapAfter, with Ordered, is how long a message may be held before
	// RefreshStats reports its key as a gap (outbox_inbox_gaps, a logged
	// error): its predecessor was purged or is stuck at the sender, and an
	// operator decides (outboxctl held, skip-gap). Too short reports a
	// predecessor that is merely slow (a relay retrying, a redelivery
	// after a consumer crash); too long lets a key stand still unseen.
	// Default DefaultGapAfter (5 minutes).
	GapAfter time.Duration
	// ApplyHeldEvery, with Ordered, is how often the inbox's router plugin
	// (Plugin) calls ApplyHeld, and how old the held-message gauges get.
	// A held message whose handler failed when its turn came is tried
	// again sooner, 100 ms after, doubling up to ApplyHeldEvery while it
	// fails, when no delivery of its key comes first. Default
	// DefaultApplyHeldEvery (10 s); each call is a read or two.
	ApplyHeldEvery time.Duration
	// PurgeBatch is how many rows one DELETE of PurgeProcessed removes.
	// Default 1000.
	PurgeBatch int
	// Logger logs what the inbox does beside its deliveries' outcomes
	// (held messages, gaps, marks that failed). Nil logs nothing.
	Logger watermill.LoggerAdapter
}

// DefaultPurgeBatch is the default of StoreConfig.PurgeBatch and
// InboxConfig.PurgeBatch: small enough that one DELETE holds its locks
// briefly, large enough that a purge of millions of rows is not a million
// round trips.
const DefaultPurgeBatch = 1000

// minAtMostOnceLease is the shortest AtMostOnceLease: renewed every third
// of it, a shorter one is more statements than handler.
const minAtMostOnceLease = 100 * time.Millisecond

// DefaultAtMostOnceLease is the default of InboxConfig.AtMostOnceLease:
// how long a copy waits, at most, after a crash in the first one's handler.
const DefaultAtMostOnceLease = 30 * time.Second

func (c *InboxConfig) setDefaults() {
	if c.TracerProvider != nil && c.Propagator == nil {
		c.Propagator = propagation.TraceContext{}
	}
	if c.InboxTable == "" {
		c.InboxTable = DefaultInboxTable
	}
	if c.OutboxTable == "" {
		c.OutboxTable = DefaultTable
	}
	if c.PurgeBatch == 0 {
		c.PurgeBatch = DefaultPurgeBatch
	}
	if c.AtMostOnceLease == 0 {
		c.AtMostOnceLease = DefaultAtMostOnceLease
	}
	if c.GapAfter == 0 {
		c.GapAfter = DefaultGapAfter
	}
	if c.ApplyHeldEvery == 0 {
		c.ApplyHeldEvery = DefaultApplyHeldEvery
	}
	if c.Logger == nil {
		c.Logger = watermill.NopLogger{}
	}
}

func (c InboxConfig) validate() error {
	if c.Dialect == nil {
		return &ConfigError{Field: "Dialect", Reason: "required unless the handle is a *sqlx.DB; use outbox.Postgres, MySQL or SQLite"}
	}
	if c.PurgeBatch < 1 {
		return &ConfigError{Field: "PurgeBatch", Reason: fmt.Sprintf("%d; want at least 1", c.PurgeBatch)}
	}
	if err := checkConsumer(c.Dialect, c.ConsumerName); err != nil {
		return &ConfigError{Field: "ConsumerName", Reason: err.Error()}
	}
	if c.AtMostOnceLease < minAtMostOnceLease {
		return &ConfigError{Field: "AtMostOnceLease", Reason: fmt.Sprintf("%s; want at least %s (renewed every third of it)", c.AtMostOnceLease, minAtMostOnceLease)}
	}
	if c.GapAfter < 0 {
		return &ConfigError{Field: "GapAfter", Reason: fmt.Sprintf("%s; want a positive duration", c.GapAfter)}
	}
	if c.ApplyHeldEvery < 0 {
		return &ConfigError{Field: "ApplyHeldEvery", Reason: fmt.Sprintf("%s; want a positive duration", c.ApplyHeldEvery)}
	}
	if c.Ordered && c.AtMostOnce {
		return &ConfigError{Field: "Ordered", Reason: "not with AtMostOnce: a held message runs after its predecessor's commit, with no key committed before its effect"}
	}
	switch c.Isolation {
	case sql.LevelDefault, sql.LevelReadUncommitted, sql.LevelReadCommitted, sql.LevelRepeatableRead, sql.LevelSerializable:
	default:
		// Refused by PostgreSQL's and MySQL's drivers at every BEGIN, each
		// delivery nacked for ever; SQLite's ignores it.
		return &ConfigError{Field: "Isolation", Reason: fmt.Sprintf("%v; want sql.LevelDefault, LevelReadUncommitted, LevelReadCommitted, LevelRepeatableRead or LevelSerializable", c.Isolation)}
	}
	return nil
}

// checkConsumer accepts a consumer name as checkName does and, on MySQL,
// one that does not end in a space: processed_messages and the ordered
// inbox's tables compare consumer names PAD SPACE there (utf8mb4_bin), so
// "ship " would share the keys of "ship", and a message both handle would
// be acked as a duplicate by the second without running.
func checkConsumer(d Dialect, name string) error {
	if err := checkName(name); err != nil {
		return err
	}
	if strings.HasSuffix(name, " ") && d.sql().PadsKeys() {
		return fmt.Errorf("ends in a space, which MySQL's inbox tables compare away: it would share the dedupe keys of %q", strings.TrimRight(name, " "))
	}
	return nil
}

// ErrNoMessageID is returned for a message that has no id, neither a UUID
// nor x-acemq-id metadata, unless InboxConfig.AllowMissingID is set.
var ErrNoMessageID = errors.New("outbox: message has no id to dedupe on")

// ErrTxRolledBackUnderHandler fails a delivery whose transaction the
// database rolled back while its handler ran, the handler returning no
// error: a deadlock or lock wait timeout on MySQL (on SQLite an interrupted
// statement, a full disk) that the handler, or a middleware added after
// inbox.Middleware (Retry, PoisonQueue), took. The database then runs each later statement
// on its own, committed as it runs, and MySQL commits no transaction
// without a word; the dedupe key and the key's sequence went with the
// rollback. The messages the handler returned are not written, and the
// delivery is nacked, to be run again; what the handler wrote after the
// rollback stays committed. Add Retry and PoisonQueue before
// inbox.Middleware.
var ErrTxRolledBackUnderHandler = errors.New("outbox: inbox: the handler's transaction was rolled back while it ran, and the handler returned no error")

// ErrHandlerTxDone fails a delivery whose transaction was over when the
// handler returned: the handler committed or rolled back the transaction
// TxFromContext gave it (leave both to the inbox), or the message's context
// ended while it ran, which makes database/sql roll it back. The messages
// the handler returned are not written, and the delivery is nacked. After
// a commit by the handler its key is committed, so the redelivery is acked
// as a duplicate and those messages are lost: the handler must not commit.
// Where the message's context ended, the error wraps its cause too
// (context.DeadlineExceeded under a Timeout middleware).
var ErrHandlerTxDone = errors.New("outbox: inbox: the handler's transaction was over when it returned: committed or rolled back by the handler (leave both to the inbox), or rolled back as the message's context ended")

// ErrHandlerEndedTx is ErrHandlerTxDone.
//
// Deprecated: use ErrHandlerTxDone; the two names of before,
// ErrHandlerEndedTx and ErrHandlerTxEnded, differed only in word order.
var ErrHandlerEndedTx = ErrHandlerTxDone

// ErrHandlerTxEnded is ErrTxRolledBackUnderHandler.
//
// Deprecated: use ErrTxRolledBackUnderHandler; the two names of before,
// ErrHandlerEndedTx and ErrHandlerTxEnded, differed only in word order.
var ErrHandlerTxEnded = ErrTxRolledBackUnderHandler

// ErrNotUnderInbox is returned by the publisher of Inbox.Publisher when a
// router hands it messages: their handler did not run behind the inbox's
// middleware, which writes them into the outbox and returns none.
var ErrNotUnderInbox = errors.New("outbox: messages a handler returned reached the inbox's publisher: the handler did not run under Inbox.Middleware, whose transaction writes them into the outbox")

// Inbox is the consumer's half of the outbox contract: a Watermill handler
// middleware that records (consumer, message id) in processed_messages in
// the same transaction as the handler's effect, and only then lets the
// message be acked. A message whose key is already there is acked without
// running the handler.
//
// Unlike Watermill's Deduplicator, which records the key before the handler
// runs and so drops the retry of a handler that failed, the key here commits
// with the effect or not at all (unless InboxConfig.AtMostOnce asks for the
// key first).
//
// The messages a handler returns are written into the outbox in the same
// transaction, to the router handler's publish topic, and none reach the
// router: a router publish after the commit could fail, and the redelivery,
// a duplicate, would not produce them again. Register such a handler with
// the inbox's Publisher.
type Inbox struct {
	db       *sqlx.DB
	dialect  Dialect
	cfg      InboxConfig
	q        *sqldialect.Inbox
	outbox   *sqldialect.Outbox // the table MarkOutboxProcessed marks and returned messages go to
	returned TxPublisherConfig  // how returned messages are written, checked once
	ordered  *orderedState      // nil unless cfg.Ordered
	log      watermill.LoggerAdapter
	tracer   trace.Tracer // nil without a TracerProvider

	// running holds the at-most-once keys whose handler runs in this
	// process, each closed when it returns (see processAtMostOnce).
	runningMu sync.Mutex
	running   map[[2]string]chan struct{}

	// outboxIDs is what the outbox's id column holds (see markable), an
	// idsAny…idsNumeric; 0 while not looked up.
	outboxIDs atomic.Int32

	// clock is the server's, on which the at-most-once stamps are written
	// and compared.
	clock *dbClock

	// plugged: a router runs the inbox's Plugin, so its deliveries come
	// with a router handler name unless a middleware dropped their
	// context, or they were handed to the inbox outside it (see
	// processOrdered).
	plugged atomic.Bool
	// flight: the deliveries of the plugged routers' handlers under way.
	flight inFlight

	// aside recalls the keyed messages this process set aside, for the
	// gap lines (see loggedAside and logGaps).
	aside asideKeys
}

// routerStopping reports whether the router that delivered msg is
// stopping (its handler's run, as Plugin's decorator put it in the
// message's context, has ended): false without the plugin.
func (in *Inbox) routerStopping(msg *message.Message) bool {
	run, _ := msg.Context().Value(routerRunKey{}).(context.Context)
	return run != nil && run.Err() != nil
}

// serverNow is the database server's time now (see dbClock).
func (in *Inbox) serverNow(ctx context.Context) (time.Time, error) {
	return in.clock.now(ctx, in.db, in.dialect.sql())
}

// NewInbox returns the inbox over db, a *sql.DB or *sqlx.DB.
func NewInbox(db any, cfg InboxConfig) (*Inbox, error) {
	var xdb *sqlx.DB
	switch h := db.(type) {
	case *sqlx.DB:
		xdb = h
		if h != nil && cfg.Dialect == nil {
			d, err := dialectForDriver(h.DriverName())
			if err != nil {
				return nil, err
			}
			cfg.Dialect = d
		}
	case *sql.DB:
		if h != nil && cfg.Dialect != nil {
			xdb = sqlx.NewDb(h, cfg.Dialect.sql().DriverName())
		}
	default:
		return nil, &ConfigError{Field: "db", Reason: fmt.Sprintf("%T; want a *sql.DB or *sqlx.DB", db)}
	}
	cfg.setDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	if xdb == nil {
		return nil, &ConfigError{Field: "db", Reason: "nil database handle"}
	}
	if err := checkDialect(xdb.DB, cfg.Dialect); err != nil {
		return nil, err
	}
	q, err := sqldialect.NewInbox(cfg.Dialect.sql(), cfg.InboxTable)
	if err != nil {
		return nil, &ConfigError{Field: "InboxTable", Reason: err.Error()}
	}
	outbox, err := sqldialect.NewOutbox(cfg.Dialect.sql(), cfg.OutboxTable)
	if err != nil {
		return nil, &ConfigError{Field: "OutboxTable", Reason: err.Error()}
	}
	returned, err := cfg.returnedConfig()
	if err != nil {
		return nil, err
	}
	in := &Inbox{db: xdb, dialect: cfg.Dialect, cfg: cfg, q: q, outbox: outbox, returned: returned, log: cfg.Logger, clock: newDBClock(cfg.Dialect)}
	if cfg.TracerProvider != nil {
		in.tracer = cfg.TracerProvider.Tracer(tracerName)
	}
	if cfg.Ordered {
		in.ordered = newOrderedState(cfg.Dialect.sql(), xdb.DB, cfg.InboxTable)
	}
	return in, nil
}

// returnedConfig is Outbox on the inbox's dialect and outbox table, with
// its defaults, checked: what every returned message is written with.
func (c InboxConfig) returnedConfig() (TxPublisherConfig, error) {
	p := c.Outbox
	if p.Dialect != nil && p.Dialect != c.Dialect {
		return p, &ConfigError{Field: "Outbox.Dialect", Reason: fmt.Sprintf("%s, but the inbox's Dialect is %s: returned messages are written through the inbox's transaction; leave Outbox.Dialect empty", p.Dialect.Name(), c.Dialect.Name())}
	}
	if p.Table != "" && p.Table != c.OutboxTable {
		return p, &ConfigError{Field: "Outbox.Table", Reason: fmt.Sprintf("%q, but OutboxTable is %q: returned messages go to the inbox's OutboxTable; set that, and leave Outbox.Table empty", p.Table, c.OutboxTable)}
	}
	p.Dialect, p.Table = c.Dialect, c.OutboxTable
	if p.Propagator == nil {
		p.Propagator = c.Propagator // the handler's trace, carried on
	}
	p.setDefaults()
	if err := p.validate(); err != nil {
		var ce *ConfigError
		if errors.As(err, &ce) {
			return p, &ConfigError{Field: "Outbox." + ce.Field, Reason: ce.Reason}
		}
		return p, err
	}
	return p, nil
}

// Publisher is the publisher to hand to router.AddHandler for a handler
// behind this inbox:
//
//	router.AddMiddleware(inbox.Middleware)
//	router.AddHandler("ship", "order.paid", sub, "order.shipped", inbox.Publisher(), ship)
//
// The middleware writes the messages the handler returns into the outbox
// itself, in the handler's transaction, and hands none to the router, so
// under this wiring the publisher is never called. If it is, a handler ran
// without the middleware: Publish fails with ErrNotUnderInbox, the router
// nacks, and nothing is published or dropped. Close does nothing (the
// router closes a handler's publisher once per handler that shares it).
func (in *Inbox) Publisher() message.Publisher { return inboxPublisher{} }

type inboxPublisher struct{}

func (inboxPublisher) Publish(topic string, msgs ...*message.Message) error {
	if len(msgs) == 0 {
		return nil
	}
	return fmt.Errorf("%w (%d for topic %q)", ErrNotUnderInbox, len(msgs), topic)
}

func (inboxPublisher) Close() error { return nil }

type txKey struct{}

// handlingKey is the context value of a message an Inbox runs its handler
// for: a handling (see handle).
type handlingKey struct{}

// handling is the Inbox that runs a handler, and the message it runs it
// for: the message, not the context alone, since a message the handler
// makes with its context (published in process, a CQRS event bus) is a
// delivery of its own (a code review: it was let through undeduped, in
// the first message's transaction).
type handling struct {
	in  *Inbox
	msg *message.Message
}

// TxFromContext returns the transaction the Inbox opened for the message
// being handled. Make the handler's effect through it, and publish through
// NewTxPublisher(tx): the effect, the outgoing messages and the dedupe key
// commit together, or none of them. The inbox commits or rolls it back
// after the handler: a handler that does either itself fails its delivery
// with ErrHandlerTxDone, and after its own commit the messages it returns
// are lost. Under InboxConfig.AtMostOnce there is none.
func TxFromContext(ctx context.Context) (*sqlx.Tx, bool) {
	tx, ok := ctx.Value(txKey{}).(*sqlx.Tx)
	return tx, ok
}

// Middleware dedupes and runs h in a transaction; add it to a router or a
// handler with AddMiddleware. It returns no messages to the router: what h
// returns goes into the outbox (see Inbox and Publisher).
//
// Middlewares added after it run inside its transaction: add Retry and
// PoisonQueue before it (one after it would commit a failed attempt's
// writes), and CorrelationID, which changes the returned messages, after.
//
// Outside a router, where a delivery names no handler, an Ordered inbox
// tells handlers apart by their function (see ErrConsumerShared): one
// handler may be wrapped again (per worker, or at each reconnect of a
// consume loop), two functions under one ConsumerName may not.
func (in *Inbox) Middleware(h message.HandlerFunc) message.HandlerFunc {
	code := handlerCode(reflect.ValueOf(h).Pointer())
	return func(msg *message.Message) ([]*message.Message, error) {
		return in.handle(h, code, msg)
	}
}

// handlerCode is the code of a handler Middleware wrapped: what tells two
// handlers apart outside a router, as far as the process can tell. One
// function wrapped twice is one handler, and so are two closures of one
// function literal.
type handlerCode uintptr

// conflictTries is how many times a delivery runs whose transaction the
// database refused for a concurrent one on the same rows, and
// conflictPause the pause before its try-th try again: 5 ms doubling, each
// at random between half and one and a half of that.
const conflictTries = 8

func conflictPause(try int) time.Duration {
	d := 5 * time.Millisecond << min(try, 5)
	return d/2 + rand.N(d)
}

// lostPause is the pause before a delivery runs again after its n-th lost
// connection in a row: 50 ms doubling to 5 s.
func lostPause(n int) time.Duration {
	return min(50*time.Millisecond<<min(n, 7), 5*time.Second)
}

// dbLostError is a delivery's error when the database dropped its
// connection (or, SQLite, stayed locked by another connection) and did
// not answer again before the delivery's context ended: the message is
// marked (dbLostKey), and PoisonPublisher does not set it aside.
type dbLostError struct{ err error }

func (e *dbLostError) Error() string {
	return "outbox: inbox: the database did not answer before the delivery's context ended: " + e.err.Error()
}

func (e *dbLostError) Unwrap() error { return e.err }

func (in *Inbox) handle(h message.HandlerFunc, code handlerCode, msg *message.Message) ([]*message.Message, error) {
	if msg.Context().Value(handlingKey{}) == (handling{in, msg}) {
		// The same inbox twice around a handler (router.AddMiddleware and
		// a handler's, say): this delivery is the outer one's, in its
		// transaction, deduped. The inner one began another and waited on
		// the outer's locks for as long as the message's context lasted,
		// the handler never run (a README review).
		return h(msg)
	}
	in.restoreDelivery(msg)
	if w := wakeOf(msg); w != nil {
		if w != in {
			return h(msg) // another inbox's, after this one (or Plugin's middleware ends it)
		}
		wakeTaken(msg)
		if in.ordered != nil {
			in.wake(h, code, msg)
		}
		return nil, nil
	}
	if err := msg.Context().Err(); err != nil {
		// Nothing to begin a transaction with, and a bare "begin: context
		// canceled" hid the usual cause: Watermill's Timeout cancels the
		// context it gave the message when it returns, and a Retry before
		// it starts every retry with that context unless told otherwise.
		return nil, fmt.Errorf("outbox: inbox: message %s: its context ended before the inbox began (%w); behind middleware.Timeout, "+
			"a middleware.Retry before it needs ResetContextOnRetry, or every retry gets the first attempt's ended context", idText(msg.UUID), err)
	}
	// Under REPEATABLE READ or SERIALIZABLE (InboxConfig.Isolation),
	// deliveries of one key at once refuse each other with serialization
	// failures, and a deadlock refuses one of two transactions anywhere.
	// Such a transaction was rolled back whole, so running the delivery
	// again here is what a redelivery would do, without the nack: a hot
	// key at a prefetch of 50 nacked one delivery 21 times, past RabbitMQ
	// 4's delivery limit of 20 for quorum queues, which then drops or
	// dead-letters it.
	// The inbox's own marks (see PoisonPublisher), never a producer's: one
	// that came from the wire (a service that forwards the headers it got)
	// kept a poison message from its poison queue for ever (a review), and
	// one left from the run before, seen by the handler on Retry's next
	// run, went on in the headers it forwarded. A run again of a delivery
	// whose context ended returned above, keeping the marks its run before
	// set; this run sets its own after the handler.
	delete(msg.Metadata, interruptedKey)
	delete(msg.Metadata, dbLostKey)
	var (
		outcome  inboxOutcome
		consumer string
		tries    int
		err      error
	)
	if in.cfg.Propagator != nil || in.tracer != nil {
		// The message leaves with the context it came with: a Retry around
		// the inbox starts its next run from the publisher's trace again,
		// not from this run's span.
		orig := msg.Context()
		if in.cfg.Propagator != nil {
			// The publisher's trace, carried in the metadata through the row
			// and the broker, becomes the parent of the handler's work.
			msg.SetContext(in.cfg.Propagator.Extract(orig, metadataCarrier(msg.Metadata)))
		}
		var span trace.Span
		if in.tracer != nil {
			span = in.startProcessSpan(msg)
		}
		defer func() {
			if span != nil {
				endProcessSpan(span, outcome, err)
			}
			msg.SetContext(orig)
		}()
	}
	err = in.retryConflicts(msg.Context(), func() error {
		if tries++; tries > 1 {
			in.log.Debug("Inbox transaction refused for a concurrent one; running the delivery again", watermill.LogFields{"message_uuid": idText(msg.UUID), "try": tries - 1, "error": err.Error()})
		}
		outcome, consumer, err = in.process(h, code, msg)
		return err
	})
	err = unmigrated(in.dialect, err, in.q.Table(), in.outbox.Table(), sqldialect.InboxSequencesTable, sqldialect.InboxHeldTable)
	if err != nil && errors.Is(msg.Context().Err(), context.Canceled) && msg.Metadata != nil {
		// Its context, alive when the inbox began, was cancelled while the
		// handler ran: the router's (or the subscriber's) Close, not the
		// handler's failure, nor middleware.Timeout's deadline (which ends
		// it with DeadlineExceeded; Timeout cancels it only once this
		// returns). PoisonPublisher refuses to set it aside.
		msg.Metadata.Set(interruptedKey, markToken)
	}
	if msg.Metadata != nil {
		// This run's word alone: Retry runs the same message again.
		delete(msg.Metadata, dbLostKey)
		if errors.As(err, new(*dbLostError)) {
			msg.Metadata.Set(dbLostKey, markToken)
		}
	}
	if err == nil && outcome == inboxDuplicate {
		in.markDuplicateProcessed(msg)
	}
	if consumer != "" {
		in.cfg.Metrics.inbox(consumer, outcome)
	}
	// Nothing goes back to the router: the messages the handler returned
	// are in the outbox already, or the message failed.
	return nil, err
}

// consumerIn is the consumer a message delivered with ctx is processed
// for: ConsumerName, or the name of the router handler ctx is of.
func (in *Inbox) consumerIn(ctx context.Context) string {
	if in.cfg.ConsumerName != "" {
		return in.cfg.ConsumerName
	}
	return message.HandlerNameFromCtx(ctx)
}

// process runs one message through the inbox, and says what became of it
// and for which consumer ("" if it has no valid name). code is h's.
func (in *Inbox) process(h message.HandlerFunc, code handlerCode, msg *message.Message) (outcome inboxOutcome, consumer string, err error) {
	ctx := msg.Context() // with the publisher's trace, and the inbox's span (see handle)
	key := dedupeKey(msg)
	// The consumer first: a message refused before it is read (no id, a
	// bad seq) still counts, under the consumer's name if it has a valid
	// one.
	consumer = in.consumerIn(ctx)
	counted, nameErr := consumer, checkConsumer(in.dialect, consumer)
	if nameErr != nil {
		counted = ""
	}
	var (
		aggregate string
		seq       int64
		keyed     bool
	)
	if in.ordered != nil {
		if aggregate, seq, keyed, err = orderKey(msg, in.dialect.sql().TextKeys()); err != nil {
			return inboxFailed, counted, err
		}
	}
	if key == "" {
		if keyed {
			// Held, it could not be told from its redelivery.
			return inboxFailed, counted, fmt.Errorf("%w (a keyed message, aggregateId %.80q: AllowMissingID does not apply)", ErrNoMessageID, aggregate)
		}
		if in.cfg.AllowMissingID {
			msg.SetContext(ctx)
			out, err := in.runRecovering(h, msg)
			if err == nil {
				err = in.writeReturnedAlone(ctx, out)
			}
			if err != nil {
				return inboxFailed, counted, err
			}
			return inboxProcessed, counted, nil
		}
		return inboxFailed, counted, ErrNoMessageID
	}
	if consumer == "" {
		return inboxFailed, "", &ConfigError{Field: "ConsumerName", Reason: "empty, and the message carries no router handler name"}
	}
	if nameErr != nil {
		return inboxFailed, "", &ConfigError{Field: "ConsumerName", Reason: fmt.Sprintf("%.80q %v", consumer, nameErr)}
	}
	if keyed {
		if err := in.carryAsIs(ctx, consumer, key); err != nil {
			return inboxFailed, consumer, err
		}
		outcome, err := in.processOrdered(ctx, h, code, msg, consumer, key, aggregate, seq)
		return outcome, consumer, err
	}
	if done, err := in.processedAsIs(ctx, consumer, key); err != nil {
		return inboxFailed, consumer, err
	} else if done {
		return inboxDuplicate, consumer, nil
	}
	if in.cfg.AtMostOnce {
		outcome, err := in.processAtMostOnce(ctx, h, msg, consumer, key)
		return outcome, consumer, err
	}

	tx, err := in.db.BeginTxx(ctx, &sql.TxOptions{Isolation: in.cfg.Isolation})
	if err != nil {
		return inboxFailed, consumer, fmt.Errorf("outbox: inbox: begin: %w", err)
	}
	committed := false
	defer func() {
		if !committed {
			_ = tx.Rollback()
		}
	}()
	if fresh, err := in.record(ctx, tx, consumer, key); err != nil {
		return inboxFailed, consumer, err
	} else if !fresh {
		return inboxDuplicate, consumer, nil
	}

	if err := in.runInTx(ctx, tx, h, msg, consumer, key); err != nil {
		return inboxFailed, consumer, err
	}
	if err := tx.Commit(); err != nil {
		return inboxFailed, consumer, in.handledCommitErr(ctx, err, key, consumer)
	}
	committed = true
	return inboxProcessed, consumer, nil
}

// handledCommitErr is the error of the commit of a handler's transaction.
// PostgreSQL ends a transaction in which a statement failed with a
// rollback: a handler that returned no error after one had its error
// taken by something between it and the inbox, most likely a Watermill
// middleware added after inbox.Middleware (PoisonQueue, Retry), which then
// runs inside its transaction.
func (in *Inbox) handledCommitErr(ctx context.Context, err error, id, consumer string) error {
	err = endedUnderHandler(ctx, err)
	if in.dialect.sql().CommitRolledBack(err) {
		return fmt.Errorf("outbox: inbox: commit %s for %s: a statement of the handler's transaction failed, yet the handler returned no error (a middleware after inbox.Middleware, such as PoisonQueue or Retry, may have taken it; add those before inbox.Middleware): %w", idText(id), consumer, err)
	}
	return fmt.Errorf("outbox: inbox: commit %s for %s: %w", idText(id), consumer, err)
}

// record inserts the key in tx and, with MarkOutboxProcessed, marks the
// outbox record processed. It reports false for a key already there:
// processed before, by a delivery whose transaction committed.
func (in *Inbox) record(ctx context.Context, tx *sqlx.Tx, consumer, key string) (fresh bool, err error) {
	return in.recordAt(ctx, tx, consumer, key, time.Now())
}

// recordAt is record with the key stamped at (its processed_at), which is
// ahead of now for an at-most-once key whose handler is to run.
func (in *Inbox) recordAt(ctx context.Context, tx *sqlx.Tx, consumer, key string, at time.Time) (fresh bool, err error) {
	now := time.Now()
	res, err := in.exec(ctx, tx, in.q.Insert(consumer, key, at))
	if err != nil {
		return false, fmt.Errorf("outbox: inbox: record %s for %s: %w", idText(key), consumer, err)
	}
	if fresh, err := sqldialect.InsertedAll(in.dialect.sql(), res, 1); err != nil {
		return false, fmt.Errorf("outbox: inbox: %w", err)
	} else if !fresh {
		if _, err := in.sameKey(ctx, tx, consumer, key); err != nil {
			return false, err
		}
		in.log.Debug("Duplicate message acked without running the handler", watermill.LogFields{"message_uuid": idText(key), "consumer": consumer})
		return false, nil
	}
	return true, in.markApplied(ctx, tx, key, now)
}

// processedAsIs reports whether consumer's key, an unkeyed message's, is
// in the inbox table as it is (see foundAsIs): its message was processed
// before the move to this library, and is acked as a duplicate.
func (in *Inbox) processedAsIs(ctx context.Context, consumer, key string) (bool, error) {
	found, err := in.foundAsIs(ctx, consumer, key)
	if found {
		in.log.Debug("Duplicate message acked without running the handler", watermill.LogFields{"message_uuid": idText(key), "consumer": consumer})
	}
	return found, err
}

// carryAsIs records a keyed message's key in the inbox's form
// (sqldialect.InboxKey), on its own before the message's transaction,
// where the table holds it as it is (see foundAsIs): on every path the
// ordered inbox then finds its id processed. Its key's next, it moves
// the key past it, as for an id processed before the consumer was
// ordered; ahead of its predecessor, it is held, and moved past so once
// applied in turn; behind, it is a duplicate. Not looked for (before
// this was written), its redelivery after the move ran again. A copy
// delivered since finds the key and writes nothing. The apply of a held
// message looks again (see applyNextHeld).
func (in *Inbox) carryAsIs(ctx context.Context, consumer, key string) error {
	if found, err := in.foundAsIs(ctx, consumer, key); err != nil || !found {
		return err
	}
	q := sqldialect.Inline(in.dialect.sql(), in.q.Insert(consumer, key, time.Now()))
	if _, err := in.db.ExecContext(ctx, q.SQL, q.Args...); err != nil {
		return fmt.Errorf("outbox: inbox: record %s for %s, processed as it is: %w", idText(key), consumer, err)
	}
	in.log.Debug("Message processed under its id as it is recorded under the inbox's key", watermill.LogFields{"message_uuid": idText(key), "consumer": consumer})
	return nil
}

// foundAsIs reports whether consumer's key is in the inbox table as it is
// where the inbox keeps it under its digest (sqldialect.InboxKey): a
// table another library's inbox wrote, with a message_id wider than 64,
// holds the ids it processed so, and a redelivery of one after the move
// to this library would otherwise run again. One plain read on the pool,
// before the message's transaction, for such ids alone; none for an id no
// text column holds (not UTF-8, a NUL), which no such table holds either.
// A read the table refuses for a character its column cannot hold
// (MySQL's for a utf8mb3 or latin1 column, PostgreSQL's in a database of
// another encoding: CannotHold) finds nothing, for no row holds the id;
// in the transaction, the first failed every delivery, and the second
// aborted the transaction. Any other failure fails the delivery, as the
// transaction's would: taken for nothing found (a lock timeout behind an
// ALTER TABLE), it ran a message the table holds again.
func (in *Inbox) foundAsIs(ctx context.Context, consumer, key string) (bool, error) {
	if !digested(key) {
		return false, nil
	}
	var gotConsumer, gotKey string
	q := sqldialect.Inline(in.dialect.sql(), in.q.KeyAsIs(consumer, key))
	switch err := in.db.QueryRowContext(ctx, q.SQL, q.Args...).Scan(&gotConsumer, &gotKey); {
	case errors.Is(err, sql.ErrNoRows) || in.dialect.sql().CannotHold(err):
		return false, nil
	case err != nil:
		return false, fmt.Errorf("outbox: inbox: look for the key of %s for %s as it is: %w", idText(key), consumer, err)
	}
	// Not another's, under a collation that takes it for this one.
	return gotConsumer == consumer && gotKey == key, nil
}

// digested reports whether the inbox keeps key under its digest and a
// table could hold it as it is (see foundAsIs).
func digested(key string) bool {
	return sqldialect.InboxKey(key) != key && textHolds(key)
}

// sameKey makes sure that the key the insert found is consumer's id, byte
// for byte, before its message is taken for a duplicate. A table another
// library created may compare message_id (or consumer_name) without case
// (MySQL's *_ci collations, SQLite's NOCASE, a nondeterministic collation
// on PostgreSQL): "ORDER-1" was then the key of "order-1", and its message,
// acked without running, was lost. Its delivery fails instead, until the
// column is converted. A key gone since the insert found it is left to the
// duplicate it was. A key that reads back as the id's UUID in PostgreSQL's
// form (lower case, hyphens) is the id's: a message_id column of type uuid
// holds the UUID, not the text it came as. Duplicates only: a redelivery
// pays the read. found says whether the key is there.
func (in *Inbox) sameKey(ctx context.Context, tx *sqlx.Tx, consumer, key string) (found bool, err error) {
	var gotConsumer, gotKey string
	err = in.queryRow(ctx, tx, in.q.Key(consumer, key)).Scan(&gotConsumer, &gotKey)
	switch {
	case errors.Is(err, sql.ErrNoRows):
		return false, nil
	case err != nil:
		return false, fmt.Errorf("outbox: inbox: read the key of %s for %s: %w", idText(key), consumer, err)
	case !keyIs(gotConsumer, gotKey, consumer, key):
		return true, fmt.Errorf("outbox: inbox: %s for %s: %s holds the key of message %q for consumer %q, which its collation takes for this one:"+
			" ids that differ in case are different messages; the message is not acked as a duplicate (convert consumer_name and message_id to a"+
			" binary collation: utf8mb4_bin on MySQL, BINARY on SQLite, a deterministic one on PostgreSQL)", idText(key), consumer, in.q.Table(), gotKey, gotConsumer)
	}
	return true, nil
}

// keyIs reports whether the key read back (gotConsumer, gotKey) is
// consumer's key of message id byte for byte, not another's that the
// table's collation takes for it (see sameKey).
func keyIs(gotConsumer, gotKey, consumer, id string) bool {
	return gotConsumer == consumer && (gotKey == sqldialect.InboxKey(id) || gotKey == canonicalUUID(id))
}

// exec and queryRow run q in a message's transaction, its arguments written
// into its text where that saves round trips (sqldialect.Inline; on MySQL
// one round trip where go-sql-driver would prepare, execute and close),
// under stmtCtx.
func (in *Inbox) exec(ctx context.Context, tx *sqlx.Tx, q sqldialect.Query) (sql.Result, error) {
	q = sqldialect.Inline(in.dialect.sql(), q)
	return tx.ExecContext(in.stmtCtx(ctx), q.SQL, q.Args...)
}

func (in *Inbox) queryRow(ctx context.Context, tx *sqlx.Tx, q sqldialect.Query) *sql.Row {
	q = sqldialect.Inline(in.dialect.sql(), q)
	return tx.QueryRowContext(in.stmtCtx(ctx), q.SQL, q.Args...)
}

// stmtCtx is ctx for a statement of the inbox's own in a message's
// transaction. On SQLite it does not end with ctx: mattn/go-sqlite3 runs a
// statement whose context can end on a goroutine of its own, to interrupt
// it should the context end, a fifth to a third of what the inbox added
// to a delivery over a second statement of the handler's (`-scenario
// inbox`, inbox_overhead_vs_floor_sqlite 1.15–1.17 before, 1.10–1.12
// after), for statements that wait for nothing: in process, they take
// microseconds, and a transaction begun under _txlock=immediate (see the
// README's Notes per database) holds the write lock from its BEGIN, which
// ctx does end. So does the transaction: database/sql rolls it back when
// ctx ends. Under _txlock=deferred, the transaction's first write may
// wait for the lock, up to the busy timeout, whatever ctx does.
func (in *Inbox) stmtCtx(ctx context.Context) context.Context {
	if in.dialect.sql() == sqldialect.SQLite {
		return context.WithoutCancel(ctx)
	}
	return ctx
}

// markProcessed, with MarkOutboxProcessed, marks the outbox record of a key
// processed: in the transaction that just recorded the key, or for a
// duplicate on the pool (markDuplicateProcessed).
//
// Where a write that finds no row locks its gap (MySQL, under REPEATABLE
// READ), it first looks for an unprocessed record with a plain read, and
// writes only if there is one. Many a message is not from this outbox
// (another service's, or any message when TrackedTopics is nil), and the
// UPDATE of its missing id locked the gap above it until the handler's
// commit: every insert of the service's own outbox rows into that gap (on
// a small table, any id above the last) waited for the whole handler, and
// two such handlers that publish through their transaction deadlocked.
// The record a message came from was committed before it was sent, so the
// read sees it; an UPDATE of a row that is there locks that row alone.
// Under REPEATABLE READ the read takes the transaction's snapshot, as
// PostgreSQL's first statement does: the handler's plain reads see the
// database as of the mark rather than as of its own first read, a moment
// later. Under SERIALIZABLE every read locks, and the gap stays locked.
// PostgreSQL takes no gap locks, and SQLite's transaction holds the
// database's write lock from the key's insert on: one statement there.
func (in *Inbox) markProcessed(ctx context.Context, on execQuerier, key string, now time.Time) error {
	return in.mark(ctx, on, key, now, processedMark{})
}

// markApplied is markProcessed of a message whose handler's transaction
// this is: a set-aside note the record kept goes (MarkApplied).
func (in *Inbox) markApplied(ctx context.Context, on execQuerier, key string, now time.Time) error {
	return in.mark(ctx, on, key, now, processedMark{applied: true})
}

// markProcessedNoting is markProcessed of a message set aside, with note
// in the record's last_error (sqldialect.Outbox.MarkSetAside).
func (in *Inbox) markProcessedNoting(ctx context.Context, on execQuerier, key string, now time.Time, note string) error {
	return in.mark(ctx, on, key, now, processedMark{note: note})
}

// processedMark is how a record is marked processed: as it was held, or
// as a duplicate (neither set), applied, or set aside with a note.
type processedMark struct {
	applied bool
	note    string
}

// mark marks the record of key processed as m says (see markProcessed).
func (in *Inbox) mark(ctx context.Context, on execQuerier, key string, now time.Time, m processedMark) error {
	if !in.cfg.MarkOutboxProcessed || (in.cfg.TrackedTopics != nil && !in.cfg.TrackedTopics.Tracked(message.SubscribeTopicFromCtx(ctx))) {
		return nil
	}
	if !in.markable(ctx, on, key) {
		return nil // not from this outbox
	}
	d := in.dialect.sql()
	if d.GapLocks() {
		look := sqldialect.Inline(d, in.outbox.Unprocessed(key, m.applied))
		var one int
		switch err := on.QueryRowContext(ctx, look.SQL, look.Args...).Scan(&one); {
		case errors.Is(err, sql.ErrNoRows):
			return nil // not from this outbox, or processed already
		case err != nil:
			return fmt.Errorf("outbox: inbox: look up outbox record %s: %w", idText(key), err)
		}
	}
	q := in.outbox.MarkProcessed(key, now)
	switch {
	case m.note != "":
		q = in.outbox.MarkSetAside(key, now, m.note)
	case m.applied:
		q = in.outbox.MarkApplied(key, now)
	}
	q = sqldialect.Inline(d, q)
	stmt := ctx
	if _, inTx := on.(*sqlx.Tx); inTx {
		stmt = in.stmtCtx(ctx)
	}
	if _, err := on.ExecContext(stmt, q.SQL, q.Args...); err != nil {
		if ctx.Err() != nil {
			// The update waits for the record's row lock: a review's
			// handlers sat 30 s behind a session's SELECT … FOR UPDATE of
			// outbox rows, until their Timeout, with an error that named
			// no lock. A relay's claim holds it only until its mark.
			return fmt.Errorf("outbox: inbox: mark outbox record %s processed: %w (waiting for the record's row lock? a session or another library's relay holding it FOR UPDATE keeps the mark, and this delivery, waiting)", idText(key), err)
		}
		return fmt.Errorf("outbox: inbox: mark outbox record %s processed: %w", idText(key), err)
	}
	return nil
}

// markable reports whether key can be an id of the outbox's rows. An
// outbox another library made with ids of a type other than text holds no
// row of an id that does not read as one: on PostgreSQL a uuid or bigint
// id column and a ULID, another service's id, and the mark's statement,
// binding it, failed, aborting the message's transaction at every
// delivery; on MySQL a BIGINT id column, which reads "17abc" as 17, and
// the mark took another record for the message's. The column's type is
// looked up once; a failed look-up is tried again at the next mark, which
// then binds the id as before.
//
// Nor does PostgreSQL's text hold an id that is not UTF-8, or holds a NUL
// (the inbox takes such a message under a digest of its id: sqldialect's
// InboxKey): bound, it failed the transaction. SQLite's TEXT holds any
// bytes, and MySQL's varchar a NUL, which a relay publishes as they are.
//
// The look-up runs on on, the message's transaction (or the pool for a
// duplicate's mark): on the pool it waited for a second connection while
// the message's transaction held one, for ever on a pool capped at one,
// or at as many deliveries at once as the pool has connections.
func (in *Inbox) markable(ctx context.Context, on execQuerier, key string) bool {
	if in.dialect.sql().TextKeys() && !textHolds(key) {
		return false
	}
	if ids := in.outboxIDs.Load(); ids != 0 {
		return idOf(ids, key)
	}
	q, ok := in.outbox.IDType()
	if !ok {
		in.outboxIDs.Store(idsAny)
		return true
	}
	var typ string
	if err := on.QueryRowContext(ctx, q.SQL, q.Args...).Scan(&typ); err != nil {
		return true
	}
	ids := idsOfType(typ)
	in.outboxIDs.Store(ids)
	return idOf(ids, key)
}

// What an outbox's id column holds, by its type (see idsOfType).
const (
	idsAny      int32 = iota + 1 // text, or a type no mark's id can fail
	idsUUID                      // PostgreSQL's uuid
	idsInt8                      // integers, of 8 to 64 bits
	idsInt16                     //
	idsInt32                     //
	idsInt64                     //
	idsUint8                     // MySQL's unsigned integers
	idsUint16                    //
	idsUint32                    //
	idsUint64                    //
	idsDecimal                   // MySQL's decimal
	idsZerofill                  // MySQL's decimal zerofill
	idsNumeric                   // PostgreSQL's numeric
)

// idsOfType is what an id column of type typ (as IDType gives it) holds.
func idsOfType(typ string) int32 {
	typ, zerofill := strings.CutSuffix(typ, " zerofill")
	unsigned := int32(0)
	if t, ok := strings.CutSuffix(typ, " unsigned"); ok {
		typ, unsigned = t, idsUint8-idsInt8
	}
	switch typ {
	case "uuid":
		return idsUUID
	case "tinyint":
		return idsInt8 + unsigned
	case "smallint":
		return idsInt16 + unsigned
	case "integer", "int", "mediumint":
		return idsInt32 + unsigned
	case "bigint":
		return idsInt64 + unsigned
	case "decimal":
		if zerofill {
			return idsZerofill
		}
		return idsDecimal
	case "numeric":
		return idsNumeric
	}
	return idsAny
}

// idOf reports whether key reads as an id of a column that holds ids:
// one that binding key to would neither fail nor read as another row's.
// An integer's is its digits as the relay publishes them: "042", "+42"
// and "-0" read as another's ids (42, 0), and are none.
func idOf(ids int32, key string) bool {
	switch ids {
	case idsUUID:
		return pgUUID(key)
	case idsInt8, idsInt16, idsInt32, idsInt64:
		v, err := strconv.ParseInt(key, 10, 8<<(ids-idsInt8))
		return err == nil && strconv.FormatInt(v, 10) == key
	case idsUint8, idsUint16, idsUint32, idsUint64:
		v, err := strconv.ParseUint(key, 10, 8<<(ids-idsUint8))
		return err == nil && strconv.FormatUint(v, 10) == key
	case idsNumeric, idsDecimal, idsZerofill:
		if ids == idsNumeric && key == "NaN" {
			return true // PostgreSQL's numeric holds it, and the relay publishes it so
		}
		// Leading zeros only where the relay's text has them: a MySQL
		// DECIMAL ZEROFILL's ("00000001.50"); elsewhere "042" reads as
		// another record's 42.
		whole, frac, dot := strings.Cut(strings.TrimPrefix(key, "-"), ".")
		return digits(whole) && (ids == idsZerofill || whole == "0" || whole[0] != '0') &&
			(!dot || digits(frac)) && key != "-0"
	}
	return true
}

// digits reports whether s is one or more decimal digits.
func digits(s string) bool {
	return s != "" && strings.Trim(s, "0123456789") == ""
}

// pgUUID reports whether PostgreSQL's uuid input reads s: 32 hex digits, in
// either case, a hyphen allowed after any group of four but the last, the
// whole in braces or not (string_to_uuid in its uuid.c).
func pgUUID(s string) bool {
	braces := strings.HasPrefix(s, "{")
	if braces {
		if !strings.HasSuffix(s, "}") {
			return false
		}
		s = s[1 : len(s)-1]
	}
	digits := 0
	for i := 0; i < len(s); i++ {
		switch c := s[i]; {
		case '0' <= c && c <= '9', 'a' <= c && c <= 'f', 'A' <= c && c <= 'F':
			digits++
		case c == '-' && digits%4 == 0 && digits > 0 && digits < 32 && s[i-1] != '-':
		default:
			return false
		}
	}
	return digits == 32
}

// canonicalUUID is s as PostgreSQL's uuid output writes it (32 lower case
// hex digits in groups of 8-4-4-4-12), or "" when pgUUID does not read s.
func canonicalUUID(s string) string {
	if !pgUUID(s) {
		return ""
	}
	hex := strings.ToLower(strings.Trim(strings.ReplaceAll(s, "-", ""), "{}"))
	return hex[:8] + "-" + hex[8:12] + "-" + hex[12:16] + "-" + hex[16:20] + "-" + hex[20:]
}

// execQuerier is what markProcessed runs on: the message's transaction,
// or the pool.
type execQuerier interface {
	sqlx.ExecerContext
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
}

// markDuplicateProcessed, with MarkOutboxProcessed, marks the outbox record
// of a duplicate processed, if it is not: the delivery that processed it
// may have come before MarkOutboxProcessed was on (a service that turned it
// on with Republish, as the quick start's third step does), and every
// Republish would then make the record pending again and send it again,
// at every boot, to every consumer of its routing key. One statement, on
// its own; a failure is logged, and the next duplicate tries again.
func (in *Inbox) markDuplicateProcessed(msg *message.Message) {
	in.markOnPool(msg.Context(), msg, "Duplicate acked, but its outbox record could not be marked processed; Republish may send it again", nil)
}

// markOnPool, with MarkOutboxProcessed, marks the outbox record of msg
// processed, if it is not, in a statement of its own on the pool (see
// markProcessed). ctx holds the topic msg arrived on, which TrackedTopics
// asks about. A failure is logged as failed says, with fields, and the
// message's id.
func (in *Inbox) markOnPool(ctx context.Context, msg *message.Message, failed string, fields watermill.LogFields) {
	if !in.cfg.MarkOutboxProcessed {
		return
	}
	key := dedupeKey(msg)
	if key == "" {
		return
	}
	if err := in.markProcessed(ctx, in.db, key, time.Now()); err != nil {
		in.log.Error(failed, err, fields.Add(watermill.LogFields{"message_uuid": idText(key)}))
	}
}

// processAtMostOnce commits the key before it runs the handler, with no
// transaction: see InboxConfig.AtMostOnce.
//
// A copy delivered while the handler of the first still runs in this
// process (the broker redelivers it after the first one's channel closed,
// a consumer's reconnect) finds the key committed, though the effect may
// yet fail and the key be taken back. Acked then as a duplicate, and the
// first's nack going to a channel that is gone, the message would be lost.
// So it waits for the first to return, and looks again: a duplicate if the
// key stayed, run if it was taken back.
func (in *Inbox) processAtMostOnce(ctx context.Context, h message.HandlerFunc, msg *message.Message, consumer, key string) (inboxOutcome, error) {
	release, err := in.runAlone(ctx, [2]string{consumer, key})
	if err != nil {
		return inboxFailed, err
	}
	defer release()
	fresh, err := in.recordRunning(ctx, consumer, key)
	if err != nil {
		return inboxFailed, err
	}
	if !fresh {
		return inboxDuplicate, nil
	}
	// From here a crash drops the message: its redelivery finds the key.
	in.cfg.Metrics.inbox(consumer, inboxAtMostOnce)

	orig := msg.Context()
	msg.SetContext(ctx)
	defer msg.SetContext(orig)
	stopRenewing := in.renewWhileRunning(ctx, consumer, key)
	defer stopRenewing() // a handler that ends its goroutine (runtime.Goexit) gets past recover
	out, err := in.runRecovering(h, msg)
	stopRenewing()
	// What follows finishes even if the message's context ends (the router
	// closing): a key left behind for an effect that did not happen loses
	// the message, and messages not written for one that did are lost too.
	after := context.WithoutCancel(ctx)
	fields := watermill.LogFields{"message_uuid": idText(key), "consumer": consumer}
	if err != nil {
		// The handler says its effect did not happen: take the key back, so
		// that the redelivery runs it. MarkOutboxProcessed's mark stays: the
		// broker still holds the message, so republish need not resend it.
		del := in.q.Delete(consumer, key)
		if delErr := in.retryConflicts(after, func() error {
			_, err := in.db.ExecContext(after, del.SQL, del.Args...)
			return err
		}); delErr != nil {
			in.log.Error("At-most-once handler failed and its key could not be taken back: the message will not run again", delErr, fields)
			return inboxFailed, &keyStaysError{errors.Join(err, fmt.Errorf("outbox: inbox: take back key %s for %s: %w", idText(key), consumer, delErr))}
		}
		return inboxFailed, err
	}
	if doneErr := in.stamp(after, consumer, key, 0); doneErr != nil {
		// The effect happened: copies elsewhere wait out the lease, then
		// take the message for a duplicate, as they should.
		in.log.Error("At-most-once handler ran, but its key could not be stamped done: copies delivered elsewhere wait until its lease ends", doneErr, fields)
	}
	if err := in.retryConflicts(after, func() error { return in.writeReturnedAlone(after, out) }); err != nil {
		in.log.Error("At-most-once handler ran, but the messages it returned could not be written into the outbox: they are lost, its key stays", err, fields)
		return inboxFailed, &keyStaysError{err}
	}
	return inboxProcessed, nil
}

// keyStaysError is an at-most-once delivery's failure after its key
// committed for good: running the delivery again would only find the key
// and ack it as a duplicate, so handle does not, even for a conflict (the
// failure is counted, and the message nacked, as it is).
type keyStaysError struct{ error }

func (e *keyStaysError) Unwrap() error { return e.error }

// retryConflicts runs f, and again while the database refuses it for a
// concurrent transaction (see conflictTries), but not past a keyStaysError:
// a delivery (handle), a held message (drain), and the writes after an
// at-most-once handler, each its own transaction, which a redelivery
// cannot redo since the key is committed. A serialization failure writing the messages it returned lost
// them, and the delivery run again was acked as a duplicate. It runs f
// again too after a lost connection (ConnLost), with no count, until ctx
// ends: then the error is a dbLostError.
func (in *Inbox) retryConflicts(ctx context.Context, f func() error) error {
	d := in.dialect.sql()
	lost := 0
	for try := 0; ; try++ {
		err := f()
		if err == nil {
			return nil
		}
		stays := errors.As(err, new(*keyStaysError))
		if lost > 0 && ctx.Err() != nil {
			// The context ended in a run after a lost connection: the
			// statement it cut short tells nothing of the message.
			return &dbLostError{err: err}
		}
		if in.databaseDown(err) && !stays {
			// The database dropped the connection or did not answer: no
			// failure of the message's. Run it again once the database
			// answers, for as long as its context lasts, as the relay waits
			// for its broker; PoisonQueue set such a message aside when
			// Retry's tries ran out in an outage of a second (see
			// dbLostKey).
			if lost == 0 {
				what := "Inbox: the database connection was lost; the delivery runs again once the database answers"
				if sqldialect.Busy(err) {
					what = "Inbox: the database is locked by another connection past its busy timeout; the delivery runs again once the lock is free"
				}
				in.log.Info(what, watermill.LogFields{"error": err.Error()})
			}
			if !sleepCtx(ctx, lostPause(lost)) {
				return &dbLostError{err: err}
			}
			lost++
			try--
			continue
		}
		if !d.Conflict(err) || stays {
			return err
		}
		if try == conflictTries-1 {
			// Said, so that the log does not read as if the inbox never
			// ran it again: a review under 350–470 InnoDB deadlocks a run
			// saw only the driver's "try restarting transaction".
			return fmt.Errorf("outbox: inbox: refused for a concurrent transaction at each of %d runs, the last: %w", conflictTries, err)
		}
		if !sleepCtx(ctx, conflictPause(try)) {
			return err
		}
	}
}

// stamp sets consumer's at-most-once key id to the database server's now
// plus ahead: done (0), or running until its lease ends.
func (in *Inbox) stamp(ctx context.Context, consumer, key string, ahead time.Duration) error {
	now, err := in.serverNow(ctx)
	if err != nil {
		return err
	}
	q := sqldialect.Inline(in.dialect.sql(), in.q.Done(consumer, key, now.Add(ahead)))
	_, err = in.db.ExecContext(ctx, q.SQL, q.Args...)
	return err
}

// renewWhileRunning moves the running key's stamp to now +
// AtMostOnceLease every third of the lease, until stop is called; stop
// returns once no renewal is under way, so that none lands after the stamp
// of done (which it would undo) or the key's take-back.
func (in *Inbox) renewWhileRunning(ctx context.Context, consumer, key string) (stop func()) {
	quit, finished := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(finished)
		tick := time.NewTicker(in.cfg.AtMostOnceLease / 3)
		defer tick.Stop()
		for {
			select {
			case <-quit:
				return
			case <-tick.C:
				if err := in.stamp(context.WithoutCancel(ctx), consumer, key, in.cfg.AtMostOnceLease); err != nil {
					in.log.Error("At-most-once handler runs, but its key's lease could not be renewed: a copy delivered elsewhere may be taken for a duplicate", err,
						watermill.LogFields{"message_uuid": idText(key), "consumer": consumer})
				}
			}
		}
	}()
	var once sync.Once
	return func() {
		once.Do(func() {
			close(quit)
			<-finished
		})
	}
}

// recordRunning commits the key as running until now + AtMostOnceLease
// (now on the database server's clock, as every stamp it compares: see
// dbClock),
// and says whether this delivery is to run. A key there already whose
// handler runs in another process (its stamp still ahead) is waited for:
// stamped done, or past its lease, this delivery is a duplicate; taken
// back (the handler failed), it is recorded again, and runs.
func (in *Inbox) recordRunning(ctx context.Context, consumer, key string) (bool, error) {
	wait := 20 * time.Millisecond
	for {
		now, err := in.serverNow(ctx)
		if err != nil {
			return false, err
		}
		fresh, err := in.recordAlone(ctx, consumer, key, now.Add(in.cfg.AtMostOnceLease))
		if err != nil || fresh {
			return fresh, err
		}
		until := sqldialect.NewTime(in.dialect.sql())
		q := sqldialect.Inline(in.dialect.sql(), in.q.Stamp(consumer, key))
		switch err := in.db.QueryRowContext(ctx, q.SQL, q.Args...).Scan(until); {
		case errors.Is(err, sql.ErrNoRows):
			// Taken back since: record it again, after a wait, should the
			// key's insert keep skipping a row that reads as absent.
		case err != nil:
			return false, fmt.Errorf("outbox: inbox: read key %s for %s: %w", idText(key), consumer, err)
		default:
			if now, err = in.serverNow(ctx); err != nil {
				return false, err
			}
			if !until.T.After(now) {
				return false, nil
			}
		}
		select {
		case <-ctx.Done():
			return false, fmt.Errorf("outbox: inbox: %s for %s: waiting for the copy whose handler runs elsewhere: %w", idText(key), consumer, ctx.Err())
		case <-time.After(wait):
		}
		wait = min(2*wait, time.Second)
	}
}

// runAlone waits until no delivery of id (consumer, key) is in
// processAtMostOnce in this process, and takes its place there until
// release is called.
func (in *Inbox) runAlone(ctx context.Context, id [2]string) (release func(), err error) {
	for {
		in.runningMu.Lock()
		done, busy := in.running[id]
		if !busy {
			if in.running == nil {
				in.running = map[[2]string]chan struct{}{}
			}
			mine := make(chan struct{})
			in.running[id] = mine
			in.runningMu.Unlock()
			return func() {
				in.runningMu.Lock()
				delete(in.running, id)
				in.runningMu.Unlock()
				close(mine)
			}, nil
		}
		in.runningMu.Unlock()
		select {
		case <-done:
		case <-ctx.Done():
			return nil, fmt.Errorf("outbox: inbox: %s for %s: waiting for the copy whose handler runs: %w", idText(id[1]), id[0], ctx.Err())
		}
	}
}

// recordAlone commits the key, stamped at, in a transaction of its own, and
// says whether it was new.
func (in *Inbox) recordAlone(ctx context.Context, consumer, key string, at time.Time) (bool, error) {
	tx, err := in.db.BeginTxx(ctx, &sql.TxOptions{Isolation: in.cfg.Isolation})
	if err != nil {
		return false, fmt.Errorf("outbox: inbox: begin: %w", err)
	}
	fresh, err := in.recordAt(ctx, tx, consumer, key, at)
	if err != nil || !fresh {
		_ = tx.Rollback()
		return false, err
	}
	if err := tx.Commit(); err != nil {
		return false, fmt.Errorf("outbox: inbox: commit %s for %s: %w", idText(key), consumer, err)
	}
	return true, nil
}

// writeReturned writes the messages a handler returned into the outbox
// through conn, to the handler's publish topic (ctx is the handler's
// context). A message without a context of its own gets ctx, so that a
// Propagator stores the handler's trace in its row.
func (in *Inbox) writeReturned(ctx context.Context, conn txConn, out []*message.Message) error {
	if len(out) == 0 {
		return nil
	}
	topic, err := publishTopic(ctx, len(out))
	if err != nil {
		return err
	}
	for _, m := range out {
		if m != nil && m.Context() == context.Background() {
			m.SetContext(ctx)
		}
	}
	pub := &TxPublisher{tx: conn, cfg: in.returned, q: in.outbox}
	if err := pub.publish(ctx, topic, out); err != nil {
		return fmt.Errorf("outbox: inbox: write the %d message(s) the handler returned into the outbox, topic %q: %w", len(out), topic, err)
	}
	return nil
}

// writeReturnedAlone is writeReturned in a transaction of its own, for a
// handler that ran outside the inbox's transaction.
func (in *Inbox) writeReturnedAlone(ctx context.Context, out []*message.Message) error {
	if len(out) == 0 {
		return nil
	}
	if _, err := publishTopic(ctx, len(out)); err != nil {
		return err // before a transaction is begun for nothing
	}
	tx, err := in.db.BeginTxx(ctx, &sql.TxOptions{Isolation: in.cfg.Isolation})
	if err != nil {
		return fmt.Errorf("outbox: inbox: begin: %w", err)
	}
	defer func() { _ = tx.Rollback() }() // a no-op after the commit
	if err := in.writeReturned(ctx, stdTx{tx.Tx}, out); err != nil {
		return err
	}
	if err := tx.Commit(); err != nil {
		return fmt.Errorf("outbox: inbox: commit the messages the handler returned: %w", err)
	}
	return nil
}

// publishTopic is the router handler's publish topic, where n returned
// messages go, or why there is none.
func publishTopic(ctx context.Context, n int) (string, error) {
	if topic := message.PublishTopicFromCtx(ctx); topic != "" {
		return topic, nil
	}
	return "", fmt.Errorf("outbox: inbox: the handler returned %d message(s) and has no publish topic to write them to "+
		"(it runs outside a router, or was added without one): register it with "+
		"router.AddHandler(name, subscribeTopic, sub, publishTopic, inbox.Publisher(), handler)", n)
}

// textHolds reports whether PostgreSQL's text holds s: valid UTF-8
// without a NUL.
func textHolds(s string) bool {
	return utf8.ValidString(s) && strings.IndexByte(s, 0) < 0
}

// dedupeKey is the id the inbox dedupes msg on, "" if it has none: its
// x-acemq-id metadata, else its UUID. Every AceMQ relay sends the id as the
// x-acemq-id header and the message_id property, over whatever the row's
// headers hold, but only this library's also as _watermill_message_uuid.
// So a message from a relay in another language reaches a subscriber with
// watermill-amqp's DefaultMarshaler with x-acemq-id in its metadata (a
// string header) and without a UUID, or with a stale one: a service that
// copies the headers it received onto what it sends carries the Watermill
// header of the message it received on, and two messages would be one.
// AMQPMarshaler takes the UUID from x-acemq-id first itself, but for a
// copy's (beside an empty message_id and a UUID header of another id),
// which it sets to the UUID in the metadata.
func dedupeKey(msg *message.Message) string {
	if id := msg.Metadata.Get(HeaderMessageID); id != "" {
		return id
	}
	return msg.UUID
}

// runRecovering runs h, turning a panic into an error so that the
// transaction rolls back and the message is nacked rather than the process
// dying with the key half-written. The error is Watermill's
// RecoveredPanicError, with the panic's stack, as middleware.Recoverer's
// would be: a Recoverer outside the inbox never sees the panic.
//
// h runs with the inbox in its message's context (see handle), and the
// message's context is set back to what it was once h returns.
func (in *Inbox) runRecovering(h message.HandlerFunc, msg *message.Message) (out []*message.Message, err error) {
	entry := msg.Context()
	msg.SetContext(context.WithValue(entry, handlingKey{}, handling{in, msg}))
	defer msg.SetContext(entry)
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("outbox: inbox: handler panicked: %w", middleware.RecoveredPanicError{V: r, Stacktrace: string(debug.Stack())})
		}
	}()
	out, err = h(msg)
	if sqldialect.Busy(err) {
		err = &notWaitedOut{err: err, hint: " (SQLite: the handler's statement waited for the write lock past the busy timeout;" +
			" a handler writes through outbox.TxFromContext's transaction, which holds the lock, not through the pool)"}
	}
	return out, err
}

// notWaitedOut is an SQLite "database is locked" that the inbox does not
// wait out as the database's trouble (see databaseDown): a handler's own,
// a statement it sent through the pool rather than TxFromContext's
// transaction, waiting for the write lock that transaction holds and
// failing at every run (a code review: it ran again until the delivery's
// context ended, and was never set aside); or an operator's call (SkipGap,
// SkipHeld), which says so at once rather than wait unbounded.
type notWaitedOut struct {
	err  error
	hint string
}

func (e *notWaitedOut) Error() string { return e.err.Error() + e.hint }
func (e *notWaitedOut) Unwrap() error { return e.err }

// notWaiting is f, its "database is locked" not waited out.
func notWaiting(f func() error) func() error {
	return func() error {
		err := f()
		if sqldialect.Busy(err) {
			return &notWaitedOut{err: err}
		}
		return err
	}
}

// databaseDown reports whether err says the database dropped the
// connection or did not answer (SQLite: stayed locked by another
// connection past the busy timeout), not a fault of the statement's or
// the handler's: what the inbox waits out.
func (in *Inbox) databaseDown(err error) bool {
	return in.dialect.sql().ConnLost(err) && !errors.As(err, new(*notWaitedOut))
}

// PurgeProcessed deletes inbox rows older than olderThan, in batches of
// PurgeBatch, and returns how many. Keep them longer than a broker could
// possibly redeliver (and than republish's grace): a key purged too early
// lets a late duplicate through.
func (in *Inbox) PurgeProcessed(ctx context.Context, olderThan time.Duration) (int64, error) {
	return inBatches(ctx, in.db, in.dialect.sql(), "purge processed", olderThan, in.cfg.PurgeBatch, in.q.PurgeBound, in.q.PurgeRange)
}

// Check asks the database whether the inbox table is there and readable,
// with the inbox's columns (consumer_name, message_id, processed_at),
// reading no row: an InboxTable naming the outbox table passed it, and
// every delivery failed (an API review).
func (in *Inbox) Check(ctx context.Context) error {
	err := probe(ctx, in.db, in.q.Probe(), in.q.Table())
	if err != nil && ctx.Err() == nil && !in.databaseDown(err) {
		// The server answered: no such table, or not the inbox's columns.
		return fmt.Errorf("%w (InboxConfig.InboxTable names the inbox's table, %s by default; the outbox's is OutboxTable)", err, DefaultInboxTable)
	}
	return err
}

// Count counts the inbox's rows, all consumers: a scan of its key, about a
// second per few million rows on PostgreSQL.
func (in *Inbox) Count(ctx context.Context) (int64, error) {
	return count(ctx, in.db, in.q.Count(), in.q.Table())
}

// ProcessedBefore counts the inbox rows processed before t: what
// PurgeProcessed with that cutoff deletes.
func (in *Inbox) ProcessedBefore(ctx context.Context, t time.Time) (int64, error) {
	return count(ctx, in.db, in.q.ProcessedBefore(t), in.q.Table())
}
