package outbox

import (
	"context"
	"database/sql/driver"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/acemq/watermill-outbox/internal/sqldialect"
)

// listen wakes the relay on every NOTIFY of the outbox trigger until ctx
// ends. It holds one connection of the pool for LISTEN, and reconnects with
// backoff when it is lost. Only pgx's database/sql driver can wait for
// notifications; with another driver it says so once and leaves the relay
// to its poll interval.
func (f *Forwarder) listen(ctx context.Context) {
	delay := time.Duration(0)
	var trigger triggerState // kept across reconnects: each change is logged once
	lost := false            // a loss was logged, and LISTEN's return is to be
	for {
		listened, err := f.listenOnce(ctx, &trigger, &lost)
		if ctx.Err() != nil {
			return
		}
		if errors.Is(err, errNotPgx) {
			f.log.Info("LISTEN/NOTIFY needs the pgx driver (github.com/jackc/pgx/v5/stdlib); the relay polls", watermill.LogFields{"poll_interval": f.cfg.PollInterval})
			return
		}
		f.log.Error("Outbox LISTEN connection lost; the relay polls until it is back", err, nil)
		lost = true
		// Rows committed while nobody listened would wait for the poll.
		f.Notify()
		if listened >= listenLived {
			delay = 0
		}
		delay = f.nextDelay(delay)
		if !sleepCtx(ctx, delay) {
			return
		}
	}
}

var errNotPgx = fmt.Errorf("outbox: not a pgx connection")

// listenLived is how long a LISTEN must have lasted for the reconnect
// after its loss to start again from the shortest backoff. The backoff
// went back only once a notification had been heard: on a quiet outbox
// whose LISTEN connections a server or pooler ends (idle_session_timeout),
// each loss left the relay without LISTEN longer than the one before, up
// to RetryMax. One that ends at once still backs off.
var listenLived = 5 * time.Second // a variable for tests

// listenQueryTimeout bounds LISTEN and each look at the trigger on the
// listening connection. A connection whose packets are dropped without
// either end being told (a NAT or firewall entry expired, a server host
// gone without a reset) answers nothing: the look waited as long as the
// kernel kept the connection (tcp_retries2, some 15 minutes), and the
// relay, sure of its LISTEN, waited PollInterval for every row. A look
// cut by it ends the connection, and the relay listens on a new one.
const listenQueryTimeout = 5 * time.Second

// listenOnce listens on one connection until it fails or ctx ends, and
// reports for how long LISTEN was in effect. It looks at the table's
// NOTIFY trigger before LISTEN (which pg_stat_activity then shows) and
// every triggerRecheck after.
//
// Where lost is set, a loss was logged: LISTEN's return is logged too, and
// lost cleared (a user review: the loss at ERROR, and nothing after it).
func (f *Forwarder) listenOnce(ctx context.Context, trigger *triggerState, lost *bool) (listened time.Duration, err error) {
	conn, err := f.store.db.Conn(ctx)
	if err != nil {
		return 0, err
	}
	defer conn.Close()
	err = conn.Raw(func(driverConn any) error {
		sc, ok := driverConn.(*stdlib.Conn)
		if !ok {
			return errNotPgx
		}
		pc := sc.Conn()
		defer f.woken.Store(false)
		if err := trigger.look(ctx, f, pc); err != nil {
			return fmt.Errorf("%w: %w", driver.ErrBadConn, err)
		}
		lctx, cancel := context.WithTimeout(ctx, listenQueryTimeout)
		_, err := pc.Exec(lctx, sqldialect.ListenRetries().SQL)
		if err == nil {
			_, err = pc.Exec(lctx, sqldialect.Listen().SQL)
		}
		cancel()
		if err != nil {
			return fmt.Errorf("%w: %w", driver.ErrBadConn, err)
		}
		start := time.Now()
		defer func() { listened = time.Since(start) }()
		if *lost {
			f.log.Info("Outbox LISTEN connection back: commits wake the relay again", nil)
			*lost = false
		}
		// Anything committed before LISTEN took effect is found by this
		// first sweep.
		f.Notify()
		for {
			if time.Now().After(trigger.next) {
				if err := trigger.look(ctx, f, pc); err != nil {
					return fmt.Errorf("%w: %w", driver.ErrBadConn, err)
				}
			}
			waitCtx, cancel := context.WithDeadline(ctx, trigger.next)
			n, err := pc.WaitForNotification(waitCtx)
			due := errors.Is(waitCtx.Err(), context.DeadlineExceeded)
			cancel()
			if err != nil {
				if due && ctx.Err() == nil && pgconn.Timeout(err) {
					continue // time to look again; pgx keeps the connection usable
				}
				// Never hand a listening connection back to the pool.
				return fmt.Errorf("%w: %w", driver.ErrBadConn, err)
			}
			if othersTable(n.Payload, trigger.payload) {
				continue
			}
			if n.Channel == sqldialect.RetryChannel {
				// Another process's Retry or Republish (one in this
				// process lowered them already): a drain goes back for
				// the rows, which its cursor is past. The wake follows,
				// on NotifyChannel.
				f.store.lowerFloorsHeard()
				continue
			}
			f.Notify()
		}
	})
	return listened, err
}

// triggerRecheck is how often a listening relay looks again at the
// table's NOTIFY trigger: one query on the LISTEN connection each time. A
// trigger disabled while the relay runs leaves rows waiting up to
// PollInterval each for as long as this; one enabled again, the relay
// polling adaptively (more probes) for as long. A variable for tests.
var triggerRecheck = time.Minute

// triggerState is what a listening relay last found of its table and the
// table's NOTIFY trigger (sqldialect.NotifyTriggerName), and when it looks
// next. It outlives a lost LISTEN connection.
type triggerState struct {
	looked bool // a reading succeeded
	// payload is the one the trigger sends for the table, "" when the
	// table is not there or nothing was read yet: then every notification
	// wakes the relay.
	payload string
	fires   bool // the last reading's
	failed  bool // the last reading failed, and said so
	next    time.Time
}

// look reads the table's notify payload and whether its NOTIFY trigger
// fires, sets the relay's woken to match, and sets when to look next. With the trigger, every
// commit that wrote rows wakes the relay, and the poll is only a safety
// net at PollInterval. Without it (a table another library created and
// this library's migrations never touched, or a trigger disabled to spare
// the services' commits the NOTIFY: see the README; or no table yet) the
// relay polls adaptively, as on MySQL, rather than wait PollInterval for
// every row. Each change is logged once. A reading that fails is logged
// once and changes nothing; until one succeeds the relay counts on the
// trigger. A reading that the connection does not answer within
// listenQueryTimeout, or that ends it, returns the error: the connection
// is gone.
func (s *triggerState) look(ctx context.Context, f *Forwarder, pc *pgx.Conn) error {
	q := f.store.q.NotifyTrigger()
	s.next = time.Now().Add(triggerRecheck)
	var payload, quiet *string
	var fires bool
	qctx, cancel := context.WithTimeout(ctx, listenQueryTimeout)
	defer cancel()
	if err := pc.QueryRow(qctx, q.SQL, q.Args...).Scan(&payload, &fires, &quiet); err != nil {
		if ctx.Err() == nil && (qctx.Err() != nil || pc.IsClosed()) {
			return fmt.Errorf("look at the NOTIFY trigger: %w", err)
		}
		if !s.failed && ctx.Err() == nil {
			f.log.Info("Cannot read the outbox table's NOTIFY trigger; the relay keeps to its last reading "+
				"(before any, that it fires and that every notification is its table's)", watermill.LogFields{
				"trigger": sqldialect.NotifyTriggerName, "err": err.Error()})
		}
		s.failed = true
		f.woken.Store(!s.looked || s.fires)
		return nil
	}
	s.failed = false
	table := payload != nil
	if !s.looked || table != (s.payload != "") || fires != s.fires {
		fields := watermill.LogFields{"trigger": sqldialect.NotifyTriggerName,
			"min_poll_interval": f.cfg.MinPollInterval, "poll_interval": f.cfg.PollInterval}
		switch {
		case !table:
			f.log.Info("The outbox table is not there yet: nothing wakes the relay, which polls adaptively", fields)
		case !fires:
			f.log.Info("The outbox table has no enabled NOTIFY trigger: commits do not wake the relay, which polls adaptively", fields)
		case s.looked:
			f.log.Info("The outbox table's NOTIFY trigger fires now: commits wake the relay", fields)
		}
	}
	s.looked, s.payload, s.fires = true, "", fires
	if table {
		s.payload = *payload
	}
	seq := ""
	if quiet != nil && fires {
		seq = *quiet
	}
	f.quietSeq.Store(&seq)
	f.woken.Store(fires)
	return nil
}

// othersTable reports whether a notification's payload names another
// schema's or table's outbox. A payload that names no table (a trigger
// other than this library's, an older one) is not known to be another's,
// and wakes the relay.
func othersTable(payload, ours string) bool {
	return ours != "" && strings.Contains(payload, ".") && payload != ours
}
