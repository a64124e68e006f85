package outbox

import (
	"context"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
)

// TrackedTopics is the registry of topics whose consumers report back: the
// Inbox sets the outbox record's processed_at for them, and Republish sends
// again what none of them processed. A topic is matched against the
// record's routing key, which is the topic under TxPublisher's default
// mapping and watermill-amqp's durable queue config.
//
// It is fixed at construction and safe for concurrent use. Asking about an
// untracked topic is one map lookup: no allocation, no database call.
type TrackedTopics struct {
	set map[string]struct{}
}

// NewTrackedTopics returns the registry of the given topics.
func NewTrackedTopics(topics ...string) *TrackedTopics {
	t := &TrackedTopics{set: make(map[string]struct{}, len(topics))}
	for _, topic := range topics {
		t.set[topic] = struct{}{}
	}
	return t
}

// Tracked reports whether topic is tracked. A nil registry tracks nothing.
func (t *TrackedTopics) Tracked(topic string) bool {
	if t == nil {
		return false
	}
	_, ok := t.set[topic]
	return ok
}

// Topics returns the tracked topics, in no order.
func (t *TrackedTopics) Topics() []string {
	out := make([]string, 0, len(t.set))
	for topic := range t.set {
		out = append(out, topic)
	}
	return out
}

// RepublishConfig configures a Republisher.
type RepublishConfig struct {
	// Dialect of the database. Optional when the handle is a *sqlx.DB.
	Dialect Dialect
	// Table is the outbox table. Default acemq_outbox.
	Table string
	// Topics are the tracked topics. Required: records of other topics are
	// never touched.
	Topics *TrackedTopics
	// Grace is how long ago a record must have been published to be sent
	// again: younger ones may still be on their way to a consumer. Default
	// 5 minutes. Too short a grace resends what is merely slow to process;
	// the inbox absorbs the copy, but the work is done twice over.
	Grace time.Duration
	// Timeout bounds the plugin's Republish at router start. Default 30 s.
	Timeout time.Duration
	// Notify, if set, is called after records were made pending again, to
	// wake a relay in the same process (Forwarder.Notify).
	Notify func()
	Logger watermill.LoggerAdapter
}

// Republisher makes the unprocessed records of tracked topics pending again
// when a service boots, so that the Forwarder sends them again: a record the
// broker lost, or that sat in a queue no consumer was bound to. It publishes
// nothing itself; the Forwarder stays the only publisher.
type Republisher struct {
	store *Store
	cfg   RepublishConfig
}

// NewRepublisher returns a Republisher over db, a *sql.DB or *sqlx.DB.
func NewRepublisher(db any, cfg RepublishConfig) (*Republisher, error) {
	if cfg.Topics == nil || len(cfg.Topics.set) == 0 {
		return nil, &ConfigError{Field: "Topics", Reason: "no tracked topics; republish would do nothing"}
	}
	if cfg.Grace == 0 {
		cfg.Grace = 5 * time.Minute
	}
	if cfg.Grace < 0 {
		return nil, &ConfigError{Field: "Grace", Reason: "negative"}
	}
	if cfg.Timeout == 0 {
		cfg.Timeout = 30 * time.Second
	}
	if cfg.Logger == nil {
		cfg.Logger = watermill.NopLogger{}
	}
	store, err := NewStore(db, StoreConfig{Dialect: cfg.Dialect, Table: cfg.Table})
	if err != nil {
		return nil, err
	}
	return &Republisher{store: store, cfg: cfg}, nil
}

// Republish makes pending again (published_at and attempts reset) every
// record of a tracked topic that was published longer than Grace ago and
// that no consumer processed, and returns how many. It is one conditional
// UPDATE: of two instances booting together, the second finds the records
// pending already, and each record is resent once.
func (r *Republisher) Republish(ctx context.Context) (int64, error) {
	topics := r.cfg.Topics.Topics()
	args := make([]any, 0, len(topics)+1)
	args = append(args, r.store.dialect.timeArg(time.Now().Add(-r.cfg.Grace)))
	for _, t := range topics {
		args = append(args, t)
	}
	res, err := r.store.db.ExecContext(ctx, r.store.q.republish(len(topics)), args...)
	if err != nil {
		return 0, fmt.Errorf("outbox: republish: %w", err)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return 0, fmt.Errorf("outbox: republish: %w", err)
	}
	if n > 0 {
		r.cfg.Logger.Info("Unprocessed outbox records made pending again", watermill.LogFields{"records": n, "grace": r.cfg.Grace})
		if r.cfg.Notify != nil {
			r.cfg.Notify()
		}
	}
	return n, nil
}

// Plugin is Republish as a Watermill router plugin: router.AddPlugin runs
// it when the router starts, before any handler does. A failure stops the
// router from starting, as a failed migration would.
func (r *Republisher) Plugin() message.RouterPlugin {
	return func(*message.Router) error {
		ctx, cancel := context.WithTimeout(context.Background(), r.cfg.Timeout)
		defer cancel()
		_, err := r.Republish(ctx)
		return err
	}
}
