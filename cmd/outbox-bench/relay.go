package main

import (
	"context"
	"encoding/binary"
	"errors"
	"flag"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"
	amqp "github.com/rabbitmq/amqp091-go"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testcluster"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// relay: how fast the Forwarder drains a backlog into RabbitMQ, against what
// the broker takes from a client that does nothing but publish.
//
//	raw_amqp_pipelined:       amqp091-go publishes n persistent messages to a
//	                          durable queue on a confirm channel, keeping
//	                          -inflight unconfirmed: the broker's ceiling. The
//	                          mean of all raw runs.
//	relay_throughput_<db>:    n pending rows committed beforehand; a Forwarder
//	                          (Run, library defaults unless -batch / -window)
//	                          drains them into the same queue. Timed from Run
//	                          to the first Stats with Pending == 0: every row
//	                          published and marked. (Stats is polled only
//	                          once the relays' published counter, read from
//	                          their Metrics, reached n, so the polling does
//	                          not load the database meanwhile.)
//	relay_vs_raw_<db>:        the relay over the mean of the two raw runs on
//	                          either side of it: raw, relay-postgres, raw,
//	                          relay-mysql, raw, … so that drift and noise of
//	                          this machine fall on both.
//	relay_keyed_vs_unkeyed_<db>: the same drain (Run) of n rows spread over
//	                          relayKeys ordering keys, several records per
//	                          key (aggregate_id and seq set by SQL in the
//	                          fill's transaction), over the unkeyed drain
//	                          just before it: what keeping each key in
//	                          sequence order costs (the claim's key-head
//	                          probe, and rows the claim skips while their
//	                          key's previous record is in flight).
//	                          With -relay-pairs N, N pairs of drains,
//	                          keyed first in every other pair, each ratio
//	                          within its pair, and their mean: the drains of
//	                          a pair are seconds apart, and what else runs
//	                          on the machine then weighs on both.
//	relay_behind_stuck_key_vs_keyed_<db>: the keyed drain with
//	                          -stuck-backlog records of one key in front
//	                          of it, the key's head stuck at MaxAttempts,
//	                          over the keyed drain just before: what one
//	                          failed key's backlog costs the other keys
//	                          (each claim used to walk all of it).
//	relay_one_key_vs_raw_sequential_<db>: a drain of -one-key records
//	                          of one key, alone, over the raw client
//	                          publishing as many keyed messages one at a
//	                          time, each once the last one is confirmed:
//	                          a key's records go out in sequence, each
//	                          after its predecessor's confirm, so that is
//	                          their bound. (Each claim used to walk the
//	                          key's whole backlog: the key drained at one
//	                          record per walk.)
//	raw_amqp_keyed_vs_plain:  the raw client with the headers the relay
//	                          adds to a keyed record (aggregateId, seq) over
//	                          the raw client without: the broker's own price
//	                          of a keyed message, which bounds
//	                          relay_keyed_vs_unkeyed from above. One pair of
//	                          raw runs, or -relay-pairs.
//	raw_quorum_vs_classic:    on a three-node cluster of the bench's own
//	                          (scripts/rabbitmq-cluster; -cluster=false skips
//	                          it), the raw client into a quorum queue over the
//	                          raw client into a classic queue, both declared
//	                          through node 1: what replication costs, a
//	                          confirm coming once a majority has the message.
//	relay_vs_raw_quorum:      the relay draining into that quorum queue (the
//	                          first -db), twice, over the raw client doing
//	                          the same three times, before, between, after.
//	raw_quorum_beside_relay_db_vs_alone: the raw client into the quorum queue
//	                          while a relay does the database work of a drain
//	                          at the rate the relay just reached (claims and
//	                          marks, a destination that publishes nothing),
//	                          over the raw client alone: what that work takes
//	                          from brokers sharing the machine with it.
//	relay_vs_raw_quorum_beside_relay_db: the relay over that raw client: the
//	                          relay's own share, the machine's set aside.
//	relay_traced_vs_untraced_<db>: the drain (Run) of n records each
//	                          carrying a sampled trace context, the relay
//	                          given a TracerProvider (the SDK's, exporting
//	                          in batches to nothing), over the plain drain
//	                          just before it: the price of the relay's
//	                          spans (-relay-traced=false skips it).
//	relay_publish_share_<db>: the fraction of the drain spent inside the
//	                          destination's Publish (publishes + waiting for
//	                          confirms); the rest is the database's (claim,
//	                          decode, mark, commit), which the relay does in
//	                          series with the broker's.
//
// Then (-relay-extras) figures that say where the relay's time goes:
//
//	raw_amqp_batched_<b>:        the raw client publishing in batches of the
//	                             relay's BatchSize, waiting for each batch's
//	                             confirms before the next, as the relay does,
//	                             but with no database.
//	relay_throughput_sweep_<db>: the same drain by calling Sweep in a loop.
//	relay_db_only_<db>:          the same drain (Run) with a destination that
//	                             confirms every record at once: the claim +
//	                             mark ceiling of the database alone.
//
// On a small machine the databases, the relay and the broker share the
// cores, and the broker's queue is a one-core process: whatever runs on its
// core slows it, and relay_vs_raw then measures that contention as much as
// the relay. broker-own-core.sh runs a scenario with RabbitMQ on a CPU of
// its own and the rest on the others, as on separate hosts; the raw runs
// are pinned the same, so each ratio still compares like with like.
//
// -relays runs that many Forwarders on the same table at once. Every drain
// ends by checking that the queue holds exactly n messages. Other processes
// that close every RabbitMQ connection (the library's tests do) disturb a
// run; such a run is repeated.
var (
	rawInflight      = flag.Int("inflight", 1000, "relay: unconfirmed publishes the raw amqp091-go client keeps in flight")
	relayCount       = flag.Int("relays", 1, "relay: Forwarders draining the same table at once (claims are exclusive)")
	relayExtras      = flag.Bool("relay-extras", true, "relay: also measure the Sweep loop and the database-only drain per database")
	relayCluster     = flag.Bool("cluster", true, "relay: also start a three-node RabbitMQ cluster (scripts/rabbitmq-cluster) and measure a quorum queue on it")
	relayStuckN      = flag.Int("stuck-backlog", 5000, "relay: records of one stuck key in front of a keyed drain (relay_behind_stuck_key_vs_keyed); 0 skips it")
	relayOneKey      = flag.Int("one-key", 2000, "relay: records of one key drained alone (relay_one_key_vs_raw_sequential); 0 skips it")
	relayTracedDrain = flag.Bool("relay-traced", true, "relay: also drain with every record traced and the relay's spans on (an SDK that samples all, exporting to nothing): relay_traced_vs_untraced")
	relayPairs       = flag.Int("relay-pairs", 1, "relay: keyed and unkeyed drains per database, in pairs of alternating order; the keyed ratio is the mean of the pairs'")
)

const (
	relayDefaultN    = 20000
	relayPayloadSize = 256
	relayFillPerTx   = 5000             // messages per fill transaction; Publish chunks them
	relayPollEvery   = time.Millisecond // Stats, once every record is confirmed or marked
	relayDrainLimit  = 5 * time.Minute
	relayKeys        = 1000 // ordering keys of the keyed drain
)

type relayMode int

const (
	relayRun    relayMode = iota // f.Run in a goroutine, Stats polled
	relaySweep                   // f.Sweep in a loop
	relayDBOnly                  // f.Run with a destination that confirms at once
	relayTraced                  // relayRun, every record traced and the relay making its spans
)

func (m relayMode) String() string {
	return [...]string{"run", "sweep", "db-only", "traced"}[m]
}

// runs reports whether the mode drains with Run into the broker.
func (m relayMode) runs() bool { return m == relayRun || m == relayTraced }

// relayResult is one drain.
type relayResult struct {
	took    time.Duration
	batches int           // calls of the destination's Publish
	publish time.Duration // time inside Publish, per relay
	first   time.Duration // from the start to the first Publish: the first claim
}

func runRelay(ctx context.Context, cfg config, out *reporter) error {
	n := cfg.n
	if n == 0 {
		n = relayDefaultN
	}
	if *rawInflight < 1 {
		return errors.New("-inflight must be at least 1")
	}
	if *relayCount < 1 {
		return errors.New("-relays must be at least 1")
	}
	if *relayPairs < 1 {
		return errors.New("-relay-pairs must be at least 1")
	}
	q, err := openBenchQueue("relay")
	if err != nil {
		return err
	}
	defer func() {
		if closeErr := q.close(); closeErr != nil {
			note("relay: %v", closeErr)
		}
	}()
	payload := benchPayload(relayPayloadSize)
	note("relay: queue %s, %d messages of %d bytes per run; batch %s, max batch %s, window %s, raw in flight %d",
		q.name, n, len(payload), orDefault(*relayBatch), orDefault(*relayMax), orDefault(*relayWindow), *rawInflight)

	rawRun := func(keyed bool) (float64, error) {
		name := "raw_amqp_pipelined"
		if keyed {
			name += " (keyed headers)"
		}
		return rawDrain(ctx, q, n, payload, keyed, name)
	}
	var raws []float64
	raw := func() (float64, error) {
		r, err := rawRun(false)
		raws = append(raws, r)
		return r, err
	}
	drain := func(kind string, mode relayMode) (res relayResult, err error) {
		err = q.undisturbed(fmt.Sprintf("relay %s (%s)", kind, mode), func() error {
			res, err = relayDrain(ctx, cfg, kind, q, n, payload, mode, 0, 0)
			return err
		})
		return res, err
	}

	// Warm-up: the broker's queue process, its message store and this
	// client's connection, discarded.
	if err := rawWarmUp(ctx, q, n, payload); err != nil {
		return err
	}

	before, err := raw()
	if err != nil {
		return err
	}
	keyedDrain := func(kind string) (res relayResult, err error) {
		err = q.undisturbed(fmt.Sprintf("relay %s (keyed)", kind), func() error {
			res, err = relayDrain(ctx, cfg, kind, q, n, payload, relayRun, relayKeys, 0)
			return err
		})
		return res, err
	}
	for _, kind := range cfg.kinds {
		res, err := drain(kind, relayRun)
		if err != nil {
			return err
		}
		after, err := raw()
		if err != nil {
			return err
		}
		r := rate(n, res.took)
		out.metric("relay_throughput_"+kind, r, "msg/s")
		out.metric("relay_vs_raw_"+kind, r/mean(before, after), "ratio")
		if res.batches > 0 { // Run's destination is not wrapped, so not timed
			out.metric("relay_publish_share_"+kind, float64(res.publish)/float64(res.took), "ratio")
			perRelay := float64(*relayCount) / float64(res.batches)
			note("relay %s: %d batches, %.0f us per batch of which %.0f us in Publish; first claim %s",
				kind, res.batches, micros(res.took)*perRelay, micros(res.publish)*perRelay, res.first.Round(time.Microsecond))
		}
		if *relayTracedDrain {
			// Right after the plain drain: the spans' price, sampled and
			// exported in batches (to nothing).
			traced, err := drain(kind, relayTraced)
			if err != nil {
				return err
			}
			out.metric("relay_traced_vs_untraced_"+kind, rate(n, traced.took)/r, "ratio")
		}
		keyed, err := keyedDrain(kind)
		if err != nil {
			return err
		}
		ratios := []float64{rate(n, keyed.took) / r}
		keyedRates := []float64{rate(n, keyed.took)}
		for i := 1; i < *relayPairs; i++ {
			// Keyed first in every other pair, so that neither drain is
			// always the one that runs after the other.
			var u, k relayResult
			if i%2 == 1 {
				if k, err = keyedDrain(kind); err == nil {
					u, err = drain(kind, relayRun)
				}
			} else if u, err = drain(kind, relayRun); err == nil {
				k, err = keyedDrain(kind)
			}
			if err != nil {
				return err
			}
			ratios = append(ratios, float64(u.took)/float64(k.took))
			keyedRates = append(keyedRates, rate(n, k.took))
		}
		if len(ratios) > 1 {
			note("relay %s: keyed over unkeyed per pair %.3f", kind, ratios)
		}
		out.metric("relay_keyed_throughput_"+kind, mean(keyedRates...), "msg/s")
		out.metric("relay_keyed_vs_unkeyed_"+kind, mean(ratios...), "ratio")
		if *relayStuckN > 0 {
			// The keyed drain again, a stuck key's backlog in front of it,
			// over the keyed drain just before: what one failed key costs
			// the others.
			var behind relayResult
			err := q.undisturbed(fmt.Sprintf("relay %s (keyed, behind a stuck key)", kind), func() error {
				behind, err = relayDrain(ctx, cfg, kind, q, n, payload, relayRun, relayKeys, *relayStuckN)
				return err
			})
			if err != nil {
				return err
			}
			out.metric("relay_behind_stuck_key_vs_keyed_"+kind, rate(n, behind.took)/keyedRates[len(keyedRates)-1], "ratio")
		}
		if *relayOneKey > 0 {
			// One key's records alone: each goes out once the one before
			// is confirmed, so the raw client publishing them one at a
			// time, each after the last one's confirm, is the bound.
			var one relayResult
			err := q.undisturbed(fmt.Sprintf("relay %s (one key)", kind), func() error {
				one, err = relayDrain(ctx, cfg, kind, q, *relayOneKey, payload, relayRun, 1, 0)
				return err
			})
			if err != nil {
				return err
			}
			ids := make([]string, *relayOneKey)
			for i := range ids {
				ids[i] = watermill.NewUUID()
			}
			var sequential float64
			err = q.undisturbed("relay: raw one at a time", func() error {
				if err := q.purge(); err != nil {
					return err
				}
				took, err := rawPublish(ctx, q, ids, payload, 1, 1, true)
				if err != nil {
					return err
				}
				sequential = rate(len(ids), took)
				return q.purge()
			})
			if err != nil {
				return err
			}
			out.metric("relay_one_key_throughput_"+kind, rate(*relayOneKey, one.took), "msg/s")
			out.metric("relay_one_key_vs_raw_sequential_"+kind, rate(*relayOneKey, one.took)/sequential, "ratio")
		}
		before = after
	}
	out.metric("raw_amqp_pipelined", mean(raws...), "msg/s")
	note("relay: raw runs %v msg/s; each ratio is over the mean of the raw runs on either side", roundAll(raws))

	// What the broker itself charges for a keyed message, its two more
	// headers, with no relay and no database: the ceiling of
	// relay_keyed_vs_unkeyed. As many pairs as -relay-pairs, keyed first in
	// every other one.
	var headerRatios []float64
	for i := 0; i < *relayPairs; i++ {
		var plain, keyed float64
		if i%2 == 1 {
			if keyed, err = rawRun(true); err == nil {
				plain, err = rawRun(false)
			}
		} else if plain, err = rawRun(false); err == nil {
			keyed, err = rawRun(true)
		}
		if err != nil {
			return err
		}
		headerRatios = append(headerRatios, keyed/plain)
	}
	out.metric("raw_amqp_keyed_vs_plain", mean(headerRatios...), "ratio")

	if *relayCluster {
		if err := relayOnCluster(ctx, cfg, n, payload, out); err != nil {
			return err
		}
	}

	if !*relayExtras {
		return nil
	}
	// The relay's publish pattern without the relay: batches of BatchSize,
	// each waiting for its confirms before the next is sent.
	batch := *relayBatch
	if batch == 0 {
		batch = 100 // ForwarderConfig's default
	}
	if *relayWindow > 0 && *relayWindow < batch {
		batch = *relayWindow
	}
	ids := make([]string, n)
	for i := range ids {
		ids[i] = watermill.NewUUID()
	}
	var batched float64
	err = q.undisturbed("relay: raw batched", func() error {
		if err := q.purge(); err != nil {
			return err
		}
		took, err := rawPublish(ctx, q, ids, payload, *rawInflight, batch, false)
		if err != nil {
			return err
		}
		if got, err := q.waitCount(ctx, n, 5*time.Second); err != nil || got != n {
			return fmt.Errorf("VERIFY FAILED: raw batched: queue holds %d messages, want %d (%v)", got, n, err)
		}
		batched = rate(n, took)
		return q.purge()
	})
	if err != nil {
		return err
	}
	out.metric(fmt.Sprintf("raw_amqp_batched_%d", batch), batched, "msg/s")
	out.metric(fmt.Sprintf("raw_amqp_batched_%d_vs_raw", batch), batched/mean(raws...), "ratio")
	for _, kind := range cfg.kinds {
		for _, mode := range []relayMode{relaySweep, relayDBOnly} {
			res, err := drain(kind, mode)
			if err != nil {
				return err
			}
			name := "relay_throughput_sweep_" + kind
			if mode == relayDBOnly {
				name = "relay_db_only_" + kind
			}
			out.metric(name, rate(n, res.took), "msg/s")
		}
	}
	return nil
}

// relayDrain fills a fresh database with n pending rows, then times
// -relays Forwarders draining them in the given mode, and checks the queue.
// The rows are spread over keys ordering keys (0: unkeyed); with stuck > 0,
// a key's stuck records are in front of them (relayStuck).
func relayDrain(ctx context.Context, cfg config, kind string, q *benchQueue, n int, payload []byte, mode relayMode, keys, stuck int) (res relayResult, err error) {
	if err := q.purge(); err != nil {
		return res, err
	}
	err = withDatabase(ctx, kind, cfg.dir, func(db *testdb.DB, d outbox.Dialect) (err error) {
		fillStart := time.Now()
		if err := relayFill(ctx, db, q.name, n, payload, keys, mode == relayTraced); err != nil {
			return err
		}
		if err := relayStuck(ctx, db, q.name, stuck); err != nil {
			return err
		}
		// The stuck key's records: its head at MaxAttempts, the others
		// pending behind it, never published.
		left := int64(max(stuck-1, 0))
		fillTook := time.Since(fillStart)

		marked, err := newMarkedCounter()
		if err != nil {
			return err
		}
		watchCtx, stopWatch := context.WithCancel(ctx)
		defer stopWatch()
		var (
			sent     = newSentCounter(n)
			relayErr relayErrors
			fs       []*outbox.Forwarder
			timed    []*timedDest
		)
		defer func() {
			for _, f := range fs {
				if closeErr := f.Close(); closeErr != nil {
					err = errors.Join(err, closeErr)
				}
			}
		}()
		var runMetrics *outbox.Metrics // the other modes end otherwise, and pay nothing for it
		if mode.runs() {
			runMetrics = marked.metrics
		}
		var tracer trace.TracerProvider
		if mode == relayTraced {
			// An SDK that samples every span (the records' trace contexts
			// are sampled) and exports them to nothing, in batches, as a
			// service's would to a collector.
			tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(tracetest.NewNoopExporter()))
			defer func() { _ = tp.Shutdown(context.WithoutCancel(ctx)) }()
			tracer = tp
		}
		for range *relayCount {
			t := &timedDest{inner: instantDest{}, sent: sent}
			if mode != relayDBOnly {
				amqpDest, err := outbox.NewAMQPDestination(outbox.AMQPConfig{URLs: []string{q.brokerURL()}, Window: *relayWindow, ConnectionName: "outbox-bench relay"})
				if err != nil {
					return err
				}
				t.inner = amqpDest
			}
			// Run gets the AMQP destination itself: a wrapper would hide
			// the pipelining that lets Run overlap the broker's work on one
			// batch with the database's on the next. Its batches are then
			// not timed.
			var dest outbox.Destination = t
			if mode.runs() {
				dest = t.inner
			}
			f, err := outbox.NewForwarder(db.DB, dest, outbox.ForwarderConfig{
				Dialect:      d,
				BatchSize:    *relayBatch,
				MaxBatchSize: *relayMax,
				// Run's drain is seen to end by its published counter, not
				// by querying the database it measures (one Stats for the
				// gauges as Run starts, none after).
				Metrics:        runMetrics,
				StatsInterval:  time.Hour,
				OnError:        relayErr.add,
				TracerProvider: tracer,
			})
			if err != nil {
				_ = t.Close()
				return err
			}
			fs, timed = append(fs, f), append(timed, t)
			// Connected before the clock starts: a relay at work has its
			// connection open, and so has the raw client.
			if err := t.Connect(ctx); err != nil {
				return err
			}
		}
		st, err := fs[0].Store().Stats(ctx)
		if err != nil {
			return err
		}
		if st.Pending != int64(n)+left {
			return fmt.Errorf("VERIFY FAILED: %d rows pending after the fill, want %d", st.Pending, int64(n)+left)
		}
		note("relay %s (%s): %d rows committed in %s; draining", kind, mode, n, fillTook.Round(time.Millisecond))

		cpu := readCPU()
		start := time.Now()
		for _, t := range timed {
			t.start = start
		}
		switch mode {
		case relaySweep:
			err = drainBySweep(ctx, fs)
		case relayRun, relayTraced:
			err = drainByRun(ctx, fs, marked.reached(watchCtx, n), left)
		default:
			err = drainByRun(ctx, fs, sent.all, left)
		}
		res.took = time.Since(start)
		busy := cpu.busySince()
		for i, t := range timed {
			res.batches += t.batches
			res.publish += t.publish
			if i == 0 || t.first < res.first {
				res.first = t.first
			}
		}
		res.publish /= time.Duration(len(timed))
		err = relayErr.join(err)
		if err != nil {
			return err
		}
		note("relay %s (%s): drained in %s: %.0f msg/s (machine CPU %.0f%% busy)", kind, mode, res.took.Round(time.Millisecond), rate(n, res.took), 100*busy)

		st, err = fs[0].Store().Stats(ctx)
		if err != nil {
			return err
		}
		if wantStuck := int64(min(stuck, 1)); st.Pending != left || st.Stuck != wantStuck {
			return fmt.Errorf("VERIFY FAILED: %d rows pending and %d stuck after the drain, want %d and %d", st.Pending, st.Stuck, left, wantStuck)
		}
		if mode != relayDBOnly {
			if got, err := q.waitCount(ctx, n, 5*time.Second); err != nil || got != n {
				return fmt.Errorf("VERIFY FAILED: the queue holds %d messages after the drain, want %d (%v)", got, n, err)
			}
		}
		return nil
	})
	if err != nil {
		return res, fmt.Errorf("relay (%s): %w", mode, err)
	}
	return res, q.purge()
}

// relayFill commits n pending rows routed to queue, relayFillPerTx per
// transaction, all of one transaction in one Publish call. With keys > 0,
// the i-th row gets key i % keys and the next sequence number of its key,
// set by SQL in the same transaction: the keys interleave in created_at
// order, as the events of many aggregates do.
func relayFill(ctx context.Context, db *testdb.DB, queue string, n int, payload []byte, keys int, traced bool) error {
	setKey := db.Rebind("UPDATE acemq_outbox SET aggregate_id = ?, seq = ? WHERE id = ?")
	for done := 0; done < n; {
		m := min(relayFillPerTx, n-done)
		msgs := make([]*message.Message, m)
		for i := range msgs {
			msgs[i] = message.NewMessage(watermill.NewUUID(), payload)
		}
		msgs[0].SetContext(ctx)
		var pubCfg outbox.TxPublisherConfig
		if traced {
			// Each message of a request of its own: a sampled trace each.
			for _, msg := range msgs {
				msg.SetContext(trace.ContextWithSpanContext(ctx, sampledSpanContext()))
			}
			pubCfg.Propagator = propagation.TraceContext{}
		}
		tx, err := db.BeginTxx(ctx, nil)
		if err != nil {
			return fmt.Errorf("fill: begin: %w", err)
		}
		pub, err := outbox.NewTxPublisher(tx, pubCfg)
		if err == nil {
			err = pub.Publish(queue, msgs...)
		}
		for i := 0; keys > 0 && err == nil && i < m; i++ {
			g := done + i
			_, err = tx.ExecContext(ctx, setKey, fmt.Sprintf("aggregate-%04d", g%keys), g/keys+1, msgs[i].UUID)
		}
		if err != nil {
			_ = tx.Rollback()
			return fmt.Errorf("fill: %w", err)
		}
		if err := tx.Commit(); err != nil {
			return fmt.Errorf("fill: commit: %w", err)
		}
		done += m
	}
	return nil
}

// sampledSpanContext is a span context of a trace of its own, sampled, as
// a request's span that published a message.
func sampledSpanContext() trace.SpanContext {
	var tid trace.TraceID
	var sid trace.SpanID
	binary.BigEndian.PutUint64(tid[:8], rand.Uint64())
	binary.BigEndian.PutUint64(tid[8:], rand.Uint64()|1)
	binary.BigEndian.PutUint64(sid[:], rand.Uint64()|1)
	return trace.NewSpanContext(trace.SpanContextConfig{TraceID: tid, SpanID: sid, TraceFlags: trace.FlagsSampled})
}

// relayStuck commits n records of one key routed to queue, created an
// hour before the fill's: its head at MaxAttempts (10, the default), the
// others pending behind it, the first of the pending index. Records of
// other keys and unkeyed ones must pass them by.
func relayStuck(ctx context.Context, db *testdb.DB, queue string, n int) error {
	if n == 0 {
		return nil
	}
	tx, err := db.BeginTxx(ctx, nil)
	if err != nil {
		return fmt.Errorf("stuck: begin: %w", err)
	}
	defer func() { _ = tx.Rollback() }()
	insert := db.Rebind("INSERT INTO acemq_outbox (id, exchange_name, routing_key, body, created_at, aggregate_id, seq, attempts) VALUES (?, '', ?, 'stuck', ?, 'stuck-key', ?, ?)")
	base := time.Now().Add(-time.Hour).UTC()
	for i := 1; i <= n; i++ {
		var at any = base.Add(time.Duration(i) * time.Microsecond)
		if db.Kind != testdb.Postgres {
			at = at.(time.Time).Format("2006-01-02 15:04:05.000000")
		}
		attempts := 0
		if i == 1 {
			attempts = 10
		}
		if _, err := tx.ExecContext(ctx, insert, fmt.Sprintf("stuck-%06d", i), queue, at, i, attempts); err != nil {
			return fmt.Errorf("stuck: %w", err)
		}
	}
	return tx.Commit()
}

// drainByRun runs the relays as a service does until every record is
// confirmed or marked (sent), then polls Stats until no more than left are
// pending: the last batch is then published and marked.
func drainByRun(ctx context.Context, fs []*outbox.Forwarder, sent <-chan struct{}, left int64) error {
	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	runErr := make(chan error, len(fs))
	for _, f := range fs {
		go func() { runErr <- f.Run(runCtx) }()
	}
	defer func() {
		cancel()
		for range fs {
			<-runErr
		}
	}()
	deadline := time.Now().Add(relayDrainLimit)
	limit := time.NewTimer(relayDrainLimit)
	defer limit.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case err := <-runErr:
		runErr <- err // for the deferred wait
		return fmt.Errorf("Run returned early: %v", err)
	case <-limit.C:
	case <-sent:
	}
	tick := time.NewTicker(relayPollEvery)
	defer tick.Stop()
	for {
		st, err := fs[0].Store().Stats(ctx)
		if err != nil {
			return err
		}
		if st.Pending <= left {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("still %d rows pending after %s", st.Pending, relayDrainLimit)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case err := <-runErr:
			runErr <- err
			return fmt.Errorf("Run returned early: %v", err)
		case <-tick.C:
		}
	}
}

// drainBySweep calls Sweep on each relay, each in a goroutine of its own,
// until a sweep finds nothing.
func drainBySweep(ctx context.Context, fs []*outbox.Forwarder) error {
	deadline := time.Now().Add(relayDrainLimit)
	errs := make(chan error, len(fs))
	for _, f := range fs {
		go func() {
			for {
				n, err := f.Sweep(ctx)
				if err != nil || n == 0 {
					errs <- err
					return
				}
				if time.Now().After(deadline) {
					errs <- fmt.Errorf("still sweeping after %s", relayDrainLimit)
					return
				}
			}
		}()
	}
	var all []error
	for range fs {
		all = append(all, <-errs)
	}
	return errors.Join(all...)
}

// timedDest wraps the relay's destination and times its Publish calls: the
// broker's share of a sweep. The rest of a sweep is the database's.
type timedDest struct {
	inner   outbox.Destination
	start   time.Time
	batches int
	publish time.Duration
	first   time.Duration
	calls   atomic.Int32 // Publish is never called concurrently; this checks it
	sent    *sentCounter
}

// sentCounter counts the records the destinations of a drain confirmed, and
// says when all are: then only the last marks are left, and the drain polls
// Stats for them. Polling Stats through the whole drain would load the
// database the relay is working on.
type sentCounter struct {
	n    atomic.Int64
	want int64
	once sync.Once
	all  chan struct{}
}

func newSentCounter(want int) *sentCounter {
	return &sentCounter{want: int64(want), all: make(chan struct{})}
}

func (c *sentCounter) add(results []error) {
	ok := 0
	for _, err := range results {
		if err == nil {
			ok++
		}
	}
	if c.n.Add(int64(ok)) >= c.want {
		c.once.Do(func() { close(c.all) })
	}
}

func (t *timedDest) Publish(ctx context.Context, records []outbox.Record) []error {
	if t.calls.Add(1) != 1 {
		panic("outbox-bench: the Forwarder called Publish concurrently")
	}
	defer t.calls.Add(-1)
	begin := time.Now()
	if t.batches == 0 && !t.start.IsZero() {
		t.first = begin.Sub(t.start)
	}
	res := t.inner.Publish(ctx, records)
	t.publish += time.Since(begin)
	t.batches++
	if t.sent != nil {
		t.sent.add(res)
	}
	return res
}

func (t *timedDest) Connect(ctx context.Context) error {
	if c, ok := t.inner.(outbox.Connector); ok {
		return c.Connect(ctx)
	}
	return nil
}

func (t *timedDest) Close() error {
	if c, ok := t.inner.(interface{ Close() error }); ok {
		return c.Close()
	}
	return nil
}

// instantDest confirms every record at once: what is left of a sweep is the
// database's work.
type instantDest struct{}

func (instantDest) Publish(_ context.Context, records []outbox.Record) []error {
	return make([]error, len(records))
}

func orDefault(v int) string {
	if v == 0 {
		return "default"
	}
	return fmt.Sprint(v)
}

func roundAll(xs []float64) []float64 {
	out := make([]float64, len(xs))
	for i, x := range xs {
		out[i] = float64(int64(x + 0.5))
	}
	return out
}

// relayErrors keeps the first errors a bench's relays report through
// OnError: a measured run must have none.
type relayErrors struct {
	mu   sync.Mutex
	errs []error
}

func (r *relayErrors) add(err error, _ outbox.ErrorContext) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if len(r.errs) < 10 {
		r.errs = append(r.errs, err)
	}
}

// join adds what the relays reported, if anything, to err.
func (r *relayErrors) join(err error) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if len(r.errs) == 0 {
		return err
	}
	return errors.Join(append([]error{err, fmt.Errorf("the relay reported %d+ errors", len(r.errs))}, r.errs...)...)
}

// markedCounter reads the relays' published counter from their metrics: a
// Run drain, whose destination is not wrapped, is seen to end without a
// query every few milliseconds on the database being measured (that query
// took a core of PostgreSQL's time from the broker's two).
type markedCounter struct {
	reg     *prometheus.Registry
	metrics *outbox.Metrics
}

func newMarkedCounter() (*markedCounter, error) {
	reg := prometheus.NewRegistry()
	m, err := outbox.NewMetrics(reg)
	if err != nil {
		return nil, err
	}
	return &markedCounter{reg: reg, metrics: m}, nil
}

// reached is closed once the relays have marked n records published.
func (c *markedCounter) reached(ctx context.Context, n int) <-chan struct{} {
	done := make(chan struct{})
	go func() {
		// Gathering the registry costs ~0.1 ms of CPU: every 10 ms it takes
		// 1% of a core from the drain and adds at most 10 ms to it.
		tick := time.NewTicker(10 * time.Millisecond)
		defer tick.Stop()
		for c.total() < float64(n) {
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			}
		}
		close(done)
	}()
	return done
}

func (c *markedCounter) total() float64 {
	families, err := c.reg.Gather()
	if err != nil {
		return 0
	}
	var sum float64
	for _, f := range families {
		if f.GetName() == "outbox_forwarder_published_total" {
			for _, m := range f.GetMetric() {
				sum += m.GetCounter().GetValue()
			}
		}
	}
	return sum
}

// relayOnCluster measures raw_quorum_vs_classic and relay_vs_raw_quorum on a
// three-node cluster it starts and stops. A machine that cannot start one
// gets a note and no figures: the rest of the scenario stands.
func relayOnCluster(ctx context.Context, cfg config, n int, payload []byte, out *reporter) error {
	started := time.Now()
	cl, err := testcluster.StartCluster(ctx)
	if err != nil {
		note("relay: no three-node cluster, so no quorum figures: %v", err)
		return nil
	}
	defer func() {
		if err := cl.Stop(); err != nil {
			note("relay: stopping the cluster: %v", err)
		}
	}()
	note("relay: three-node cluster up in %s", time.Since(started).Round(100*time.Millisecond))
	classic, err := openBenchQueueAt("relay-classic", cl.URL(0), nil)
	if err != nil {
		return err
	}
	defer func() { _ = classic.close() }()
	quorum, err := openBenchQueueAt("relay-quorum", cl.URL(0), amqp.Table{"x-queue-type": "quorum"})
	if err != nil {
		return err
	}
	defer func() { _ = quorum.close() }()

	// Warm-up of both queues, discarded.
	for _, q := range []*benchQueue{classic, quorum} {
		if err := rawWarmUp(ctx, q, n, payload); err != nil {
			return err
		}
	}
	// classic, quorum, relay, beside, quorum, relay, beside, quorum,
	// classic: each ratio over runs on either side of what it compares, the
	// cluster's queues being noisier than the single node's.
	var (
		classics, quorums []float64
		relayRates        []float64
		besides           []float64
	)
	for _, step := range []string{"classic", "quorum", "relay", "beside", "quorum", "relay", "beside", "quorum", "classic"} {
		switch step {
		case "beside":
			// The raw client again, while the relay's database work for
			// the rate it just reached runs beside it, against no broker.
			r, err := rawBesideRelayDB(ctx, cfg, quorum, n, payload, relayRates[len(relayRates)-1])
			if err != nil {
				return err
			}
			besides = append(besides, r)
		case "classic":
			r, err := rawDrain(ctx, classic, n, payload, false, "raw classic (cluster)")
			if err != nil {
				return err
			}
			classics = append(classics, r)
		case "quorum":
			r, err := rawDrain(ctx, quorum, n, payload, false, "raw quorum (cluster)")
			if err != nil {
				return err
			}
			quorums = append(quorums, r)
		case "relay":
			kind := cfg.kinds[0]
			var res relayResult
			err := quorum.undisturbed("relay "+kind+" (quorum)", func() (err error) {
				res, err = relayDrain(ctx, cfg, kind, quorum, n, payload, relayRun, 0, 0)
				return err
			})
			if err != nil {
				return err
			}
			r := rate(n, res.took)
			note("relay: %s into the quorum queue %.0f msg/s", kind, r)
			out.metric("relay_quorum_throughput_"+kind, r, "msg/s")
			relayRates = append(relayRates, r)
		}
	}
	out.metric("raw_quorum_throughput", mean(quorums...), "msg/s")
	out.metric("raw_quorum_vs_classic", mean(quorums...)/mean(classics...), "ratio")
	out.metric("relay_vs_raw_quorum", mean(relayRates...)/mean(quorums...), "ratio")
	out.metric("raw_quorum_beside_relay_db_vs_alone", mean(besides...)/mean(quorums...), "ratio")
	out.metric("relay_vs_raw_quorum_beside_relay_db", mean(relayRates...)/mean(besides...), "ratio")
	return nil
}

// rawBesideRelayDB measures the raw client draining n messages into q while
// a relay does the database work of a drain at rate msg/s beside it: claims
// and marks on a table of its own, its destination (pacedDest) confirming
// at the rate the relay reached into the queue before. On a machine where
// the database and the broker share the cores and the disk, that work
// slows the broker whoever publishes; the raw client so measured is what
// the broker gives a relay that costs nothing of its own.
func rawBesideRelayDB(ctx context.Context, cfg config, q *benchQueue, n int, payload []byte, rate float64) (float64, error) {
	var r float64
	err := withDatabase(ctx, cfg.kinds[0], cfg.dir, func(db *testdb.DB, d outbox.Dialect) error {
		// Twice the rows: the relay does not run dry before the raw
		// client is done, though the broker be faster for it.
		if err := relayFill(ctx, db, q.name, 2*n, payload, 0, false); err != nil {
			return err
		}
		f, err := outbox.NewForwarder(db.DB, &pacedDest{rate: rate}, outbox.ForwarderConfig{Dialect: d, BatchSize: *relayBatch, MaxBatchSize: *relayMax, StatsInterval: time.Hour})
		if err != nil {
			return err
		}
		defer func() { _ = f.Close() }()
		runCtx, stop := context.WithCancel(ctx)
		ran := make(chan error, 1)
		go func() { ran <- f.Run(runCtx) }()
		r, err = rawDrain(ctx, q, n, payload, false, "raw quorum (cluster) beside the relay's database work")
		stop()
		return errors.Join(err, <-ran)
	})
	return r, err
}

// pacedDest confirms records at rate msg/s, on a schedule from its first
// batch (the database's time between batches counts toward it), and
// publishes nothing. Run calls Publish from one goroutine.
type pacedDest struct {
	rate  float64
	start time.Time
	done  int
}

func (p *pacedDest) Publish(ctx context.Context, records []outbox.Record) []error {
	if p.start.IsZero() {
		p.start = time.Now()
	}
	p.done += len(records)
	t := time.NewTimer(time.Until(p.start.Add(time.Duration(float64(p.done) / p.rate * float64(time.Second)))))
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	}
	return make([]error, len(records))
}

// rawDrain has the raw client publish n messages to the empty queue q
// (rawPublish, -inflight unconfirmed), checks that the queue holds all of
// them, empties it again and returns the rate. A run disturbed from outside
// is repeated (undisturbed).
func rawDrain(ctx context.Context, q *benchQueue, n int, payload []byte, keyed bool, name string) (float64, error) {
	ids := make([]string, n)
	for i := range ids {
		ids[i] = watermill.NewUUID()
	}
	var r float64
	err := q.undisturbed("relay: "+name, func() error {
		if err := q.purge(); err != nil {
			return err
		}
		cpu := readCPU()
		took, err := rawPublish(ctx, q, ids, payload, *rawInflight, 0, keyed)
		if err != nil {
			return err
		}
		busy := cpu.busySince()
		if got, err := q.waitCount(ctx, n, 10*time.Second); err != nil || got != n {
			return fmt.Errorf("VERIFY FAILED: %s: queue holds %d messages, want %d (%v)", name, got, n, err)
		}
		r = rate(n, took)
		note("relay: %s %.0f msg/s (%s, machine CPU %.0f%% busy)", name, r, took.Round(time.Millisecond), 100*busy)
		return q.purge()
	})
	return r, err
}

// rawWarmUp warms the broker's queue process, its message store and the
// client's connection up with up to 2,000 messages, left in the queue for
// the next run's purge.
func rawWarmUp(ctx context.Context, q *benchQueue, n int, payload []byte) error {
	warm := make([]string, min(n, 2000))
	for i := range warm {
		warm[i] = watermill.NewUUID()
	}
	_, err := rawPublish(ctx, q, warm, payload, *rawInflight, 0, false)
	return err
}
