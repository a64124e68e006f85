package outbox

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"fmt"
	"math/rand/v2"
	"time"

	"github.com/acemq/watermill-outbox/internal/sqldialect"
)

// Waiting for SQLite's write lock.
//
// A leasing relay (SQLite) writes twice per batch, the claim and the marks,
// each a transaction of its own, and the services' commits write beside
// it. SQLite's own wait for a busy lock (busy_timeout) sleeps 1, 2, 5, 10,
// 15, 20, 25 ms and on between tries, so a claim that misses the lock a few
// times under a steady flow of commits waits tens of milliseconds while the
// lock is free most of that time, and every record pending waits with it:
// at 2,000 commits a second, the relay in its own process, that was a p99
// of 29-166 ms from commit to broker. The relay so waits itself instead: on
// a connection whose busy_timeout it sets to 0 for the transaction, it
// tries again within a millisecond (busyPause) for as long as the pool's
// busy_timeout would have waited, and then sets the pool's value back.

// busyPause is the relay's pause before its try-th try again of a busy
// lock: 50 µs doubling to 800 µs, each at random between half and one and
// a half of that, so that two relays do not try in step. A lock that stays
// busy costs a try per 0.8 ms, not per 50 µs.
func busyPause(try int) time.Duration {
	d := 50 * time.Microsecond << min(try, 4)
	return d/2 + rand.N(d)
}

// writeTx runs fn in a transaction of its own and commits it. Where the
// database makes a writer wait in the client (SQLite), the transaction is
// tried again while another connection holds the write lock (see above);
// elsewhere it is one try on the pool. Its BEGIN's or COMMIT's error says
// "outbox: <what>: …"; fn's is returned as it is.
func (s *Store) writeTx(ctx context.Context, what string, fn func(tx *sql.Tx) error) error {
	if _, ok := s.q.BusyTimeout(0); !ok {
		return s.txOn(ctx, what, s.db.BeginTx, fn)
	}
	conn, err := s.db.Conn(ctx)
	if err != nil {
		return fmt.Errorf("outbox: %s: %w", what, err)
	}
	defer func() { _ = conn.Close() }()
	patience, err := s.busyPatience(ctx, conn)
	if err != nil {
		return err
	}
	restore, err := s.suspendBusyTimeout(ctx, conn, patience)
	if err != nil {
		return err
	}
	defer restore()
	// The transaction itself is not tied to ctx: database/sql would end a
	// cancelled one from a goroutine of its own and close conn there, under
	// the restore above (a race inside database/sql's Conn, a nil pointer
	// in a -race run of cancelled sweeps). fn's statements still run under
	// ctx, and a cancelled one fails fn, which is rolled back here, as is
	// an fn that ctx ended after.
	begin := func(_ context.Context, opts *sql.TxOptions) (*sql.Tx, error) {
		return conn.BeginTx(context.WithoutCancel(ctx), opts)
	}
	run := func(tx *sql.Tx) error {
		if err := fn(tx); err != nil {
			return err
		}
		return ctx.Err()
	}
	deadline := time.Now().Add(patience)
	for try := 0; ; try++ {
		err := s.txOn(ctx, what, begin, run)
		if err == nil || !sqldialect.Busy(err) || !time.Now().Before(deadline) {
			return err
		}
		if !sleepCtx(ctx, busyPause(try)) {
			return err
		}
	}
}

// txOn runs fn in a transaction begun by begin and commits it, or rolls it
// back when fn fails.
func (s *Store) txOn(ctx context.Context, what string, begin func(context.Context, *sql.TxOptions) (*sql.Tx, error), fn func(tx *sql.Tx) error) error {
	s.sent.Add(1) // BEGIN
	tx, err := begin(ctx, nil)
	if err != nil {
		return fmt.Errorf("outbox: %s: begin: %w", what, err)
	}
	if err := fn(tx); err != nil {
		s.sent.Add(1)
		_ = tx.Rollback()
		return err
	}
	s.sent.Add(1)
	if err := tx.Commit(); err != nil {
		return fmt.Errorf("outbox: %s: commit: %w", what, err)
	}
	return nil
}

// busyPatience is the busy_timeout of the pool's connections, read once
// from the first (the DSN's _busy_timeout, or the driver's default, sets
// it alike on every connection): how long the relay waits for a busy lock,
// as the services' writers do, and what each connection is given back.
func (s *Store) busyPatience(ctx context.Context, conn *sql.Conn) (time.Duration, error) {
	s.busyMu.Lock()
	defer s.busyMu.Unlock()
	if s.busyKnown {
		return s.busyWait, nil
	}
	q, _ := s.q.BusyTimeout(-1)
	s.sent.Add(1)
	var ms int64
	if err := conn.QueryRowContext(ctx, q.SQL).Scan(&ms); err != nil {
		return 0, fmt.Errorf("outbox: read busy_timeout: %w", err)
	}
	s.busyWait, s.busyKnown = time.Duration(ms)*time.Millisecond, true
	return s.busyWait, nil
}

// suspendBusyTimeout sets conn's busy_timeout to 0, and returns what sets
// it back to patience. A connection whose setting could not be given back
// is discarded, not returned to the pool: a service's transaction on it
// would fail at once where it should wait.
func (s *Store) suspendBusyTimeout(ctx context.Context, conn *sql.Conn, patience time.Duration) (restore func(), err error) {
	off, _ := s.q.BusyTimeout(0)
	s.sent.Add(1)
	// Not cut short by ctx: SQLite applies the pragma as it compiles it, so
	// a statement interrupted after that has set 0 already, and its error
	// would return the connection to the pool at 0, where every service
	// transaction on it then fails at once under contention.
	if _, err := conn.ExecContext(context.WithoutCancel(ctx), off.SQL); err != nil {
		_ = conn.Raw(func(any) error { return driver.ErrBadConn }) // whatever it holds now, not the pool's
		return nil, fmt.Errorf("outbox: set busy_timeout: %w", err)
	}
	return func() {
		back, _ := s.q.BusyTimeout(int(patience / time.Millisecond))
		s.sent.Add(1)
		if _, err := conn.ExecContext(context.WithoutCancel(ctx), back.SQL); err != nil {
			_ = conn.Raw(func(any) error { return driver.ErrBadConn })
		}
	}, nil
}
