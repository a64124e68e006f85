package outbox

import (
	"bytes"
	"cmp"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"reflect"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jmoiron/sqlx"
	"go.opentelemetry.io/otel/propagation"

	"github.com/acemq/watermill-outbox/internal/rowcodec"
	"github.com/acemq/watermill-outbox/internal/sqldialect"
)

// Metadata keys a message may carry to steer its own row. The message
// keeps them, but MetadataExchange, MetadataRoutingKey and
// MetadataAggregateID are the row's columns, not its headers: a consumer
// does not receive them, so a handler that returns a copy of its message
// (msg.Copy()) does not steer the copy to the incoming message's
// destination or key.
const (
	// MetadataExchange overrides the exchange the topic maps to.
	MetadataExchange = "outbox_exchange"
	// MetadataRoutingKey overrides the routing key the topic maps to.
	MetadataRoutingKey = "outbox_routing_key"
	// MetadataContentType sets the row's content_type (the AMQP
	// content_type property); without it the publisher's default is used.
	MetadataContentType = "content_type"
	// MetadataAggregateID is a message's ordering key, its aggregate's id:
	// 1 to 255 bytes of UTF-8 without NUL. The publisher gives the message
	// the key's next sequence number in the caller's transaction, from 1,
	// without gaps, increasing in commit order; the relay sends both as the
	// headers HeaderAggregateID and HeaderSeq. Without it a message is
	// unkeyed and costs nothing more. A message holding HeaderAggregateID
	// ("aggregateId") without HeaderSeq and without MetadataAggregateID is
	// refused with an *InvalidMessageError: an ordered inbox would refuse
	// it at every delivery (ErrInvalidSeq).
	//
	// A keyed message whose id is in the table already is a retry when the
	// row has its key, compared byte for byte, and a *DuplicateIDError
	// when the row has another key or none. An unkeyed message over a
	// keyed row is a retry: the row keeps its key.
	MetadataAggregateID = "outbox_aggregate_id"
)

// Limits of the columns, checked before anything is written so that no
// database ever truncates a value (MySQL outside strict mode would).
const (
	maxIDLen       = 64  // id varchar(64)
	maxNameLen     = 255 // exchange_name, routing_key, content_type: AMQP shortstr
	maxRowsPerStmt = 1000
	// maxBytesPerStmt bounds the bodies one INSERT carries, so a call with
	// many large messages does not exceed MySQL's max_allowed_packet (16 MiB
	// by default on MariaDB). A single larger body still goes alone.
	maxBytesPerStmt = 4 << 20
)

// DefaultContentType is the content_type of a message whose metadata names none.
const DefaultContentType = "application/octet-stream"

// TopicMapper maps a Watermill topic to the AMQP exchange and routing key of
// its row. The default keeps the configured exchange and uses the topic as
// the routing key.
type TopicMapper func(topic string) (exchange, routingKey string)

// TxPublisherConfig configures a TxPublisher. Its zero value is a working
// default on a *sqlx.Tx.
type TxPublisherConfig struct {
	// Dialect of the database. Required with a *sql.Tx or a watermill-sql
	// Tx; a *sqlx.Tx reports its own.
	Dialect Dialect
	// Table is the outbox table, "name" or "schema.name". Default
	// acemq_outbox. It is validated as an identifier and quoted.
	Table string
	// Exchange is the exchange every topic maps to. Default "", the AMQP
	// default exchange, which routes to the queue named by the routing key:
	// the convention of watermill-amqp's durable queue config.
	Exchange string
	// ContentType is the content_type of messages whose metadata names
	// none. Default DefaultContentType.
	ContentType string
	// TopicMapper replaces the default topic → (exchange, routing key) map.
	// A message's MetadataExchange and MetadataRoutingKey still override it.
	TopicMapper TopicMapper
	// Propagator, if set, stores the trace context of each message's
	// context (its traceparent, with propagation.TraceContext{}) in the
	// row's headers, where the relay carries it to the broker and an Inbox
	// with the same Propagator restores it for the handler. Nil adds
	// nothing and costs nothing.
	Propagator propagation.TextMapPropagator
}

func (c *TxPublisherConfig) setDefaults() {
	if c.Table == "" {
		c.Table = DefaultTable
	}
	if c.ContentType == "" {
		c.ContentType = DefaultContentType
	}
}

func (c TxPublisherConfig) validate() error {
	if c.Dialect == nil {
		return &ConfigError{Field: "Dialect", Reason: "the dialect cannot be told from this transaction; set Dialect: outbox.Postgres, MySQL or SQLite"}
	}
	if err := checkName(c.Exchange); err != nil {
		return &ConfigError{Field: "Exchange", Reason: err.Error()}
	}
	if err := checkName(c.ContentType); err != nil {
		return &ConfigError{Field: "ContentType", Reason: err.Error()}
	}
	return nil
}

// txConn is the caller's transaction, whatever its type.
type txConn interface {
	exec(ctx context.Context, q sqldialect.Query) (sqldialect.Result, error)
	query(ctx context.Context, q sqldialect.Query) (rowsScanner, error)
}

type rowsScanner interface {
	Next() bool
	Scan(dest ...any) error
	// Err is the error that ended Next early: pgx reports an error the
	// server raised while the statement ran only there (watermill-sql's
	// PgxRows closes without one), and rows that merely ended look alike.
	Err() error
	Close() error
}

type stdTx struct{ tx *sql.Tx }

func (t stdTx) exec(ctx context.Context, q sqldialect.Query) (sqldialect.Result, error) {
	return t.tx.ExecContext(ctx, q.SQL, q.Args...)
}

func (t stdTx) query(ctx context.Context, q sqldialect.Query) (rowsScanner, error) {
	return t.tx.QueryContext(ctx, q.SQL, q.Args...)
}

type watermillTx struct{ tx wsql.Tx }

func (t watermillTx) exec(ctx context.Context, q sqldialect.Query) (sqldialect.Result, error) {
	return t.tx.ExecContext(ctx, q.SQL, q.Args...)
}

func (t watermillTx) query(ctx context.Context, q sqldialect.Query) (rowsScanner, error) {
	rows, err := t.tx.QueryContext(ctx, q.SQL, q.Args...)
	if err != nil {
		return nil, err
	}
	return watermillRows{rows}, nil
}

// watermillRows is watermill-sql's Rows with the Err its value has
// (PgxRows's pgx.Rows, *sql.Rows), or none.
type watermillRows struct{ wsql.Rows }

func (r watermillRows) Err() error {
	if e, ok := r.Rows.(interface{ Err() error }); ok {
		return e.Err()
	}
	return nil
}

// TxPublisher is a Watermill message.Publisher bound to one database
// transaction. Publish writes each message as a row of the outbox table
// through that transaction and does nothing else: the row exists if and only
// if the caller commits, and the Forwarder is what sends it to the broker.
//
// A TxPublisher lives as long as its transaction. It is safe for concurrent
// use: its calls run one at a time, since a call of several statements
// (a savepoint and its rollback, a read back, a key's numbers given back)
// must not interleave with another's on the one connection. Two
// publishers on one transaction must not be used at once.
type TxPublisher struct {
	tx  txConn
	cfg TxPublisherConfig
	q   *sqldialect.Outbox

	mu     sync.Mutex // one call at a time; Close waits for the one in flight
	closed bool
	// clientCharsetOK: the connection reads a statement's arguments as
	// utf8mb4 (MySQL; see inline).
	clientCharsetOK bool
}

var _ message.Publisher = (*TxPublisher)(nil)

// NewTxPublisher returns a publisher that writes into tx, which is a
// *sqlx.Tx, a *sql.Tx, or a watermill-sql Tx (sql.TxFromStdSQL, or
// sql.TxFromPgx for pgx without database/sql). With anything but a *sqlx.Tx,
// set TxPublisherConfig.Dialect.
//
// The configuration is optional, unlike the other components', so that the
// call made in every transaction reads NewTxPublisher(tx) where the defaults
// serve; more than one is an error.
func NewTxPublisher(tx any, config ...TxPublisherConfig) (*TxPublisher, error) {
	var cfg TxPublisherConfig
	switch len(config) {
	case 0:
	case 1:
		cfg = config[0]
	default:
		return nil, &ConfigError{Field: "config", Reason: fmt.Sprintf("%d configurations given; want at most one", len(config))}
	}
	var conn txConn
	switch t := tx.(type) {
	case *sqlx.Tx:
		if t == nil {
			break
		}
		if cfg.Dialect == nil {
			cfg.Dialect, _ = dialectForDriver(t.DriverName())
		} else if err := checkTxDialect(t.DriverName(), cfg.Dialect); err != nil {
			return nil, err
		}
		conn = stdTx{t.Tx}
	case *sql.Tx:
		if t != nil {
			conn = stdTx{t}
		}
	case wsql.Tx:
		if !nilWatermillTx(t) {
			conn = watermillTx{t}
		}
	default:
		return nil, &ConfigError{Field: "tx", Reason: fmt.Sprintf("%T is not a transaction this publisher can write through; pass a *sqlx.Tx, a *sql.Tx or a watermill-sql Tx", tx)}
	}
	if conn == nil {
		return nil, &ConfigError{Field: "tx", Reason: "nil transaction"}
	}
	cfg.setDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	q, err := sqldialect.NewOutbox(cfg.Dialect.sql(), cfg.Table)
	if err != nil {
		return nil, &ConfigError{Field: "Table", Reason: err.Error()}
	}
	return &TxPublisher{tx: conn, cfg: cfg, q: q}, nil
}

// nilWatermillTx reports whether t, a non-nil interface, holds no
// transaction: watermill-sql's adapters around a nil one
// (sql.TxFromStdSQL(nil), sql.TxFromPgx(nil)) or a typed nil pointer. It
// was accepted, and Publish panicked.
func nilWatermillTx(t wsql.Tx) bool {
	switch w := t.(type) {
	case *wsql.StdSQLTx:
		return w == nil || w.Tx == nil
	case wsql.StdSQLTx:
		return w.Tx == nil
	case wsql.PgxTx:
		return nilValue(w.Tx)
	case *wsql.PgxTx:
		return w == nil || nilValue(w.Tx)
	}
	return nilValue(t)
}

// nilValue reports whether v is nil, or a typed nil in an interface.
func nilValue(v any) bool {
	if v == nil {
		return true
	}
	switch r := reflect.ValueOf(v); r.Kind() {
	case reflect.Pointer, reflect.Interface, reflect.Map, reflect.Slice, reflect.Func, reflect.Chan:
		return r.IsNil()
	}
	return false
}

// Publish writes one outbox row per message into the transaction, in one
// statement (a call with more than 1,000 messages or 4 MiB of bodies takes
// several, under a savepoint, so that it still writes all or nothing). The
// statement runs with the first message's context.
//
// Every message is checked before anything is written; an invalid one
// fails the whole call with an *InvalidMessageError. A message whose id is
// already in the table (the caller retrying its transaction) is skipped
// without error, the row keeping what was written first; unless the row
// goes to another exchange or routing key, or under another ordering key:
// that fails the whole call with a *DuplicateIDError.
//
// A message with MetadataAggregateID gets its key's next sequence number
// first: the call takes its keys' rows of acemq_outbox_sequences (in the
// schema of the outbox table) in sorted order, and holds them until the
// transaction ends. A second transaction publishing on one of those keys
// waits for this one; other keys do not. The messages of a key in one call
// get consecutive numbers in call order. A skipped message takes no number.
func (p *TxPublisher) Publish(topic string, msgs ...*message.Message) error {
	ctx := context.Background() // a nil first message fails the checks before ctx is used
	if len(msgs) > 0 && msgs[0] != nil {
		ctx = msgs[0].Context()
	}
	for i, msg := range msgs {
		if err := loneAggregateID(i, msg); err != nil {
			return err
		}
	}
	return p.publish(ctx, topic, msgs)
}

// loneAggregateID refuses msg, the i-th of a Publish, when its metadata
// holds aggregateId and no seq and it has no ordering key: its row would
// go out unkeyed with that header, which an ordered inbox refuses at every
// delivery (ErrInvalidSeq), a poison message made by setting the header's
// name where MetadataAggregateID was meant (an API review). Publish's
// alone: a handler's returned messages, which may carry on an incoming
// message's metadata, are written as they are (refused, the delivery
// would fail at every try; a code review).
func loneAggregateID(i int, msg *message.Message) error {
	if msg == nil {
		return nil
	}
	v, ok := msg.Metadata[HeaderAggregateID]
	if !ok || v == "" || v == voidHeader {
		return nil
	}
	if _, keyed := msg.Metadata[MetadataAggregateID]; keyed {
		return nil
	}
	if _, ok := msg.Metadata[HeaderSeq]; ok {
		return nil
	}
	return &InvalidMessageError{Index: i, MessageID: msgID(msg), Field: "metadata", Reason: fmt.Sprintf(
		"holds %s %.80q and no %s, which an ordered inbox refuses at every delivery (ErrInvalidSeq); to order by it, set outbox.MetadataAggregateID (%q) instead, and the relay sends %s and %s; an application's own metadata of that name, name it otherwise",
		HeaderAggregateID, v, HeaderSeq, MetadataAggregateID, HeaderAggregateID, HeaderSeq)}
}

// publish is Publish with the statements run under ctx. The inbox writes a
// handler's returned messages with the handler's context, which outlives a
// context the handler may have given a message and cancelled on return.
func (p *TxPublisher) publish(ctx context.Context, topic string, msgs []*message.Message) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return ErrPublisherClosed
	}
	if len(msgs) == 0 {
		return nil
	}
	rows := make([]sqldialect.Row, len(msgs))
	for i, msg := range msgs {
		if err := p.buildRow(&rows[i], i, topic, msg); err != nil {
			return err
		}
	}
	keyed, err := checkCallDuplicates(rows)
	if err != nil {
		return err
	}
	// One row per id, the first message's: readBack tells the rows this
	// call inserted by their stamps, and a later copy's stamp is not the
	// row's.
	rows = dedupeIDs(rows)
	// Stamps are strictly increasing within the process, so the relay's
	// ORDER BY created_at, id keeps the order the messages were given in,
	// within this call and across calls.
	base := reserveStamps(len(rows))
	for i := range rows {
		rows[i].CreatedAt = base.Add(time.Duration(i) * time.Microsecond)
	}
	if keyed {
		return p.wrapExecErr(p.publishKeyed(ctx, rows))
	}

	chunks := splitRows(rows)
	if len(chunks) == 1 {
		return p.wrapExecErr(p.insert(ctx, chunks[0]))
	}
	return p.wrapExecErr(p.insertUnderSavepoint(ctx, chunks))
}

func (p *TxPublisher) insert(ctx context.Context, rows []sqldialect.Row) error {
	all, err := p.insertedAll(ctx, p.q.Insert(rows), len(rows))
	if err != nil {
		return err
	}
	if !all {
		// Some ids were there already: a retried transaction (the same
		// message again, harmless) or the same id sent somewhere else, which
		// would lose that copy without a word.
		return p.checkConflicts(ctx, rows)
	}
	return nil
}

// checkConflicts compares the rows already in the table under the ids of
// rows with where rows were going. A different destination or ordering key
// is an error, and
// the rows this statement inserted are taken out again, so that nothing of
// the call stays.
//
// It runs after a write, so whatever ctx says: a call cancelled here would
// otherwise leave its rows behind its error.
func (p *TxPublisher) checkConflicts(ctx context.Context, rows []sqldialect.Row) error {
	ctx = context.WithoutCancel(ctx)
	ours, conflict, err := p.readBack(ctx, rows)
	if err != nil || conflict == nil {
		return err
	}
	if len(ours) > 0 {
		if _, err := p.exec(ctx, p.q.Delete(ours)); err != nil {
			return errors.Join(conflict, err)
		}
	}
	return conflict
}

// readBack reads the rows under the ids of rows: ours are those this call
// inserted (by their created_at), and conflict the first of the others
// that goes to another destination or under another ordering key (a
// *DuplicateIDError), or else a row
// that is not there at all: MySQL's insert skips a row for any unique key
// (ON DUPLICATE KEY UPDATE leaving the row there as it is), and a keyed row whose (aggregate_id, seq) another row holds
// (a counter behind the table) would otherwise be lost without a word.
func (p *TxPublisher) readBack(ctx context.Context, rows []sqldialect.Row) (ours []string, conflict error, err error) {
	// near: a row not ours whose created_at is within a second of our
	// stamp, as all of ours are in a table that rounds them (see
	// checkPrecision).
	near := false
	seen := make(map[string]bool, len(rows))
	want := make(map[string]*sqldialect.Row, len(rows))
	keyed := false // the call's keyed rows need aggregate_id, and 0005
	// A uuid id column (PostgreSQL, a table another library made) reads an
	// id back as uuid's output writes it, not as it was sent: a retry of an
	// id in upper case was taken for a collation's conflict, for ever.
	canonical := map[string]*sqldialect.Row{}
	for i := range rows {
		want[rows[i].ID] = &rows[i]
		keyed = keyed || rows[i].AggregateID != ""
		if c := canonicalUUID(rows[i].ID); c != "" && c != rows[i].ID && p.cfg.Dialect.sql() == sqldialect.Postgres {
			canonical[c] = &rows[i]
		}
	}
	for start := 0; start < len(rows); start += maxRowsPerStmt {
		end := min(start+maxRowsPerStmt, len(rows))
		ids := make([]string, 0, end-start)
		for i := start; i < end; i++ {
			ids = append(ids, rows[i].ID)
		}
		found, err := p.query(ctx, p.q.Destinations(ids, keyed))
		if err != nil {
			return nil, nil, err
		}
		for found.Next() {
			var (
				id, exchange, routingKey string
				// Read by the dialect's rule, as it was written: a row another
				// library wrote with a created_at that is no time reads as
				// the zero time, not ours.
				created = sqldialect.NewTime(p.cfg.Dialect.sql())
				// NULL and '' (which another library may write for none)
				// are both unkeyed, as the relay reads them; any other key
				// is compared in its bytes, not by the column's collation.
				key sql.NullString
			)
			dest := []any{&id, &exchange, &routingKey, created}
			if keyed {
				dest = append(dest, &key)
			}
			if err := found.Scan(dest...); err != nil {
				_ = found.Close()
				return nil, nil, err
			}
			r, ok := want[id]
			if c, uuid := canonical[id]; !ok && uuid {
				r, ok, id = c, true, c.ID
			}
			if !ok {
				// The id column takes the database's id for one of ours
				// without their bytes being equal: a collation that ignores
				// case, or trailing spaces (MySQL's PAD SPACE).
				if conflict == nil {
					conflict = fmt.Errorf("%w: the outbox's id column takes a message's id for the row %q already there (a collation that ignores case or trailing spaces); give the message an id of its own", ErrDuplicateID, id)
				}
				continue
			}
			seen[id] = true
			switch {
			case created.T.UnixMicro() == r.CreatedAt.UnixMicro():
				ours = append(ours, id) // inserted by this statement
			// An unkeyed message over a keyed row is a retry: the row keeps
			// its key, and goes out ordered by it.
			case (exchange != r.Exchange || routingKey != r.RoutingKey || r.AggregateID != "" && key.String != r.AggregateID) && conflict == nil:
				conflict = &DuplicateIDError{ID: id, Exchange: exchange, RoutingKey: routingKey, AggregateID: key.String,
					WantExchange: r.Exchange, WantRoutingKey: r.RoutingKey, WantAggregateID: r.AggregateID}
			}
			near = near || (!created.T.IsZero() && created.T.UnixMicro() != r.CreatedAt.UnixMicro() && created.T.Sub(r.CreatedAt).Abs() < time.Second)
		}
		if err := errors.Join(found.Err(), found.Close()); err != nil {
			return nil, nil, err
		}
	}
	if near {
		if err := p.checkPrecision(ctx); err != nil {
			return nil, nil, err
		}
	}
	for i := range rows {
		if r := &rows[i]; conflict == nil && !seen[r.ID] {
			conflict = fmt.Errorf("outbox: message %s was not written, and no row has its id: the database skipped it for another unique key"+
				" (aggregate %q: does another row hold its next seq, with %s behind the table?)", r.ID, r.AggregateID, p.q.Sequences())
		}
	}
	return ours, conflict, nil
}

// checkPrecision fails when the table's created_at keeps less than
// microseconds (a table of Rails before 7.0, say, not migrated since): the
// database rounded the call's stamps, readBack cannot tell the call's rows
// from those already there, and taking its guess would give back the
// numbers of rows it wrote or leave a refused call's rows behind. Only the
// slow path asks, and only when a row's time is within a second of ours.
// It cannot tell a call that inserted nothing (a plain retry, whose guess
// would be right) from one that did: on such a table every call that meets
// ids already there within a second of them fails until it is migrated.
func (p *TxPublisher) checkPrecision(ctx context.Context) error {
	q, ok := p.q.CreatedAtPrecision()
	if !ok {
		return nil
	}
	found, err := p.query(ctx, q)
	if err != nil {
		return err
	}
	digits := 6
	if found.Next() {
		err = found.Scan(&digits)
	}
	if err := errors.Join(err, found.Err(), found.Close()); err != nil {
		return err
	}
	if digits < 6 {
		return fmt.Errorf("outbox: %s.created_at keeps %d digits of a second, and the publisher tells the rows of its call from those already there by created_at to the microsecond;"+
			" roll this transaction back, and run outbox.Migrate (or sqlschema's 0011) on the table", p.q.Table(), digits)
	}
	return nil
}

// checkCallDuplicates refuses one id sent to two destinations, or under two
// ordering keys, in one call; the same message twice to the same place is
// one row. keyed reports a message with an ordering key.
func checkCallDuplicates(rows []sqldialect.Row) (keyed bool, err error) {
	if len(rows) < 2 {
		return len(rows) == 1 && rows[0].AggregateID != "", nil
	}
	first := make(map[string]int, len(rows))
	for i := range rows {
		keyed = keyed || rows[i].AggregateID != ""
		j, ok := first[rows[i].ID]
		if !ok {
			first[rows[i].ID] = i
			continue
		}
		if rows[j].Exchange != rows[i].Exchange || rows[j].RoutingKey != rows[i].RoutingKey {
			return keyed, &InvalidMessageError{Index: i, MessageID: rows[i].ID, Field: "id",
				Reason: fmt.Sprintf("is also message %d of this call, to exchange %q routing key %q; the id is the outbox row's key, so each destination needs a message of its own id", j, rows[j].Exchange, rows[j].RoutingKey)}
		}
		if rows[j].AggregateID != rows[i].AggregateID {
			return keyed, &InvalidMessageError{Index: i, MessageID: rows[i].ID, Field: "aggregate id",
				Reason: fmt.Sprintf("is %q, but message %d of this call has the same id and aggregate id %q; one row has one key", rows[i].AggregateID, j, rows[j].AggregateID)}
		}
	}
	return keyed, nil
}

// publishKeyed writes a call with keyed messages: each keyed row numbered
// and inserted in the same statement (on PostgreSQL one statement in all),
// all or nothing as the unkeyed path (under a savepoint when the rows take
// several statements, whose rollback also gives the numbers back).
func (p *TxPublisher) publishKeyed(ctx context.Context, rows []sqldialect.Row) error {
	if len(splitRows(rows)) == 1 {
		return p.insertKeyed(ctx, rows, true)
	}
	if _, err := p.exec(ctx, p.q.Savepoint()); err != nil {
		return err
	}
	if err := p.insertKeyed(ctx, rows, false); err != nil {
		_, rbErr := p.exec(context.WithoutCancel(ctx), p.q.RollbackToSavepoint())
		return errors.Join(err, rbErr)
	}
	_, err := p.exec(context.WithoutCancel(ctx), p.q.ReleaseSavepoint()) // the rows are written
	return err
}

// insertKeyed numbers rows and inserts them. A number must never go to a
// row that is not written: the ordered inbox would wait for it for ever.
// So when some ids are in the table already (the caller retrying a
// transaction that did commit, or the same message in an earlier call of
// this one), the rows this call inserted are taken out, the numbers given
// back (this transaction still holds the keys' rows, so nobody took one
// since), and the call runs again without those ids. That costs the slow
// path only: the common call numbers and inserts, and checks nothing.
//
// alone says no savepoint is around the call: should the slow path fail,
// the call's keyed rows and numbers are taken back here (takeBack).
func (p *TxPublisher) insertKeyed(ctx context.Context, rows []sqldialect.Row, alone bool) error {
	for len(rows) > 0 {
		chunks := splitRows(rows)
		taken := keyCounts(rows)
		if len(chunks) > 1 {
			// Every key of the call first, in sorted order, as one
			// statement would take them: the chunks' own keys are sorted
			// within a chunk only. In statements of maxRowsPerStmt keys:
			// tens of thousands in one passed the databases' limits on
			// arguments.
			for start := 0; start < len(taken); start += maxRowsPerStmt {
				if _, err := p.exec(ctx, p.q.LockKeys(taken[start:min(start+maxRowsPerStmt, len(taken))])); err != nil {
					return p.seqErr(err)
				}
			}
		}
		insertedAll := true
		for i, c := range chunks {
			all, tookOwn, err := p.insertNumbered(ctx, c)
			if err != nil {
				// Best effort, for a caller who commits after our error on
				// MySQL or SQLite, where a failed statement leaves the
				// transaction open; on PostgreSQL the transaction is
				// aborted and takes the numbers with it. Not after an error
				// that ended the transaction (a deadlock): its raise is
				// undone already, another transaction may have taken the
				// numbers since, and the give-back, committed on its own,
				// would leave the counter below them for good.
				if !p.endsTransaction(context.WithoutCancel(ctx), err) {
					end := chunkEnd(chunks, i-1)
					if tookOwn {
						end = chunkEnd(chunks, i)
					}
					_, _ = p.giveBackSeqs(context.WithoutCancel(ctx), keyCounts(rows[:end]))
				}
				return p.seqErr(err)
			}
			insertedAll = insertedAll && all
		}
		if insertedAll {
			return nil
		}
		// After the writes, whatever ctx says: the call's rows and numbers
		// are taken back, or it returns nil.
		after := context.WithoutCancel(ctx)
		undo := func(taken []sqldialect.KeyCount, err error) error {
			if !alone {
				return err // the savepoint's rollback takes everything back
			}
			return p.takeBack(after, rows, taken, err)
		}
		ours, conflict, err := p.readBack(after, rows)
		if err != nil {
			return undo(taken, err)
		}
		if conflict == nil && len(ours) == len(rows) {
			// Every row is this call's: a statement whose result could not
			// say so (see sqldialect's insertedAll on MySQL).
			return nil
		}
		for start := 0; start < len(ours); start += maxRowsPerStmt { // SQLite takes 32,766 arguments
			if _, err := p.exec(after, p.q.Delete(ours[start:min(start+maxRowsPerStmt, len(ours))])); err != nil {
				return undo(taken, err)
			}
		}
		if n, err := p.giveBackSeqs(after, taken); err != nil {
			// The call's rows are gone, and the first n keys have their
			// numbers back.
			return undo(taken[n:], err)
		}
		if conflict != nil {
			return conflict
		}
		// Every id not inserted by this call was there before it.
		inserts := make(map[string]bool, len(ours))
		for _, id := range ours {
			inserts[id] = true
		}
		kept := rows[:0:0]
		for _, r := range rows {
			if inserts[r.ID] {
				kept = append(kept, r)
			}
		}
		rows = kept
	}
	return nil
}

// endsTransaction reports whether err, a statement's, ended the caller's
// transaction, asking the database where the error alone does not say
// (MySQL's lock wait timeout: the raise of the key stayed, and its number
// must be given back, unless innodb_rollback_on_timeout is on; on SQLite
// every error).
func (p *TxPublisher) endsTransaction(ctx context.Context, err error) bool {
	d := p.cfg.Dialect.sql()
	if d.AsksByBegin() {
		return p.outsideTransaction(ctx, err)
	}
	q, ask := d.TimeoutEnds(err)
	if !ask {
		return d.EndsTransaction(err)
	}
	rows, qerr := p.query(ctx, q)
	if qerr != nil {
		return true // the connection is gone: so is the transaction
	}
	defer func() { _ = rows.Close() }()
	var on int
	if !rows.Next() || rows.Scan(&on) != nil {
		return true
	}
	return on == 1
}

// outsideTransaction asks SQLite whether err left the connection outside
// the caller's transaction (see sqldialect.Dialect.AsksByBegin), rolled back
// by SQLite: a statement sent then would commit on its own. The
// transaction the asking BEGIN starts is rolled back at once, so that the
// caller's Commit fails, as the transaction it began is gone. Should the
// BEGIN fail otherwise, err alone decides.
func (p *TxPublisher) outsideTransaction(ctx context.Context, err error) bool {
	_, berr := p.exec(ctx, sqldialect.Query{SQL: "BEGIN"})
	if berr == nil {
		_, _ = p.exec(ctx, sqldialect.Query{SQL: "ROLLBACK"})
		return true
	}
	if sqldialect.BeginRefused(berr) {
		return false
	}
	return p.cfg.Dialect.sql().EndsTransaction(err)
}

// insertNumbered runs InsertNumbered for one chunk and reports whether it
// inserted every row. On an error, took says the chunk's numbers were
// taken: the raise ran and the insert did not.
func (p *TxPublisher) insertNumbered(ctx context.Context, rows []sqldialect.Row) (all, took bool, err error) {
	qs := p.q.InsertNumbered(rows, keyCounts(rows))
	var res sqldialect.Result
	for i, q := range qs {
		if res, err = p.exec(ctx, q); err != nil {
			return false, i > 0, err
		}
	}
	all, err = sqldialect.InsertedAll(p.cfg.Dialect.sql(), res, len(rows))
	return all, false, err
}

// seqErr says where numbering failed: a sequences table that is missing
// (migration 0005 not applied) is the likely cause.
func (p *TxPublisher) seqErr(err error) error {
	return fmt.Errorf("number and insert keyed rows (counters in %s): %w", p.q.Sequences(), err)
}

// chunkEnd is the index in the call's rows where chunk i ends (0 for -1).
func chunkEnd(chunks [][]sqldialect.Row, i int) int {
	n := 0
	for _, c := range chunks[:i+1] {
		n += len(c)
	}
	return n
}

// keyCounts counts rows' keyed rows per key, in sorted key order: two calls
// that share two keys and took them in call order, A then B against B then
// A, would each hold one and wait for the other, a deadlock the database
// ends by aborting one of them. (Keys taken in separate Publish calls of
// one transaction are taken in the caller's order: the database detects a
// deadlock between two such transactions, and one of them must retry.)
func keyCounts(rows []sqldialect.Row) []sqldialect.KeyCount {
	if len(rows) == 1 {
		if k := rows[0].AggregateID; k != "" {
			return []sqldialect.KeyCount{{Key: k, N: 1}} // the common call: no map
		}
		return nil
	}
	counts := make(map[string]int, 1)
	for i := range rows {
		if k := rows[i].AggregateID; k != "" {
			counts[k]++
		}
	}
	keys := make([]sqldialect.KeyCount, 0, len(counts))
	for k, n := range counts {
		keys = append(keys, sqldialect.KeyCount{Key: k, N: n})
	}
	sort.Slice(keys, func(i, j int) bool { return keys[i].Key < keys[j].Key })
	return keys
}

// giveBackSeqs returns the numbers of taken to their keys; on an error,
// given is how many keys have theirs back.
func (p *TxPublisher) giveBackSeqs(ctx context.Context, taken []sqldialect.KeyCount) (given int, err error) {
	for i, kc := range taken {
		if _, err := p.exec(ctx, p.q.GiveBackSeq(kc.Key, kc.N)); err != nil {
			return i, fmt.Errorf("give back %d numbers of aggregate %q in %s: %w", kc.N, kc.Key, p.q.Sequences(), err)
		}
	}
	return len(taken), nil
}

// takeBack undoes a keyed call alone in its statement whose slow path
// failed after the write, and returns cause. The error tells the caller
// to roll back, but the transaction is still open after it (a refusal of
// ours, or a failed statement on MySQL or SQLite), and a caller that
// committed anyway (a handler that logs errors and goes on) kept the
// call's new keyed rows and the numbers of its rows skipped as already
// there: a key holding 1 and 3, its counter at 3, and an ordered inbox
// waiting for 2 for ever. The call's rows are those holding the number
// each took (the key's row has stayed locked since) and the call's stamp
// (DeleteNumbered): by the number alone, a row of the same id committed
// under that number, its key's counter behind the table, was deleted, and
// the message lost. The numbers go back but for those a row still holds
// (GiveBackAbove). Left as they were: on a table whose created_at keeps
// whole seconds (checkPrecision's refusal), the call's rows, whose stamps
// the database rounded, and their numbers; and the unkeyed rows of the
// call, as after the same error on the unkeyed path.
//
// Not after an error that ended the transaction on MySQL or SQLite: the
// statements would commit on their own (see insertKeyed). On PostgreSQL a
// statement's error aborted the transaction, which refuses these too.
func (p *TxPublisher) takeBack(ctx context.Context, rows []sqldialect.Row, taken []sqldialect.KeyCount, cause error) error {
	d := p.cfg.Dialect.sql()
	if d != sqldialect.Postgres && p.endsTransaction(ctx, cause) {
		return cause
	}
	failed := func(err error) error {
		if d == sqldialect.Postgres && sqldialect.TxAborted(err) {
			return cause
		}
		return errors.Join(cause, fmt.Errorf("outbox: take the call's keyed rows and their numbers back: %w; roll the transaction back", err))
	}
	low := make(map[string]int64, len(taken)) // each key's last number before the call's
	for _, kc := range taken {
		last, err := p.lastSeq(ctx, kc.Key)
		if err != nil {
			return failed(err)
		}
		low[kc.Key] = last - int64(kc.N)
	}
	// The k-th keyed row of a key took the number low + k (InsertNumbered).
	own := make([]sqldialect.Numbered, 0, len(rows))
	k := make(map[string]int64, len(taken))
	for i := range rows {
		if r := &rows[i]; r.AggregateID != "" {
			if l, ok := low[r.AggregateID]; ok {
				k[r.AggregateID]++
				own = append(own, sqldialect.Numbered{ID: r.ID, Seq: l + k[r.AggregateID], CreatedAt: r.CreatedAt})
			}
		}
	}
	for start := 0; start < len(own); start += maxRowsPerStmt {
		if _, err := p.exec(ctx, p.q.DeleteNumbered(own[start:min(start+maxRowsPerStmt, len(own))])); err != nil {
			return failed(err)
		}
	}
	for _, kc := range taken {
		if _, err := p.exec(ctx, p.q.GiveBackAbove(kc.Key, low[kc.Key], low[kc.Key]+int64(kc.N))); err != nil {
			return failed(err)
		}
	}
	return cause
}

// lastSeq reads key's last sequence number, which this transaction holds.
func (p *TxPublisher) lastSeq(ctx context.Context, key string) (int64, error) {
	found, err := p.query(ctx, p.q.LastSeq(key))
	if err != nil {
		return 0, err
	}
	var last int64
	if !found.Next() {
		err = fmt.Errorf("no counter for aggregate %q in %s", key, p.q.Sequences())
	} else {
		err = found.Scan(&last)
	}
	return last, errors.Join(err, found.Err(), found.Close())
}

// dedupeIDs keeps the first of messages with the same id (checkCallDuplicates
// made sure they go to one place under one key): one row, one number, one
// stamp.
func dedupeIDs(rows []sqldialect.Row) []sqldialect.Row {
	if len(rows) < 2 {
		return rows
	}
	seen := make(map[string]struct{}, len(rows))
	out := make([]sqldialect.Row, 0, len(rows))
	for _, r := range rows {
		if _, ok := seen[r.ID]; !ok {
			seen[r.ID] = struct{}{}
			out = append(out, r)
		}
	}
	return out
}

// insertUnderSavepoint writes several statements all or nothing: on MySQL
// and SQLite a failed statement does not undo the ones before it, and the
// caller may still commit its transaction after our error.
func (p *TxPublisher) insertUnderSavepoint(ctx context.Context, chunks [][]sqldialect.Row) error {
	if _, err := p.exec(ctx, p.q.Savepoint()); err != nil {
		return err
	}
	for _, c := range chunks {
		if err := p.insert(ctx, c); err != nil {
			_, rbErr := p.exec(context.WithoutCancel(ctx), p.q.RollbackToSavepoint())
			return errors.Join(err, rbErr)
		}
	}
	_, err := p.exec(context.WithoutCancel(ctx), p.q.ReleaseSavepoint()) // the rows are written
	return err
}

func (p *TxPublisher) wrapExecErr(err error) error {
	var dup *DuplicateIDError
	switch {
	case err == nil:
		return nil
	case errors.As(err, &dup):
		return err
	case errors.Is(err, sql.ErrTxDone), errors.Is(err, pgx.ErrTxClosed):
		return fmt.Errorf("%w: %w", ErrTxDone, err)
	case sqldialect.SyntaxError(err):
		// A *sql.Tx carries no driver name: its Dialect is the caller's
		// word, and another database's gave a bare syntax error that named
		// neither (a review: a service with a pool on each).
		return fmt.Errorf("outbox: insert into %s: %w (the statement is written for Dialect %s: is the transaction that database's? "+
			"With a *sql.Tx or a watermill-sql Tx, TxPublisherConfig.Dialect must name its database)", p.q.Table(), err, p.cfg.Dialect.Name())
	case p.cfg.Dialect == SQLite && sqldialect.Busy(err):
		return fmt.Errorf("outbox: insert into %s: %w (SQLite: unless the DSN sets _txlock=immediate, which a relay beside the services requires,"+
			" a transaction that read before this write cannot wait for the write lock: see the README's SQLite notes)", p.q.Table(), err)
	default:
		return fmt.Errorf("outbox: insert into %s: %w", p.q.Table(), unmigrated(p.cfg.Dialect, err, p.q.Table(), sqldialect.SequencesTable))
	}
}

// Close makes further Publish calls fail with ErrPublisherClosed, after the
// calls in flight have finished. It does not touch the transaction, which
// belongs to the caller. Calling it again does nothing.
func (p *TxPublisher) Close() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.closed = true
	return nil
}

func (p *TxPublisher) buildRow(r *sqldialect.Row, i int, topic string, msg *message.Message) error {
	invalid := func(field, reason string) error {
		return &InvalidMessageError{Index: i, MessageID: msgID(msg), Field: field, Reason: reason}
	}
	if msg == nil {
		return invalid("message", "is nil")
	}
	if err := checkID(msg.UUID); err != nil {
		return invalid("id", err.Error())
	}
	if topic == "" {
		return invalid("topic", "is empty")
	}
	exchange, routingKey := p.cfg.Exchange, topic
	if p.cfg.TopicMapper != nil {
		exchange, routingKey = p.cfg.TopicMapper(topic)
	}
	if v, ok := msg.Metadata[MetadataExchange]; ok {
		exchange = v
	}
	if v, ok := msg.Metadata[MetadataRoutingKey]; ok {
		routingKey = v
	}
	aggregateID, keyed := msg.Metadata[MetadataAggregateID]
	if keyed {
		if aggregateID == "" {
			return invalid("aggregate id", "is empty; leave out "+MetadataAggregateID+" for a message without an ordering key")
		}
		if err := checkName(aggregateID); err != nil {
			return invalid("aggregate id", err.Error())
		}
		if strings.HasSuffix(aggregateID, " ") && p.cfg.Dialect.sql().PadsKeys() {
			return invalid("aggregate id", fmt.Sprintf("ends in a space, which MySQL's _bin collations ignore: it would share %q's sequence numbers; trim it", strings.TrimRight(aggregateID, " ")))
		}
	}
	contentType := p.cfg.ContentType
	if v, ok := msg.Metadata[MetadataContentType]; ok && v != "" {
		contentType = v
	}
	if err := checkName(exchange); err != nil {
		return invalid("exchange", err.Error())
	}
	if err := checkName(routingKey); err != nil {
		return invalid("routing key", err.Error())
	}
	if err := checkName(contentType); err != nil {
		return invalid("content type", err.Error())
	}
	md := msg.Metadata
	ordered := relayOrdered(md)
	if p.cfg.Propagator != nil || steered(md) || ordered {
		// Into a copy: the caller's message is not ours to change.
		md = make(message.Metadata, len(msg.Metadata)+2)
		for k, v := range msg.Metadata {
			if !steeringKeys[k] && !(ordered && (k == HeaderAggregateID || k == HeaderSeq)) {
				md[k] = v
			}
		}
		if p.cfg.Propagator != nil {
			p.cfg.Propagator.Inject(msg.Context(), metadataCarrier(md))
		}
	}
	if err := sendable(md, contentType, msg.UUID); err != nil {
		return invalid("metadata", err.Error())
	}
	headers, err := rowcodec.EncodeHeaders(md)
	if err != nil {
		return invalid("metadata", err.Error())
	}
	body, encoding := rowcodec.EncodeBody(msg.Payload)
	*r = sqldialect.Row{
		ID: msg.UUID, Exchange: exchange, RoutingKey: routingKey,
		Body: body, BodyEncoding: encoding,
		ContentType: contentType, Headers: headers,
		AggregateID: aggregateID,
	}
	return nil
}

// steeringKeys are the metadata keys held in the row's columns rather than
// its headers. A consumer that received them would carry them onto the
// copies it returns, which would then go to the incoming message's
// routing key (back into the handler's own queue) instead of its publish
// topic, and take the incoming message's ordering key.
var steeringKeys = map[string]bool{MetadataExchange: true, MetadataRoutingKey: true, MetadataAggregateID: true}

// relayOrdered reports whether md holds both the headers a relay writes
// from a keyed row's columns, HeaderAggregateID and HeaderSeq: a keyed
// delivery's metadata, which a consumer's copy of it keeps. Written into
// the row's headers, they went out on the copy (the relay overrides them
// only for a keyed row), and an ordered inbox took it for the original's
// key and number: a duplicate, not run, or held behind numbers that never
// come. They are left out of the row; a keyed row gets its own from the
// relay. Either alone is the application's, and stays.
func relayOrdered(md message.Metadata) bool {
	_, key := md[HeaderAggregateID]
	_, seq := md[HeaderSeq]
	return key && seq
}

func steered(md message.Metadata) bool {
	for k := range steeringKeys {
		if _, ok := md[k]; ok {
			return true
		}
	}
	return false
}

// headerFrame is RabbitMQ's frame_max by default: a message's properties,
// its headers among them, travel in one frame, and headers that do not fit
// are a row the relay can never send (stuck at once, and a keyed one holds
// its key). headerRoom is what the relay adds (the ids, a keyed record's
// aggregateId and seq, the fixed properties) and AMQP's framing of each
// header: checked with room to spare.
const (
	headerFrame = 131072
	headerRoom  = 512
)

// sendable refuses metadata the relay could never send: a key AMQP cannot
// name (over 255 bytes), more headers than AMQP clients read, headers
// beyond the broker's default frame, or CC and BCC, which RabbitMQ reads as
// sender-selected routing and takes only as arrays: as the strings
// metadata holds, it refuses the message (406, unacceptable_type_in_header)
// at every try, and a keyed one holds its key.
func sendable(md message.Metadata, contentType, id string) error {
	for _, k := range []string{"CC", "BCC"} {
		if _, ok := md[k]; ok {
			return fmt.Errorf("has the key %q, which RabbitMQ reads as sender-selected routing and refuses as a string (406 unacceptable_type_in_header): name it otherwise", k)
		}
	}
	if limit := rowcodec.MaxElements - 8; len(md) > limit {
		return fmt.Errorf("has %d keys: AMQP clients read at most %d headers, and the relay adds up to 8 of its own: at most %d", len(md), rowcodec.MaxElements, limit)
	}
	size := headerRoom + len(contentType) + 2*len(id)
	for k, v := range md {
		if len(k) > maxNameLen {
			return fmt.Errorf("key of %d bytes (%.20q…): an AMQP header name is at most %d", len(k), k, maxNameLen)
		}
		size += 1 + len(k) + 1 + 4 + len(v)
	}
	if size > headerFrame {
		return fmt.Errorf("of about %d bytes would not fit the one AMQP frame a message's headers travel in (RabbitMQ's frame_max, %d bytes by default); put large values in the payload", size, headerFrame)
	}
	return nil
}

func msgID(msg *message.Message) string {
	if msg == nil {
		return ""
	}
	return msg.UUID
}

// checkID accepts 1 to 64 printable ASCII characters without spaces: what
// fits varchar(64) under every collation unchanged, and what AMQP's
// message_id and any log line carry without escaping. Watermill's UUIDs,
// ULIDs and the ids of the other AceMQ libraries all qualify.
func checkID(id string) error {
	if id == "" {
		return errors.New("is empty")
	}
	if len(id) > maxIDLen {
		return fmt.Errorf("is %d bytes, over the %d the id column holds", len(id), maxIDLen)
	}
	for i := 0; i < len(id); i++ {
		if c := id[i]; c <= ' ' || c > '~' {
			return fmt.Errorf("has byte 0x%02x at %d; want printable ASCII without spaces", c, i)
		}
	}
	return nil
}

// checkName accepts what an AMQP short string and a varchar(255) column both
// hold unchanged: valid UTF-8 of at most 255 bytes, without NUL (which
// PostgreSQL text refuses).
func checkName(s string) error {
	if len(s) > maxNameLen {
		return fmt.Errorf("is %d bytes, over the %d AMQP allows", len(s), maxNameLen)
	}
	if !utf8.ValidString(s) {
		return errors.New("is not valid UTF-8")
	}
	if bytes.IndexByte([]byte(s), 0) >= 0 {
		return errors.New("contains a NUL byte")
	}
	return nil
}

// splitRows cuts rows into statements of at most maxRowsPerStmt rows and
// maxBytesPerStmt bytes of body.
func splitRows(rows []sqldialect.Row) [][]sqldialect.Row {
	var (
		chunks [][]sqldialect.Row
		start  int
		size   int
	)
	for i := range rows {
		n := len(rows[i].Body) + len(rows[i].Headers)
		if i > start && (i-start >= maxRowsPerStmt || size+n > maxBytesPerStmt) {
			chunks = append(chunks, rows[start:i])
			start, size = i, 0
		}
		size += n
	}
	return append(chunks, rows[start:])
}

// lastStamp is the last created_at handed out, in Unix microseconds.
var lastStamp atomic.Int64

// reserveStamps returns the first of n consecutive microsecond stamps, all
// later than any stamp this process handed out before: the wall clock,
// unless it stands still or steps back.
func reserveStamps(n int) time.Time {
	for {
		last := lastStamp.Load()
		now := time.Now().UnixMicro()
		if now <= last {
			now = last + 1
		}
		if lastStamp.CompareAndSwap(last, now+int64(n)-1) {
			return time.UnixMicro(now).UTC()
		}
	}
}

// exec and query run q in the caller's transaction, its arguments written
// into its text where that saves round trips (sqldialect.Inline: on MySQL
// one round trip where go-sql-driver would prepare, execute and close, for
// every statement whatever the DSN).
func (p *TxPublisher) exec(ctx context.Context, q sqldialect.Query) (sqldialect.Result, error) {
	q, err := p.inline(ctx, q)
	if err != nil {
		return nil, err
	}
	return p.tx.exec(ctx, q)
}

// inline is sqldialect.Inline's q. A MySQL statement that goes with its
// arguments (over 64 KiB, or text that is not UTF-8) and holds text
// outside ASCII is sent only on a connection that reads its arguments as
// utf8mb4: under a DSN's charset=utf8 an emoji failed the statement, and
// under latin1 the text was stored garbled, without an error (a review).
// The connection's character set is asked once per publisher.
func (p *TxPublisher) inline(ctx context.Context, q sqldialect.Query) (sqldialect.Query, error) {
	in, ok := sqldialect.InlineOK(p.cfg.Dialect.sql(), q)
	if ok || p.cfg.Dialect != MySQL || p.clientCharsetOK || !sqldialect.NonASCIIText(q.Args) {
		return in, nil
	}
	rows, err := p.tx.query(ctx, sqldialect.Query{SQL: sqldialect.MySQLSessionCharsets})
	if err != nil {
		return q, err
	}
	var client, results string
	if rows.Next() {
		err = rows.Scan(&client, &results)
	}
	if cerr := rows.Close(); err == nil {
		err = cmp.Or(rows.Err(), cerr)
	}
	if err != nil {
		return q, err
	}
	if !sqldialect.CharsetHolds(client, q.Args) {
		return q, fmt.Errorf("outbox: the connection's character_set_client is %s, and a statement over 64 KiB goes with its arguments, which MySQL reads in it: text outside it would be refused or stored garbled; open the pool with charset=utf8mb4 (go-sql-driver's default)", client)
	}
	p.clientCharsetOK = sqldialect.FullCharset(client)
	return in, nil
}

// insertedAll runs q, an insert of n rows that skips the ids already in
// the table, and reports whether it inserted all of them.
func (p *TxPublisher) insertedAll(ctx context.Context, q sqldialect.Query, n int) (bool, error) {
	res, err := p.exec(ctx, q)
	if err != nil {
		return false, err
	}
	return sqldialect.InsertedAll(p.cfg.Dialect.sql(), res, n)
}

func (p *TxPublisher) query(ctx context.Context, q sqldialect.Query) (rowsScanner, error) {
	q, err := p.inline(ctx, q)
	if err != nil {
		return nil, err
	}
	return p.tx.query(ctx, q)
}
