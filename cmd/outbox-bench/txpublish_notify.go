package main

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jmoiron/sqlx"

	"github.com/acemq/watermill-outbox/internal/testdb"
)

// On PostgreSQL the NOTIFY that wakes the relay at commit (migration 0003's
// trigger) is not free for the services once they commit at the same time:
// PostgreSQL serialises the commits of transactions that notify (it holds a
// lock on the notification queue from before the commit record until the
// commit is durable), so they no longer share a WAL flush. txpublish
// measures it with concurrentSessions sessions committing order-and-message
// transactions as fast as they can: with the trigger, with it disabled,
// and with it kept quiet as a relay in a flow keeps it (migration 0010's
// sequence set ahead: the trigger reads it and sends nothing), in rotating
// order:
//
//	txpublish_concurrent_tps_postgres            with the trigger
//	txpublish_concurrent_tps_postgres_no_notify  with it disabled
//	txpublish_concurrent_tps_postgres_quiet      with it kept quiet
//	txpublish_concurrent_notify_vs_none_postgres the first over the second
//	txpublish_concurrent_quiet_vs_none_postgres  the third over the second
const (
	concurrentSessions = 8
	concurrentSpell    = 3 * time.Second
	concurrentRounds   = 2
)

// The trigger's three ways, as txPublishConcurrent sets them.
const (
	triggerOff = iota
	triggerOn
	triggerQuiet
)

// setNotifyTrigger sets the trigger one of its three ways: disabled,
// notifying, or enabled and kept quiet for an hour.
func setNotifyTrigger(ctx context.Context, db sqlx.ExecerContext, way int) error {
	verb, ahead := "ENABLE", 0
	switch way {
	case triggerOff:
		verb = "DISABLE"
	case triggerQuiet:
		ahead = 3_600_000
	}
	if _, err := db.ExecContext(ctx, "ALTER TABLE acemq_outbox "+verb+" TRIGGER acemq_outbox_notify"); err != nil {
		return err
	}
	_, err := db.ExecContext(ctx, "SELECT setval('acemq_outbox_quiet', CASE WHEN $1 > 0 THEN (extract(epoch FROM clock_timestamp()) * 1000)::bigint + $1 ELSE 0 END)", ahead)
	return err
}

func txPublishConcurrent(ctx context.Context, db *testdb.DB, out *reporter) error {
	db.SetMaxOpenConns(concurrentSessions)
	db.SetMaxIdleConns(concurrentSessions)
	insertOrder := db.Rebind("INSERT INTO orders (id, customer, total, created_at) VALUES (?, ?, ?, ?)")
	setTrigger := func(way int) error { return setNotifyTrigger(ctx, db, way) }
	defer func() { _ = setTrigger(triggerOn) }()

	var commits [3]int
	var spent [3]time.Duration
	for r := 0; r < concurrentRounds; r++ {
		for i := range 3 {
			way := (r + i) % 3
			if err := setTrigger(way); err != nil {
				return fmt.Errorf("setting the notify trigger: %w", err)
			}
			start := time.Now()
			n, err := commitFlatOut(ctx, db.DB, insertOrder, concurrentSpell)
			if err != nil {
				return err
			}
			commits[way] += n
			spent[way] += time.Since(start)
		}
	}
	with, without, quiet := rate(commits[triggerOn], spent[triggerOn]), rate(commits[triggerOff], spent[triggerOff]), rate(commits[triggerQuiet], spent[triggerQuiet])
	note("txpublish %s: %d sessions committing at once, %d rounds of %s each way", db.Kind, concurrentSessions, concurrentRounds, concurrentSpell)
	out.metric("txpublish_concurrent_tps_"+db.Kind, with, "tx/s")
	out.metric("txpublish_concurrent_tps_"+db.Kind+"_no_notify", without, "tx/s")
	out.metric("txpublish_concurrent_tps_"+db.Kind+"_quiet", quiet, "tx/s")
	out.metric("txpublish_concurrent_notify_vs_none_"+db.Kind, with/without, "ratio")
	out.metric("txpublish_concurrent_quiet_vs_none_"+db.Kind, quiet/without, "ratio")
	return nil
}

// commitFlatOut commits order-and-message transactions on
// concurrentSessions sessions for spell, and returns how many committed.
func commitFlatOut(ctx context.Context, db *sqlx.DB, insertOrder string, spell time.Duration) (int, error) {
	ctx, cancel := context.WithTimeout(ctx, spell)
	defer cancel()
	var (
		n    atomic.Int64
		wg   sync.WaitGroup
		errs = make([]error, concurrentSessions)
	)
	for s := 0; s < concurrentSessions; s++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := s; ctx.Err() == nil; i += concurrentSessions {
				o := newOrder(i)
				_, err := orderTx(ctx, db, insertOrder, o, func(tx *sqlx.Tx) error {
					return publishOrderCreated(ctx, tx, watermill.NewUUID(), orderPayload(o), o, "")
				})
				if err != nil {
					if ctx.Err() == nil {
						errs[s] = err
					}
					return
				}
				n.Add(1)
			}
		}()
	}
	wg.Wait()
	return int(n.Load()), errors.Join(errs...)
}

// triggerCost measures in the server what the NOTIFY trigger adds to an
// inserting transaction, apart from the client's round trips and the WAL
// flush, whose noise on this machine is larger than the trigger: a
// procedure commits triggerTxs one-row transactions into acemq_outbox
// (synchronous_commit off), with the trigger disabled, notifying and kept
// quiet, in rotating order:
//
//	trigger_tx_us_postgres_none    µs a transaction, without the trigger
//	trigger_tx_us_postgres         with it, notifying
//	trigger_tx_us_postgres_quiet   with it kept quiet
//	trigger_cost_us_postgres       the second less the first
//	trigger_cost_us_postgres_quiet the third less the first
//
// Nothing listens, so a notification is queued and read by nobody; with
// sessions committing at once a notifying commit costs more, which
// txpublish_concurrent_* measures.
const (
	triggerTxs    = 10_000
	triggerRounds = 4
)

func triggerCost(ctx context.Context, db *testdb.DB, out *reporter) error {
	conn, err := db.Connx(ctx) // one session: its SET and its procedure
	if err != nil {
		return err
	}
	defer conn.Close()
	for _, q := range []string{
		"SET synchronous_commit = off",
		`CREATE OR REPLACE PROCEDURE bench_trigger_txs(n int) LANGUAGE plpgsql AS $$
BEGIN
	FOR i IN 1..n LOOP
		INSERT INTO acemq_outbox (id, exchange_name, routing_key, body) VALUES ('bench-trigger-' || i, 'bench.trigger', 'bench', 'x');
		COMMIT;
	END LOOP;
END $$`,
	} {
		if _, err := conn.ExecContext(ctx, q); err != nil {
			return fmt.Errorf("trigger cost: %w", err)
		}
	}
	// TRUNCATE, not DELETE: every round starts on an empty table and
	// indexes, not on the dead entries of the rounds before. The
	// scenario's database is its own, and this is its last step.
	clear := func() error {
		_, err := conn.ExecContext(ctx, "TRUNCATE acemq_outbox")
		return err
	}
	defer func() {
		bg := context.WithoutCancel(ctx)
		_ = setNotifyTrigger(bg, conn, triggerOn)
		_, _ = conn.ExecContext(bg, "RESET synchronous_commit") // the session goes back to the pool
	}()

	var spent [3]time.Duration
	for r := 0; r < triggerRounds; r++ {
		for i := range 3 {
			way := (r + i) % 3
			err := setNotifyTrigger(ctx, conn, way)
			if err == nil {
				err = clear()
			}
			if err != nil {
				return fmt.Errorf("trigger cost: %w", err)
			}
			start := time.Now()
			if _, err := conn.ExecContext(ctx, "CALL bench_trigger_txs($1)", triggerTxs); err != nil {
				return fmt.Errorf("trigger cost: %w", err)
			}
			if r > 0 { // the first round warms up
				spent[way] += time.Since(start)
			}
		}
	}
	us := func(way int) float64 {
		return float64(spent[way].Microseconds()) / float64(triggerTxs*(triggerRounds-1))
	}
	note("txpublish %s: the trigger in the server, %d one-row transactions a round, %d rounds each way after one to warm up", db.Kind, triggerTxs, triggerRounds-1)
	out.metric("trigger_tx_us_"+db.Kind+"_none", us(triggerOff), "µs")
	out.metric("trigger_tx_us_"+db.Kind, us(triggerOn), "µs")
	out.metric("trigger_tx_us_"+db.Kind+"_quiet", us(triggerQuiet), "µs")
	out.metric("trigger_cost_us_"+db.Kind, us(triggerOn)-us(triggerOff), "µs")
	out.metric("trigger_cost_us_"+db.Kind+"_quiet", us(triggerQuiet)-us(triggerOff), "µs")
	return nil
}
