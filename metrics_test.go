package outbox_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testamqp"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// metricValue reads one sample of reg: the metric name and, for a vector,
// its one label's value.
func metricValue(t testing.TB, reg *prometheus.Registry, name, label string) float64 {
	t.Helper()
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
		for _, m := range f.GetMetric() {
			if label != "" && (len(m.GetLabel()) != 1 || m.GetLabel()[0].GetValue() != label) {
				continue
			}
			return sampleValue(m)
		}
	}
	return 0
}

func sampleValue(m *dto.Metric) float64 {
	switch {
	case m.Counter != nil:
		return m.Counter.GetValue()
	case m.Gauge != nil:
		return m.Gauge.GetValue()
	case m.Histogram != nil:
		return float64(m.Histogram.GetSampleCount())
	}
	return 0
}

func TestMetrics_KnownSequence_ExactValues(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.SQLite)
	createEffects(t, db)
	b := testamqp.New(t)
	queue := b.Queue("ok")
	reg := prometheus.NewRegistry()
	m, err := outbox.NewMetrics(reg)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := outbox.NewMetrics(reg); err == nil {
		t.Error("registering the metrics twice on one registry was accepted")
	}

	publishOrdered(t, db, b.Exchange, [2]string{"a", "ok"}, [2]string{"b", "ok"}, [2]string{"c", "ok"})
	publishOrdered(t, db, b.Exchange, [2]string{"lost", "nobody.listens"})
	publishOrdered(t, db, "", [2]string{"via-default-exchange", queue})
	insertRaw(t, db, "malformed", b.Exchange, "ok", "{", "utf-8")

	f := newForwarder(t, db, outbox.ForwarderConfig{MaxAttempts: 1, Metrics: m, StatsInterval: time.Millisecond, PollInterval: 10 * time.Millisecond})
	go func() { _ = f.Run(context.Background()) }()
	waitFor(t, 20*time.Second, "the gauges to show the drained outbox", func() bool {
		return metricValue(t, reg, "outbox_stuck", "") == 2 && metricValue(t, reg, "outbox_pending", "") == 0
	})
	if got := metricValue(t, reg, "outbox_forwarder_published_total", b.Exchange); got != 3 {
		t.Errorf("published to %s = %v, want 3", b.Exchange, got)
	}
	if got := metricValue(t, reg, "outbox_forwarder_published_total", ""); got != 1 {
		t.Errorf("published to the default exchange = %v, want 1", got)
	}
	if got := metricValue(t, reg, "outbox_forwarder_failed_total", b.Exchange); got != 2 {
		t.Errorf("failed on %s = %v, want 2 (the unroutable and the malformed row)", b.Exchange, got)
	}
	if got := metricValue(t, reg, "outbox_forwarder_batch_duration_seconds", ""); got < 1 {
		t.Errorf("batch duration observed %v times, want at least 1", got)
	}
	if got := metricValue(t, reg, "outbox_oldest_pending_age_seconds", ""); got != 0 {
		t.Errorf("oldest pending age %v with nothing pending, want 0", got)
	}

	var ran atomic.Int32
	effect := writeEffect(t, db, &ran)
	in := newInbox(t, db, outbox.InboxConfig{ConsumerName: "billing", Metrics: m})
	h := in.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		if string(msg.Payload) == "fail" {
			return nil, errors.New("refused")
		}
		return effect(msg)
	})
	msg := message.NewMessage("m1", []byte("ok"))
	_, _ = h(msg.Copy())
	_, _ = h(msg.Copy())
	_, _ = h(message.NewMessage("m2", []byte("fail")))
	for name, want := range map[string]float64{"outbox_inbox_processed_total": 1, "outbox_inbox_duplicates_total": 1, "outbox_inbox_failed_total": 1, "outbox_inbox_at_most_once_total": 0} {
		if got := metricValue(t, reg, name, "billing"); got != want {
			t.Errorf("%s{consumer=billing} = %v, want %v", name, got, want)
		}
	}
}

// An at-most-once key is counted when it commits, before the handler runs,
// so a message whose handler then fails counts there and as failed; the
// other outcomes keep their meaning.
func TestMetrics_AtMostOnce_ExactValues(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.SQLite)
	reg := prometheus.NewRegistry()
	m, err := outbox.NewMetrics(reg)
	if err != nil {
		t.Fatal(err)
	}
	failed := false
	h := newInbox(t, db, outbox.InboxConfig{ConsumerName: "mailer", AtMostOnce: true, Metrics: m}).Middleware(func(msg *message.Message) ([]*message.Message, error) {
		if string(msg.Payload) == "fail once" && !failed {
			failed = true
			return nil, errors.New("SMTP server refused the connection")
		}
		return nil, nil
	})
	m1 := message.NewMessage("m1", []byte("ok"))
	m2 := message.NewMessage("m2", []byte("fail once"))
	for _, msg := range []*message.Message{m1, m1, m2, m2} {
		_, _ = h(msg.Copy())
	}
	for name, want := range map[string]float64{
		"outbox_inbox_at_most_once_total": 3, // m1, m2, m2's retry
		"outbox_inbox_processed_total":    2, // m1, m2's retry
		"outbox_inbox_duplicates_total":   1, // m1 again
		"outbox_inbox_failed_total":       1, // m2's first run
	} {
		if got := metricValue(t, reg, name, "mailer"); got != want {
			t.Errorf("%s{consumer=mailer} = %v, want %v", name, got, want)
		}
	}
}

// A message refused before the inbox reads it (a keyed message with a bad
// seq, one without an id) is counted failed under the consumer's name: it
// was not counted at all, and a message refused on every delivery stayed
// out of sight of alerting.
func TestMetrics_Inbox_RefusedBeforeItIsRead_CountedFailed(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.SQLite)
	reg := prometheus.NewRegistry()
	m, err := outbox.NewMetrics(reg)
	if err != nil {
		t.Fatal(err)
	}
	in := newInbox(t, db, outbox.InboxConfig{ConsumerName: "ledger", Ordered: true, Metrics: m})
	h := in.Middleware(func(msg *message.Message) ([]*message.Message, error) { return nil, nil })
	badSeq := message.NewMessage("m1", nil)
	badSeq.Metadata.Set(outbox.HeaderAggregateID, "order-1")
	badSeq.Metadata.Set(outbox.HeaderSeq, "first")
	if _, err := h(badSeq); !errors.Is(err, outbox.ErrInvalidSeq) {
		t.Fatalf("err = %v, want ErrInvalidSeq", err)
	}
	if _, err := h(message.NewMessage("", nil)); !errors.Is(err, outbox.ErrNoMessageID) {
		t.Fatalf("err = %v, want ErrNoMessageID", err)
	}
	if got := metricValue(t, reg, "outbox_inbox_failed_total", "ledger"); got != 2 {
		t.Errorf("outbox_inbox_failed_total{consumer=ledger} = %v, want 2", got)
	}
}

// An idle relay whose broker goes: outbox_forwarder_broker_connected drops
// to 0 when the connection closes, not when the next row comes, so that
// an alert on it sees the broker gone during a quiet spell.
func TestMetrics_IdleRelay_BrokerGone_ConnectedDropsToZero(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.SQLite)
	b := testamqp.New(t)
	_ = b.Queue("x")
	node := testamqp.NewNode(t)
	reg := prometheus.NewRegistry()
	m, err := outbox.NewMetrics(reg)
	if err != nil {
		t.Fatal(err)
	}
	dest, err := outbox.NewAMQPDestination(outbox.AMQPConfig{URLs: []string{node.URL}, Metrics: m})
	if err != nil {
		t.Fatal(err)
	}
	f, err := outbox.NewForwarder(db.DB, dest, outbox.ForwarderConfig{Dialect: outbox.SQLite, Metrics: m, PollInterval: 20 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() { _ = f.Run(ctx) }()
	<-f.Running()
	publishBatch(t, db, b.Exchange, "x", 1)
	connected := func() float64 { return metricValue(t, reg, "outbox_forwarder_broker_connected", node.Addr) }
	waitFor(t, 20*time.Second, "the connected gauge at 1", func() bool { return connected() == 1 })
	waitFor(t, 20*time.Second, "the row sent", func() bool { return pendingCount(t, f) == 0 })
	node.Kill()
	waitFor(t, 10*time.Second, "the connected gauge at 0 with the relay idle", func() bool { return connected() == 0 })
	if n := dest.Node(); n != "" {
		t.Errorf("Node() = %q after the broker went, want \"\"", n)
	}
}

// Two tables' relays in one process: each Metrics on the one registry,
// apart by a label, as the README and NewMetrics say.
func TestNewMetrics_TwoTablesOneRegistry_ApartByALabel(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	for _, name := range []string{"billing", "shop"} {
		if _, err := outbox.NewMetrics(prometheus.WrapRegistererWith(prometheus.Labels{"outbox": name}, reg)); err != nil {
			t.Fatalf("metrics of %s: %v", name, err)
		}
	}
	if _, err := reg.Gather(); err != nil {
		t.Fatal(err)
	}
}

// A gauge a process never read is not exported: a consumer's process
// exported outbox_pending and outbox_stuck as 0 while rows waited, and a
// relay's outbox_inbox_held as 0 beside 1,321 held messages, read as
// healthy by a dashboard over the pods (a user review). Each appears once
// its reader ran: the relay's stats, Inbox.RefreshStats.
func TestMetrics_GaugesAProcessNeverRead_NotExported(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.Postgres)
	publishN(t, db, "payments", "payment.captured", 3) // pending: no relay runs
	reg := prometheus.NewRegistry()
	m, err := outbox.NewMetrics(reg)
	if err != nil {
		t.Fatal(err)
	}
	in := newInbox(t, db, outbox.InboxConfig{ConsumerName: "ledger", Ordered: true, Metrics: m})
	relayGauges := []string{"outbox_pending", "outbox_stuck", "outbox_oldest_pending_age_seconds"}
	inboxGauges := []string{"outbox_inbox_held", "outbox_inbox_gaps", "outbox_inbox_oldest_gap_age_seconds"}
	exported := func() map[string]bool {
		mfs, err := reg.Gather()
		if err != nil {
			t.Fatal(err)
		}
		got := map[string]bool{}
		for _, mf := range mfs {
			got[mf.GetName()] = len(mf.GetMetric()) > 0
		}
		return got
	}
	for _, name := range append(relayGauges, inboxGauges...) {
		if exported()[name] {
			t.Errorf("%s exported before anything read it", name)
		}
	}
	if err := in.RefreshStats(context.Background()); err != nil {
		t.Fatal(err)
	}
	got := exported()
	for _, name := range inboxGauges {
		if !got[name] {
			t.Errorf("%s not exported after RefreshStats", name)
		}
	}
	for _, name := range relayGauges {
		if got[name] {
			t.Errorf("%s exported by a process with no relay, while 3 rows are pending", name)
		}
	}
	f, err := outbox.NewForwarder(db.DB, outbox.NewPublisherDestination(newRefusingPublisher("", "down"), nil),
		outbox.ForwarderConfig{Dialect: outbox.Postgres, Metrics: m, StatsInterval: 10 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	ctx, cancel := context.WithCancel(context.Background())
	ran := make(chan error, 1)
	go func() { ran <- f.Run(ctx) }()
	defer func() { cancel(); <-ran }()
	waitFor(t, 20*time.Second, "the relay's gauges exported", func() bool {
		got := exported()
		return got[relayGauges[0]] && got[relayGauges[1]] && got[relayGauges[2]]
	})
}

// An idle relay whose broker restarts (connections dropped, new ones
// taken): outbox_forwarder_broker_connected dropped to 0 and stayed there
// with the broker back until a row came, since the relay connected only to
// claim, so an alert on it never cleared on a quiet outbox. The idle relay
// connects again.
func TestMetrics_IdleRelay_BrokerRestarted_ConnectedBackToOne(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.SQLite)
	node := testamqp.NewNode(t)
	reg := prometheus.NewRegistry()
	m, err := outbox.NewMetrics(reg)
	if err != nil {
		t.Fatal(err)
	}
	dest, err := outbox.NewAMQPDestination(outbox.AMQPConfig{URLs: []string{node.URL}, Metrics: m})
	if err != nil {
		t.Fatal(err)
	}
	f, err := outbox.NewForwarder(db.DB, dest, outbox.ForwarderConfig{Dialect: outbox.SQLite, Metrics: m, PollInterval: 20 * time.Millisecond,
		RetryMin: 20 * time.Millisecond, RetryMax: 100 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() { _ = f.Run(ctx) }()
	<-f.Running()
	connected := func() float64 { return metricValue(t, reg, "outbox_forwarder_broker_connected", node.Addr) }
	waitFor(t, 20*time.Second, "a relay started with nothing to send connected", func() bool { return connected() == 1 })
	node.Drop() // a broker restart: connections cut, new ones taken
	waitFor(t, 20*time.Second, "the idle relay connected again", func() bool {
		return metricValue(t, reg, "outbox_forwarder_broker_connects_total", node.Addr) >= 2 && connected() == 1
	})
}
