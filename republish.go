package outbox

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/acemq/watermill-outbox/internal/sqldialect"
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

// Topics returns the tracked topics, in no order; nil for a nil registry,
// which tracks nothing.
func (t *TrackedTopics) Topics() []string {
	if t == nil {
		return nil
	}
	out := make([]string, 0, len(t.set))
	for topic := range t.set {
		out = append(out, topic)
	}
	return out
}

// RepublisherConfig configures a Republisher. The zero value of every
// field but TrackedTopics (required) and Dialect (needed unless the handle
// is a *sqlx.DB) is a working default.
type RepublisherConfig struct {
	// Dialect of the database. Optional when the handle is a *sqlx.DB.
	Dialect Dialect
	// Table is the outbox table. Default acemq_outbox.
	Table string
	// TrackedTopics are the topics whose unprocessed records are sent
	// again. Required: records of other topics are never touched.
	TrackedTopics *TrackedTopics
	// Exchanges, if set, narrows TrackedTopics to records published to
	// one of these exchanges ("" is the default exchange). In an
	// acemq_outbox shared with other services, set it to the exchanges
	// this service's consumers read: another service's records under a
	// tracked routing key to an exchange of its own are processed by no
	// consumer of yours, and without it every boot would send them again.
	// Empty: records of a tracked topic to any exchange.
	Exchanges []string
	// Grace is how long ago a record must have been published to be sent
	// again: younger ones may still be on their way to a consumer. Default
	// 5 minutes. Too short a grace resends what is merely slow to process;
	// the inbox absorbs the copy, but the work is done twice over.
	Grace time.Duration
	// PublishedAfter, if set, leaves alone the records published at or
	// before it: the moment from which every consumer of the tracked
	// topics marks what it processed (MarkOutboxProcessed). Records a
	// consumer without the inbox took before then (a switch from another
	// outbox, Watermill's forwarder say, or MarkOutboxProcessed turned on
	// over history) are processed, but no consumer marked them, and
	// without it every boot past Grace sends them again, to handlers that
	// have no key of them and run them twice (a review of such a switch:
	// 231 to 262 events applied twice). Zero: every record.
	PublishedAfter time.Time
	// Timeout bounds the plugin's Republish at router start. Default 30 s.
	Timeout time.Duration
	// Notify, if set, is called after records were made pending again, to
	// wake a relay in the same process (Forwarder.Notify).
	Notify func()
	// Logger logs how many records each Republish made pending again.
	// Nil logs nothing.
	Logger watermill.LoggerAdapter
}

func (c *RepublisherConfig) setDefaults() {
	if c.Grace == 0 {
		c.Grace = 5 * time.Minute
	}
	if c.Timeout == 0 {
		c.Timeout = 30 * time.Second
	}
	if c.Logger == nil {
		c.Logger = watermill.NopLogger{}
	}
}

func (c RepublisherConfig) validate() error {
	switch {
	case c.TrackedTopics == nil || len(c.TrackedTopics.set) == 0:
		return &ConfigError{Field: "TrackedTopics", Reason: "no tracked topics; republish would do nothing"}
	case c.Grace < 0:
		return &ConfigError{Field: "Grace", Reason: "negative"}
	case c.Timeout < 0:
		return &ConfigError{Field: "Timeout", Reason: "negative"}
	}
	for _, e := range c.Exchanges {
		if err := checkName(e); err != nil {
			return &ConfigError{Field: "Exchanges", Reason: fmt.Sprintf("%q %v", e, err)}
		}
	}
	return nil
}

// Republisher makes the unprocessed records of tracked topics pending again
// when a service boots, so that the Forwarder sends them again: a record the
// broker lost, or that sat in a queue no consumer was bound to. It publishes
// nothing itself; the Forwarder stays the only publisher.
type Republisher struct {
	store *Store
	cfg   RepublisherConfig
}

// NewRepublisher returns a Republisher over db, a *sql.DB or *sqlx.DB.
func NewRepublisher(db any, cfg RepublisherConfig) (*Republisher, error) {
	cfg.setDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	store, err := NewStore(db, StoreConfig{Dialect: cfg.Dialect, Table: cfg.Table})
	if err != nil {
		return nil, err
	}
	return &Republisher{store: store, cfg: cfg}, nil
}

// Republish makes pending again (published_at and attempts reset) every
// record of a tracked topic (to one of Exchanges, if set) that was
// published longer than Grace ago and that no consumer processed, and
// returns how many, also with an error. It walks them in batches of
// DefaultPurgeBatch, the earliest published first, each batch read and
// then updated on its own: none holds the locks of a large backlog for
// long, each goes on where the last ended, and the records made pending
// before a failure (Timeout, say) stay so, for the relay and the next
// boot. Keyed records are made pending after the walk (or each 50
// batches of them), lower seqs first, so that a relay does not find a
// key's later record pending while an earlier one this walk makes pending
// is still published (past 50 batches' worth it can: a key's earlier
// record found after them); a walk cut short makes those it found pending
// within 5 s more. Of two instances booting together each record is
// resent once.
func (r *Republisher) Republish(ctx context.Context) (int64, error) {
	n, err := r.republish(ctx)
	if n > 0 {
		// Whatever ctx says (a Timeout that cut the walk short): the rows are
		// pending, and a relay should know; within a bound of its own.
		wctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), wakeTimeout)
		r.store.wake(wctx, n)
		cancel()
		r.cfg.Logger.Info("Unprocessed outbox records made pending again", watermill.LogFields{"records": n, "grace": r.cfg.Grace, "complete": err == nil})
		if r.cfg.Notify != nil {
			r.cfg.Notify()
		}
	}
	if err != nil {
		return n, fmt.Errorf("outbox: republish: %w", err)
	}
	if n == 0 {
		// Said too: a user review could not tell a Republish that found
		// nothing from one that did not run.
		r.cfg.Logger.Info("Republish: no unprocessed outbox record to make pending again", watermill.LogFields{"grace": r.cfg.Grace})
	}
	return n, nil
}

// wakeTimeout bounds the NOTIFY that Republish sends after it made records
// pending, which runs after its own ctx may have ended.
const wakeTimeout = 5 * time.Second

func (r *Republisher) republish(ctx context.Context) (int64, error) {
	shift := r.zoneShift(ctx)
	since := r.cfg.PublishedAfter
	if !since.IsZero() {
		since = since.Add(shift)
	}
	var (
		topics = r.cfg.TrackedTopics.Topics()
		cutoff = time.Now().Add(-r.cfg.Grace).Add(shift)
		batch  = r.store.cfg.PurgeBatch
		d      = r.store.dialect.sql()
		after  *sqldialect.RepublishCursor
		total  int64
	)
	// The keyed records the walk finds are made pending once it is over
	// (or holds keyedHeld batches of them), lower seqs first: made pending
	// batch by batch in the walk's order, a key's later record went out
	// first where it had the earlier published_at (the earlier one sent
	// again by an earlier boot or a resend) and a batch ended between
	// them, a relay claiming between the batches. Made pending in seq
	// order, a key's earlier records are pending before its later ones,
	// wherever the updates stop, and whatever the database takes for one
	// key (MySQL's _bin collations ignore trailing spaces): the records it
	// numbers as one key share one sequence.
	var keyed []keyedRecord
	keys := r.keyColumns(ctx)
	flush := func(ctx context.Context) error {
		n, rest, err := r.pendKeyed(ctx, keyed, cutoff, batch)
		total += n
		if err != nil && ctx.Err() != nil {
			// Cut short in the flush: the rest still goes, within a bound.
			fctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), wakeTimeout)
			n, _, ferr := r.pendKeyed(fctx, rest, cutoff, batch)
			cancel()
			total += n
			err = errors.Join(err, ferr)
		}
		keyed = keyed[:0]
		return err
	}
	for {
		unkeyed, found, picked, last, err := r.pick(ctx, r.store.q.RepublishPick(cutoff, since, topics, r.cfg.Exchanges, after, batch, keys))
		if err == nil && len(unkeyed) > 0 {
			var n int64
			n, err = execRange(ctx, r.store.db, d, r.store.q.RepublishIDs(unkeyed, cutoff))
			total += n
		}
		keyed = append(keyed, found...)
		if republishBatched != nil {
			republishBatched()
		}
		if err != nil || picked < batch {
			return total, errors.Join(err, flush(ctx))
		}
		if len(keyed) >= keyedHeld*batch {
			if err := flush(ctx); err != nil {
				return total, err
			}
		}
		after = last
	}
}

// keyColumns reports whether the table has aggregate_id and seq: one
// another library made without them holds unkeyed records only, which
// Republish walks as it did before it read the keys. A look that fails
// for another reason says yes: the walk's own statements then fail the
// same way, or read the keys (taken for no, a look that failed once made
// that Republish's keyed records pending in the walk's order).
func (r *Republisher) keyColumns(ctx context.Context) bool {
	q := r.store.q.KeyColumnsProbe()
	rows, err := r.store.db.QueryContext(ctx, q.SQL, q.Args...)
	if err != nil {
		return !r.store.dialect.sql().MissingColumn(err)
	}
	_ = rows.Close()
	return true
}

// keyedHeld is how many batches of keyed records a Republish walk holds
// before it makes them pending (see republish): past it, a key's earlier
// record the walk finds later may go out after its later one, as before.
const keyedHeld = 50

// keyedRecord is a keyed record a Republish walk found.
type keyedRecord struct {
	key string
	seq int64
	id  string
}

// pendKeyed makes the records of keyed pending again, in batches of batch,
// lower seqs first, and returns how many, and the records it did not get
// to when it failed.
func (r *Republisher) pendKeyed(ctx context.Context, keyed []keyedRecord, cutoff time.Time, batch int) (int64, []keyedRecord, error) {
	slices.SortFunc(keyed, func(a, b keyedRecord) int {
		if c := cmp.Compare(a.seq, b.seq); c != 0 {
			return c
		}
		return strings.Compare(a.key, b.key)
	})
	var total int64
	d := r.store.dialect.sql()
	for len(keyed) > 0 {
		k := min(batch, len(keyed))
		ids := make([]string, k)
		for i, rec := range keyed[:k] {
			ids[i] = rec.id
		}
		n, err := execRange(ctx, r.store.db, d, r.store.q.RepublishIDs(ids, cutoff))
		total += n
		if err != nil {
			return total, keyed, err
		}
		keyed = keyed[k:]
		if republishBatched != nil {
			republishBatched()
		}
	}
	return total, nil, nil
}

// republishBatched, if set (by a test), is called after each update of a
// Republish: where a relay's claim could come between two.
var republishBatched func()

// zoneShift is how far the session's time_zone is ahead of UTC where
// published_at is a MySQL TIMESTAMP (another library's table: Laravel's),
// which MySQL reads a time's text in: the cutoff, UTC text, read as a
// time that far off, and a session five hours behind UTC sent again at
// every boot the records of the last five hours, inside Grace and still
// on their way (a review). The times Republish compares are shifted by it.
// Zero where nothing is converted, or the look fails.
func (r *Republisher) zoneShift(ctx context.Context) time.Duration {
	cols, offset, ok := r.store.zonedTimes(ctx, r.store.db)
	if !ok || !slices.Contains(cols, "published_at") {
		return 0
	}
	return time.Duration(offset) * time.Second
}

// pick reads a batch of the walk: the ids of its unkeyed records, its keyed
// ones, how many it read, and where the next batch starts. A record whose
// key is NULL or empty, or whose seq is NULL, has no place in a key's
// order (as for the relay) and is taken as unkeyed; so is one whose key
// is no text or whose seq no integer (another library's), which the relay
// fails as malformed: it goes as it did before keys were held.
func (r *Republisher) pick(ctx context.Context, q sqldialect.Query) (unkeyed []string, keyed []keyedRecord, picked int, _ *sqldialect.RepublishCursor, _ error) {
	rows, err := r.store.db.QueryContext(ctx, q.SQL, q.Args...)
	if err != nil {
		return nil, nil, 0, nil, err
	}
	defer func() { _ = rows.Close() }()
	var (
		last     sqldialect.RepublishCursor
		key, seq any
	)
	for rows.Next() {
		if err := rows.Scan(&last.ID, &last.PublishedAt, &key, &seq); err != nil {
			return nil, nil, 0, nil, err
		}
		picked++
		if rec, ok := keyedOf(last.ID, key, seq); ok {
			keyed = append(keyed, rec)
		} else {
			unkeyed = append(unkeyed, last.ID)
		}
	}
	return unkeyed, keyed, picked, &last, rows.Err()
}

// keyedOf is the record id of key and seq as the walk read them, if it has
// a place in a key's order.
func keyedOf(id string, key, seq any) (keyedRecord, bool) {
	var k string
	switch x := key.(type) {
	case string:
		k = x
	case []byte:
		k = string(x)
	default:
		return keyedRecord{}, false // NULL, or a number another library wrote
	}
	n, err := sqldialect.ReadInt64(seq) // as the relay reads it
	if k == "" || err != nil {
		return keyedRecord{}, false
	}
	return keyedRecord{key: k, seq: n, id: id}, true
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
