package outbox

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jmoiron/sqlx"
)

// StoreConfig configures a Store.
type StoreConfig struct {
	// Dialect of the database. Optional when the handle is a *sqlx.DB.
	Dialect Dialect
	// Table is the outbox table, "name" or "schema.name". Default acemq_outbox.
	Table string
	// MaxAttempts is the number of failed publishes after which a record is
	// left alone ("stuck") until an operator retries it. Default 10. Without
	// a ceiling one record nothing can publish would be claimed for ever and
	// hold the records behind it.
	MaxAttempts int
	// PurgeBatch is how many rows one DELETE of PurgePublished removes, so a
	// purge of millions of rows never holds long locks. Default 1000.
	PurgeBatch int
}

// DefaultMaxAttempts is StoreConfig.MaxAttempts's default.
const DefaultMaxAttempts = 10

func (c *StoreConfig) setDefaults() {
	if c.Table == "" {
		c.Table = DefaultTable
	}
	if c.MaxAttempts == 0 {
		c.MaxAttempts = DefaultMaxAttempts
	}
	if c.PurgeBatch == 0 {
		c.PurgeBatch = 1000
	}
}

func (c StoreConfig) validate() error {
	if c.Dialect == nil {
		return &ConfigError{Field: "Dialect", Reason: "required unless the handle is a *sqlx.DB; use outbox.Postgres, MySQL or SQLite"}
	}
	if c.MaxAttempts < 1 {
		return &ConfigError{Field: "MaxAttempts", Reason: fmt.Sprintf("%d; want at least 1", c.MaxAttempts)}
	}
	if c.PurgeBatch < 1 {
		return &ConfigError{Field: "PurgeBatch", Reason: fmt.Sprintf("%d; want at least 1", c.PurgeBatch)}
	}
	return nil
}

// Store is the relay's side of the outbox table: claiming and marking rows
// for a Forwarder, and the questions an operator asks (pending, stuck, retry,
// purge). Beyond the database handle it holds only what it learned of the
// table (on MySQL, the name of its pending index).
type Store struct {
	db      *sql.DB
	dialect Dialect
	table   string // quoted
	cfg     StoreConfig
	q       storeQueries

	// On MySQL the locking claim names the pending index, looked up at the
	// first claim (see mysqlDialect.pendingIndex): forced is that claim.
	// Not found, it is looked up again after indexRecheck.
	claimMu      sync.Mutex
	forced       *[2]string
	indexChecked time.Time

	// stmts are the relay's statements Run prepared (Dialect.prepareRelay),
	// by their SQL.
	stmts atomic.Pointer[map[string]*sql.Stmt]
}

// indexRecheck is how long a MySQL relay claims without naming an index
// before it looks for one again (the migration may run after it starts).
const indexRecheck = time.Minute

// NewStore returns the Store of the outbox table in db, a *sql.DB or *sqlx.DB.
func NewStore(db any, cfg StoreConfig) (*Store, error) {
	var std *sql.DB
	switch h := db.(type) {
	case *sqlx.DB:
		if h != nil {
			std = h.DB
			if cfg.Dialect == nil {
				d, err := DialectForDriver(h.DriverName())
				if err != nil {
					return nil, err
				}
				cfg.Dialect = d
			}
		}
	case *sql.DB:
		std = h
	default:
		return nil, &ConfigError{Field: "db", Reason: fmt.Sprintf("%T; want a *sql.DB or *sqlx.DB", db)}
	}
	if std == nil {
		return nil, &ConfigError{Field: "db", Reason: "nil database handle"}
	}
	cfg.setDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	table, err := quoteTable(cfg.Dialect, cfg.Table)
	if err != nil {
		return nil, &ConfigError{Field: "Table", Reason: err.Error()}
	}
	return &Store{db: std, dialect: cfg.Dialect, table: table, cfg: cfg, q: newStoreQueries(cfg.Dialect, table)}, nil
}

// DB returns the database handle the store works on.
func (s *Store) DB() *sql.DB { return s.db }

// Dialect returns the store's dialect.
func (s *Store) Dialect() Dialect { return s.dialect }

// MaxAttempts returns the attempt ceiling the store was configured with.
func (s *Store) MaxAttempts() int { return s.cfg.MaxAttempts }

// listens reports whether the database can wake the relay at commit
// (PostgreSQL's LISTEN/NOTIFY).
func (s *Store) listens() bool { return s.dialect == Postgres }

// leases reports whether claims are leases committed before publishing
// (SQLite) rather than row locks held by an open transaction, which hold a
// connection until the batch is marked.
func (s *Store) leases() bool { return s.dialect.leases() }

// maxOpenConns is the cap of the store's pool, 0 for none.
func (s *Store) maxOpenConns() int { return s.db.Stats().MaxOpenConnections }

// claimedRow is one row as the relay reads it, before decoding.
type claimedRow struct {
	id, exchange, routingKey string
	body, bodyEncoding       string
	contentType, headers     string
	createdAt                time.Time
	attempts                 int
}

// claim is a batch of rows one relay holds: under row locks of an open
// transaction (PostgreSQL, MySQL) or under a lease (SQLite).
type claim struct {
	rows  []claimedRow
	tx    *sql.Tx // locking claims; nil for leases
	lease string  // leasing claims: the relay id in locked_by
}

// failure is a row whose publish failed: attempts becomes attempts, and the
// reason is stored in last_error.
type failure struct {
	id       string
	exchange string
	attempts int
	reason   string
}

// cursor is the (created_at, id) of the last row a drain claimed.
type cursor struct {
	createdAt time.Time
	id        string
}

// claimBatch claims up to n claimable rows in created_at, id order:
// unpublished, under MaxAttempts, not under a live lease, and after the
// cursor if there is one.
func (s *Store) claimBatch(ctx context.Context, n int, relayID string, lease time.Duration, after *cursor) (*claim, error) {
	now := time.Now()
	variant, cursorArgs := 0, []any(nil)
	if after != nil {
		at := s.dialect.timeArg(after.createdAt)
		variant, cursorArgs = 1, []any{at, at, after.id}
	}
	if s.dialect.leases() {
		args := append([]any{relayID, s.dialect.timeArg(now.Add(lease)), s.cfg.MaxAttempts, s.dialect.timeArg(now)}, cursorArgs...)
		return s.claimLease(ctx, s.q.claimLease[variant], append(args, n), relayID)
	}
	// READ COMMITTED: on MySQL, REPEATABLE READ's gap locks would make every
	// business transaction that inserts an outbox row wait for the relay's
	// batch to finish.
	tx, err := s.db.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelReadCommitted})
	if err != nil {
		return nil, fmt.Errorf("outbox: claim: %w", err)
	}
	if setup := s.dialect.claimSetup(); setup != "" {
		if _, err := tx.ExecContext(ctx, setup); err != nil {
			_ = tx.Rollback()
			return nil, fmt.Errorf("outbox: claim: %w", err)
		}
	}
	args := append([]any{s.cfg.MaxAttempts, s.dialect.timeArg(now)}, cursorArgs...)
	query, err := s.lockedClaim(ctx, tx, variant)
	if err != nil {
		_ = tx.Rollback()
		return nil, fmt.Errorf("outbox: claim: %w", err)
	}
	rows, err := s.queryTx(ctx, tx, query, append(args, n)...)
	if err != nil {
		_ = tx.Rollback()
		s.forgetIndex() // dropped or renamed, maybe: look again
		return nil, fmt.Errorf("outbox: claim: %w", err)
	}
	claimed, err := scanClaimed(rows)
	if err != nil {
		_ = tx.Rollback()
		return nil, fmt.Errorf("outbox: claim: %w", err)
	}
	return &claim{rows: claimed, tx: tx}, nil
}

// lockedClaim is the locking claim's SQL; on MySQL it names the pending
// index, looked up the first time, in the claim's transaction (a capped
// pool may have no other connection to give).
func (s *Store) lockedClaim(ctx context.Context, tx *sql.Tx, variant int) (string, error) {
	if s.dialect.pendingIndex() == "" {
		return s.q.claimLocked[variant], nil
	}
	s.claimMu.Lock()
	defer s.claimMu.Unlock()
	if s.forced == nil && time.Since(s.indexChecked) >= indexRecheck {
		forced, err := s.findIndex(ctx, tx)
		if err != nil {
			return "", err
		}
		s.forced, s.indexChecked = forced, time.Now()
	}
	if s.forced != nil {
		return s.forced[variant], nil
	}
	return s.q.claimLocked[variant], nil
}

// findIndex looks the pending index up and returns the claims that name it,
// or nil if the table has none.
func (s *Store) findIndex(ctx context.Context, q interface {
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
}) (*[2]string, error) {
	var schema any
	name := s.cfg.Table
	if i := strings.LastIndexByte(name, '.'); i >= 0 {
		schema, name = name[:i], name[i+1:]
	}
	var index string
	err := q.QueryRowContext(ctx, s.dialect.pendingIndex(), schema, name).Scan(&index)
	switch {
	case errors.Is(err, sql.ErrNoRows):
		// No such index: claims as the optimizer sees fit, and never
		// overlapping, so the relay cannot wait on itself.
		return nil, nil
	case err != nil:
		return nil, fmt.Errorf("look up the pending index of %s: %w", s.table, err)
	}
	forced := claimLocked(s.dialect, s.table, s.dialect.quoteIdent(index))
	return &forced, nil
}

// prepareRelay prepares the statements the relay runs for every batch, if
// the dialect wants it (see Dialect.prepareRelay): the claims, from the head
// and after a cursor, naming the pending index if there is one, and the mark
// of a full batch. Run calls it when it starts, while the relay holds no
// connection, since preparing takes one from the pool for a moment; it holds
// no lock meanwhile, so a Sweep that holds the pool's last connection goes
// on. A statement that could not be prepared (a proxy that refuses to) runs
// unprepared, as do all of them after one fails (see queryTx); the error
// says which.
func (s *Store) prepareRelay(ctx context.Context, batchSize int) error {
	if !s.dialect.prepareRelay() {
		return nil
	}
	queries := []string{s.q.claimLocked[0], s.q.claimLocked[1], s.q.markPublished(batchSize)}
	if s.dialect.pendingIndex() != "" {
		forced, err := s.findIndex(ctx, s.db)
		if err != nil {
			return err
		}
		s.claimMu.Lock()
		if s.forced == nil {
			s.forced, s.indexChecked = forced, time.Now()
		}
		if s.forced != nil {
			queries = append(queries, s.forced[0], s.forced[1])
		}
		s.claimMu.Unlock()
	}
	stmts := make(map[string]*sql.Stmt, len(queries))
	var errs []error
	for _, q := range queries {
		st, err := s.db.PrepareContext(ctx, q)
		if err != nil {
			errs = append(errs, fmt.Errorf("outbox: prepare %.40q…: %w", q, err))
			continue
		}
		stmts[q] = st
	}
	if old := s.stmts.Swap(&stmts); old != nil {
		closeStmts(*old)
	}
	return errors.Join(errs...)
}

// closePrepared closes what prepareRelay prepared.
func (s *Store) closePrepared() {
	if old := s.stmts.Swap(nil); old != nil {
		closeStmts(*old)
	}
}

func closeStmts(stmts map[string]*sql.Stmt) {
	for _, st := range stmts {
		_ = st.Close()
	}
}

// queryTx and execTx run q in tx, prepared if the relay prepared it. A
// prepared statement that fails makes the relay give them all up and run
// them unprepared from then on, as before they were: a proxy that does not
// keep a connection's statements, or a server out of them
// (max_prepared_stmt_count), must not stop the relay. A failure for any
// other reason costs the relay its prepared statements too, and nothing
// else.
func (s *Store) queryTx(ctx context.Context, tx *sql.Tx, q string, args ...any) (*sql.Rows, error) {
	if st := s.prepared(q); st != nil {
		rows, err := tx.StmtContext(ctx, st).QueryContext(ctx, args...)
		if err != nil {
			s.closePrepared()
		}
		return rows, err
	}
	return tx.QueryContext(ctx, q, args...)
}

func (s *Store) execTx(ctx context.Context, tx *sql.Tx, q string, args ...any) (sql.Result, error) {
	if st := s.prepared(q); st != nil {
		res, err := tx.StmtContext(ctx, st).ExecContext(ctx, args...)
		if err != nil {
			s.closePrepared()
		}
		return res, err
	}
	return tx.ExecContext(ctx, q, args...)
}

func (s *Store) prepared(q string) *sql.Stmt {
	if m := s.stmts.Load(); m != nil {
		return (*m)[q]
	}
	return nil
}

// forgetIndex makes the next claim look the pending index up again.
func (s *Store) forgetIndex() {
	if s.dialect.pendingIndex() == "" {
		return
	}
	s.claimMu.Lock()
	defer s.claimMu.Unlock()
	s.forced, s.indexChecked = nil, time.Time{}
}

// claimsOverlap reports whether a relay may claim a batch while it holds the
// claim of the one before, which is what pipelining does: on PostgreSQL
// (tuple locks) and SQLite (committed leases) always, on MySQL once the
// claims are known to walk the pending index.
func (s *Store) claimsOverlap() bool {
	if s.dialect.pendingIndex() == "" {
		return true
	}
	s.claimMu.Lock()
	defer s.claimMu.Unlock()
	return s.forced != nil
}

func (s *Store) claimLease(ctx context.Context, query string, args []any, relayID string) (*claim, error) {
	tx, err := s.db.BeginTx(ctx, nil)
	if err != nil {
		return nil, fmt.Errorf("outbox: claim: %w", err)
	}
	defer func() { _ = tx.Rollback() }()
	// The update is conditional on the rows still being free, so of two
	// relays the second claims other rows, or none.
	rows, err := tx.QueryContext(ctx, query, args...)
	if err != nil {
		return nil, fmt.Errorf("outbox: claim: %w", err)
	}
	claimed, err := scanClaimed(rows)
	if err != nil {
		return nil, fmt.Errorf("outbox: claim: %w", err)
	}
	// Committed before anything is published: SQLite has one writer, and the
	// services' own transactions must not wait for the broker.
	if err := tx.Commit(); err != nil {
		return nil, fmt.Errorf("outbox: claim: %w", err)
	}
	sortClaimed(claimed) // RETURNING promises no order
	return &claim{rows: claimed, lease: relayID}, nil
}

func scanClaimed(rows *sql.Rows) ([]claimedRow, error) {
	defer rows.Close()
	var out []claimedRow
	for rows.Next() {
		var r claimedRow
		var created timeScanner
		if err := rows.Scan(&r.id, &r.exchange, &r.routingKey, &r.body, &r.bodyEncoding,
			&r.contentType, &r.headers, &created, &r.attempts); err != nil {
			return nil, err
		}
		r.createdAt = created.t
		out = append(out, r)
	}
	return out, rows.Err()
}

func sortClaimed(rows []claimedRow) {
	// Insertion sort: a batch is small and usually sorted already.
	for i := 1; i < len(rows); i++ {
		for j := i; j > 0 && claimedLess(rows[j], rows[j-1]); j-- {
			rows[j], rows[j-1] = rows[j-1], rows[j]
		}
	}
}

func claimedLess(a, b claimedRow) bool {
	if !a.createdAt.Equal(b.createdAt) {
		return a.createdAt.Before(b.createdAt)
	}
	return a.id < b.id
}

// finish marks the published rows (one statement), records the failures,
// releases whatever else the claim held, and ends the claim.
func (s *Store) finish(ctx context.Context, c *claim, published []string, failures []failure) error {
	if c.tx != nil {
		err := s.mark(ctx, c.tx, time.Now(), published, failures)
		if err != nil {
			_ = c.tx.Rollback()
			return err
		}
		if err := c.tx.Commit(); err != nil {
			return fmt.Errorf("outbox: commit marks: %w", err)
		}
		return nil
	}
	tx, err := s.db.BeginTx(ctx, nil)
	if err != nil {
		return fmt.Errorf("outbox: mark: %w", err)
	}
	defer func() { _ = tx.Rollback() }()
	if err := s.mark(ctx, tx, time.Now(), published, failures); err != nil {
		return err
	}
	// Rows claimed but neither published nor failed (not sent, behind a
	// failure) are free for the next sweep at once, not at lease expiry.
	if err := s.release(ctx, tx, c, published, failures); err != nil {
		return err
	}
	if err := tx.Commit(); err != nil {
		return fmt.Errorf("outbox: commit marks: %w", err)
	}
	return nil
}

// abandon gives a claim up without marking anything: the rows are claimable
// again at once.
func (s *Store) abandon(ctx context.Context, c *claim) error {
	if c.tx != nil {
		return c.tx.Rollback()
	}
	return s.release(ctx, s.db, c, nil, nil)
}

// release frees the leased rows of c that are neither published nor failed.
func (s *Store) release(ctx context.Context, q execQuerier, c *claim, published []string, failures []failure) error {
	done := make(map[string]bool, len(published)+len(failures))
	for _, id := range published {
		done[id] = true
	}
	for _, f := range failures {
		done[f.id] = true
	}
	args := []any{c.lease}
	for _, r := range c.rows {
		if !done[r.id] {
			args = append(args, r.id)
		}
	}
	if len(args) == 1 {
		return nil
	}
	if _, err := q.ExecContext(ctx, s.q.releaseLease(len(args)-1), args...); err != nil {
		return fmt.Errorf("outbox: release lease: %w", err)
	}
	return nil
}

func (s *Store) mark(ctx context.Context, tx *sql.Tx, now time.Time, published []string, failures []failure) error {
	if len(published) > 0 {
		args := make([]any, 0, len(published)+1)
		args = append(args, s.dialect.timeArg(now))
		for _, id := range published {
			args = append(args, id)
		}
		if _, err := s.execTx(ctx, tx, s.q.markPublished(len(published)), args...); err != nil {
			return fmt.Errorf("outbox: mark published: %w", err)
		}
	}
	for _, f := range failures {
		if _, err := tx.ExecContext(ctx, s.q.markFailed, f.attempts, truncateError(f.reason), f.id); err != nil {
			return fmt.Errorf("outbox: mark failed: %w", err)
		}
	}
	return nil
}

// maxLastError is the size of the last_error column.
const maxLastError = 1000

// truncateError cuts a reason to what last_error holds, on a rune boundary.
func truncateError(s string) string {
	if len([]rune(s)) <= maxLastError {
		return s
	}
	return string([]rune(s)[:maxLastError-1]) + "…"
}

// Stats is the state of the outbox at one moment.
type Stats struct {
	// Pending rows: not yet published and under MaxAttempts.
	Pending int64
	// Stuck rows: not published, at MaxAttempts; left alone until retried.
	Stuck int64
	// OldestPending is the created_at of the oldest pending row (zero if none).
	OldestPending time.Time
}

// Stats counts pending and stuck rows.
func (s *Store) Stats(ctx context.Context) (Stats, error) {
	var (
		st     Stats
		oldest timeScanner
	)
	max := s.cfg.MaxAttempts
	err := s.db.QueryRowContext(ctx, s.q.stats, max, max, max).Scan(&st.Pending, &st.Stuck, &oldest)
	if err != nil {
		return Stats{}, fmt.Errorf("outbox: stats: %w", err)
	}
	st.OldestPending = oldest.t
	return st, nil
}

// PendingCount is the backlog: rows not yet published and under MaxAttempts.
// One that goes up and stays up is a relay that is down or a broker that
// refuses.
func (s *Store) PendingCount(ctx context.Context) (int64, error) {
	st, err := s.Stats(ctx)
	return st.Pending, err
}

// StuckRecord is a row the relay gave up on, with why.
type StuckRecord struct {
	ID         string
	Exchange   string
	RoutingKey string
	Attempts   int
	LastError  string
	CreatedAt  time.Time
}

// Stuck lists up to limit rows at MaxAttempts, oldest first.
func (s *Store) Stuck(ctx context.Context, limit int) ([]StuckRecord, error) {
	rows, err := s.db.QueryContext(ctx, s.q.stuck, s.cfg.MaxAttempts, limit)
	if err != nil {
		return nil, fmt.Errorf("outbox: stuck: %w", err)
	}
	defer rows.Close()
	var out []StuckRecord
	for rows.Next() {
		var (
			r       StuckRecord
			lastErr sql.NullString
			created timeScanner
		)
		if err := rows.Scan(&r.ID, &r.Exchange, &r.RoutingKey, &r.Attempts, &lastErr, &created); err != nil {
			return nil, fmt.Errorf("outbox: stuck: %w", err)
		}
		r.LastError, r.CreatedAt = lastErr.String, created.t
		out = append(out, r)
	}
	return out, rows.Err()
}

// Retry makes the given unpublished rows pending again, attempts reset, and
// returns how many it changed. last_error is kept until the next failure.
func (s *Store) Retry(ctx context.Context, ids ...string) (int64, error) {
	if len(ids) == 0 {
		return 0, nil
	}
	args := make([]any, len(ids))
	for i, id := range ids {
		args[i] = id
	}
	res, err := s.db.ExecContext(ctx, s.q.retry(len(ids)), args...)
	if err != nil {
		return 0, fmt.Errorf("outbox: retry: %w", err)
	}
	return res.RowsAffected()
}

// RetryAllStuck makes every stuck row pending again and returns how many.
func (s *Store) RetryAllStuck(ctx context.Context) (int64, error) {
	res, err := s.db.ExecContext(ctx, s.q.retryStuck, s.cfg.MaxAttempts)
	if err != nil {
		return 0, fmt.Errorf("outbox: retry stuck: %w", err)
	}
	return res.RowsAffected()
}

// PurgePublished deletes rows published longer than olderThan ago, in
// batches of PurgeBatch, and returns how many. Pending and stuck rows are
// never touched. Nothing else removes published rows, and a table that only
// grows costs disk and slows everything that scans it.
func (s *Store) PurgePublished(ctx context.Context, olderThan time.Duration) (int64, error) {
	if olderThan < 0 {
		return 0, &ConfigError{Field: "olderThan", Reason: "negative duration"}
	}
	cutoff := s.dialect.timeArg(time.Now().Add(-olderThan))
	var total int64
	for {
		res, err := s.db.ExecContext(ctx, s.q.purge, cutoff, s.cfg.PurgeBatch)
		if err != nil {
			return total, fmt.Errorf("outbox: purge: %w", err)
		}
		n, err := res.RowsAffected()
		if err != nil {
			return total, err
		}
		total += n
		if n < int64(s.cfg.PurgeBatch) {
			return total, nil
		}
	}
}

// Check asks the database whether the outbox table is there and readable,
// reading no row. Its error is the driver's: a missing table, an
// unreachable server, a refused login.
func (s *Store) Check(ctx context.Context) error {
	rows, err := s.db.QueryContext(ctx, s.q.probe)
	if err != nil {
		return fmt.Errorf("outbox: %s: %w", s.table, err)
	}
	return rows.Close()
}

// PublishedSince counts the rows published at or after t ("published in the
// last hour").
func (s *Store) PublishedSince(ctx context.Context, t time.Time) (int64, error) {
	return s.count(ctx, s.q.countSince, t)
}

// PublishedBefore counts the rows published before t: what PurgePublished
// with that cutoff deletes.
func (s *Store) PublishedBefore(ctx context.Context, t time.Time) (int64, error) {
	return s.count(ctx, s.q.countBefore, t)
}

func (s *Store) count(ctx context.Context, query string, t time.Time) (int64, error) {
	var n int64
	if err := s.db.QueryRowContext(ctx, query, s.dialect.timeArg(t)).Scan(&n); err != nil {
		return 0, fmt.Errorf("outbox: count %s: %w", s.table, err)
	}
	return n, nil
}

// ValidTableName reports whether name can be a table of this library,
// "name" or "schema.name" of letters, digits and underscores; the error
// says why not.
func ValidTableName(name string) error {
	_, err := quoteTable(Postgres, name)
	return err
}

// timeScanner reads a timestamp however the driver delivers it: a time.Time,
// or text when the DSN asks for no parsing (MySQL without parseTime=true).
type timeScanner struct{ t time.Time }

func (ts *timeScanner) Scan(v any) error {
	switch x := v.(type) {
	case nil:
		ts.t = time.Time{}
	case time.Time:
		ts.t = x.UTC()
	case []byte:
		return ts.parse(string(x))
	case string:
		return ts.parse(x)
	default:
		return fmt.Errorf("outbox: cannot read %T as a timestamp", v)
	}
	return nil
}

func (ts *timeScanner) parse(s string) error {
	for _, layout := range []string{timeLayout, "2006-01-02 15:04:05.999999999", "2006-01-02 15:04:05", time.RFC3339Nano} {
		if t, err := time.Parse(layout, s); err == nil {
			ts.t = t.UTC()
			return nil
		}
	}
	return fmt.Errorf("outbox: cannot read %q as a timestamp", s)
}

var _ interface{ Scan(any) error } = (*timeScanner)(nil)

// placeholders returns "?, ?, …" for n arguments.
func placeholders(n int) string {
	if n <= 0 {
		return ""
	}
	return strings.Repeat("?, ", n-1) + "?"
}
