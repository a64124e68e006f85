package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// latency: how long a committed message takes to reach a consumer, with a
// relay running as a service runs it.
//
// A Forwarder runs (Run, library defaults unless -batch / -window), a
// consumer reads the bench's queue (amqp091-go, no-ack), and the bench
// commits -rate transactions a second, one message each (NewTxPublisher on
// the transaction, Publish, Commit). A message's latency is from Commit
// returning to the consumer receiving it, both on this process's monotonic
// clock. The publisher keeps to a schedule (message i at start + i/rate),
// so a slow commit does not lower the load the relay sees.
//
//	commit_to_broker_p50/p99_postgres:        LISTEN/NOTIFY wakes the relay (the default)
//	commit_to_broker_p50/p99_postgres_poll:   DisableListen: the relay polls every PollInterval
//	commit_to_broker_p50/p99_<db>_nudge:      mysql, sqlite: Forwarder.Notify() after each
//	                                          commit, from the same process
//	commit_to_broker_p50/p99_<db>_process_<rate>: every database: the relay is
//	                                          `outboxctl relay`, a process of its own, at
//	                                          500 and 2,000 msg/s (latency_process.go);
//	                                          commit_rate_<db>_process_<rate> is the rate the
//	                                          services' commits reached (msg/s)
//	commit_to_broker_p50/p99_broker_only_<rate>: their floor: the bench publishes
//	                                          straight to the broker at the same rate,
//	                                          no database, no relay (latencyRawRun)
//	commit_to_broker_p50/p99_<db>_process_<rate>_floor: the floor of any relay: a
//	                                          relay process that does one statement per
//	                                          batch and nothing else (latency_floor.go),
//	                                          and …_<db>_process_<rate>_vs_floor, the
//	                                          relay's p50 and p99 over the floor's
//	commit_to_broker_p50/p99_<db>_process_500_held: with -held-snapshot N alone,
//	                                          postgres and mysql: the relay process at
//	                                          500 msg/s after N rows were published
//	                                          while a snapshot was held, which it is
//	                                          still (a pg_dump's), beside _process_500
//
// -n is the number of measured messages of the main (postgres LISTEN) run;
// the other runs send half as many. A few warm-up messages precede each run
// (the LISTEN connection, the relay's and the consumer's), discarded.
var (
	latencyRate = flag.Int("rate", 500, "latency: messages committed per second")
	latencyCSV  = flag.String("latency-csv", "", "latency: write every measured message (variant, commit offset, latency) to this CSV file")
	latencyHeld = flag.Int("held-snapshot", 0, "latency: run only the relay process at 500 msg/s on postgres and mysql, beside a snapshot held over N rows published (the _held variants), and without")
)

const (
	latencyDefaultN = 5000 // 10 s at 500/s
	latencyWarmup   = 25
	latencyPayload  = 256
	latencyDrain    = 15 * time.Second // the longest a run waits for its last deliveries
)

type latencyVariant struct {
	kind   string
	suffix string // of the metric names
	listen bool   // false: DisableListen
	nudge  bool   // Notify after each commit
	n      int
	// process: the relay is outboxctl relay in a process of its own, and
	// the run commits rate messages a second; idle: then measure its idle
	// cost.
	process, idle bool
	rate          int
	// noNotify: PostgreSQL's NOTIFY trigger is disabled, so the relay
	// polls adaptively and the services' commits do not notify.
	noNotify bool
	// loud: the relay never keeps PostgreSQL's NOTIFY trigger quiet in a
	// flow (ForwarderConfig.QuietAbove -1): every commit notifies.
	loud bool
	// raw: no database and no relay: the bench publishes to the broker
	// itself, on a confirm channel, at rate (latencyRawRun).
	raw bool
	// held: that many rows are published while a snapshot is held, as a
	// pg_dump holds one, before the run, and it is held to its end
	// (holdSnapshot).
	held int
	// floor: the relay process is the floor relay (latency_floor.go), not
	// outboxctl relay; with noNotify it polls every floorPoll.
	floor bool
}

func runLatency(ctx context.Context, cfg config, out *reporter) error {
	n := cfg.n
	if n == 0 {
		n = latencyDefaultN
	}
	if *latencyRate < 1 {
		return errors.New("-rate must be at least 1")
	}
	var variants []latencyVariant
	if *latencyHeld > 0 {
		for _, kind := range cfg.kinds {
			if kind != testdb.SQLite {
				for _, held := range []int{0, *latencyHeld} {
					v := latencyVariant{kind: kind, suffix: "_process_500", process: true, rate: 500, n: max(n/2, 1), held: held}
					if held > 0 {
						v.suffix += "_held"
					}
					variants = append(variants, v)
				}
			}
		}
		cfg.kinds = nil
	}
	for _, kind := range cfg.kinds {
		switch kind {
		case testdb.Postgres:
			variants = append(variants,
				latencyVariant{kind: kind, listen: true, n: n},
				latencyVariant{kind: kind, suffix: "_poll", n: max(n/2, 1)})
		default:
			variants = append(variants, latencyVariant{kind: kind, suffix: "_nudge", nudge: true, n: max(n/2, 1)})
		}
	}
	// The floor of the process variants: no database and no relay, the
	// bench publishing straight to the broker at the same rates, so that
	// each rate's figures have the broker's own share beside them.
	for _, r := range processRates {
		if *latencyHeld == 0 {
			variants = append(variants, latencyVariant{suffix: fmt.Sprintf("broker_only_%d", r), raw: true, rate: r, n: max(n*r / *latencyRate / 2, 1)})
		}
	}
	for _, kind := range cfg.kinds {
		for i, r := range processRates {
			variants = append(variants, latencyVariant{kind: kind, suffix: fmt.Sprintf("_process_%d", r), process: true,
				idle: i == len(processRates)-1, rate: r, n: max(n*r / *latencyRate / 2, 1)})
		}
		// The least any relay can do at those rates (latency_floor.go).
		for _, r := range processRates {
			variants = append(variants, latencyVariant{kind: kind, suffix: fmt.Sprintf("_process_%d_floor", r), process: true,
				floor: true, rate: r, n: max(n*r / *latencyRate / 2, 1)})
		}
		if kind == testdb.Postgres {
			// What NOTIFY costs the services and buys the relay (see
			// txpublish's concurrent figures), and the floor of any relay
			// there without NOTIFY (latency_floor.go).
			for _, r := range processRates {
				variants = append(variants, latencyVariant{kind: kind, suffix: fmt.Sprintf("_process_%d_floor_poll", r), process: true,
					floor: true, noNotify: true, rate: r, n: max(n*r / *latencyRate / 2, 1)})
				variants = append(variants, latencyVariant{kind: kind, suffix: fmt.Sprintf("_process_%d_no_notify", r), process: true,
					noNotify: true, rate: r, n: max(n*r / *latencyRate / 2, 1)})
				variants = append(variants, latencyVariant{kind: kind, suffix: fmt.Sprintf("_process_%d_loud", r), process: true,
					loud: true, rate: r, n: max(n*r / *latencyRate / 2, 1)})
			}
		}
	}

	q, err := openBenchQueue("latency")
	if err != nil {
		return err
	}
	defer func() {
		if closeErr := q.close(); closeErr != nil {
			note("latency: %v", closeErr)
		}
	}()
	rec := newLatencyRecorder()
	stopConsumer, err := consumeQueue(q, rec)
	if err != nil {
		return err
	}
	defer stopConsumer()

	var csv *os.File
	if *latencyCSV != "" {
		if csv, err = os.Create(*latencyCSV); err != nil {
			return err
		}
		defer csv.Close()
		fmt.Fprintln(csv, "variant,commit_ms,latency_ms")
	}

	payload := benchPayload(latencyPayload)
	p50s, p99s := map[string]time.Duration{}, map[string]time.Duration{}
	note("latency: queue %s, %d msg/s, batch %s, window %s", q.name, *latencyRate, orDefault(*relayBatch), orDefault(*relayWindow))
	for _, v := range variants {
		var lat, at []time.Duration
		name := v.kind + v.suffix
		if v.rate == 0 {
			v.rate = *latencyRate
		}
		err := q.undisturbed("latency "+name, func() (err error) {
			if v.raw {
				lat, at, err = latencyRawRun(ctx, q, rec, v, payload)
			} else if v.process {
				lat, at, err = latencyProcessRun(ctx, cfg, q, rec, v, payload, out)
			} else {
				lat, at, err = latencyRun(ctx, cfg, q, rec, v, payload)
			}
			return err
		})
		if err != nil {
			return fmt.Errorf("latency %s: %w", name, err)
		}
		p50s[name], p99s[name] = quantile(lat, 0.5), quantile(lat, 0.99)
		out.metric("commit_to_broker_p50_"+name, millis(p50s[name]), "ms")
		out.metric("commit_to_broker_p99_"+name, millis(p99s[name]), "ms")
		if base, floor, ok := strings.Cut(name, "_floor"); ok && p50s[base] > 0 && p50s[name] > 0 {
			// The relay's figures over the floor's, taken a few seconds
			// apart: how far the relay is from the least this machine
			// allows at that rate, which the day's load moves less than
			// either.
			out.metric("commit_to_broker_p50_"+base+"_vs_floor"+floor, float64(p50s[base])/float64(p50s[name]), "ratio")
			out.metric("commit_to_broker_p99_"+base+"_vs_floor"+floor, float64(p99s[base])/float64(p99s[name]), "ratio")
		}
		if tx := rec.txQuantile(0.5); v.process && tx > 0 {
			// A ratio, which this machine's load moves less than either
			// figure: the relay claims in statements that wait for the
			// same CPU and disk as the services' own.
			out.metric("commit_to_broker_p50_vs_publish_tx_"+name, float64(quantile(lat, 0.5))/float64(tx), "ratio")
		}
		if csv != nil {
			for i := range lat {
				fmt.Fprintf(csv, "%s,%.3f,%.3f\n", name, millis(at[i]), millis(lat[i]))
			}
		}
		note("latency %s: %d messages; p90 %.1f ms, max %.1f ms", name, len(lat), millis(quantile(lat, 0.9)), millis(quantile(lat, 1)))
	}
	return nil
}

// latencyRun runs one variant on a fresh database and returns the
// latencies of its measured messages.
func latencyRun(ctx context.Context, cfg config, q *benchQueue, rec *latencyRecorder, v latencyVariant, payload []byte) (lat, at []time.Duration, err error) {
	if err := q.purge(); err != nil {
		return nil, nil, err
	}
	err = withDatabase(ctx, v.kind, cfg.dir, func(db *testdb.DB, d outbox.Dialect) (err error) {
		dest, err := outbox.NewAMQPDestination(outbox.AMQPConfig{URLs: []string{*amqpURL}, Window: *relayWindow, ConnectionName: "outbox-bench latency relay"})
		if err != nil {
			return err
		}
		var (
			relayErr relayErrors
		)
		f, err := outbox.NewForwarder(db.DB, dest, outbox.ForwarderConfig{
			Dialect:       d,
			BatchSize:     *relayBatch,
			MaxBatchSize:  *relayMax,
			DisableListen: !v.listen,
			OnError:       relayErr.add,
		})
		if err != nil {
			_ = dest.Close()
			return err
		}
		runCtx, cancel := context.WithCancel(ctx)
		runErr := make(chan error, 1)
		go func() { runErr <- f.Run(runCtx) }()
		defer func() {
			cancel()
			if e := <-runErr; e != nil {
				err = errors.Join(err, fmt.Errorf("Run: %w", e))
			}
			err = errors.Join(err, f.Close())
			err = relayErr.join(err)
		}()
		select {
		case <-f.Running():
		case e := <-runErr:
			runErr <- e
			return fmt.Errorf("Run returned at once: %v", e)
		}

		send := func(count int) ([]string, error) {
			return latencySend(ctx, db, q.name, f, v.nudge, v.rate, count, payload, rec)
		}
		// Warm-up: connections, the LISTEN, the statement caches.
		rec.reset()
		ids, err := send(latencyWarmup)
		if err == nil {
			_, _, err = rec.wait(ctx, ids, latencyDrain, time.Now())
		}
		if err != nil {
			return fmt.Errorf("warm-up: %w", err)
		}

		rec.reset()
		cpu := readCPU()
		start := time.Now()
		ids, err = send(v.n)
		if err != nil {
			return err
		}
		sendTook, busy := time.Since(start), cpu.busySince()
		lat, at, err = rec.wait(ctx, ids, latencyDrain, start)
		if err != nil {
			return err
		}
		note("latency %s%s: %d messages committed in %s (%.0f msg/s, machine CPU %.0f%% busy)", v.kind, v.suffix, len(ids), sendTook.Round(time.Millisecond), rate(len(ids), sendTook), 100*busy)
		return nil
	})
	return lat, at, err
}

// latencyProcessRun runs one process variant: outboxctl relay on a fresh
// database, the messages committed here, the relay's CPU over the run and,
// for v.idle, its idle cost after it.
func latencyProcessRun(ctx context.Context, cfg config, q *benchQueue, rec *latencyRecorder, v latencyVariant, payload []byte, out *reporter) (lat, at []time.Duration, err error) {
	if err := q.purge(); err != nil {
		return nil, nil, err
	}
	err = withDatabase(ctx, v.kind, cfg.dir, func(db *testdb.DB, d outbox.Dialect) (err error) {
		if v.noNotify {
			if _, err := db.ExecContext(ctx, "ALTER TABLE acemq_outbox DISABLE TRIGGER acemq_outbox_notify"); err != nil {
				return err
			}
		}
		if v.held > 0 {
			release, err := holdSnapshot(ctx, db, v.held)
			if err != nil {
				return err
			}
			defer release()
		}
		var extra []string
		if v.loud {
			extra = append(extra, "--quiet-above=-1")
		}
		var profile string
		if *relayCPUProfile != "" {
			profile = filepath.Join(*relayCPUProfile, "relay_"+v.kind+v.suffix+".prof")
			note("latency %s: the relay's CPU profile goes to %s", v.kind+v.suffix, profile)
		}
		var relay *relayProcess
		if v.floor {
			var poll time.Duration
			if v.noNotify || v.kind != testdb.Postgres {
				poll = floorPoll
			}
			relay, err = startFloorRelay(ctx, v.kind, db.DSN, poll)
		} else {
			relay, err = startRelayProcess(ctx, db.DSN, profile, extra...)
		}
		if err != nil {
			return err
		}
		defer func() { err = errors.Join(err, relay.stop()) }()
		send := func(count int) ([]string, error) {
			return latencySend(ctx, db, q.name, nil, false, v.rate, count, payload, rec)
		}
		rec.reset()
		ids, err := send(latencyWarmup)
		if err == nil {
			_, _, err = rec.wait(ctx, ids, latencyDrain, time.Now())
		}
		if err != nil {
			return fmt.Errorf("warm-up: %w", err)
		}

		rec.reset()
		cpu0, st0, err := relay.sample()
		if err != nil {
			return err
		}
		start := time.Now()
		if ids, err = send(v.n); err != nil {
			return err
		}
		sendTook := time.Since(start)
		if lat, at, err = rec.wait(ctx, ids, latencyDrain, start); err != nil {
			return err
		}
		cpu1, st1, err := relay.sample()
		if err != nil {
			return err
		}
		name := v.kind + v.suffix
		out.metric("relay_cpu_"+name, 100*(cpu1-cpu0)/time.Since(start).Seconds(), "%")
		// What the relay asked of the database per message: its claims,
		// probes and marks over the run (the idle polls in it too).
		out.metric("relay_statements_per_msg_"+name, (st1-st0)/float64(len(ids)), "stmt")
		// The services' side: their transactions share the database, and
		// on SQLite its one write lock, with the relay's claims and marks.
		out.metric("publish_tx_p50_"+name, millis(rec.txQuantile(0.5)), "ms")
		out.metric("publish_tx_p99_"+name, millis(rec.txQuantile(0.99)), "ms")
		// The rate the services reached: below the one asked for when
		// their commits cannot keep up (PostgreSQL's NOTIFY serialises
		// them), and the latencies above are then those of that rate.
		reached := rate(len(ids), sendTook)
		out.metric("commit_rate_"+name, reached, "msg/s")
		note("latency %s: %d messages committed in %s (%.0f msg/s)", name, len(ids), sendTook.Round(time.Millisecond), reached)
		if v.idle {
			return measureIdle(ctx, relay, v.kind, out)
		}
		return nil
	})
	return lat, at, err
}

// latencySend commits count transactions on schedule (message i at start +
// i/rate), one message each, and records each commit's time. Several
// senders share the schedule, so that a database whose commit takes longer
// than 1/rate still sees the rate. It returns the ids committed.
func latencySend(ctx context.Context, db *testdb.DB, queue string, f *outbox.Forwarder, nudge bool, rate, count int, payload []byte, rec *latencyRecorder) ([]string, error) {
	interval := time.Second / time.Duration(rate)
	senders := max(1, min(8, rate/250))
	start := time.Now()
	var (
		mu   sync.Mutex
		ids  = make([]string, 0, count)
		errs = make([]error, senders)
		wg   sync.WaitGroup
	)
	for w := 0; w < senders; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := w; i < count; i += senders {
				if wait := time.Until(start.Add(time.Duration(i) * interval)); wait > 0 {
					select {
					case <-ctx.Done():
						errs[w] = ctx.Err()
						return
					case <-time.After(wait):
					}
				}
				began := time.Now()
				id, err := latencyCommit(ctx, db, queue, payload)
				if err != nil {
					errs[w] = err
					return
				}
				now := time.Now()
				rec.committed(id, now)
				rec.took(now.Sub(began))
				if nudge {
					f.Notify()
				}
				mu.Lock()
				ids = append(ids, id)
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	return ids, errors.Join(errs...)
}

// latencyRawRun publishes v.n messages at v.rate to the queue with the raw
// amqp091-go client, persistent and mandatory on a confirm channel as the
// relay publishes them, and returns their latencies from publish to
// delivery: what the broker takes at that rate on this machine, with no
// database and no relay.
func latencyRawRun(ctx context.Context, q *benchQueue, rec *latencyRecorder, v latencyVariant, payload []byte) (lat, at []time.Duration, err error) {
	if err := q.purge(); err != nil {
		return nil, nil, err
	}
	conn, err := q.dial(q.name + " raw publisher")
	if err != nil {
		return nil, nil, err
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return nil, nil, err
	}
	if err := ch.Confirm(false); err != nil {
		return nil, nil, err
	}
	// Confirms are drained as they come, never waited for: the measure is
	// the delivery, and a relay does not wait for one confirm before the
	// next publish either.
	confirms := ch.NotifyPublish(make(chan amqp.Confirmation, 1024))
	go func() {
		for range confirms {
		}
	}()
	send := func(count int) ([]string, error) {
		interval := time.Second / time.Duration(v.rate)
		ids := make([]string, 0, count)
		start := time.Now()
		for i := 0; i < count; i++ {
			if wait := time.Until(start.Add(time.Duration(i) * interval)); wait > 0 {
				select {
				case <-ctx.Done():
					return ids, ctx.Err()
				case <-time.After(wait):
				}
			}
			id := watermill.NewUUID()
			rec.committed(id, time.Now())
			err := ch.PublishWithContext(ctx, "", q.name, true, false, amqp.Publishing{
				Headers:      amqp.Table{outbox.HeaderMessageID: id, outbox.HeaderWatermillUUID: id},
				ContentType:  outbox.DefaultContentType,
				DeliveryMode: amqp.Persistent,
				MessageId:    id,
				Timestamp:    time.Now(),
				Body:         payload,
			})
			if err != nil {
				return ids, fmt.Errorf("raw publish: %w", err)
			}
			ids = append(ids, id)
		}
		return ids, nil
	}
	rec.reset()
	ids, err := send(latencyWarmup)
	if err == nil {
		_, _, err = rec.wait(ctx, ids, latencyDrain, time.Now())
	}
	if err != nil {
		return nil, nil, fmt.Errorf("warm-up: %w", err)
	}
	rec.reset()
	cpu := readCPU()
	start := time.Now()
	if ids, err = send(v.n); err != nil {
		return nil, nil, err
	}
	sendTook, busy := time.Since(start), cpu.busySince()
	if lat, at, err = rec.wait(ctx, ids, latencyDrain, start); err != nil {
		return nil, nil, err
	}
	note("latency %s: %d messages published in %s (%.0f msg/s, machine CPU %.0f%% busy)", v.suffix, len(ids), sendTook.Round(time.Millisecond), rate(len(ids), sendTook), 100*busy)
	return lat, at, nil
}

// latencyCommit commits one transaction that publishes one message.
func latencyCommit(ctx context.Context, db *testdb.DB, queue string, payload []byte) (string, error) {
	id := watermill.NewUUID()
	msg := message.NewMessage(id, payload)
	msg.SetContext(ctx)
	tx, err := db.BeginTxx(ctx, nil)
	if err != nil {
		return "", fmt.Errorf("begin: %w", err)
	}
	pub, err := outbox.NewTxPublisher(tx)
	if err == nil {
		err = pub.Publish(queue, msg)
	}
	if err != nil {
		_ = tx.Rollback()
		return "", fmt.Errorf("publish: %w", err)
	}
	if err := tx.Commit(); err != nil {
		return "", fmt.Errorf("commit: %w", err)
	}
	return id, nil
}

// latencyRecorder pairs each message's commit time with its delivery time.
type latencyRecorder struct {
	mu        sync.Mutex
	commit    map[string]time.Time
	delivered map[string]time.Time
	dups      int
	txs       []time.Duration // each publishing transaction, begin to commit
}

func newLatencyRecorder() *latencyRecorder {
	r := &latencyRecorder{}
	r.reset()
	return r
}

func (r *latencyRecorder) reset() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.commit, r.delivered, r.dups, r.txs = map[string]time.Time{}, map[string]time.Time{}, 0, nil
}

// took records how long a publishing transaction took, begin to commit.
func (r *latencyRecorder) took(d time.Duration) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.txs = append(r.txs, d)
}

// txQuantile is the q-quantile of the publishing transactions since reset.
func (r *latencyRecorder) txQuantile(q float64) time.Duration {
	r.mu.Lock()
	defer r.mu.Unlock()
	return quantile(r.txs, q)
}

func (r *latencyRecorder) committed(id string, at time.Time) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.commit[id] = at
}

func (r *latencyRecorder) received(id string, at time.Time) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if _, ok := r.delivered[id]; ok {
		r.dups++
		return
	}
	r.delivered[id] = at
}

// wait waits until every id was delivered, then returns their latencies and
// their commit times as offsets from start.
func (r *latencyRecorder) wait(ctx context.Context, ids []string, within time.Duration, start time.Time) (lat, at []time.Duration, err error) {
	deadline := time.Now().Add(within)
	for {
		r.mu.Lock()
		missing := 0
		for _, id := range ids {
			if _, ok := r.delivered[id]; !ok {
				missing++
			}
		}
		if missing == 0 {
			lat, at = make([]time.Duration, len(ids)), make([]time.Duration, len(ids))
			for i, id := range ids {
				lat[i] = r.delivered[id].Sub(r.commit[id])
				at[i] = r.commit[id].Sub(start)
			}
			dups := r.dups
			r.mu.Unlock()
			if dups > 0 {
				note("latency: %d messages were delivered twice", dups)
			}
			return lat, at, nil
		}
		r.mu.Unlock()
		if time.Now().After(deadline) {
			return nil, nil, fmt.Errorf("VERIFY FAILED: %d of %d messages not delivered within %s of the last commit", missing, len(ids), within)
		}
		select {
		case <-ctx.Done():
			return nil, nil, ctx.Err()
		case <-time.After(5 * time.Millisecond):
		}
	}
}

// consumeQueue reads the queue on a connection of its own and records each
// delivery's arrival, until stop is called. A consumer closed from outside
// is opened again (the run it disturbed is repeated: see undisturbed).
func consumeQueue(q *benchQueue, rec *latencyRecorder) (stop func(), err error) {
	open := func() (*amqp.Connection, <-chan amqp.Delivery, error) {
		conn, err := q.dial(q.name + " consumer")
		if err != nil {
			return nil, nil, err
		}
		ch, err := conn.Channel()
		if err != nil {
			_ = conn.Close()
			return nil, nil, err
		}
		deliveries, err := ch.Consume(q.name, "", true, false, false, false, nil)
		if err != nil {
			_ = conn.Close()
			return nil, nil, fmt.Errorf("consuming %s: %w", q.name, err)
		}
		return conn, deliveries, nil
	}
	conn, deliveries, err := open()
	if err != nil {
		return nil, err
	}
	var (
		mu      sync.Mutex
		current = conn
		stopped bool
		done    = make(chan struct{})
		wg      sync.WaitGroup
	)
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			for d := range deliveries {
				rec.received(d.MessageId, time.Now())
			}
			select {
			case <-done:
				return
			default:
			}
			for {
				c, ds, err := open()
				if err == nil {
					mu.Lock()
					if stopped {
						mu.Unlock()
						_ = c.Close()
						return
					}
					current, deliveries = c, ds
					mu.Unlock()
					break
				}
				select {
				case <-done:
					return
				case <-time.After(200 * time.Millisecond):
				}
			}
		}
	}()
	return func() {
		close(done)
		mu.Lock()
		stopped = true
		_ = current.Close()
		mu.Unlock()
		wg.Wait()
	}, nil
}

func millis(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// holdSnapshot opens a transaction that holds a snapshot, as a pg_dump or a
// mysqldump --single-transaction does, on a connection of its own, then
// writes n rows an hour old and marks them published, as a relay would
// have: their entries stay in the pending index while the snapshot is
// held. release ends it.
func holdSnapshot(ctx context.Context, db *testdb.DB, n int) (release func(), err error) {
	conn, err := db.DB.Conn(ctx)
	if err != nil {
		return nil, err
	}
	release = func() {
		_, _ = conn.ExecContext(context.WithoutCancel(ctx), "ROLLBACK")
		_ = conn.Close()
	}
	begin := "BEGIN ISOLATION LEVEL REPEATABLE READ"
	if db.Kind == testdb.MySQL {
		begin = "START TRANSACTION WITH CONSISTENT SNAPSHOT"
	}
	var count int
	if _, err = conn.ExecContext(ctx, begin); err == nil {
		err = conn.QueryRowContext(ctx, "SELECT COUNT(*) FROM acemq_outbox").Scan(&count)
	}
	base := time.Now().Add(-time.Hour).UTC()
	for start := 0; err == nil && start < n; start += 1000 {
		var (
			values strings.Builder
			args   []any
		)
		for i := start; i < min(start+1000, n); i++ {
			if i > start {
				values.WriteString(", ")
			}
			values.WriteString("(?, 'x', 'k', 'b', '{}', ?)")
			args = append(args, fmt.Sprintf("held%07d", i), base.Add(time.Duration(i)*time.Millisecond))
		}
		_, err = db.ExecContext(ctx, db.Rebind("INSERT INTO acemq_outbox (id, exchange_name, routing_key, body, headers, created_at) VALUES "+values.String()), args...)
	}
	if err == nil {
		_, err = db.ExecContext(ctx, db.Rebind("UPDATE acemq_outbox SET published_at = ? WHERE published_at IS NULL"), time.Now().UTC())
	}
	if err != nil {
		release()
		return nil, fmt.Errorf("held snapshot: %w", err)
	}
	note("latency: %d rows published beside a held snapshot", n)
	return release, nil
}
