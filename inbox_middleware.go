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
)

// DefaultInboxTable is the inbox table's name in every AceMQ library.
const DefaultInboxTable = "processed_messages"

// InboxConfig configures an Inbox.
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
	// Track, with MarkOutboxProcessed, limits the marking to messages that
	// arrived on a tracked topic (the router's subscribe topic), the topics
	// a Republisher resends. Another topic costs one map lookup and no
	// database call. Nil marks every message.
	Track *TrackedTopics
	// Isolation of the handler's transaction. Default: the database's.
	Isolation sql.IsolationLevel
	// AllowMissingID lets a message without a UUID through, undeduplicated
	// and outside any transaction. By default such a message fails with
	// ErrNoMessageID: without an id there is no way to tell a duplicate.
	AllowMissingID bool
	// Metrics, if set, counts processed, duplicate and failed messages by
	// consumer.
	Metrics *Metrics
	// Propagator, if set, restores the trace context a TxPublisher with
	// WithPropagator stored in the message's metadata into the message's
	// context before the handler runs, so that one trace spans commit,
	// relay and handler. Nil costs nothing.
	Propagator propagation.TextMapPropagator
	// PurgeBatch is how many rows one DELETE of PurgeProcessed removes.
	// Default 1000.
	PurgeBatch int
	Logger     watermill.LoggerAdapter
}

// ErrNoMessageID is returned for a message that has no UUID, unless
// InboxConfig.AllowMissingID is set.
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
	db         *sqlx.DB
	dialect    Dialect
	cfg        InboxConfig
	insert     string
	markOutbox string
	purge      string
	table      string // quoted
	log        watermill.LoggerAdapter
}

// NewInbox returns the inbox over db, a *sql.DB or *sqlx.DB.
func NewInbox(db any, cfg InboxConfig) (*Inbox, error) {
	var xdb *sqlx.DB
	switch h := db.(type) {
	case *sqlx.DB:
		xdb = h
		if h != nil && cfg.Dialect == nil {
			d, err := DialectForDriver(h.DriverName())
			if err != nil {
				return nil, err
			}
			cfg.Dialect = d
		}
	case *sql.DB:
		if h != nil && cfg.Dialect != nil {
			xdb = sqlx.NewDb(h, sqlxDriverName(cfg.Dialect))
		}
	default:
		return nil, &ConfigError{Field: "db", Reason: fmt.Sprintf("%T; want a *sql.DB or *sqlx.DB", db)}
	}
	if cfg.Dialect == nil {
		return nil, &ConfigError{Field: "Dialect", Reason: "required unless the handle is a *sqlx.DB; use outbox.Postgres, MySQL or SQLite"}
	}
	if xdb == nil {
		return nil, &ConfigError{Field: "db", Reason: "nil database handle"}
	}
	if cfg.Table == "" {
		cfg.Table = DefaultInboxTable
	}
	if cfg.OutboxTable == "" {
		cfg.OutboxTable = DefaultTable
	}
	if cfg.PurgeBatch == 0 {
		cfg.PurgeBatch = 1000
	}
	if cfg.Logger == nil {
		cfg.Logger = watermill.NopLogger{}
	}
	if cfg.PurgeBatch < 1 {
		return nil, &ConfigError{Field: "PurgeBatch", Reason: "want at least 1"}
	}
	if err := checkName(cfg.ConsumerName); err != nil {
		return nil, &ConfigError{Field: "ConsumerName", Reason: err.Error()}
	}
	table, err := quoteTable(cfg.Dialect, cfg.Table)
	if err != nil {
		return nil, &ConfigError{Field: "Table", Reason: err.Error()}
	}
	outboxTable, err := quoteTable(cfg.Dialect, cfg.OutboxTable)
	if err != nil {
		return nil, &ConfigError{Field: "OutboxTable", Reason: err.Error()}
	}
	d := cfg.Dialect
	return &Inbox{
		db:         xdb,
		dialect:    d,
		cfg:        cfg,
		insert:     d.rebind(d.insertProcessed(table)),
		markOutbox: d.rebind("UPDATE " + outboxTable + " SET processed_at = ? WHERE id = ? AND processed_at IS NULL"),
		purge:      d.rebind(d.purgeProcessed(table)),
		table:      table,
		log:        cfg.Logger,
	}, nil
}

// sqlxDriverName is a driver name sqlx and DialectForDriver both know.
func sqlxDriverName(d Dialect) string {
	switch d {
	case Postgres:
		return "pgx"
	case MySQL:
		return "mysql"
	}
	return "sqlite3"
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
	if msg.UUID == "" {
		if in.cfg.AllowMissingID {
			msg.SetContext(ctx)
			out, err := h(msg)
			return out, inboxProcessed, "", err
		}
		return nil, inboxFailed, "", ErrNoMessageID
	}
	if err := checkID(msg.UUID); err != nil {
		return nil, inboxFailed, "", fmt.Errorf("outbox: inbox: message id %.80q %v", msg.UUID, err)
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

	now := in.dialect.timeArg(time.Now())
	res, err := tx.ExecContext(ctx, in.insert, consumer, msg.UUID, now)
	if err != nil {
		return nil, inboxFailed, consumer, fmt.Errorf("outbox: inbox: record %s for %s: %w", msg.UUID, consumer, err)
	}
	if n, err := res.RowsAffected(); err != nil {
		return nil, inboxFailed, consumer, fmt.Errorf("outbox: inbox: %w", err)
	} else if n == 0 {
		// Processed before, by a delivery whose transaction committed: ack
		// without running the handler again.
		in.log.Debug("Duplicate message acked without running the handler", watermill.LogFields{"message_uuid": msg.UUID, "consumer": consumer})
		return nil, inboxDuplicate, consumer, nil
	}
	if in.cfg.MarkOutboxProcessed && (in.cfg.Track == nil || in.cfg.Track.Tracked(message.SubscribeTopicFromCtx(ctx))) {
		if _, err := tx.ExecContext(ctx, in.markOutbox, now, msg.UUID); err != nil {
			return nil, inboxFailed, consumer, fmt.Errorf("outbox: inbox: mark outbox record %s processed: %w", msg.UUID, err)
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
		return nil, inboxFailed, consumer, fmt.Errorf("outbox: inbox: commit %s for %s: %w", msg.UUID, consumer, err)
	}
	committed = true
	return out, inboxProcessed, consumer, nil
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
	if olderThan < 0 {
		return 0, &ConfigError{Field: "olderThan", Reason: "negative duration"}
	}
	cutoff := in.dialect.timeArg(time.Now().Add(-olderThan))
	var total int64
	for {
		res, err := in.db.ExecContext(ctx, in.purge, cutoff, in.cfg.PurgeBatch)
		if err != nil {
			return total, fmt.Errorf("outbox: purge processed: %w", err)
		}
		n, err := res.RowsAffected()
		if err != nil {
			return total, err
		}
		total += n
		if n < int64(in.cfg.PurgeBatch) {
			return total, nil
		}
	}
}

// Check asks the database whether the inbox table is there and readable,
// reading no row.
func (in *Inbox) Check(ctx context.Context) error {
	rows, err := in.db.QueryContext(ctx, "SELECT 1 FROM "+in.table+" WHERE 1 = 0")
	if err != nil {
		return fmt.Errorf("outbox: %s: %w", in.table, err)
	}
	return rows.Close()
}

// Count counts the inbox's rows, all consumers: a scan of its key, about a
// second per few million rows on PostgreSQL.
func (in *Inbox) Count(ctx context.Context) (int64, error) {
	var n int64
	if err := in.db.QueryRowContext(ctx, "SELECT COUNT(*) FROM "+in.table).Scan(&n); err != nil {
		return 0, fmt.Errorf("outbox: count %s: %w", in.table, err)
	}
	return n, nil
}

// ProcessedBefore counts the inbox rows processed before t: what
// PurgeProcessed with that cutoff deletes.
func (in *Inbox) ProcessedBefore(ctx context.Context, t time.Time) (int64, error) {
	var n int64
	q := in.dialect.rebind("SELECT COUNT(*) FROM " + in.table + " WHERE processed_at < ?")
	if err := in.db.QueryRowContext(ctx, q, in.dialect.timeArg(t)).Scan(&n); err != nil {
		return 0, fmt.Errorf("outbox: count %s: %w", in.table, err)
	}
	return n, nil
}
