package outbox

import (
	"errors"
	"strings"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/prometheus/client_golang/prometheus"
)

// Metrics are the relay's and the inbox's figures for Prometheus. Create one
// with NewMetrics on the registry of your choice and hand it to
// ForwarderConfig.Metrics and InboxConfig.Metrics. Without it nothing is
// counted and nothing costs.
type Metrics struct {
	published     *prometheus.CounterVec
	failed        *prometheus.CounterVec
	unmarked      *prometheus.CounterVec
	batchDuration prometheus.Histogram
	pending       *readGauge
	oldestPending *ageGauge
	stuck         *readGauge

	inboxProcessed  *prometheus.CounterVec
	inboxDuplicate  *prometheus.CounterVec
	inboxFailed     *prometheus.CounterVec
	inboxAtMostOnce *prometheus.CounterVec
	inboxHeld       *prometheus.CounterVec
	inboxSetAside   *prometheus.CounterVec
	heldMessages    *readGauge
	heldGaps        *readGauge
	oldestGap       *readGauge
	statements      prometheus.Counter

	brokerConnectedNodes *prometheus.GaugeVec
	brokerConnects       *prometheus.CounterVec
	brokerDialFailures   *prometheus.CounterVec
}

// readGauge is a gauge that a process exports only once it has read it:
// a consumer's process exported outbox_pending and outbox_stuck as 0, and
// a relay's outbox_inbox_held as 0 beside 1,321 held messages, and a
// dashboard summing over pods, or an alert on one, read them as healthy
// (a user review). The relay's are read by a Forwarder with Metrics, the
// inbox's by Inbox.RefreshStats.
type readGauge struct {
	prometheus.Gauge
	read atomic.Bool
}

func newReadGauge(opts prometheus.GaugeOpts) *readGauge {
	return &readGauge{Gauge: prometheus.NewGauge(opts)}
}

func (g *readGauge) Set(v float64) {
	g.Gauge.Set(v)
	g.read.Store(true)
}

func (g *readGauge) Collect(ch chan<- prometheus.Metric) {
	if g.read.Load() {
		g.Gauge.Collect(ch)
	}
}

// ageGauge is outbox_oldest_pending_age_seconds: the created_at of the
// oldest pending record at the last reading, its age taken at each
// scrape. Set as an age at the reading, it froze when the readings
// stopped (the relay cut off from its database), and an alert on it never
// fired through the outage (a review): the record read last is pending
// still, as nothing publishes it meanwhile. Exported once read, as
// readGauge.
type ageGauge struct {
	prometheus.GaugeFunc
	// since is the oldest pending record's created_at, as the relay's
	// clock reads it (the reading's own time less the record's age at
	// it), in Unix nanoseconds; 0 for none.
	since atomic.Int64
	read  atomic.Bool
}

func newAgeGauge(opts prometheus.GaugeOpts) *ageGauge {
	g := &ageGauge{}
	g.GaugeFunc = prometheus.NewGaugeFunc(opts, func() float64 {
		since := g.since.Load()
		if since == 0 {
			return 0
		}
		return max(0, time.Since(time.Unix(0, since)).Seconds())
	})
	return g
}

// set notes a reading at now of the oldest pending record, created at
// oldest by the database's clock (zero: none). What it stores is the
// record's age at now carried onto the process's clock.
func (g *ageGauge) set(oldest, now time.Time) {
	if oldest.IsZero() {
		g.since.Store(0)
	} else {
		g.since.Store(time.Now().Add(-max(0, now.Sub(oldest))).UnixNano())
	}
	g.read.Store(true)
}

func (g *ageGauge) Collect(ch chan<- prometheus.Metric) {
	if g.read.Load() {
		g.GaugeFunc.Collect(ch)
	}
}

// NewMetrics creates the metrics and registers them with reg. Their names
// start with "outbox_". Registering twice on one registry fails, as
// Prometheus does for any collector.
//
// One Metrics serves one outbox table and one database's ordered inboxes:
// its gauges (outbox_pending, outbox_stuck, the oldest pending age; the
// held messages, gaps and oldest gap of Inbox.RefreshStats) are one
// reading, which a second Forwarder on another table, or an Inbox on
// another database, would overwrite with its own. Give each its own, apart
// by a label:
// NewMetrics(prometheus.WrapRegistererWith(prometheus.Labels{"outbox": "billing"}, reg)).
func NewMetrics(reg prometheus.Registerer) (*Metrics, error) {
	if nilValue(reg) {
		return nil, &ConfigError{Field: "reg", Reason: "nil registerer; pass prometheus.DefaultRegisterer or a registry of your own"}
	}
	m := &Metrics{
		published: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "outbox_forwarder_published_total",
			Help: "Outbox records the broker confirmed and the relay marked published, by exchange.",
		}, []string{"exchange"}),
		failed: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "outbox_forwarder_failed_total",
			Help: "Outbox records whose publish failed, by exchange: each failure the relay records on its row (last_error). The records in flight behind the first one a lost connection took, released to go again, are not counted.",
		}, []string{"exchange"}),
		unmarked: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "outbox_forwarder_unmarked_total",
			Help: "Outbox records the broker confirmed whose mark failed (the database went), by exchange: they go out again, and the consumers' inboxes drop the copies. A relay killed between the confirm and the mark counts none.",
		}, []string{"exchange"}),
		batchDuration: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "outbox_forwarder_batch_duration_seconds",
			Help:    "Time from claiming a batch to marking it.",
			Buckets: prometheus.ExponentialBuckets(0.001, 2, 14), // 1 ms to 8 s
		}),
		pending: newReadGauge(prometheus.GaugeOpts{
			Name: "outbox_pending",
			Help: "Outbox records not yet published and under the attempt ceiling.",
		}),
		oldestPending: newAgeGauge(prometheus.GaugeOpts{
			Name: "outbox_oldest_pending_age_seconds",
			Help: "Age of the oldest pending outbox record at the last reading, as of the scrape (it grows while no reading comes); 0 when none was pending.",
		}),
		stuck: newReadGauge(prometheus.GaugeOpts{
			Name: "outbox_stuck",
			Help: "Outbox records at the attempt ceiling, left alone until an operator retries them.",
		}),
		inboxProcessed: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "outbox_inbox_processed_total",
			Help: "Messages the inbox ran the handler for and committed, by consumer.",
		}, []string{"consumer"}),
		inboxDuplicate: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "outbox_inbox_duplicates_total",
			Help: "Messages the inbox acked without running the handler, already processed or (ordered inbox) a copy of one held already, by consumer.",
		}, []string{"consumer"}),
		inboxFailed: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "outbox_inbox_failed_total",
			Help: "Messages whose handler or commit failed and were rolled back, by consumer: a delivery is nacked; a held message of the ordered inbox stays held.",
		}, []string{"consumer"}),
		inboxAtMostOnce: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "outbox_inbox_at_most_once_total",
			Help: "Messages whose key was committed before the handler ran, by consumer: from here a crash drops the message rather than repeating its effect.",
		}, []string{"consumer"}),
		inboxHeld: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "outbox_inbox_held_total",
			Help: "Keyed messages the ordered inbox held, ahead of their predecessor, and acked, by consumer.",
		}, []string{"consumer"}),
		inboxSetAside: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "outbox_inbox_set_aside_total",
			Help: "Messages set aside on a poison topic (PoisonOutbox, PoisonPublisher), never applied, by consumer: each waits for an operator (outboxctl resend once its cause is fixed).",
		}, []string{"consumer"}),
		heldMessages: newReadGauge(prometheus.GaugeOpts{
			Name: "outbox_inbox_held",
			Help: "Messages the ordered inbox holds until their predecessor is applied, all consumers (set by Inbox.RefreshStats).",
		}),
		heldGaps: newReadGauge(prometheus.GaugeOpts{
			Name: "outbox_inbox_gaps",
			Help: "Keys with a message held longer than InboxConfig.GapAfter: a predecessor missing, for an operator (outboxctl held, skip-gap).",
		}),
		oldestGap: newReadGauge(prometheus.GaugeOpts{
			Name: "outbox_inbox_oldest_gap_age_seconds",
			Help: "How long the longest-held message of the ordered inbox has been held; 0 when none is.",
		}),
		statements: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "outbox_forwarder_statements_total",
			Help: "Statements the relay sent to the database, BEGIN and COMMIT included: its load on the database, busy or idle.",
		}),
		brokerConnectedNodes: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "outbox_forwarder_broker_connected",
			Help: "Relay connections open to each RabbitMQ node of AMQPConfig.URLs: 1 on the node a relay is on, 0 on the others.",
		}, []string{"node"}),
		brokerConnects: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "outbox_forwarder_broker_connects_total",
			Help: "Connections the relay opened, by RabbitMQ node: after the first, each is a reconnect, to another node a failover.",
		}, []string{"node"}),
		brokerDialFailures: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "outbox_forwarder_broker_connect_failures_total",
			Help: "Connects to a RabbitMQ node that failed (refused, timed out, handshake refused), by node.",
		}, []string{"node"}),
	}
	var (
		errs       []error
		registered []prometheus.Collector
	)
	for _, c := range []prometheus.Collector{m.published, m.failed, m.unmarked, m.batchDuration, m.pending, m.oldestPending, m.stuck,
		m.inboxProcessed, m.inboxDuplicate, m.inboxFailed, m.inboxAtMostOnce, m.inboxHeld, m.inboxSetAside, m.heldMessages, m.heldGaps, m.oldestGap, m.statements,
		m.brokerConnectedNodes, m.brokerConnects, m.brokerDialFailures} {
		if err := reg.Register(c); err != nil {
			errs = append(errs, err)
		} else {
			registered = append(registered, c)
		}
	}
	if err := errors.Join(errs...); err != nil {
		// All or nothing: the registry is left as it was, so that a
		// NewMetrics once the conflict is gone succeeds.
		for _, c := range registered {
			reg.Unregister(c)
		}
		return nil, err
	}
	return m, nil
}

// sentStatements adds n statements the relay sent.
func (m *Metrics) sentStatements(n int64) {
	if m == nil || n <= 0 {
		return
	}
	m.statements.Add(float64(n))
}

// batch records one settled batch of the relay: what was marked published
// and what failed (an attempt counted, or the connection lost).
func (m *Metrics) batch(started time.Time, published []Record, failures []failure) {
	if m == nil {
		return
	}
	m.batchDuration.Observe(time.Since(started).Seconds())
	for _, r := range published {
		m.published.WithLabelValues(validUTF8(r.Exchange)).Inc()
	}
	for _, f := range failures {
		m.failed.WithLabelValues(validUTF8(f.exchange)).Inc()
	}
}

// relayStopped stops exporting the relay's gauges (Run returned), until a
// relay reads them again.
func (m *Metrics) relayStopped() {
	if m == nil {
		return
	}
	m.pending.read.Store(false)
	m.stuck.read.Store(false)
	m.oldestPending.read.Store(false)
}

// unmarkedBatch counts records the broker confirmed whose mark failed.
func (m *Metrics) unmarkedBatch(published []Record) {
	if m == nil {
		return
	}
	for _, r := range published {
		m.unmarked.WithLabelValues(validUTF8(r.Exchange)).Inc()
	}
}

// validUTF8 is s with each run of bytes that are not UTF-8 replaced by
// U+FFFD: a label value or a span attribute read from another library's
// row. Prometheus panics on a label value that is not UTF-8, which took
// the relay down at each restart for as long as a row whose exchange was
// such bytes (SQLite's TEXT holds any) was claimed (a review).
func validUTF8(s string) string {
	if utf8.ValidString(s) {
		return s
	}
	return strings.ToValidUTF8(s, "\uFFFD")
}

// brokerNodes makes the broker metrics of nodes show, at 0, before any
// connect: a node never connected to is a node that shows 0.
func (m *Metrics) brokerNodes(nodes []string) {
	if m == nil {
		return
	}
	for _, n := range nodes {
		m.brokerConnectedNodes.WithLabelValues(n).Add(0)
		m.brokerConnects.WithLabelValues(n).Add(0)
		m.brokerDialFailures.WithLabelValues(n).Add(0)
	}
}

// brokerConnected counts a connection to node opened (delta 1) or gone
// (-1), and the opening in the connects too.
func (m *Metrics) brokerConnected(node string, delta float64) {
	if m == nil {
		return
	}
	m.brokerConnectedNodes.WithLabelValues(node).Add(delta)
	if delta > 0 {
		m.brokerConnects.WithLabelValues(node).Inc()
	}
}

// brokerConnectFailed counts a connect to node that failed.
func (m *Metrics) brokerConnectFailed(node string) {
	if m == nil {
		return
	}
	m.brokerDialFailures.WithLabelValues(node).Inc()
}

// stats sets the gauges from a Stats reading.
func (m *Metrics) stats(st Stats, now time.Time) {
	if m == nil {
		return
	}
	m.pending.Set(float64(st.Pending))
	m.stuck.Set(float64(st.Stuck))
	m.oldestPending.set(st.OldestPending, now)
}

func (m *Metrics) inbox(consumer string, outcome inboxOutcome) {
	if m == nil {
		return
	}
	switch outcome {
	case inboxProcessed:
		m.inboxProcessed.WithLabelValues(consumer).Inc()
	case inboxDuplicate, inboxHeldAgain:
		m.inboxDuplicate.WithLabelValues(consumer).Inc()
	case inboxFailed:
		m.inboxFailed.WithLabelValues(consumer).Inc()
	case inboxAtMostOnce:
		m.inboxAtMostOnce.WithLabelValues(consumer).Inc()
	case inboxHeld:
		m.inboxHeld.WithLabelValues(consumer).Inc()
	case inboxSetAside:
		m.inboxSetAside.WithLabelValues(consumer).Inc()
	}
}

// held sets the ordered inbox's gauges (RefreshStats).
func (m *Metrics) held(messages, gaps int64, oldest time.Duration) {
	if m == nil {
		return
	}
	m.heldMessages.Set(float64(messages))
	m.heldGaps.Set(float64(gaps))
	m.oldestGap.Set(oldest.Seconds())
}

type inboxOutcome int

const (
	inboxProcessed inboxOutcome = iota
	inboxDuplicate
	inboxFailed
	// inboxAtMostOnce is counted when an at-most-once key commits, before
	// the handler runs; the message then also ends processed or failed.
	inboxAtMostOnce
	// inboxHeld: an ordered message ahead of its predecessor, held and
	// acked; it is counted processed when it is applied.
	inboxHeld
	// inboxHeldAgain: a copy of a message held already, acked; counted as
	// a duplicate. Its outbox record is marked processed in the hold's
	// transaction, as the held message's is, not by markDuplicateProcessed.
	inboxHeldAgain
	// inboxSetAside: a message a poison publisher of the inbox's took, once
	// it took it. Its deliveries' failures were counted failed: that count
	// could not tell a message given up from failures that passed (an
	// on-call drill).
	inboxSetAside
)
