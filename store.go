package outbox

import (
	"cmp"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jmoiron/sqlx"

	"github.com/acemq/watermill-outbox/internal/rowcodec"
	"github.com/acemq/watermill-outbox/internal/sqldialect"
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
	// hold the records behind it. At most math.MaxInt32: attempts is a
	// 32-bit column on PostgreSQL and MySQL, which refuse a record's
	// attempts past it, and with them the marks of its batch.
	//
	// Stuck is read from the row (attempts at the ceiling), not stored, so
	// it is the relays' ceiling: give a Store the MaxAttempts of the
	// relays that send the table's rows (Forwarder.Store has its relay's;
	// outboxctl takes OUTBOX_MAX_ATTEMPTS). One lower than the relays'
	// calls a record stuck that a relay still retries, and Discard
	// deletes it; one higher calls a stuck record pending (an API review).
	MaxAttempts int
	// PurgeBatch is how many rows one DELETE of PurgePublished removes, so a
	// purge of millions of rows never holds long locks. Default
	// DefaultPurgeBatch.
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
		c.PurgeBatch = DefaultPurgeBatch
	}
}

func (c StoreConfig) validate() error {
	if c.Dialect == nil {
		return &ConfigError{Field: "Dialect", Reason: "required unless the handle is a *sqlx.DB; use outbox.Postgres, MySQL or SQLite"}
	}
	if c.MaxAttempts < 1 || c.MaxAttempts > math.MaxInt32 {
		return &ConfigError{Field: "MaxAttempts", Reason: fmt.Sprintf("%d; want 1 to %d, what the attempts column holds", c.MaxAttempts, math.MaxInt32)}
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
	cfg     StoreConfig
	q       *sqldialect.Outbox

	// sent counts the statements the relay's calls sent, BEGIN and COMMIT
	// included (outbox_forwarder_statements_total).
	sent atomic.Int64
	// holding: the Forwarder's Run has locking claims in flight, their rows
	// locked (see poolConn). Its loop sets it at the end of each sweep,
	// under the sweep lock, where alone its batches change.
	holding atomic.Bool
	// ids is what the table's id column holds (see holdable): 0 until
	// looked up.
	ids atomic.Int32

	// busyWait is the pool's busy_timeout on SQLite, once busyKnown (see
	// writeTx).
	busyMu    sync.Mutex
	busyWait  time.Duration
	busyKnown bool

	// window, if set, is defaultClaimWindow for a test. narrowed, if set,
	// is the window of the next claims (see claimedInWindow).
	window   func(n int) int
	narrowed atomic.Int64
	// walksShort: the last claim was unwindowed and quick, so the next one
	// claims without asking for a window (see claimedInWindow).
	walksShort atomic.Bool
	// keysAfter is where the next windowed claim's keys start, nil for
	// the first (see sliceKeys); slice, if set, is keysPerClaim for a
	// test.
	keysMu    sync.Mutex
	keysAfter any
	keysMoves uint64 // how many times the cursor moved
	slice     func(n int) int

	// floor is where claims and probes start while a walk from the head
	// of the pending index is slow (see headFloor).
	floor *headFloor

	// On MySQL the locking claim names the pending index, and its key-head
	// probe the index of a key's pending rows, looked up at the first claim
	// (see sqldialect's mysql pendingIndex and keyIndex): index and
	// keyIndex are their names, "" until found. One not found, both are
	// looked up again after indexRecheck.
	claimMu      sync.Mutex
	index        string
	keyIndex     string
	indexChecked time.Time
	// tupleIDs: whether the table's rows have a ctid, which PostgreSQL's
	// windowed claims lock them by (sqldialect.ClaimParams.ByID), read
	// once at the first: 0 unread, 1 yes, 2 no (a view).
	tupleIDs atomic.Int32

	// stmts are the relay's statements Run prepared (Dialect.prepareRelay),
	// by their SQL.
	stmts atomic.Pointer[map[string]*sql.Stmt]

	// log is the logger of the Forwarder the store is for; a NopLogger
	// for a store of its own (NewStore).
	log watermill.LoggerAdapter
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
				d, err := dialectForDriver(h.DriverName())
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
	if err := checkDialect(std, cfg.Dialect); err != nil {
		return nil, err
	}
	q, err := sqldialect.NewOutbox(cfg.Dialect.sql(), cfg.Table)
	if err != nil {
		return nil, &ConfigError{Field: "Table", Reason: err.Error()}
	}
	s := &Store{db: std, dialect: cfg.Dialect, cfg: cfg, q: q, log: watermill.NopLogger{}, floor: newHeadFloor(cfg.Dialect == MySQL)}
	s.joinFloors()
	return s, nil
}

// listens reports whether the database can wake the relay at commit
// (PostgreSQL's LISTEN/NOTIFY).
func (s *Store) listens() bool { return s.dialect.sql().Listens() }

// hasClaimableNow is hasClaimable once the writers of the moment are done:
// where writers wait in the client (SQLite), in a transaction that takes
// the write lock first, waiting for it as the relay's claims do, so a
// commit whose write to the log woke the relay is visible to it. It
// changes nothing, and so writes nothing to the log. A lock still held
// after busy_timeout says nothing of the commit that woke the relay: its
// error lets the claim run (see nothingToClaim), which waits for the lock
// in turn and, still busy, fails the sweep, which backs off. Taken as
// nothing to claim, the wake-up was lost when the holder rolled back or
// had only read (neither writes the log, so nothing woke the relay again),
// and the row waited for the poll. Waking again instead would keep the
// relay waiting on the lock, one busy wait after another without a pause,
// for as long as a long transaction holds it; the backoff spaces the tries
// (RetryMin up to RetryMax, a wake-up does not cut it short). What the
// probe costs: a commit to another table of the file wakes the relay to a
// write transaction rather than a read. A service committing to another table
// as fast as it could (over 20,000 a second) kept 0.64 of its rate with
// the relay beside it, against 0.75-0.81 with plain probes (0.61-0.62 when
// a wake-up claimed at once, which also dialed the broker, and reported
// its errors, for every commit to another table). Elsewhere it is
// hasClaimable: NOTIFY comes after the commit.
func (s *Store) hasClaimableNow(ctx context.Context) (bool, error) {
	lock, ok := s.q.WriteLock()
	if !ok {
		return s.hasClaimable(ctx)
	}
	var found bool
	err := s.writeTx(ctx, "probe", func(tx *sql.Tx) error {
		s.sent.Add(1)
		_, err := tx.ExecContext(ctx, lock.SQL)
		if err == nil {
			found, err = s.probe(ctx, tx)
		}
		if err != nil {
			return fmt.Errorf("outbox: probe: %w", err)
		}
		return nil
	})
	return found, err
}

// hasClaimable reports whether a claim would find a row now (Probe).
// Unprepared: an idle relay probes a few times a second, and a statement
// prepared on the pool would run on whatever connection database/sql
// picks, where the claims' run in their transaction. On one connection,
// taken first: the floor's measure (see headBound) times two reads side by
// side, and the first paying for a dial (a connection the pool had
// closed as idle, a TLS login) looked like a walk worth a floor.
func (s *Store) hasClaimable(ctx context.Context) (bool, error) {
	conn, err := s.db.Conn(ctx)
	if err != nil {
		return false, err
	}
	defer func() { _ = conn.Close() }()
	return s.probe(ctx, conn)
}

// quietFor keeps the table's NOTIFY trigger quiet for d, through its quiet
// sequence (see quietFlow).
func (s *Store) quietFor(ctx context.Context, sequence string, d time.Duration) error {
	return s.execQuiet(ctx, sqldialect.QuietFor(sequence, d.Milliseconds()))
}

// quietOff lets the table's NOTIFY trigger notify again.
func (s *Store) quietOff(ctx context.Context, sequence string) error {
	return s.execQuiet(ctx, sqldialect.QuietOff(sequence))
}

func (s *Store) execQuiet(ctx context.Context, q sqldialect.Query) error {
	s.sent.Add(1)
	var v int64
	return s.queryRowRelay(ctx, q, &v)
}

// quietOver reports whether every transaction the table's NOTIFY trigger
// kept quiet has ended (see quietFlow).
func (s *Store) quietOver(ctx context.Context) (bool, error) {
	s.sent.Add(1)
	var over bool
	err := s.queryRowRelay(ctx, s.q.QuietOver(), &over)
	return over, err
}

// probe runs the query of hasClaimable on db.
func (s *Store) probe(ctx context.Context, db rowQuerier) (bool, error) {
	p := sqldialect.ClaimParams{MaxAttempts: s.cfg.MaxAttempts, Now: time.Now()}
	if s.q.Windows() {
		p.Window = probeWindow
		switch {
		case s.window != nil:
			p.Window = s.window(1) // a test's
		case everyClaimWindow > 0:
			p.Window = everyClaimWindow
		}
	}
	walk := time.Now() // a probe from the head: see headWalked
	var err error
	index, keyIndex := s.indexNames()
	var points []sqldialect.Cursor
	if p.After, points, err = s.headBound(ctx, db, index, keyIndex, true); err != nil {
		return false, err
	}
	if len(points) > 0 {
		// The rows below the floor that the claims take as points.
		q := s.inline(s.q.Claimable(sqldialect.ClaimParams{MaxAttempts: p.MaxAttempts, Now: p.Now, Points: points}))
		s.sent.Add(1)
		var one int
		switch err := db.QueryRowContext(ctx, q.SQL, q.Args...).Scan(&one); {
		case err == nil:
			return true, nil
		case !errors.Is(err, sql.ErrNoRows):
			return false, err
		}
	}
	q := s.inline(s.q.Claimable(p))
	s.sent.Add(1)
	var one int
	err = db.QueryRowContext(ctx, q.SQL, q.Args...).Scan(&one)
	// One from the head that found a row leaves a period that is over as
	// it is: the claim after it measures too, and takes what lies below
	// the floor (a row whose created_at is NULL, which no floor is below,
	// waited for good behind an idle relay's probes).
	if p.After == nil && errors.Is(err, sql.ErrNoRows) {
		s.headWalked(time.Since(walk))
	}
	if errors.Is(err, sql.ErrNoRows) {
		return false, nil
	}
	return err == nil, err
}

// firstNext is where a drain must resume to find the next records of the
// keyed records recs: a cursor just before the first of them, nil when
// none is unpublished (see sqldialect.Outbox.FirstNext).
func (s *Store) firstNext(ctx context.Context, recs []sqldialect.KeySeq) (*sqldialect.Cursor, error) {
	q := s.inline(s.q.FirstNext(recs))
	s.sent.Add(1)
	var id string
	at := sqldialect.NewTime(s.dialect.sql())
	err := s.queryRowRelay(ctx, q, at, &id)
	switch {
	case errors.Is(err, sql.ErrNoRows):
		return nil, nil
	case err != nil:
		return nil, fmt.Errorf("outbox: next records of keys: %w", err)
	case at.Err != nil || at.T.IsZero():
		return nil, fmt.Errorf("outbox: next records of keys: created_at of %s: %v", idText(id), at.Err)
	}
	// Just before it: the claim resumes after (created_at, id), and every
	// id is above "".
	return &sqldialect.Cursor{CreatedAt: at.T, ID: ""}, nil
}

// watchesFile: see sqldialect.Dialect.WatchesFile.
func (s *Store) watchesFile() bool { return s.dialect.sql().WatchesFile() }

// leases reports whether claims are leases committed before publishing
// (SQLite) rather than row locks held by an open transaction, which hold a
// connection until the batch is marked.
func (s *Store) leases() bool { return s.dialect.sql().Leases() }

// busyRead is the pool's busy timeout on SQLite, and whether it was read.
func (s *Store) busyRead() (time.Duration, bool) {
	s.busyMu.Lock()
	defer s.busyMu.Unlock()
	return s.busyWait, s.busyKnown
}

// busyBound is the longest a claim may wait for the write lock on SQLite
// (the pool's busy_timeout), 0 until known.
func (s *Store) busyBound() time.Duration {
	s.busyMu.Lock()
	defer s.busyMu.Unlock()
	return s.busyWait
}

// passedOver is how many unpublished rows the locking claim c, made from
// after, passed over on its way to its last row: rows other relays hold,
// the relay's own in flight, and rows it could not take (a key's next
// record, a record held for a retry), which it keeps locked where the
// dialect LocksPassedOver. Stuck rows do not count. One read in c's
// transaction, which locks nothing.
func (s *Store) passedOver(ctx context.Context, c *claim, after, last *sqldialect.Cursor) (int, error) {
	q := s.inline(s.q.PendingBetween(s.pendingIndex(), s.cfg.MaxAttempts, after, *last))
	s.sent.Add(1)
	var n int
	if err := c.tx.QueryRowContext(ctx, q.SQL, q.Args...).Scan(&n); err != nil {
		return 0, fmt.Errorf("outbox: rows the claim passed over: %w", err)
	}
	return max(n-(len(c.rows)-c.points), 0), nil
}

// pendingIndex is the first of indexNames.
func (s *Store) pendingIndex() string {
	index, _ := s.indexNames()
	return index
}

// indexNames are the pending index and the index of a key's pending rows
// a claim names (MySQL's, once found; see claimIndexes), "" for none.
func (s *Store) indexNames() (index, keyIndex string) {
	s.claimMu.Lock()
	defer s.claimMu.Unlock()
	return s.index, s.keyIndex
}

// locksPassedOver: see sqldialect.Dialect.LocksPassedOver.
func (s *Store) locksPassedOver() bool { return s.dialect.sql().LocksPassedOver() }

// maxOpenConns is the cap of the store's pool, 0 for none.
func (s *Store) maxOpenConns() int { return s.db.Stats().MaxOpenConnections }

// claim is a batch of rows one relay holds: under row locks of an open
// transaction (PostgreSQL, MySQL) or under a lease (SQLite).
type claim struct {
	rows  []sqldialect.ClaimedRow
	tx    claimTx   // locking claims; nil for leases
	conn  *sql.Conn // tx's connection (locking claims)
	lease string    // leasing claims: the relay id in locked_by
	// end releases the context tx began with, once tx is over (locking
	// claims; see claimBatch).
	end context.CancelFunc
	// keys is the keys' cursor as it was before the claim moved it (see
	// moveKeys), which abandon puts back.
	keys keysBefore
	// from is where the claim started: the cursor it was given, or the
	// floor (see headFloor); nil for the head (locking claims). points:
	// how many of rows, the first, it took below the floor as points (see
	// headFloor.points).
	from *sqldialect.Cursor
	// lookedBack: given a drain's cursor, the claim went back for the look
	// back or the floor's period, which the claim resets; not for
	// belowPoints, which the same cursor meets again.
	lookedBack bool
	points     int
}

// idArgs are the ids of the claim's rows a mark must not bind as text,
// with how it binds them (ClaimedRow.IDArg); nil when there are none.
func (c *claim) idArgs() map[string]any {
	var m map[string]any
	for _, r := range c.rows {
		if r.RawID != nil {
			if m == nil {
				m = map[string]any{}
			}
			m[r.ID] = r.IDArg()
		}
	}
	return m
}

// ended releases what the claim's transaction began with, once it is over.
func (c *claim) ended() {
	if c.end != nil {
		c.end()
	}
	if c.conn != nil {
		_ = c.conn.Close()
	}
}

// errNoConnection: a statement of the relay's found no connection in the
// pool within claimConnWait while its batches in flight hold theirs (see
// poolConn).
var errNoConnection = errors.New("outbox: no free connection in the pool while batches are in flight")

// claimConnWait is how long a statement of the relay waits for a connection
// of a capped pool that others hold while the relay holds batches in
// flight, and claimDialWait how long for one the pool dials.
const (
	claimConnWait = 50 * time.Millisecond
	claimDialWait = 10 * time.Second
)

// poolConn takes a connection of the pool for a statement of the relay's.
// While Run holds locking claims in flight (holding), a service's
// transaction on the same pool may wait for their rows (an inbox marking
// the processed_at of a message the broker delivered before the relay
// marked it published), holding a connection: on a capped pool perhaps the
// last one, and the relay, waiting for it before it marks the rows, waited
// for ever. A saturated pool's connection is then waited for claimConnWait
// at most, and the error is errNoConnection (settle what is in flight, and
// try again).
//
// Only the wait for a connection others hold is that short: a pool with
// room dials a new one, which to a remote server (TLS, SCRAM) may take
// longer, and cut short it wasted the dial and stopped the pipeline on an
// idle pool. That wait is bounded too (claimDialWait), should the room be
// taken meanwhile.
func (s *Store) poolConn(ctx context.Context) (*sql.Conn, error) {
	acquire, cancel := ctx, context.CancelFunc(func() {})
	if s.holding.Load() {
		if st := s.db.Stats(); st.MaxOpenConnections > 0 {
			wait := claimDialWait
			if st.OpenConnections >= st.MaxOpenConnections && st.Idle == 0 {
				wait = claimConnWait
			}
			acquire, cancel = context.WithTimeout(ctx, wait)
		}
	}
	defer cancel()
	conn, err := s.db.Conn(acquire)
	if err != nil && ctx.Err() == nil && errors.Is(err, context.DeadlineExceeded) {
		return nil, errNoConnection
	}
	return conn, err
}

// queryRowRelay runs a statement of the relay's, q, on a connection of the
// pool, taken as poolConn takes it, and scans its row into dest.
func (s *Store) queryRowRelay(ctx context.Context, q sqldialect.Query, dest ...any) error {
	conn, err := s.poolConn(ctx)
	if err != nil {
		return err
	}
	defer func() { _ = conn.Close() }()
	return conn.QueryRowContext(ctx, q.SQL, q.Args...).Scan(dest...)
}

// failure is a row whose publish failed: attempts becomes attempts, and the
// reason is stored in last_error. A failure with holdBy set keeps the row
// leased to holdBy (sqldialect.RetryHold) until holdUntil: a keyed record's
// retry-after.
type failure struct {
	id        string
	exchange  string
	attempts  int
	reason    string
	holdBy    string
	holdUntil time.Time
}

// claimBatch claims up to n claimable rows in created_at, id order:
// unpublished, under MaxAttempts, not under a live lease, and after the
// cursor if there is one; without, from the floor while one is kept (see
// headFloor), and with atHead from the head whatever the floor says.
// inFlight are the ids of the keyed records the relay has in flight (see
// sqldialect.ClaimParams.InFlight).
//
// While Run holds locking claims in flight, a claim on a saturated capped
// pool fails with errNoConnection rather than wait (see poolConn), a Sweep's
// too.
func (s *Store) claimBatch(ctx context.Context, n int, relayID string, lease time.Duration, after *sqldialect.Cursor, inFlight []string) (*claim, error) {
	floor := after == nil
	lookedBack := false // went back for the look back or the floor's period, not for belowPoints
	rewind := after != atHead && s.drainRewinds(time.Now(), after != nil)
	if rewind {
		defer func(start time.Time) { s.rewindTook(time.Since(start)) }(time.Now())
	}
	switch {
	case after == atHead:
		after = nil
	case after != nil && (rewind || s.floorDue() == 0):
		// A drain, when the floor's period is over (a claim that measures
		// takes what waited below the floor), or when rows behind its
		// cursor became claimable (a keyed record's retry backoff ended,
		// a Retry, the look back): the cursor would pass them over until
		// the drain ends. Each is over with this claim.
		lookedBack = true
		after, floor = nil, true
	case after != nil && s.belowPoints(after):
		// Where its cursor went back below a floor with points. Not a
		// look back (lookedBack): the same cursor meets it again, and a
		// short claim here, its points the relay's own in flight, taken
		// for one, kept the drain on that cursor, claiming without a
		// pause, its batch never marked (a review's catch).
		after, floor = nil, true
	}
	if after == nil {
		s.claimsFromHead(time.Now())
	}
	p := sqldialect.ClaimParams{Limit: n, MaxAttempts: s.cfg.MaxAttempts, Now: time.Now(), After: after, InFlight: inFlight}
	if s.leases() {
		var sliced keysCursor
		cl, err := s.claimLease(ctx, func(tx *sql.Tx) (sqldialect.Query, error) {
			// Timed once the write lock is this transaction's: a lease timed
			// before a wait for it (up to busy_timeout) was that much
			// shorter, and a second relay took over rows still in flight.
			now := time.Now()
			p.Now, p.RelayID, p.LeaseUntil = now, relayID, now.Add(lease)
			var err error
			if p.Window, err = s.claimWindow(ctx, tx, p); err != nil {
				return sqldialect.Query{}, err
			}
			s.sliceKeys(&p)
			return s.q.Claim(p), nil
		}, func(tx *sql.Tx, claimed []sqldialect.ClaimedRow) (err error) {
			sliced, err = s.slicedKeys(ctx, tx, p, sqldialect.KeysSlice{}, claimed)
			return err
		}, relayID, func(n int, took time.Duration) { s.claimedInWindow(p, n, took) })
		if err == nil {
			cl.keys = s.moveKeys(sliced, len(cl.rows)) // committed
			cl.lookedBack = lookedBack
		}
		return cl, err
	}
	// READ COMMITTED: on MySQL, REPEATABLE READ's gap locks would make every
	// business transaction that inserts an outbox row wait for the relay's
	// batch to finish.
	//
	// Until the claim is made, it ends with ctx: a stopping relay waits for
	// no connection, BEGIN or statement of a database that does not
	// answer. Once made, the transaction lives on to the marks, whatever
	// ctx says: database/sql rolls a transaction back when the context it
	// began with ends, which would undo the claim of a batch in flight,
	// and its marks with it.
	txCtx, end := context.WithCancel(context.WithoutCancel(ctx))
	stop := context.AfterFunc(ctx, end)
	var (
		tx   claimTx
		conn *sql.Conn
	)
	fail := func(err error) (*claim, error) {
		stop()
		if tx != nil {
			_ = tx.Rollback()
		}
		end()
		if conn != nil {
			_ = conn.Close()
		}
		if errors.Is(err, errNoConnection) {
			return nil, err
		}
		return nil, fmt.Errorf("outbox: claim: %w", unmigrated(s.dialect, err, s.q.Table()))
	}
	conn, err := s.poolConn(ctx)
	if err != nil {
		return fail(err)
	}
	if floor {
		if err := s.lockMeasure(ctx, conn); err != nil {
			if ctx.Err() != nil {
				return fail(err)
			}
			// A measure, not the claim: the claim goes on from the head,
			// and looks its indexes up again (the measure's reads name
			// MySQL's pending index: dropped or renamed, maybe).
			s.forgetIndex()
			s.log.Info("Outbox: the floor's locking measure failed; claims start at the head", watermill.LogFields{"table": s.q.Table(), "error": err.Error()})
		}
	}
	s.sent.Add(2) // BEGIN, the claim
	if s.q.ClaimSetup().SQL != "" {
		s.sent.Add(1)
	}
	if tx, err = s.beginClaim(ctx, txCtx, conn); err != nil {
		return fail(err)
	}
	if p.Index, p.KeyIndex, err = s.claimIndexes(ctx, tx); err != nil {
		return fail(err)
	}
	walk := time.Now() // a claim from the head: see headWalked
	var points []sqldialect.ClaimedRow
	if floor {
		var at []sqldialect.Cursor
		if p.After, at, err = s.headBound(ctx, tx, p.Index, p.KeyIndex, false); err != nil {
			s.forgetIndex() // MySQL's, which the read names: dropped or renamed, maybe
			return fail(err)
		}
		if len(at) > 0 {
			// The rows below the floor its measure found (see
			// stragglers), first: they come first in claim order. All
			// of them, the first n claimable taken: given the first n
			// only, a key's later records, or rows in flight, used the
			// places up, and a claimable one after them waited for good.
			pp := sqldialect.ClaimParams{Limit: n, MaxAttempts: p.MaxAttempts, Now: p.Now, Index: p.Index, KeyIndex: p.KeyIndex, InFlight: p.InFlight, Points: at}
			s.sent.Add(1)
			rows, err := s.queryTx(ctx, tx, s.q.Claim(pp))
			if err == nil {
				points, err = s.q.ScanClaimed(rows)
			}
			if err != nil {
				s.forgetIndex()
				return fail(err)
			}
			p.Limit -= len(points)
		}
	}
	if p.Limit == 0 {
		if !stop() {
			return fail(ctx.Err())
		}
		return &claim{rows: points, points: len(points), tx: tx, conn: conn, end: end, from: p.After, lookedBack: lookedBack}, nil
	}
	if p.Window, err = s.claimWindow(ctx, tx, p); err != nil {
		return fail(err)
	}
	if p.Window > 0 && s.dialect == Postgres {
		if p.ByID, err = s.withoutTupleIDs(ctx, tx); err != nil {
			return fail(err)
		}
	}
	s.sliceKeys(&p)
	started := time.Now()
	rows, err := s.queryTx(ctx, tx, s.q.Claim(p))
	if err != nil {
		s.forgetIndex() // dropped or renamed, maybe: look again
		s.tupleIDs.Store(0)
		return fail(err)
	}
	var (
		claimed []sqldialect.ClaimedRow
		sliced  keysCursor
	)
	if p.KeysRead > 0 {
		var ks sqldialect.KeysSlice
		if claimed, ks, err = s.q.ScanClaimedSlice(rows); err == nil {
			sliced, err = s.slicedKeys(ctx, tx, p, ks, claimed)
		}
	} else {
		claimed, err = s.q.ScanClaimed(rows)
	}
	if err != nil {
		return fail(err)
	}
	s.claimedInWindow(p, len(claimed), time.Since(started))
	if floor && p.After == nil { // not a Sweep's (atHead): the relay's period is its own
		s.headWalked(time.Since(walk))
	}
	if !stop() {
		// ctx ended as the claim was made: its transaction is being
		// rolled back; nothing is claimed.
		return fail(ctx.Err())
	}
	if len(points) > 0 {
		// headBound gives no point at or above the floor, which the claim
		// from it would take again; should one come, it is taken once.
		taken := make(map[string]bool, len(points))
		for _, r := range points {
			taken[r.ID] = true
		}
		claimed = slices.DeleteFunc(claimed, func(r sqldialect.ClaimedRow) bool { return taken[r.ID] })
	}
	keys := s.moveKeys(sliced, len(claimed))
	return &claim{rows: append(points, claimed...), points: len(points), tx: tx, conn: conn, end: end, keys: keys, from: p.After, lookedBack: lookedBack}, nil
}

// defaultClaimWindow is how many entries of the pending index a claim of n
// rows walks before it looks for the rest key by key (see sqldialect's
// window.go): enough that a claim over records of many keys, or of keys
// whose heads are in flight, finds its rows in the walk; the walk costs a
// probe per entry it passes over.
func defaultClaimWindow(n int) int { return 2*n + 256 }

// claimShortWalk is the time under which an unwindowed claim is taken to
// have walked little of the pending index (see claimedInWindow): a probe
// an entry costs about 10 µs on PostgreSQL, 1 µs on SQLite, so a walk of a
// window's worth (456 entries at claims of 100) takes longer.
const claimShortWalk = 2 * time.Millisecond

// probeWindow is how many entries of the pending index the probe of an
// idle relay reads before it looks key by key (see sqldialect's
// Claimable).
const probeWindow = 256

// everyClaimWindow, if set, is every store's window: set by a test run
// that makes every claim windowed (OUTBOX_TEST_CLAIM_WINDOW), before its
// tests start.
var everyClaimWindow int

// claimWindow is the window of the claim p, in tx: 0 (none) unless the
// dialect windows its claims and the pending index holds a window's worth
// of entries from where the claim starts.
func (s *Store) claimWindow(ctx context.Context, tx claimTx, p sqldialect.ClaimParams) (int, error) {
	if !s.q.Windows() {
		return 0, nil
	}
	w := defaultClaimWindow(p.Limit)
	switch {
	case s.window != nil:
		w = s.window(p.Limit) // a test's
	case everyClaimWindow > 0:
		w = everyClaimWindow
	case s.walksShort.Load():
		return 0, nil
	default:
		if narrow := int(s.narrowed.Load()); narrow > 0 && narrow < w {
			w = narrow
		}
	}
	q := s.q.WindowFull(p, w)
	s.sent.Add(1)
	var one int
	switch err := tx.QueryRowContext(ctx, q.SQL, q.Args...).Scan(&one); {
	case errors.Is(err, sql.ErrNoRows):
		s.narrowed.Store(0) // too few entries to cost a walk much
		return 0, nil
	case err != nil:
		return 0, err
	}
	return w, nil
}

// keysPerClaim is how many keys a windowed claim of n rows reads beyond
// its window (see sliceKeys).
func keysPerClaim(n int) int { return 4*n + 256 }

// sliceKeys has the windowed claim p read a slice of the keys beyond its
// window, read in the claim and only if its window falls short:
// keysPerClaim of them after where the last claim's read stopped, from the
// first again once past the last. Every key is read again within keys ÷
// keysPerClaim claims that read them. A claim costs a probe per key it
// reads: reading every key cost the first windowed claim from the head
// 330 ms on PostgreSQL (80 ms on SQLite) behind a stuck key's window with
// 50,000 keys after it, and a list of keys read before the claim (as
// narrowed claims did) costs the claims that their window fills. The keys
// stay in the database, and the cursor as it was read: a list sent back as
// JSON lost a key that is not UTF-8, or a blob on SQLite (a review).
func (s *Store) sliceKeys(p *sqldialect.ClaimParams) {
	p.KeysRead, p.KeysFrom = 0, nil // a retried claim's p read none yet
	if p.Window == 0 {
		return
	}
	p.KeysRead = keysPerClaim(p.Limit)
	if s.slice != nil {
		p.KeysRead = s.slice(p.Limit) // a test's; 0 reads every key
	}
	if p.KeysRead == 0 {
		return
	}
	s.keysMu.Lock()
	p.KeysFrom = s.keysAfter
	s.keysMu.Unlock()
}

// keysCursor is where the keys' cursor goes after a claim (see
// slicedKeys): to next, if move.
type keysCursor struct {
	next any
	move bool
}

// slicedKeys is where the keys' cursor goes past the slice that the claim
// p, which took claimed, read: on from its last key, or from the first
// once it read fewer than it could. ks is what the claim said of it
// (PostgreSQL's, on a row it took beyond its window). Unsaid, it is asked
// in tx, the claim's transaction (KeysSliceEnd): on PostgreSQL of a claim
// that came back short, whose window fell short, so that a slice whose
// keys' heads are all held or stuck does not hold the reading in place; on
// SQLite, whose claim says nothing, of every claim that took rows (it
// reads the keys again only if one of them lies beyond the window, in the
// database's order: Go's order of two time formats is not SQLite's). The
// cursor moves once the claim is made (moveKeys): one undone leaves the
// keys it read for the next.
func (s *Store) slicedKeys(ctx context.Context, tx claimTx, p sqldialect.ClaimParams, ks sqldialect.KeysSlice, claimed []sqldialect.ClaimedRow) (keysCursor, error) {
	if p.KeysRead == 0 {
		return keysCursor{}, nil
	}
	if !ks.Known {
		var ids []any // nil: ask of a short claim
		if len(claimed) >= p.Limit {
			if !s.leases() {
				return keysCursor{}, nil // a full claim that says nothing read no key
			}
			ids = make([]any, len(claimed))
			for i := range claimed {
				ids[i] = claimed[i].IDArg()
			}
		}
		q := s.q.KeysSliceEnd(p, ids)
		s.sent.Add(1)
		switch err := tx.QueryRowContext(ctx, q.SQL, q.Args...).Scan(&ks.Read, &ks.Last); {
		case errors.Is(err, sql.ErrNoRows):
			return keysCursor{}, nil
		case err != nil:
			return keysCursor{}, err
		}
	}
	if ks.Read < p.KeysRead {
		return keysCursor{move: true}, nil
	}
	return keysCursor{next: ks.Last, move: true}, nil
}

// keysBefore is the keys' cursor before a claim moved it: after, once
// the cursor had moved moves times; moved is false when the claim left it.
type keysBefore struct {
	after any
	moves uint64
	moved bool
}

// moveKeys moves the keys' cursor as c says after a claim of n rows, and
// returns where it was, for abandon to put it back. A claim that took no
// row has no head to give back, and the relay abandons every such claim: put
// back, the cursor of a slice whose heads are all held or stuck stayed
// there for good, and every key after it waited (a review found the
// relay claiming nothing, over and over, with keys claimable beyond it).
func (s *Store) moveKeys(c keysCursor, n int) keysBefore {
	if !c.move {
		return keysBefore{}
	}
	s.keysMu.Lock()
	defer s.keysMu.Unlock()
	before := keysBefore{after: s.keysAfter, moved: n > 0}
	s.keysAfter = c.next
	s.keysMoves++
	before.moves = s.keysMoves
	return before
}

// unmoveKeys puts the keys' cursor back where the claim of b found it,
// unless another claim moved it since: the heads an abandoned claim took
// are claimable again, and the next claim's slice holds them.
func (s *Store) unmoveKeys(b keysBefore) {
	if !b.moved {
		return
	}
	s.keysMu.Lock()
	defer s.keysMu.Unlock()
	if s.keysMoves == b.moves {
		s.keysAfter = b.after
		s.keysMoves++
	}
}

// claimedInWindow narrows the window of the next claims after a windowed
// claim p that took n rows, or widens it again: a claim that came back
// short found its window blocked (a key's backlog, behind its next record
// in flight or its stuck head), and the next walk of it would cost a probe
// an entry again for nothing. The next claims walk a quarter as far, 16
// entries at least, and take the rest key by key, until one comes back
// full. A key with a backlog then drains at its confirms' pace, not at one
// record a walk of the window.
//
// took is how long the claim's statement took. An unwindowed one that took
// under claimShortWalk walked little: the next claim does not ask whether
// the index holds a window (one round trip less for every claim of a relay
// that keeps up, which claims a few rows at a time); one that took longer
// may have walked a backlog, and the next one asks.
func (s *Store) claimedInWindow(p sqldialect.ClaimParams, n int, took time.Duration) {
	if p.Window == 0 {
		s.walksShort.Store(took < claimShortWalk)
	}
	if p.Window == 0 || s.window != nil || everyClaimWindow > 0 {
		return
	}
	if n < p.Limit {
		s.narrowed.Store(int64(max(p.Window/4, 16)))
		return
	}
	s.narrowed.Store(0)
}

// claimIndexes are the indexes a locking claim names, "" for none: on
// MySQL the pending index and the index of a key's pending rows, looked up
// the first time, in the claim's transaction (a capped pool may have no
// other connection to give).
func (s *Store) claimIndexes(ctx context.Context, tx claimTx) (index, keyIndex string, err error) {
	if _, ok := s.q.PendingIndex(); !ok {
		return "", "", nil
	}
	s.claimMu.Lock()
	defer s.claimMu.Unlock()
	if s.indexMissing() && time.Since(s.indexChecked) >= indexRecheck {
		index, keyIndex, err := s.findIndexes(ctx, tx)
		if err != nil {
			return "", "", err
		}
		s.index, s.keyIndex, s.indexChecked = index, keyIndex, time.Now()
	}
	return s.index, s.keyIndex, nil
}

// withoutTupleIDs reports whether the table's rows have no ctid (a view,
// which a relay's Table may name), read on tx the first time: a windowed
// claim over a view that locked its rows by their ctid failed every time
// (column "ctid" does not exist), and a backlog over the window was never
// relayed (a review's catch).
func (s *Store) withoutTupleIDs(ctx context.Context, tx claimTx) (bool, error) {
	switch s.tupleIDs.Load() {
	case 1:
		return false, nil
	case 2:
		return true, nil
	}
	q := s.q.TupleIDs()
	var has bool
	s.sent.Add(1)
	if err := tx.QueryRowContext(ctx, q.SQL, q.Args...).Scan(&has); err != nil {
		return false, fmt.Errorf("is %s a table: %w", s.q.Table(), err)
	}
	if has {
		s.tupleIDs.Store(1)
	} else {
		s.tupleIDs.Store(2)
	}
	return !has, nil
}

// indexMissing reports whether an index the claims would name is not
// known (under claimMu).
func (s *Store) indexMissing() bool {
	_, keyed := s.q.KeyIndex()
	return s.index == "" || keyed && s.keyIndex == ""
}

// findIndexes looks the pending index and the index of a key's pending rows
// up and returns their names, "" for one the table does not have.
func (s *Store) findIndexes(ctx context.Context, q interface {
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
}) (index, keyIndex string, err error) {
	lookup, _ := s.q.PendingIndex()
	// No pending index: claims as the optimizer sees fit, and never
	// overlapping, so the relay cannot wait on itself.
	if index, err = findIndex(ctx, q, lookup); err != nil {
		return "", "", fmt.Errorf("look up the pending index of %s: %w", s.q.Table(), err)
	}
	if lookup, ok := s.q.KeyIndex(); ok {
		// None: the key-head probe as the optimizer sees fit, slower,
		// in the same order.
		if keyIndex, err = findIndex(ctx, q, lookup); err != nil {
			return "", "", fmt.Errorf("look up the pending key index of %s: %w", s.q.Table(), err)
		}
	}
	return index, keyIndex, nil
}

// findIndex runs an index lookup: the index's name, or "" if there is none.
func findIndex(ctx context.Context, q interface {
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
}, lookup sqldialect.Query) (string, error) {
	var index string
	err := q.QueryRowContext(ctx, lookup.SQL, lookup.Args...).Scan(&index)
	if errors.Is(err, sql.ErrNoRows) {
		return "", nil
	}
	return index, err
}

// prepareRelay prepares the statements the relay runs for every batch, if
// the dialect wants it (see sqldialect.Dialect.PreparesRelay): the claims,
// from the head and after a cursor, naming the indexes the table has (see
// claimIndexes), and the mark of a full batch of each size on a drain's
// doubling from BatchSize to MaxBatchSize (a claim cut short to fit
// growBytes marks unprepared). Run calls it when it starts, while the
// relay holds no connection, since preparing takes one from the pool for a
// moment; it holds no lock meanwhile, so a Sweep that holds the pool's
// last connection goes on. A statement that could not be prepared (a proxy
// that refuses to) runs unprepared, as do all of them after one fails (see
// queryTx); the error says which.
func (s *Store) prepareRelay(ctx context.Context, batchSizes []int) error {
	if !s.dialect.sql().PreparesRelay() {
		return nil
	}
	queries := s.q.RelayStatements("", "", batchSizes)
	if _, ok := s.q.PendingIndex(); ok {
		index, keyIndex, err := s.findIndexes(ctx, s.db)
		if err != nil {
			return err
		}
		s.claimMu.Lock()
		if s.indexMissing() {
			s.index, s.keyIndex, s.indexChecked = index, keyIndex, time.Now()
		}
		if s.index != "" || s.keyIndex != "" {
			queries = append(queries, s.q.RelayStatements(s.index, s.keyIndex, nil)...)
		}
		s.claimMu.Unlock()
	}
	stmts := make(map[string]*sql.Stmt, len(queries))
	var errs []error
	for _, q := range queries {
		st, err := s.db.PrepareContext(ctx, q)
		if s.dialect.sql().MissingTable(err) {
			// Not migrated: one error that says so, rather than one a
			// statement naming nothing of the cause.
			closeStmts(stmts)
			return unmigrated(s.dialect, fmt.Errorf("outbox: prepare the relay's statements: %w", err), s.q.Table())
		}
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
func (s *Store) queryTx(ctx context.Context, tx claimTx, q sqldialect.Query) (*sql.Rows, error) {
	if st, std := s.preparedIn(tx, q.SQL); st != nil {
		rows, err := std.StmtContext(ctx, st).QueryContext(ctx, q.Args...)
		if err != nil {
			s.closePrepared()
		}
		return rows, err
	}
	q = s.inline(q)
	return tx.QueryContext(ctx, q.SQL, q.Args...)
}

func (s *Store) execTx(ctx context.Context, tx claimTx, q sqldialect.Query) (sql.Result, error) {
	if st, std := s.preparedIn(tx, q.SQL); st != nil {
		res, err := std.StmtContext(ctx, st).ExecContext(ctx, q.Args...)
		if err != nil {
			s.closePrepared()
		}
		return res, err
	}
	q = s.inline(q)
	return tx.ExecContext(ctx, q.SQL, q.Args...)
}

// inline writes q's arguments into its text where that saves a round trip
// (sqldialect.Inline; MySQL): what the relay does not run prepared (an
// idle relay's probe, the mark of a batch of a size not prepared, a
// failure's mark) goes in one round trip rather than the driver's prepare,
// execute and close.
func (s *Store) inline(q sqldialect.Query) sqldialect.Query {
	return sqldialect.Inline(s.dialect.sql(), q)
}

// preparedIn is q prepared, and tx as the *sql.Tx to run it in: nil
// unless both are (a pgClaimTx runs nothing prepared; nor does PostgreSQL
// prepare the relay's statements, see PreparesRelay).
func (s *Store) preparedIn(tx claimTx, q string) (*sql.Stmt, *sql.Tx) {
	std, ok := tx.(*sql.Tx)
	if !ok {
		return nil, nil
	}
	if st := s.prepared(q); st != nil {
		return st, std
	}
	return nil, nil
}

func (s *Store) prepared(q string) *sql.Stmt {
	if m := s.stmts.Load(); m != nil {
		return (*m)[q]
	}
	return nil
}

// forgetIndex makes the next claim look the indexes it names up again.
func (s *Store) forgetIndex() {
	if _, ok := s.q.PendingIndex(); !ok {
		return
	}
	s.claimMu.Lock()
	defer s.claimMu.Unlock()
	s.index, s.keyIndex, s.indexChecked = "", "", time.Time{}
}

// claimsOverlap reports whether a relay may claim a batch while it holds the
// claim of the one before, which is what pipelining does: on PostgreSQL
// (tuple locks) and SQLite (committed leases) always, on MySQL once the
// claims are known to walk the pending index.
func (s *Store) claimsOverlap() bool {
	if _, ok := s.q.PendingIndex(); !ok {
		return true
	}
	s.claimMu.Lock()
	defer s.claimMu.Unlock()
	return s.index != ""
}

// claimLease claims, in a write transaction of its own, with the statement
// claimQuery makes, and calls then, if set, in the same transaction.
func (s *Store) claimLease(ctx context.Context, claimQuery func(tx *sql.Tx) (sqldialect.Query, error), then func(tx *sql.Tx, claimed []sqldialect.ClaimedRow) error, relayID string, took func(n int, d time.Duration)) (*claim, error) {
	var (
		claimed []sqldialect.ClaimedRow
		elapsed time.Duration // the claim's statement's
	)
	// Committed before anything is published: SQLite has one writer, and the
	// services' own transactions must not wait for the broker.
	err := s.writeTx(ctx, "claim", func(tx *sql.Tx) error {
		s.sent.Add(1)
		q, err := claimQuery(tx)
		if err != nil {
			return fmt.Errorf("outbox: claim: %w", err)
		}
		// The update is conditional on the rows still being free, so of two
		// relays the second claims other rows, or none.
		started := time.Now()
		rows, err := tx.QueryContext(ctx, q.SQL, q.Args...)
		if err == nil {
			claimed, err = s.q.ScanClaimed(rows)
		}
		elapsed = time.Since(started)
		if err == nil && then != nil {
			err = then(tx, claimed)
		}
		if err != nil {
			return fmt.Errorf("outbox: claim: %w", err)
		}
		return nil
	})
	if err != nil {
		return nil, unmigrated(s.dialect, err, s.q.Table())
	}
	took(len(claimed), elapsed)
	sortClaimed(claimed) // RETURNING promises no order
	return &claim{rows: claimed, lease: relayID}, nil
}

// sortClaimed puts a leasing claim's rows in created_at, id order. A row
// whose created_at could not be read (the zero time) goes first: it fails
// alone, and holds nothing back.
func sortClaimed(rows []sqldialect.ClaimedRow) {
	// Not an insertion sort: a drain's claims grow to 1000 rows, which
	// SQLite's UPDATE … RETURNING gives in no particular order.
	slices.SortFunc(rows, func(a, b sqldialect.ClaimedRow) int {
		if c := a.CreatedAt.Compare(b.CreatedAt); c != 0 {
			return c
		}
		return compareIDs(a, b)
	})
}

// compareIDs orders two claimed rows' ids as SQLite's ORDER BY id does:
// integers (by value) before text, and text before BLOBs; and MySQL's
// integer id columns. By their text, another library's integer ids of one
// created_at went out 10, 11, 9.
func compareIDs(a, b sqldialect.ClaimedRow) int {
	ka, kb := idClass(a.RawID), idClass(b.RawID)
	if ka != kb {
		return ka - kb
	}
	switch x := a.RawID.(type) {
	case int64:
		return cmp.Compare(x, b.RawID.(int64))
	case uint64:
		return cmp.Compare(x, b.RawID.(uint64))
	case float64:
		return cmp.Compare(x, b.RawID.(float64))
	}
	return strings.Compare(a.ID, b.ID)
}

// idClass ranks a raw id's storage class for compareIDs: each class its
// own rank, as no two compare by value.
func idClass(raw any) int {
	switch raw.(type) {
	case int64:
		return 0
	case uint64:
		return 1
	case float64:
		return 2
	case nil:
		return 3 // text
	}
	return 4 // a BLOB
}

// finish marks the published rows (one statement), records the failures,
// releases whatever else the claim held, and ends the claim.
func (s *Store) finish(ctx context.Context, c *claim, published []string, failures []failure) error {
	c.keys = keysBefore{} // settled: an abandon after (a panic's) gives nothing back
	if c.tx != nil {
		s.sent.Add(1) // COMMIT
		defer c.ended()
		marked := time.Now()
		if pg, ok := c.tx.(*pgClaimTx); ok && len(published) > 0 && len(failures) == 0 {
			// The mark and COMMIT in one round trip (see markAndCommit).
			s.sent.Add(1)
			n, err := pg.markAndCommit(ctx, s.markPublished(c.idArgs(), marked, published))
			if err != nil {
				return fmt.Errorf("outbox: %w", err)
			}
			s.markedFewer(n, len(published))
			s.settled(published, failures)
			return nil
		}
		stuck, err := s.mark(ctx, c, c.tx, marked, published, failures)
		if err != nil {
			_ = c.tx.Rollback()
			return err
		}
		if err := c.tx.Commit(); err != nil {
			return fmt.Errorf("outbox: commit marks: %w", err)
		}
		s.passStuck(stuck, marked)
		s.settled(published, failures)
		return nil
	}
	var stuck []sqldialect.KeySeq
	marked := time.Now()
	err := s.writeTx(ctx, "mark", func(tx *sql.Tx) error {
		var err error
		if stuck, err = s.mark(ctx, c, tx, time.Now(), published, failures); err != nil {
			return err
		}
		// Rows claimed but neither published nor failed (not sent, behind a
		// failure) are free for the next sweep at once, not at lease expiry.
		return s.release(ctx, tx, c, published, failures)
	})
	if err == nil {
		s.passStuck(stuck, marked)
	}
	return err
}

// abandon gives a claim up without marking anything: the rows are claimable
// again at once.
func (s *Store) abandon(ctx context.Context, c *claim) error {
	s.unmoveKeys(c.keys)
	if c.tx != nil {
		s.sent.Add(1)
		defer c.ended()
		return c.tx.Rollback()
	}
	return s.release(ctx, s.db, c, nil, nil)
}

// release frees the leased rows of c that are neither published nor failed.
func (s *Store) release(ctx context.Context, q sqldialect.Execer, c *claim, published []string, failures []failure) error {
	done := make(map[string]bool, len(published)+len(failures))
	for _, id := range published {
		done[id] = true
	}
	for _, f := range failures {
		done[f.id] = true
	}
	var free []any
	for _, r := range c.rows {
		if !done[r.ID] {
			free = append(free, r.IDArg())
		}
	}
	if len(free) == 0 {
		return nil
	}
	release := s.q.ReleaseLease(c.lease, free)
	s.sent.Add(1)
	if _, err := q.ExecContext(ctx, release.SQL, release.Args...); err != nil {
		return fmt.Errorf("outbox: release lease: %w", err)
	}
	return nil
}

// mark marks the published and the failed rows of the claim c in tx. It
// returns the keyed records it took to MaxAttempts (key, seq), for the
// floor to pass what they hold once the marks commit (see passStuck).
//
// A published mark that changes fewer rows than it names leaves a record
// the broker took unmarked, to go out again at its lease's end: it is
// logged. Marks run on rows the claim holds, so none should be missing:
// one an operator deleted meanwhile, or an id the mark does not find as
// the claim read it.
func (s *Store) mark(ctx context.Context, c *claim, tx claimTx, now time.Time, published []string, failures []failure) ([]sqldialect.KeySeq, error) {
	ids := c.idArgs()
	if len(published) > 0 {
		s.sent.Add(1)
		res, err := s.execTx(ctx, tx, s.markPublished(ids, now, published))
		if err != nil {
			return nil, fmt.Errorf("outbox: mark published: %w", err)
		}
		if n, err := res.RowsAffected(); err == nil {
			s.markedFewer(n, len(published))
		}
	}
	if len(failures) == 0 {
		return nil, nil
	}
	var stuck []sqldialect.KeySeq
	for _, f := range failures {
		id := any(f.id)
		if arg, ok := ids[f.id]; ok {
			id = arg
		}
		changed, err := s.markFailed(ctx, tx, c.lease, id, f)
		if err != nil {
			return nil, fmt.Errorf("outbox: mark failed: %w", err)
		}
		if changed && f.attempts >= s.cfg.MaxAttempts {
			if k, ok := c.keySeq(f.id); ok {
				stuck = append(stuck, k)
			}
		}
	}
	return stuck, nil
}

// markPublished is the mark of the published rows, ids those of the claim
// a mark must not bind as text (claim.idArgs).
func (s *Store) markPublished(ids map[string]any, now time.Time, published []string) sqldialect.Query {
	args := make([]any, len(published))
	for i, id := range published {
		args[i] = id
		if arg, ok := ids[id]; ok {
			args[i] = arg // an INTEGER a text never equals (SQLite, a column without affinity)
		}
	}
	return s.q.MarkPublished(now, args)
}

// markedFewer logs a mark of published records that changed n rows of the
// published it named, when that is fewer (see mark).
func (s *Store) markedFewer(n int64, published int) {
	if n < int64(published) {
		s.log.Error("Outbox: the mark of published records found fewer rows than it names; the others will be published again", nil, watermill.LogFields{"marked": n, "published": published, "table": s.q.Table()})
	}
}

// keySeq is the key and seq of the claimed row id, if it has both.
func (c *claim) keySeq(id string) (sqldialect.KeySeq, bool) {
	for _, r := range c.rows {
		if r.ID == id {
			return sqldialect.KeySeq{Key: r.AggregateID, Seq: r.Seq}, r.AggregateID != "" && r.Seq >= 1
		}
	}
	return sqldialect.KeySeq{}, false
}

// markFailed records the failure f in tx, its reason made storable
// (storableError): refused, it would undo the whole mark, the records the
// broker took included, which went out again at every sweep while f was
// never charged its attempt. A reason that is not plain ASCII may still
// be refused by a table another library created (a MySQL last_error in
// utf8mb3 or latin1 refuses characters it has no room for, Error 1366):
// it is written after a savepoint, and, refused, taken back to it and
// written again as its ASCII escape, which any text column takes. The
// savepoint is the publisher's (sqldialect's savepoint): the relay's
// transactions run no publish. changed: the write changed the row (one an
// operator deleted, or whose lease another relay took, it does not).
func (s *Store) markFailed(ctx context.Context, tx claimTx, lease string, id any, f failure) (changed bool, err error) {
	reason := storableError(f.reason)
	write := func(reason string) error {
		q := s.inline(s.q.MarkFailed(id, f.attempts, reason, f.holdBy, f.holdUntil, lease))
		s.sent.Add(1)
		res, err := tx.ExecContext(ctx, q.SQL, q.Args...)
		if err == nil {
			n, nerr := res.RowsAffected()
			changed = nerr == nil && n == 1
		}
		return err
	}
	ascii := asciiError(reason)
	if ascii == reason {
		err := write(reason)
		return changed, err
	}
	if err := s.execSavepoint(ctx, tx, s.q.Savepoint()); err != nil {
		return false, err
	}
	err = write(reason)
	if err == nil {
		return changed, nil
	}
	if rbErr := s.execSavepoint(ctx, tx, s.q.RollbackToSavepoint()); rbErr != nil {
		return false, errors.Join(err, rbErr)
	}
	if err2 := write(ascii); err2 != nil {
		return false, errors.Join(err, err2)
	}
	return changed, nil
}

func (s *Store) execSavepoint(ctx context.Context, tx claimTx, q sqldialect.Query) error {
	s.sent.Add(1)
	_, err := tx.ExecContext(ctx, q.SQL, q.Args...)
	return err
}

// maxLastError is the size of the last_error column, in characters
// (varchar(1000) on PostgreSQL and MySQL, a CHECK on length() on SQLite).
const maxLastError = 1000

// storableError is a failure's reason as every last_error column takes it:
// valid UTF-8 (PostgreSQL and MySQL's utf8mb4 refuse the bytes of an
// error text that is not, a destination's quoting a binary payload, say),
// with no NUL (PostgreSQL refuses it in text), and at most maxLastError
// characters. A byte that is not UTF-8 becomes U+FFFD, a NUL the text
// \x00, so a reader sees that something was there.
func storableError(s string) string {
	s = strings.ToValidUTF8(s, "\uFFFD")
	s = strings.ReplaceAll(s, "\x00", `\x00`)
	return truncateError(s, maxLastError)
}

// truncateError cuts s, valid UTF-8, to at most n characters, on a rune
// boundary, its end marked with "...": in ASCII, so that a long reason in
// plain ASCII stays one (markFailed writes a reason that is not under a
// savepoint, one statement more).
func truncateError(s string, n int) string {
	if utf8.RuneCountInString(s) <= n {
		return s
	}
	r := []rune(s)
	return string(r[:n-3]) + "..."
}

// asciiError is the reason s, storable, in plain ASCII: every character
// past ASCII written as its \u escape, cut to maxLastError characters.
func asciiError(s string) string {
	var b strings.Builder
	for _, r := range s {
		switch {
		case r < utf8.RuneSelf:
			b.WriteRune(r)
		case r <= 0xFFFF:
			fmt.Fprintf(&b, `\u%04X`, r)
		default:
			fmt.Fprintf(&b, `\U%08X`, r)
		}
	}
	if b.Len() <= maxLastError {
		return b.String()
	}
	return b.String()[:maxLastError-3] + "..."
}

// Stats is the state of the outbox at one moment.
type Stats struct {
	// Pending rows: not yet published and under MaxAttempts. One number
	// that goes up and stays up is a relay that is down or a broker that
	// refuses.
	Pending int64
	// Stuck rows: not published, at MaxAttempts; left alone until retried.
	Stuck int64
	// OldestPending is the created_at of the oldest pending row, in UTC:
	// zero if none, or if that created_at cannot be read (a row another
	// library wrote badly, which the relay fails at its first claim).
	OldestPending time.Time
}

// Stats counts pending and stuck rows.
func (s *Store) Stats(ctx context.Context) (Stats, error) { return s.stats(ctx, false) }

// stats is Stats; for the relay's metrics (relay) its connection is taken
// as poolConn takes it, as they are read with batches in flight.
func (s *Store) stats(ctx context.Context, relay bool) (Stats, error) {
	var st Stats
	oldest := sqldialect.NewTime(s.dialect.sql())
	q := s.q.Stats(s.cfg.MaxAttempts)
	s.sent.Add(1)
	var err error
	if relay {
		err = s.queryRowRelay(ctx, q, &st.Pending, &st.Stuck, oldest)
	} else {
		err = s.db.QueryRowContext(ctx, q.SQL, q.Args...).Scan(&st.Pending, &st.Stuck, oldest)
	}
	if err != nil {
		if errors.Is(err, errNoConnection) {
			return Stats{}, err
		}
		return Stats{}, fmt.Errorf("outbox: stats: %w", err)
	}
	st.OldestPending = oldest.T
	return st, nil
}

// StuckRecord is a row the relay gave up on, with why. A row the relay
// could not read is listed too, with what of it can be read: a NULL reads
// as "", a created_at that is no time as the zero time, and LastError
// names the column.
type StuckRecord struct {
	ID         string
	Exchange   string
	RoutingKey string
	// AggregateID and Seq: the record's ordering key and its number, "" and
	// 0 for an unkeyed record. A keyed one holds its key's later records
	// back; an unkeyed failing one, the records behind it. SeqNull: the
	// row's seq is NULL (Seq reads 0), as an unkeyed record's is and as a
	// keyed row written without a number (not by a publisher) is.
	AggregateID string
	Seq         int64
	SeqNull     bool
	Attempts    int
	LastError   string
	CreatedAt   time.Time // UTC
	// Leased: a relay holds the row under a live lease (one that claimed
	// it under a higher MaxAttempts, another library's say), which Retry
	// leaves alone until LeasedUntil (UTC), by LeasedBy, its locked_by. A
	// failed keyed record's backoff is no lease: Retry ends it.
	Leased      bool
	LeasedBy    string
	LeasedUntil time.Time
}

// Stuck lists up to limit rows at MaxAttempts, oldest first.
func (s *Store) Stuck(ctx context.Context, limit int) ([]StuckRecord, error) {
	return s.failedRows(ctx, s.q.Stuck(s.cfg.MaxAttempts, limit, time.Now()), "stuck")
}

// SetAside lists up to limit published records whose message a consumer
// set aside (an inbox with MarkOutboxProcessed behind PoisonOutbox, on this
// database), oldest first, their LastError the inbox's note: published,
// never applied, each sent again by Resend once its cause is fixed. The
// last message of a key set aside holds nothing back, and no other list
// showed it (a review's on-call read 18 of 48 off the poison queue). It
// reads the whole table.
func (s *Store) SetAside(ctx context.Context, limit int) ([]StuckRecord, error) {
	return s.failedRows(ctx, s.q.SetAside(limit), "set aside")
}

// SetAsideCount counts the records SetAside lists.
func (s *Store) SetAsideCount(ctx context.Context) (int64, error) {
	q := s.q.SetAsideCount()
	var n int64
	if err := s.db.QueryRowContext(ctx, q.SQL, q.Args...).Scan(&n); err != nil {
		return 0, fmt.Errorf("outbox: set aside: %w", err)
	}
	return n, nil
}

// Failing lists up to limit rows that failed and are not stuck (pending
// after fewer than MaxAttempts failed attempts), oldest first: the relay
// tries them again itself, and an unkeyed one holds back the records
// behind it meanwhile.
func (s *Store) Failing(ctx context.Context, limit int) ([]StuckRecord, error) {
	return s.failedRows(ctx, s.q.Failing(s.cfg.MaxAttempts, limit, time.Now()), "failing")
}

// FailingCount counts the rows Failing lists.
func (s *Store) FailingCount(ctx context.Context) (int64, error) {
	q := s.q.FailingCount(s.cfg.MaxAttempts)
	var n int64
	if err := s.db.QueryRowContext(ctx, q.SQL, q.Args...).Scan(&n); err != nil {
		return 0, fmt.Errorf("outbox: failing: %w", err)
	}
	return n, nil
}

// failedRows reads the rows of q, a Stuck or a Failing; what names it in
// errors.
func (s *Store) failedRows(ctx context.Context, q sqldialect.Query, what string) ([]StuckRecord, error) {
	rows, err := s.db.QueryContext(ctx, q.SQL, q.Args...)
	if err != nil {
		return nil, fmt.Errorf("outbox: %s: %w", what, err)
	}
	defer rows.Close()
	var out []StuckRecord
	for rows.Next() {
		var (
			r                                            StuckRecord
			exchange, routingKey, key, lastErr, lockedBy sql.NullString
			seq                                          sql.NullInt64
			created                                      = sqldialect.NewTime(s.dialect.sql())
			lockedUntil                                  = sqldialect.NewTime(s.dialect.sql())
		)
		if err := rows.Scan(&r.ID, &exchange, &routingKey, &key, &seq, &r.Attempts, &lastErr, created, &lockedBy, lockedUntil, &r.Leased); err != nil {
			return nil, fmt.Errorf("outbox: %s: %w", what, err)
		}
		r.Exchange, r.RoutingKey, r.LastError, r.CreatedAt = exchange.String, routingKey.String, lastErr.String, created.T
		r.AggregateID, r.Seq, r.SeqNull = key.String, seq.Int64, !seq.Valid
		if r.Leased {
			r.LeasedBy, r.LeasedUntil = lockedBy.String, lockedUntil.T
		}
		out = append(out, r)
	}
	return out, rows.Err()
}

// RecordState is a row of the outbox table as Lookup reads it. A NULL reads
// as "", 0 or the zero time, and so does a time no parser of the
// dialect's reads.
type RecordState struct {
	ID, Exchange, RoutingKey string
	// AggregateID, Seq and SeqNull: as StuckRecord's.
	AggregateID string
	Seq         int64
	SeqNull     bool
	Attempts    int
	LastError   string
	// Published: published_at is set. CreatedAt, PublishedAt and
	// ProcessedAt, in UTC.
	Published                           bool
	CreatedAt, PublishedAt, ProcessedAt time.Time
	// Leased, LeasedBy and LeasedUntil: as StuckRecord's. Locked: the row
	// has a locked_by or locked_until, live or not (a Retry clears them).
	Leased      bool
	LeasedBy    string
	LeasedUntil time.Time
	Locked      bool
	// PoisonedID is the record's x-acemq-poisoned-id header: it is a
	// poison copy (PoisonOutbox, outboxctl skip-held --park) of that
	// message, sent to the poison topic, not to its consumer.
	PoisonedID string
}

// Lookup reads the rows of ids that are in the table, oldest first (by
// created_at, then id): what
// an operator looks up about a message (outboxctl show), and what tells
// why a Retry left an id alone.
func (s *Store) Lookup(ctx context.Context, ids ...string) ([]RecordState, error) {
	var out []RecordState
	ids = s.holdable(ctx, ids)
	for start := 0; start < len(ids); start += maxRowsPerStmt {
		q := s.q.Records(ids[start:min(start+maxRowsPerStmt, len(ids))], time.Now())
		rows, err := s.db.QueryContext(ctx, q.SQL, q.Args...)
		if err != nil {
			return nil, fmt.Errorf("outbox: lookup: %w", err)
		}
		for rows.Next() {
			var (
				r                                            RecordState
				exchange, routingKey, key, lastErr, lockedBy sql.NullString
				headers                                      sql.NullString
				seq, attempts                                sql.NullInt64
			)
			d := s.dialect.sql()
			created, published, processed, lockedUntil := sqldialect.NewTime(d), sqldialect.NewTime(d), sqldialect.NewTime(d), sqldialect.NewTime(d)
			if err := rows.Scan(&r.ID, &exchange, &routingKey, &key, &seq, &attempts, &lastErr, created, published, processed, &lockedBy, lockedUntil, &r.Leased, &headers); err != nil {
				_ = rows.Close()
				return nil, fmt.Errorf("outbox: lookup: %w", err)
			}
			r.Exchange, r.RoutingKey, r.AggregateID, r.Seq, r.Attempts, r.LastError = exchange.String, routingKey.String, key.String, seq.Int64, int(attempts.Int64), lastErr.String
			r.SeqNull = !seq.Valid
			r.CreatedAt, r.PublishedAt, r.ProcessedAt = created.T, published.T, processed.T
			r.Published = !published.T.IsZero() || published.Err != nil // a value no parser reads is still set
			r.Locked = lockedBy.Valid || !lockedUntil.T.IsZero() || lockedUntil.Err != nil
			if h, err := rowcodec.DecodeHeaders(headers.String); err == nil { // a row the relay refuses says nothing here
				r.PoisonedID, _ = h[PoisonedIDMetadataKey].(string)
			}
			if r.Leased {
				r.LeasedBy, r.LeasedUntil = lockedBy.String, lockedUntil.T
			}
			out = append(out, r)
		}
		if err := rows.Close(); err != nil {
			return nil, fmt.Errorf("outbox: lookup: %w", err)
		}
		if err := rows.Err(); err != nil {
			return nil, fmt.Errorf("outbox: lookup: %w", err)
		}
	}
	// Oldest first across the statements too.
	slices.SortStableFunc(out, func(a, b RecordState) int {
		return cmp.Or(a.CreatedAt.Compare(b.CreatedAt), strings.Compare(a.ID, b.ID))
	})
	return out, nil
}

// PoisonCopies finds the poison copies (PoisonOutbox's, in this table) of
// the messages ids: for each id that has any, their ids. A consumer that
// set a message aside without MarkOutboxProcessed notes nothing on its
// record, and an on-call could not tell it from one lost in a queue (an
// on-call drill); its copy is in the table all the same when the inbox
// shares the outbox's database. It reads the whole table.
func (s *Store) PoisonCopies(ctx context.Context, ids ...string) (map[string][]string, error) {
	want := make(map[string]bool, len(ids))
	for _, id := range ids {
		want[id] = true
	}
	q := s.q.HeadersLike("%" + PoisonedIDMetadataKey + "%")
	rows, err := s.db.QueryContext(ctx, q.SQL, q.Args...)
	if err != nil {
		return nil, fmt.Errorf("outbox: poison copies: %w", err)
	}
	defer func() { _ = rows.Close() }()
	out := map[string][]string{}
	for rows.Next() {
		var id string
		var headers sql.NullString
		if err := rows.Scan(&id, &headers); err != nil {
			return nil, fmt.Errorf("outbox: poison copies: %w", err)
		}
		h, err := rowcodec.DecodeHeaders(headers.String)
		if err != nil {
			continue // a row the relay refuses too
		}
		if of, _ := h[PoisonedIDMetadataKey].(string); want[of] {
			out[of] = append(out[of], id)
		}
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("outbox: poison copies: %w", err)
	}
	return out, nil
}

// Retry makes the given unpublished rows pending again, attempts reset, and
// returns how many it changed. last_error is kept until the next failure.
// A row a relay holds under a live lease (in flight: on SQLite, or claimed
// by another library's relay) is left alone, so that no second relay
// publishes it meanwhile; a failed keyed record's backoff is ended.
func (s *Store) Retry(ctx context.Context, ids ...string) (int64, error) {
	return s.pendingAgain(ctx, "retry", ids, func(ids []string) sqldialect.Query { return s.q.Retry(ids, time.Now()) })
}

// pendingAgain runs update, a statement that makes rows of ids pending
// again, in statements of maxRowsPerStmt ids, each committed on its own:
// one statement of them all failed past the databases' limits on
// arguments (65,535 on PostgreSQL and MySQL, 32,766 on SQLite), and an
// operator retrying the rows of an incident can pass more. It wakes the
// relays of what it changed, and returns how many.
func (s *Store) pendingAgain(ctx context.Context, what string, ids []string, update func([]string) sqldialect.Query) (int64, error) {
	var n int64
	ids = s.holdable(ctx, ids)
	for start := 0; start < len(ids); start += maxRowsPerStmt {
		m, err := execRange(ctx, s.db, s.dialect.sql(), update(ids[start:min(start+maxRowsPerStmt, len(ids))]))
		n += m
		if err != nil {
			s.wake(ctx, n)
			return n, fmt.Errorf("outbox: %s: %w (%d made pending before)", what, err, n)
		}
	}
	s.wake(ctx, n)
	return n, nil
}

// Resend makes the given published records pending again, to be sent
// again: attempts reset, processed_at and last_error cleared. It returns
// how many it changed; rows not published (pending, stuck, in flight) and
// ids not in the table are left alone. It is the way to send again a record whose
// message a consumer set aside (a poison queue) once its cause is fixed,
// above all a keyed one, whose key's later messages an ordered inbox holds
// until it is applied: a consumer with the inbox runs it then, as it never
// processed it, and drops it as a duplicate where it did. A consumer
// without the inbox gets it twice.
func (s *Store) Resend(ctx context.Context, ids ...string) (int64, error) {
	return s.pendingAgain(ctx, "resend", ids, s.q.Resend)
}

// Discard deletes the given stuck records (unpublished, at MaxAttempts)
// and returns how many: an operator's giving up on records that will
// never go out (a foreign row to an exchange that will not be, a payload
// nobody wants), which kept outbox_stuck above 0 for good and an unkeyed
// one among the oldest. Rows not stuck, and those a relay holds under a
// live lease, are left alone. A discarded keyed record leaves its number
// missing: its key's later records go out, and a consumer's ordered inbox
// waits for the number until an operator skips it (SkipGap). Keep what
// the records held first (outboxctl discard prints it): this deletes the
// only copy. Stuck is at this Store's MaxAttempts: under a MaxAttempts
// lower than the relays', a record a relay still retries is deleted.
func (s *Store) Discard(ctx context.Context, ids ...string) (int64, error) {
	var n int64
	ids = s.holdable(ctx, ids)
	for start := 0; start < len(ids); start += maxRowsPerStmt {
		m, err := execRange(ctx, s.db, s.dialect.sql(), s.q.Discard(ids[start:min(start+maxRowsPerStmt, len(ids))], s.cfg.MaxAttempts, time.Now()))
		n += m
		if err != nil {
			return n, fmt.Errorf("outbox: discard: %w (%d discarded before)", err, n)
		}
	}
	return n, nil
}

// zonedTimes reads, on on (the pool, or a claim's transaction), the table's time columns that MySQL converts
// from and to the session's time_zone (TIMESTAMP: another library's
// table), and how many seconds the session is ahead of UTC; ok is false
// where the dialect converts none or the read fails.
func (s *Store) zonedTimes(ctx context.Context, on rowQuerier) (cols []string, offset int64, ok bool) {
	q, ok := s.q.ZonedTimes()
	if !ok {
		return nil, 0, false
	}
	q = s.inline(q)
	var list string
	if err := on.QueryRowContext(ctx, q.SQL, q.Args...).Scan(&list, &offset); err != nil {
		return nil, 0, false
	}
	if list != "" {
		cols = strings.Split(list, ",")
	}
	return cols, offset, true
}

// holdable is ids without those the table's id column cannot hold, which
// name no row: another library's table may keep its ids as a uuid or an
// integer, and on PostgreSQL one id of another form (a typo, a truncated
// paste) failed the whole statement (22P02), the others' lookup or retry
// undone with it (an operator review); on MySQL a BIGINT column reads
// "17abc" as 17, another row's. Nor does PostgreSQL's text hold an id that
// is not UTF-8 or holds a NUL. The column's type is looked up once, as the
// inbox's marks look it up (markable); a failed look-up binds every id, as
// before, and is tried again next time.
func (s *Store) holdable(ctx context.Context, ids []string) []string {
	kind := s.ids.Load()
	if kind == 0 {
		var typ string
		if q, ok := s.q.IDType(); !ok {
			kind = idsAny
		} else if err := s.db.QueryRowContext(ctx, q.SQL, q.Args...).Scan(&typ); err == nil {
			kind = idsOfType(typ)
		}
		if kind != 0 {
			s.ids.Store(kind)
		}
	}
	textKeys := s.dialect.sql().TextKeys()
	out := make([]string, 0, len(ids))
	for _, id := range ids {
		if textKeys && !textHolds(id) || kind != 0 && !columnReads(kind, id) {
			continue
		}
		out = append(out, id)
	}
	return out
}

// columnReads reports whether an id column of kind (idsOfType's) reads id
// as a value of its type, as the databases read an operator's text: an
// integer with blanks around it, a sign or leading zeros ("017" is row
// 17's, which Retry("017") made pending before holdable; a review), a
// decimal in plain or exponent form; a uuid as pgUUID. Stricter than
// idOf, which takes a message id as the relay writes it.
func columnReads(kind int32, id string) bool {
	s := strings.TrimSpace(id)
	switch kind {
	case idsUUID:
		return pgUUID(id)
	case idsInt8, idsInt16, idsInt32, idsInt64:
		_, err := strconv.ParseInt(s, 10, 8<<(kind-idsInt8))
		return err == nil
	case idsUint8, idsUint16, idsUint32, idsUint64:
		_, err := strconv.ParseUint(strings.TrimPrefix(s, "+"), 10, 8<<(kind-idsUint8))
		return err == nil
	case idsNumeric, idsDecimal, idsZerofill:
		return s == "NaN" && kind == idsNumeric || decimalInput.MatchString(s)
	}
	return true
}

// decimalInput is a number as PostgreSQL's numeric and MySQL's DECIMAL read
// it: a sign, digits with a point, an exponent.
var decimalInput = regexp.MustCompile(`^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$`)

// KeySeqID returns the id of key's record seq, and false where the table
// holds none (purged, or the key numbered elsewhere).
func (s *Store) KeySeqID(ctx context.Context, key string, seq int64) (string, bool, error) {
	q := s.q.KeySeq(key, seq)
	var id string
	switch err := s.db.QueryRowContext(ctx, q.SQL, q.Args...).Scan(&id); {
	case errors.Is(err, sql.ErrNoRows):
		return "", false, nil
	case err != nil:
		return "", false, fmt.Errorf("outbox: record of %q seq %d: %w", key, seq, err)
	}
	return id, true, nil
}

// RetryAllStuck makes every stuck row pending again and returns how many,
// but for rows a relay holds under a live lease (see Retry).
func (s *Store) RetryAllStuck(ctx context.Context) (int64, error) {
	n, err := execRange(ctx, s.db, s.dialect.sql(), s.q.RetryStuck(s.cfg.MaxAttempts, time.Now()))
	if err != nil {
		return 0, fmt.Errorf("outbox: retry stuck: %w", err)
	}
	s.wake(ctx, n)
	return n, nil
}

// wake tells listening relays, on PostgreSQL, of n rows an UPDATE made
// pending again (the NOTIFY trigger fires on INSERT only), so that they
// claim them now rather than at their next poll, a PollInterval away. The
// rows are pending whether or not it is heard: its error is dropped, and
// the poll still finds them.
func (s *Store) wake(ctx context.Context, n int64) {
	if n > 0 {
		s.lowerFloors()
	}
	if n > 0 && s.listens() {
		q := s.q.Wake()
		_, _ = s.db.ExecContext(ctx, q.SQL, q.Args...)
	}
}

// PurgePublished deletes rows published longer than olderThan ago, in
// batches of PurgeBatch, and returns how many. Pending and stuck rows are
// never touched. Nothing else removes published rows, and a table that only
// grows costs disk and slows everything that scans it.
func (s *Store) PurgePublished(ctx context.Context, olderThan time.Duration) (int64, error) {
	return inBatches(ctx, s.db, s.dialect.sql(), "purge", olderThan, s.cfg.PurgeBatch, s.q.PurgePublishedBound, s.q.PurgePublishedRange)
}

// Check asks the database whether the outbox table is there and readable,
// reading no row. Its error is the driver's: a missing table, an
// unreachable server, a refused login.
func (s *Store) Check(ctx context.Context) error {
	return probe(ctx, s.db, s.q.Probe(), s.q.Table())
}

// PublishedSince counts the rows published at or after t ("published in the
// last hour").
func (s *Store) PublishedSince(ctx context.Context, t time.Time) (int64, error) {
	return count(ctx, s.db, s.q.PublishedSince(t), s.q.Table())
}

// PublishedBefore counts the rows published before t: what PurgePublished
// with that cutoff deletes.
func (s *Store) PublishedBefore(ctx context.Context, t time.Time) (int64, error) {
	return count(ctx, s.db, s.q.PublishedBefore(t), s.q.Table())
}
