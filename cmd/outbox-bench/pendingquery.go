package main

import (
	"context"
	"database/sql"
	"errors"
	"flag"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// pendingquery: does the relay's claim stay flat as published rows pile up?
// PostgreSQL only: the partial index acemq_outbox_pending (WHERE published_at
// IS NULL) is what should make it so.
//
// Two isolated schemas: "big" holds -n (default 1,000,000) published rows
// and 100 pending ones, "small" only the same 100 pending. The published
// rows are written by one INSERT … SELECT generate_series, then both tables
// are ANALYZEd. The claim query, the relay's own text (claimLocked of
// queries.go for PostgreSQL, with the default batch of 100), then runs in
// a READ COMMITTED transaction that is rolled back, alternately on each
// table, -iters times each after a warm-up; the time is that of the query
// and of reading its 100 rows.
//
//	pending_query_big/small_postgres_us: medians
//	pending_query_ratio_postgres:                 big over small
//
// Then the case the fill above does not show: published rows that were
// pending first, as the relay leaves them. -churn rows (default 200,000)
// are inserted pending into the small table and marked published by an
// UPDATE, as the relay marks them, with autovacuum off for that table. The
// partial index still holds their dead entries, at its head, where the
// claim's scan starts, until VACUUM removes them.
//
//	pending_query_churn_ratio_postgres:  before VACUUM, over the small table's median
//	pending_query_vacuumed_ratio_postgres: after VACUUM
var (
	pendingIters = flag.Int("iters", 2000, "pendingquery: timed claims per table")
	pendingChurn = flag.Int("churn", 200000, "pendingquery: rows published by UPDATE for the churn figure (0 = skip it)")
)

const (
	pendingDefaultN = 1000000
	pendingRows     = 100
	pendingBatch    = 100 // ForwarderConfig's default BatchSize
	pendingWarmup   = 50
)

// pendingClaimSQL is claimLocked of queries.go as newStoreQueries builds it
// for PostgreSQL and the default table: the query the relay runs.
const pendingClaimSQL = `SELECT id, exchange_name, routing_key, body, body_encoding, content_type, headers, created_at, attempts` +
	` FROM "acemq_outbox" WHERE published_at IS NULL AND attempts < $1 AND (locked_until IS NULL OR locked_until < $2)` +
	` ORDER BY created_at, id LIMIT $3 FOR UPDATE SKIP LOCKED`

func runPendingQuery(ctx context.Context, cfg config, out *reporter) error {
	n := cfg.n
	if n == 0 {
		n = pendingDefaultN
	}
	if !slices.Contains(cfg.kinds, testdb.Postgres) {
		note("pendingquery: PostgreSQL only, and -db leaves it out: nothing to do")
		return nil
	}
	if *pendingIters < 1 {
		return errors.New("-iters must be at least 1")
	}
	return withDatabase(ctx, testdb.Postgres, cfg.dir, func(big *testdb.DB, _ outbox.Dialect) error {
		return withDatabase(ctx, testdb.Postgres, cfg.dir, func(small *testdb.DB, _ outbox.Dialect) error {
			return pendingQueryOn(ctx, big, small, n, out)
		})
	})
}

func pendingQueryOn(ctx context.Context, big, small *testdb.DB, n int, out *reporter) error {
	fillStart := time.Now()
	// Published a day ago, one millisecond apart, and processed: what a
	// relay and an inbox leave behind before the purge.
	_, err := big.ExecContext(ctx, `INSERT INTO acemq_outbox
    (id, exchange_name, routing_key, body, body_encoding, content_type, headers, created_at, published_at, processed_at)
SELECT 'published-' || g, '', 'outbox-bench', repeat('x', 256), 'utf-8', 'application/octet-stream', '{}',
       now() - interval '1 day' + g * interval '1 millisecond',
       now() - interval '1 day' + g * interval '1 millisecond' + interval '5 milliseconds',
       now() - interval '1 day' + g * interval '1 millisecond' + interval '10 milliseconds'
FROM generate_series(1, $1) AS g`, n)
	if err != nil {
		return fmt.Errorf("filling %d published rows: %w", n, err)
	}
	note("pendingquery: %d published rows written in %s", n, time.Since(fillStart).Round(time.Millisecond))

	// The same 100 pending rows in both tables, written as a service writes
	// them.
	msgs := make([]*message.Message, pendingRows)
	payload := benchPayload(256)
	for i := range msgs {
		msgs[i] = message.NewMessage(watermill.NewUUID(), payload)
	}
	for _, db := range []*testdb.DB{big, small} {
		if err := publishAll(ctx, db, msgs); err != nil {
			return err
		}
		if _, err := db.ExecContext(ctx, "ANALYZE acemq_outbox"); err != nil {
			return err
		}
	}

	for _, t := range []struct {
		name string
		db   *testdb.DB
	}{{"big", big}, {"small", small}} {
		if err := explainClaim(ctx, t.db, t.name); err != nil {
			return err
		}
	}

	// Interleaved, alternating which goes first, so that drift and noise
	// fall on both alike.
	iters := *pendingIters
	bigT := make([]time.Duration, 0, iters)
	smallT := make([]time.Duration, 0, iters)
	start := time.Now()
	for i := 0; i < pendingWarmup+iters; i++ {
		order := []*testdb.DB{big, small}
		if i%2 == 1 {
			order = []*testdb.DB{small, big}
		}
		for _, db := range order {
			took, err := timeClaim(ctx, db, pendingRows)
			if err != nil {
				return err
			}
			if i < pendingWarmup {
				continue
			}
			if db == big {
				bigT = append(bigT, took)
			} else {
				smallT = append(smallT, took)
			}
		}
	}
	note("pendingquery: %d claims per table in %s", iters, time.Since(start).Round(time.Millisecond))
	bigMed, smallMed := quantile(bigT, 0.5), quantile(smallT, 0.5)
	out.metric("pending_query_big_postgres_us", micros(bigMed), "us")
	out.metric("pending_query_small_postgres_us", micros(smallMed), "us")
	out.metric("pending_query_ratio_postgres", float64(bigMed)/float64(smallMed), "ratio")
	note("pendingquery: p90 big %.0f us, small %.0f us", micros(quantile(bigT, 0.9)), micros(quantile(smallT, 0.9)))

	if *pendingChurn > 0 {
		return pendingChurnOn(ctx, small, *pendingChurn, smallMed, out)
	}
	return nil
}

// pendingChurnOn publishes churn rows through the pending state, as the
// relay does, and times the claim before and after VACUUM.
func pendingChurnOn(ctx context.Context, db *testdb.DB, churn int, baseline time.Duration, out *reporter) error {
	// Autovacuum would clean up at a moment of its choosing and make the
	// figure a matter of timing; off, it shows the state between two of
	// its runs, which on a busy table is where the relay spends its time.
	if _, err := db.ExecContext(ctx, "ALTER TABLE acemq_outbox SET (autovacuum_enabled = false)"); err != nil {
		return err
	}
	start := time.Now()
	// Older than the 100 pending rows: in the partial index they sit where
	// the claim's scan starts, as the rows a relay published before do.
	if _, err := db.ExecContext(ctx, `INSERT INTO acemq_outbox
    (id, exchange_name, routing_key, body, body_encoding, content_type, headers, created_at)
SELECT 'churn-' || g, '', 'outbox-bench', repeat('x', 256), 'utf-8', 'application/octet-stream', '{}',
       now() - interval '1 hour' + g * interval '1 millisecond'
FROM generate_series(1, $1) AS g`, churn); err != nil {
		return fmt.Errorf("churn: insert: %w", err)
	}
	if _, err := db.ExecContext(ctx, "UPDATE acemq_outbox SET published_at = now() WHERE id LIKE 'churn-%'"); err != nil {
		return fmt.Errorf("churn: mark published: %w", err)
	}
	note("pendingquery: %d rows inserted pending and marked published in %s", churn, time.Since(start).Round(time.Millisecond))
	if err := explainClaim(ctx, db, "churned, before VACUUM"); err != nil {
		return err
	}
	measure := func() ([]time.Duration, error) {
		iters := min(*pendingIters, 500)
		ts := make([]time.Duration, 0, iters)
		for i := 0; i < iters; i++ {
			took, err := timeClaim(ctx, db, pendingRows)
			if err != nil {
				return nil, err
			}
			ts = append(ts, took)
		}
		return ts, nil
	}
	churned, err := measure()
	if err != nil {
		return err
	}
	if _, err := db.ExecContext(ctx, "VACUUM acemq_outbox"); err != nil {
		return err
	}
	vacuumed, err := measure()
	if err != nil {
		return err
	}
	out.metric("pending_query_churn_postgres_us", micros(quantile(churned, 0.5)), "us")
	out.metric("pending_query_churn_ratio_postgres", float64(quantile(churned, 0.5))/float64(baseline), "ratio")
	out.metric("pending_query_vacuumed_ratio_postgres", float64(quantile(vacuumed, 0.5))/float64(baseline), "ratio")
	note("pendingquery: churned: first claim %.0f us, median %.0f us; after VACUUM median %.0f us", micros(churned[0]), micros(quantile(churned, 0.5)), micros(quantile(vacuumed, 0.5)))
	return nil
}

// publishAll commits msgs to db's outbox in one transaction.
func publishAll(ctx context.Context, db *testdb.DB, msgs []*message.Message) error {
	tx, err := db.BeginTxx(ctx, nil)
	if err != nil {
		return err
	}
	pub, err := outbox.NewTxPublisher(tx)
	if err == nil {
		err = pub.Publish("outbox-bench", msgs...)
	}
	if err != nil {
		_ = tx.Rollback()
		return err
	}
	return tx.Commit()
}

// timeClaim runs the relay's claim in a transaction it rolls back, and
// times the query and the reading of its rows.
func timeClaim(ctx context.Context, db *testdb.DB, want int) (time.Duration, error) {
	tx, err := db.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelReadCommitted})
	if err != nil {
		return 0, err
	}
	defer func() { _ = tx.Rollback() }()
	start := time.Now()
	rows, err := tx.QueryContext(ctx, pendingClaimSQL, outbox.DefaultMaxAttempts, time.Now(), pendingBatch)
	if err != nil {
		return 0, fmt.Errorf("claim: %w", err)
	}
	got := 0
	for rows.Next() {
		var (
			id, exchange, key, body, enc, ct, headers string
			created                                   time.Time
			attempts                                  int
		)
		if err := rows.Scan(&id, &exchange, &key, &body, &enc, &ct, &headers, &created, &attempts); err != nil {
			rows.Close()
			return 0, err
		}
		got++
	}
	if err := rows.Err(); err != nil {
		return 0, err
	}
	took := time.Since(start)
	if got != want {
		return 0, fmt.Errorf("VERIFY FAILED: the claim returned %d rows, want %d", got, want)
	}
	return took, nil
}

// explainClaim prints the plan of the claim on stderr: the custom plan (the
// first executions of a prepared statement) with its actual run, and the
// generic plan PostgreSQL may switch to after five.
func explainClaim(ctx context.Context, db *testdb.DB, name string) error {
	conn, err := db.Conn(ctx)
	if err != nil {
		return err
	}
	defer conn.Close()
	tx, err := conn.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback() }()
	explain := func(title, query string, args ...any) error {
		rows, err := tx.QueryContext(ctx, query, args...)
		if err != nil {
			return fmt.Errorf("explain: %w", err)
		}
		defer rows.Close()
		var lines []string
		for rows.Next() {
			var line string
			if err := rows.Scan(&line); err != nil {
				return err
			}
			lines = append(lines, "#   "+line)
		}
		if err := rows.Err(); err != nil {
			return err
		}
		note("pendingquery: %s table, %s:\n%s", name, title, strings.Join(lines, "\n"))
		return nil
	}
	if err := explain("EXPLAIN (ANALYZE, BUFFERS), custom plan", "EXPLAIN (ANALYZE, BUFFERS) "+pendingClaimSQL,
		outbox.DefaultMaxAttempts, time.Now(), pendingBatch); err != nil {
		return err
	}
	for _, stmt := range []string{
		"PREPARE outbox_bench_claim AS " + pendingClaimSQL,
		"SET LOCAL plan_cache_mode = force_generic_plan",
	} {
		if _, err := tx.ExecContext(ctx, stmt); err != nil {
			return err
		}
	}
	if err := explain("EXPLAIN, generic plan", fmt.Sprintf("EXPLAIN EXECUTE outbox_bench_claim(%d, now(), %d)", outbox.DefaultMaxAttempts, pendingBatch)); err != nil {
		return err
	}
	// A prepared statement outlives the transaction; the pool reuses the
	// connection. (Not DEALLOCATE ALL: that would drop pgx's own.)
	_, err = tx.ExecContext(ctx, "DEALLOCATE outbox_bench_claim")
	return err
}
