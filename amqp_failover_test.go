package outbox_test

import (
	"context"
	"errors"
	"net"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/prometheus/client_golang/prometheus"
	amqp "github.com/rabbitmq/amqp091-go"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testamqp"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// refusingURL is the test broker's URL at a port where nothing listens: a
// node that is down.
func refusingURL(t testing.TB) string {
	t.Helper()
	u, err := url.Parse(testdb.AMQPURL())
	if err != nil {
		t.Fatal(err)
	}
	u.Host = "127.0.0.1:1"
	return u.String()
}

// brokerAddr is the test broker's host:port, as the destination names it.
func brokerAddr(t testing.TB) string {
	t.Helper()
	uri, err := amqp.ParseURI(testdb.AMQPURL())
	if err != nil {
		t.Fatal(err)
	}
	return net.JoinHostPort(uri.Host, strconv.Itoa(uri.Port))
}

// recordingLogger keeps the Info and Error messages logged, with their
// fields.
type recordingLogger struct {
	mu   sync.Mutex
	logs []loggedLine
}

type loggedLine struct {
	msg    string
	err    error // an ERROR line's, nil for the others
	fields watermill.LogFields
}

func (l *recordingLogger) Error(msg string, err error, fields watermill.LogFields) {
	l.add(msg, err, fields)
}
func (l *recordingLogger) Info(msg string, fields watermill.LogFields)      { l.add(msg, nil, fields) }
func (l *recordingLogger) Debug(string, watermill.LogFields)                {}
func (l *recordingLogger) Trace(string, watermill.LogFields)                {}
func (l *recordingLogger) With(watermill.LogFields) watermill.LoggerAdapter { return l }

func (l *recordingLogger) add(msg string, err error, fields watermill.LogFields) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.logs = append(l.logs, loggedLine{msg, err, fields})
}

// errorLines returns the lines logged with an error, in order.
func (l *recordingLogger) errorLines() []loggedLine {
	l.mu.Lock()
	defer l.mu.Unlock()
	var found []loggedLine
	for _, line := range l.logs {
		if line.err != nil {
			found = append(found, line)
		}
	}
	return found
}

// find returns the fields of the lines logged as msg, in order.
func (l *recordingLogger) find(msg string) []watermill.LogFields {
	l.mu.Lock()
	defer l.mu.Unlock()
	var found []watermill.LogFields
	for _, line := range l.logs {
		if line.msg == msg {
			found = append(found, line.fields)
		}
	}
	return found
}

// wantBrokerGauge checks outbox_forwarder_broker_connected of each node.
func wantBrokerGauge(t testing.TB, reg *prometheus.Registry, want map[string]float64) {
	t.Helper()
	for node, v := range want {
		if got := metricValue(t, reg, "outbox_forwarder_broker_connected", node); got != v {
			t.Errorf("outbox_forwarder_broker_connected{node=%q} = %v, want %v", node, got, v)
		}
	}
}

func TestAMQPConfig_URLs_ValidatedNamingTheIndex(t *testing.T) {
	for _, tc := range []struct {
		urls  []string
		field string
	}{
		{nil, "URLs"},
		{[]string{"amqp://guest:guest@a:5672/", "http://b/"}, "URLs[1]"},
		{[]string{"amqp://guest:s3cret@a:5672/%zz"}, "URLs[0]"},
	} {
		_, err := outbox.NewAMQPDestination(outbox.AMQPConfig{URLs: tc.urls})
		var cfgErr *outbox.ConfigError
		if !errors.As(err, &cfgErr) || cfgErr.Field != tc.field {
			t.Errorf("URLs %q: error %v, want a ConfigError on %s", tc.urls, err, tc.field)
			continue
		}
		if strings.Contains(err.Error(), "s3cret") {
			t.Errorf("URLs %q: the error shows the password: %v", tc.urls, err)
		}
	}
}

// The first node refuses: the destination connects to the second, and the
// logs, Node and the metrics say so.
func TestAMQPDestination_FirstNodeDown_ConnectsToTheNextAndShowsIt(t *testing.T) {
	testdb.Require(t, "amqp")
	reg := prometheus.NewRegistry()
	m, err := outbox.NewMetrics(reg)
	if err != nil {
		t.Fatal(err)
	}
	log := &recordingLogger{}
	d, err := outbox.NewAMQPDestination(outbox.AMQPConfig{
		URLs: []string{refusingURL(t), testdb.AMQPURL()}, Metrics: m, Logger: log,
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Close() })
	if got := d.Node(); got != "" {
		t.Fatalf("Node() = %q before any connect, want \"\"", got)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	if err := d.Connect(ctx); err != nil {
		t.Fatalf("connect with the second node up: %v", err)
	}
	real := brokerAddr(t)
	if got := d.Node(); got != real {
		t.Errorf("Node() = %q, want %q", got, real)
	}
	wantBrokerGauge(t, reg, map[string]float64{real: 1, "127.0.0.1:1": 0})
	if got := metricValue(t, reg, "outbox_forwarder_broker_connect_failures_total", "127.0.0.1:1"); got != 1 {
		t.Errorf("connect failures of 127.0.0.1:1 = %v, want 1", got)
	}
	if got := metricValue(t, reg, "outbox_forwarder_broker_connects_total", real); got != 1 {
		t.Errorf("connects to %s = %v, want 1", real, got)
	}
	if connected := log.find("Connected to RabbitMQ"); len(connected) != 1 || connected[0]["node"] != real ||
		!strings.HasPrefix(toString(connected[0]["unanswered"]), "127.0.0.1:1: dial tcp 127.0.0.1:1") {
		t.Errorf("the connect logged %v, want once, on %s, 127.0.0.1:1 unanswered", connected, real)
	}
	for _, line := range log.logs {
		for _, v := range line.fields {
			if s, ok := v.(string); ok && strings.Contains(s, "guest:guest") {
				t.Errorf("log %q shows a password: %v", line.msg, line.fields)
			}
		}
	}

	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	if got := d.Node(); got != "" {
		t.Errorf("Node() = %q after Close, want \"\"", got)
	}
	wantBrokerGauge(t, reg, map[string]float64{real: 0})
}

// No node answers: the connect fails as a lost connection (the Forwarder
// waits and tries again, counting no attempt), naming every node.
func TestAMQPDestination_NoNodeAnswers_ConnectionLostNamingEach(t *testing.T) {
	u2 := strings.Replace(refusingURL(t), "127.0.0.1:1", "127.0.0.1:2", 1)
	d, err := outbox.NewAMQPDestination(outbox.AMQPConfig{URLs: []string{refusingURL(t), u2}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	err = d.Connect(ctx)
	if !errors.Is(err, outbox.ErrConnectionLost) {
		t.Fatalf("connect with every node down: %v, want ErrConnectionLost", err)
	}
	for _, node := range []string{"127.0.0.1:1: ", "127.0.0.1:2: "} {
		if !strings.Contains(err.Error(), node) {
			t.Errorf("error %q does not name node %s", err, node)
		}
	}
}

// After a lost connection the destination tries the node after the one it
// was on first, and the one it lost last: a node that went down is not
// waited for, and the connections of a cluster's relays do not all pile
// onto its first node.
func TestAMQPDestination_LostConnection_TriesTheNextNodeFirst(t *testing.T) {
	testdb.Require(t, "amqp")
	a, b, c := testamqp.NewNode(t), testamqp.NewNode(t), testamqp.NewNode(t)
	log := &recordingLogger{}
	d, err := outbox.NewAMQPDestination(outbox.AMQPConfig{URLs: []string{a.URL, b.URL, c.URL}, Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Close() })
	connect := func(want *testamqp.Node, what string) {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
		defer cancel()
		if err := d.Connect(ctx); err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		if got := d.Node(); got != want.Addr {
			t.Fatalf("%s: on node %s, want %s", what, got, want.Addr)
		}
	}
	lose := func(n *testamqp.Node, drop func()) {
		t.Helper()
		drop()
		waitFor(t, 10*time.Second, "the client to see its connection to "+n.Addr+" lost", func() bool { return d.Node() == "" })
	}

	connect(a, "first connect")
	lose(a, a.Kill)
	connect(b, "A is down")
	lose(b, b.Drop) // B still answers, but C comes first
	connect(c, "B dropped the connection")
	lose(c, c.Drop)
	connect(b, "C dropped the connection, A is down") // A is tried first, and refuses
	var got []string
	for _, f := range log.find("Connected to RabbitMQ") {
		unanswered, _, _ := strings.Cut(toString(f["unanswered"]), ": ")
		got = append(got, f["node"].(string)+" after "+toString(f["previous_node"])+" unanswered "+unanswered)
	}
	want := []string{
		a.Addr + " after  unanswered ",
		b.Addr + " after " + a.Addr + " unanswered ", // B comes after A: A, down, is not tried
		c.Addr + " after " + b.Addr + " unanswered ",
		b.Addr + " after " + c.Addr + " unanswered " + a.Addr,
	}
	if strings.Join(got, ", ") != strings.Join(want, ", ") {
		t.Errorf("connects logged %q, want %q", got, want)
	}
}

func toString(v any) string {
	s, _ := v.(string)
	return s
}

// The node the relay publishes through goes down between batches: the
// relay moves on to the other node, every row arrives once and is marked
// once, and the logs and the Forwarder's metrics show the new node.
func TestForwarder_NodeDown_FailsOverToTheOtherNodeNothingLost(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	broker := testamqp.New(t)
	queue := broker.Queue("order.placed")
	a, b := testamqp.NewNode(t), testamqp.NewNode(t)

	reg := prometheus.NewRegistry()
	m, err := outbox.NewMetrics(reg)
	if err != nil {
		t.Fatal(err)
	}
	log := &recordingLogger{}
	dest, err := outbox.NewAMQPDestination(outbox.AMQPConfig{URLs: []string{a.URL, b.URL}, Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	// The destination has no Metrics of its own: the Forwarder hands down
	// its.
	f, err := outbox.NewForwarder(db.DB, dest, outbox.ForwarderConfig{Metrics: m, Logger: log})
	if err != nil {
		_ = dest.Close()
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = f.Close() })

	ids := publishN(t, db, broker.Exchange, "order.placed", 5)
	if n := sweepAll(t, f); n != 5 {
		t.Fatalf("published %d through node A, want 5", n)
	}
	if got := dest.Node(); got != a.Addr {
		t.Fatalf("on node %q, want A %s", got, a.Addr)
	}
	wantBrokerGauge(t, reg, map[string]float64{a.Addr: 1, b.Addr: 0})

	a.Kill()
	waitFor(t, 10*time.Second, "the relay's client to see node A gone", func() bool { return dest.Node() == "" })
	ids = append(ids, publishN(t, db, broker.Exchange, "order.placed", 5)...)
	if n := sweepAll(t, f); n != 5 {
		t.Fatalf("published %d after node A went down, want 5", n)
	}
	if got := dest.Node(); got != b.Addr {
		t.Errorf("on node %q after A went down, want B %s", got, b.Addr)
	}
	wantBrokerGauge(t, reg, map[string]float64{a.Addr: 0, b.Addr: 1})
	if got := metricValue(t, reg, "outbox_forwarder_broker_connects_total", b.Addr); got != 1 {
		t.Errorf("connects to B = %v, want 1", got)
	}
	if lost := log.find("Connection to RabbitMQ lost"); len(lost) != 1 || lost[0]["node"] != a.Addr {
		t.Errorf("the loss logged %v, want once, of A %s", lost, a.Addr)
	}
	if connected := log.find("Connected to RabbitMQ"); len(connected) != 2 || connected[1]["node"] != b.Addr || connected[1]["previous_node"] != a.Addr {
		t.Errorf("connects logged %v, want A, then B after A", connected)
	}

	seen := countIDs(broker.Drain(queue, len(ids), 10*time.Second))
	for _, id := range ids {
		st := stateOf(t, db, id)
		if seen[id] != 1 || !st.Published || st.Attempts != 0 {
			t.Errorf("message %s: arrived %d times, row %+v; want once, published, no attempt counted", id, seen[id], st)
		}
	}
	if len(seen) != len(ids) {
		t.Errorf("%d distinct messages arrived, want %d", len(seen), len(ids))
	}
}

// A watermill-amqp subscriber whose connection dials through FailoverDial
// consumes again, through the other node, once its node went down: its
// ConnectionWrapper redials through Config.Dial. The queue is a quorum
// queue, as the examples declare theirs.
//
// Not under -race: watermill-amqp v3's reconnect writes
// ConnectionWrapper.connected in one goroutine while the subscriber reads it
// in another (ThreeDotsLabs/watermill#693), which the race detector reports
// and no code of ours can avoid (integration_test skips its consumers'
// reconnects under -race for the same reason).
func TestFailoverDial_WatermillSubscriberNodeDown_ConsumesThroughTheOther(t *testing.T) {
	if raceEnabled {
		t.Skip("watermill-amqp v3's reconnect races (ThreeDotsLabs/watermill#693); run without -race")
	}
	testdb.Require(t, "amqp")
	a, b := testamqp.NewNode(t), testamqp.NewNode(t)
	log := &recordingLogger{}
	dial, err := outbox.FailoverDial([]string{a.URL, b.URL}, 5*time.Second, log)
	if err != nil {
		t.Fatal(err)
	}
	queue := "test-failover-" + testdb.RandomName()
	cfg := wamqp.NewDurableQueueConfig(a.URL)
	cfg.Connection.AmqpConfig = &amqp.Config{Dial: dial}
	cfg.Queue.Arguments = amqp.Table{amqp.QueueTypeArg: amqp.QueueTypeQuorum}
	cfg.Connection.Reconnect = &wamqp.ReconnectConfig{BackoffInitialInterval: 50 * time.Millisecond, BackoffMultiplier: 2, BackoffMaxInterval: time.Second}
	sub, err := wamqp.NewSubscriber(cfg, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { testamqpDeleteQueue(t, queue) })
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	msgs, err := sub.Subscribe(ctx, queue)
	if err != nil {
		_ = sub.Close()
		t.Fatal(err)
	}
	defer func() {
		if err := sub.Close(); err != nil {
			t.Error(err)
		}
	}()
	testamqp.New(t).With(func(ch *amqp.Channel) error {
		// The broker refuses (406) to declare a queue again as a quorum
		// queue unless it is one.
		_, err := ch.QueueDeclare(queue, true, false, false, false, amqp.Table{amqp.QueueTypeArg: amqp.QueueTypeQuorum})
		return err
	})

	send := func(id string) {
		t.Helper()
		testamqp.New(t).With(func(ch *amqp.Channel) error {
			return ch.PublishWithContext(context.Background(), "", queue, false, false, amqp.Publishing{
				MessageId: id, Headers: amqp.Table{"_watermill_message_uuid": id}, Body: []byte(id),
			})
		})
	}
	receive := func(want string) {
		t.Helper()
		select {
		case msg := <-msgs:
			msg.Ack()
			if msg.UUID != want {
				t.Fatalf("received %s, want %s", msg.UUID, want)
			}
		case <-time.After(30 * time.Second):
			t.Fatalf("message %s did not arrive", want)
		}
	}
	send("before")
	receive("before")
	if a.Connections() == 0 || b.Connections() != 0 {
		t.Fatalf("connections through A %d, B %d: want the subscriber on A", a.Connections(), b.Connections())
	}

	a.Kill()
	send("after")
	receive("after")
	if b.Connections() == 0 {
		t.Error("the message arrived, but not through B")
	}
	dialled := log.find("Dialled RabbitMQ node")
	if len(dialled) < 2 || dialled[0]["node"] != a.Addr || dialled[len(dialled)-1]["node"] != b.Addr {
		t.Errorf("dials logged %v, want A first and B last", dialled)
	}
}
