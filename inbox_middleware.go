package outbox

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"
	"go.opentelemetry.io/otel/propagation"

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
	ConsumerName string
	// Table is the inbox table. Default processed_messages.
	Table string
	// MarkOutboxProcessed: the outbox table lives in this same database (a
	// service consuming its own events), and the transaction that processes
	// a message also sets its outbox record's processed_at, if still null.
	// Republish then leaves it alone. Off by default: then no query touches
	// the outbox table.
	MarkOutboxProcessed bool
	// OutboxTable is the outbox table MarkOutboxProcessed updates. Default
	// acemq_outbox.
	OutboxTable string
	// TrackedTopics, with MarkOutboxProcessed, limits the marking to
	// messages that arrived on a tracked topic (the router's subscribe
	// topic), the topics a Republisher resends. Another topic costs one map
	// lookup and no database call. Nil marks every message.
	TrackedTopics *TrackedTopics
	// Isolation of the handler's transaction. Default: the database's.
	Isolation sql.IsolationLevel
	// AllowMissingID lets a message without an id (neither a UUID nor
	// x-acemq-id metadata) through, undeduplicated and outside any
	// transaction. By default such a message fails with ErrNoMessageID:
	// without an id there is no way to tell a duplicate.
	AllowMissingID bool
	// Metrics, if set, counts processed, duplicate and failed messages by
	// consumer.
	Metrics *Metrics
	// Propagator, if set, restores the trace context a TxPublisher with the
	// same Propagator stored in the message's metadata into the message's
	// context before the handler runs, so that one trace spans commit,
	// relay and handler. Nil costs nothing.
	Propagator propagation.TextMapPropagator
	// PurgeBatch is how many rows one DELETE of PurgeProcessed removes.
	// Default 1000.
	PurgeBatch int
	Logger     watermill.LoggerAdapter
}

// DefaultPurgeBatch is the default of StoreConfig.PurgeBatch and
// InboxConfig.PurgeBatch: small enough that one DELETE holds its locks
// briefly, large enough that a purge of millions of rows is not a million
// round trips.
const DefaultPurgeBatch = 1000

func (c *InboxConfig) setDefaults() {
	if c.Table == "" {
		c.Table = DefaultInboxTable
	}
	if c.OutboxTable == "" {
		c.OutboxTable = DefaultTable
	}
	if c.PurgeBatch == 0 {
		c.PurgeBatch = DefaultPurgeBatch
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
	if err := checkName(c.ConsumerName); err != nil {
		return &ConfigError{Field: "ConsumerName", Reason: err.Error()}
	}
	return nil
}

// ErrNoMessageID is returned for a message that has no id, neither a UUID
// nor x-acemq-id metadata, unless InboxConfig.AllowMissingID is set.
var ErrNoMessageID = errors.New("outbox: message has no id to dedupe on")

// Inbox is the consumer's half of the outbox contract: a Watermill handler
// middleware that records (consumer, message id) in processed_messages in
// the same transaction as the handler's effect, and only then lets the
// message be acked. A message whose key is already there is acked without
// running the handler.
//
// Unlike Watermill's Deduplicator, which records the key before the handler
// runs and so drops the retry of a handler that failed, the key here commits
// with the effect or not at all.
type Inbox struct {
	db      *sqlx.DB
	dialect Dialect
	cfg     InboxConfig
	q       *sqldialect.Inbox
	outbox  *sqldialect.Outbox // the table MarkOutboxProcessed marks
	log     watermill.LoggerAdapter
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
	q, err := sqldialect.NewInbox(cfg.Dialect.sql(), cfg.Table)
	if err != nil {
		return nil, &ConfigError{Field: "Table", Reason: err.Error()}
	}
	outbox, err := sqldialect.NewOutbox(cfg.Dialect.sql(), cfg.OutboxTable)
	if err != nil {
		return nil, &ConfigError{Field: "OutboxTable", Reason: err.Error()}
	}
	return &Inbox{db: xdb, dialect: cfg.Dialect, cfg: cfg, q: q, outbox: outbox, log: cfg.Logger}, nil
}

type txKey struct{}

// TxFromContext returns the transaction the Inbox opened for the message
// being handled. Make the handler's effect through it, and publish through
// NewTxPublisher(tx): the effect, the outgoing messages and the dedupe key
// commit together, or none of them.
func TxFromContext(ctx context.Context) (*sqlx.Tx, bool) {
	tx, ok := ctx.Value(txKey{}).(*sqlx.Tx)
	return tx, ok
}

// Middleware dedupes and runs h in a transaction; add it to a router or a
// handler with AddMiddleware.
func (in *Inbox) Middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		return in.handle(h, msg)
	}
}

func (in *Inbox) handle(h message.HandlerFunc, msg *message.Message) ([]*message.Message, error) {
	out, outcome, consumer, err := in.process(h, msg)
	if consumer != "" {
		in.cfg.Metrics.inbox(consumer, outcome)
	}
	return out, err
}

// process runs one message through the inbox, and says what became of it
// and for which consumer ("" before the consumer is known).
func (in *Inbox) process(h message.HandlerFunc, msg *message.Message) (out []*message.Message, outcome inboxOutcome, consumer string, err error) {
	ctx := msg.Context()
	if in.cfg.Propagator != nil {
		// The publisher's trace, carried in the metadata through the row and
		// the broker, becomes the parent of the handler's work.
		ctx = in.cfg.Propagator.Extract(ctx, metadataCarrier(msg.Metadata))
	}
	key := dedupeKey(msg)
	if key == "" {
		if in.cfg.AllowMissingID {
			msg.SetContext(ctx)
			out, err := h(msg)
			return out, inboxProcessed, "", err
		}
		return nil, inboxFailed, "", ErrNoMessageID
	}
	if err := checkID(key); err != nil {
		return nil, inboxFailed, "", fmt.Errorf("outbox: inbox: message id %.80q %v", key, err)
	}
	consumer = in.cfg.ConsumerName
	if consumer == "" {
		consumer = message.HandlerNameFromCtx(ctx)
	}
	if consumer == "" {
		return nil, inboxFailed, "", &ConfigError{Field: "ConsumerName", Reason: "empty, and the message carries no router handler name"}
	}
	if err := checkName(consumer); err != nil {
		return nil, inboxFailed, "", &ConfigError{Field: "ConsumerName", Reason: fmt.Sprintf("%.80q %v", consumer, err)}
	}

	tx, err := in.db.BeginTxx(ctx, &sql.TxOptions{Isolation: in.cfg.Isolation})
	if err != nil {
		return nil, inboxFailed, consumer, fmt.Errorf("outbox: inbox: begin: %w", err)
	}
	committed := false
	defer func() {
		if !committed {
			_ = tx.Rollback()
		}
	}()

	now := time.Now()
	insert := in.q.Insert(consumer, key, now)
	res, err := tx.ExecContext(ctx, insert.SQL, insert.Args...)
	if err != nil {
		return nil, inboxFailed, consumer, fmt.Errorf("outbox: inbox: record %s for %s: %w", key, consumer, err)
	}
	if n, err := res.RowsAffected(); err != nil {
		return nil, inboxFailed, consumer, fmt.Errorf("outbox: inbox: %w", err)
	} else if n == 0 {
		// Processed before, by a delivery whose transaction committed: ack
		// without running the handler again.
		in.log.Debug("Duplicate message acked without running the handler", watermill.LogFields{"message_uuid": key, "consumer": consumer})
		return nil, inboxDuplicate, consumer, nil
	}
	if in.cfg.MarkOutboxProcessed && (in.cfg.TrackedTopics == nil || in.cfg.TrackedTopics.Tracked(message.SubscribeTopicFromCtx(ctx))) {
		mark := in.outbox.MarkProcessed(key, now)
		if _, err := tx.ExecContext(ctx, mark.SQL, mark.Args...); err != nil {
			return nil, inboxFailed, consumer, fmt.Errorf("outbox: inbox: mark outbox record %s processed: %w", key, err)
		}
	}

	orig := msg.Context()
	msg.SetContext(context.WithValue(ctx, txKey{}, tx))
	defer msg.SetContext(orig)
	out, err = runRecovering(h, msg)
	if err != nil {
		return nil, inboxFailed, consumer, err
	}
	if err := tx.Commit(); err != nil {
		return nil, inboxFailed, consumer, fmt.Errorf("outbox: inbox: commit %s for %s: %w", key, consumer, err)
	}
	committed = true
	return out, inboxProcessed, consumer, nil
}

// dedupeKey is the id the inbox dedupes msg on, "" if it has none: its
// UUID, else its x-acemq-id metadata. Every AceMQ relay sends the id as the
// x-acemq-id header and the message_id property, but only this library's
// also as _watermill_message_uuid, so a message from a relay in another
// language reaches a subscriber with watermill-amqp's DefaultMarshaler
// without a UUID, and with x-acemq-id in its metadata (a string header).
// AMQPMarshaler takes the UUID from x-acemq-id or message_id itself.
func dedupeKey(msg *message.Message) string {
	if msg.UUID != "" {
		return msg.UUID
	}
	return msg.Metadata.Get(HeaderMessageID)
}

// runRecovering runs h, turning a panic into an error so that the
// transaction rolls back and the message is nacked rather than the process
// dying with the key half-written.
func runRecovering(h message.HandlerFunc, msg *message.Message) (out []*message.Message, err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("outbox: inbox: handler panicked: %v", r)
		}
	}()
	return h(msg)
}

// PurgeProcessed deletes inbox rows older than olderThan, in batches of
// PurgeBatch, and returns how many. Keep them longer than a broker could
// possibly redeliver (and than republish's grace): a key purged too early
// lets a late duplicate through.
func (in *Inbox) PurgeProcessed(ctx context.Context, olderThan time.Duration) (int64, error) {
	return purgeInBatches(ctx, in.db, "purge processed", olderThan, in.cfg.PurgeBatch, in.q.Purge)
}

// Check asks the database whether the inbox table is there and readable,
// reading no row.
func (in *Inbox) Check(ctx context.Context) error {
	return probe(ctx, in.db, in.q.Probe(), in.q.Table())
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
