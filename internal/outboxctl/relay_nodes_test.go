package outboxctl

import (
	"context"
	"io"
	"net"
	"net/http"
	"net/url"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/acemq/watermill-outbox/internal/testamqp"
	"github.com/acemq/watermill-outbox/internal/testdb"
	"github.com/acemq/watermill-outbox/internal/testutil"
)

func TestSplitURLs_CommaListOfNodes(t *testing.T) {
	for in, want := range map[string][]string{
		"amqp://a/":                         {"amqp://a/"},
		"amqp://a/,amqp://b/":               {"amqp://a/", "amqp://b/"},
		" amqp://a/ , amqp://b/,,amqp://c/": {"amqp://a/", "amqp://b/", "amqp://c/"},
		"amqp://u:p%2Cw@a/,amqp://b/":       {"amqp://u:p%2Cw@a/", "amqp://b/"},
		" , ":                               nil,
	} {
		if got := splitURLs(in); !slices.Equal(got, want) {
			t.Errorf("splitURLs(%q) = %q, want %q", in, got, want)
		}
	}
}

func TestRelay_BadNodeURL_UsageErrorNamingItsIndex(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		amqp, want string
	}{
		{"amqp://guest:s3cret@a/,http://b/", "--amqp amqp://guest:xxxxx@a/,http://b/: outbox: URLs[1]: "},
		{" , ", "no broker: pass --amqp or set OUTBOX_AMQP_URL"},
	} {
		r := ctl(t, nil, "relay", "--db", "x.db", "--amqp", tc.amqp)
		r.wantFailure(t, 2, tc.want)
		if strings.Contains(r.stderr, "s3cret") {
			t.Errorf("--amqp %q: stderr shows the password:\n%s", tc.amqp, r.stderr)
		}
	}
}

func TestRelay_NoNodeAnswers_ExitsOneNamingEach(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	r := ctl(t, nil, "relay", "--db", db.DSN, "--amqp", "amqp://guest:s3cret@127.0.0.1:1/,amqp://guest:s3cret@127.0.0.1:2/", "--listen", "", "--broker-wait", "0")
	r.wantFailure(t, 1, "cannot connect to RabbitMQ at any of amqp://guest:xxxxx@127.0.0.1:1/,amqp://guest:xxxxx@127.0.0.1:2/: "+
		"127.0.0.1:1: dial tcp 127.0.0.1:1: connect: connection refused; 127.0.0.1:2: dial tcp 127.0.0.1:2")
	if strings.Contains(r.stderr, "s3cret") {
		t.Errorf("stderr shows the password:\n%s", r.stderr)
	}
}

// --amqp names two nodes and the first is down: the relay connects to the
// second, publishes through it, and its log and /metrics name that node.
func TestRelay_FirstNodeDown_PublishesThroughTheNextAndShowsIt(t *testing.T) {
	testdb.Require(t, "amqp")
	db := migrated(t, testdb.SQLite)
	broker := testamqp.New(t)
	queue := broker.Queue()
	node := testamqp.NewNode(t)
	down := testamqp.NewNode(t)
	down.Kill()

	relay := startRelay(t, db.DSN, "--amqp", down.URL+","+node.URL)
	ids := publish(t, db, 20, queue)
	eventually(t, 30*time.Second, "the relay to publish every row", func() bool {
		return count(t, db, "SELECT COUNT(*) FROM acemq_outbox WHERE published_at IS NULL") == 0
	})
	_, metrics := relay.get("/metrics")
	for _, want := range []string{
		`outbox_forwarder_broker_connected{node="` + node.Addr + `"} 1`,
		`outbox_forwarder_broker_connected{node="` + down.Addr + `"} 0`,
		`outbox_forwarder_broker_connect_failures_total{node="` + down.Addr + `"} 1`,
	} {
		if !strings.Contains(metrics, want) {
			t.Errorf("/metrics lacks %s:\n%s", want, grepLines(metrics, "outbox_forwarder_broker"))
		}
	}
	if code := relay.stop(); code != 0 {
		t.Fatalf("relay exited %d after SIGTERM, want 0", code)
	}
	logs := relay.stderr.String()
	line := grepLines(logs, `msg="Connected to RabbitMQ"`)
	// The fields come in any order: node= may end the line.
	if !regexp.MustCompile(`(?m)(^| )node=` + regexp.QuoteMeta(node.Addr) + `( |$)`).MatchString(line) {
		t.Errorf("the relay's log of its connect lacks node=%s:\n%s", node.Addr, logs)
	}
	if f := ` unanswered="` + down.Addr + ": dial tcp " + down.Addr; !strings.Contains(line, f) {
		t.Errorf("the relay's log of its connect lacks %s:\n%s", f, logs)
	}
	arrived := messageIDs(t, broker, queue, len(ids))
	for _, id := range ids {
		if arrived[id] != 1 {
			t.Errorf("message %s arrived %d times, want once", id, arrived[id])
		}
	}
}

// grepLines is the lines of s that contain sub.
func grepLines(s, sub string) string {
	var lines []string
	for _, l := range regexp.MustCompile(`\r?\n`).Split(s, -1) {
		if strings.Contains(l, sub) {
			lines = append(lines, l)
		}
	}
	return strings.Join(lines, "\n")
}

// A broker that does not answer yet when the relay starts (a cluster
// coming up, the broker restarting): the relay tries again for
// --broker-wait, rather than exit at once into Kubernetes'
// CrashLoopBackOff and come back up to 5 minutes after the broker (an
// on-call drill), and publishes once it answers.
func TestRelay_BrokerAnswersLater_WaitedForThenPublished(t *testing.T) {
	testdb.Require(t, "amqp")
	db := migrated(t, testdb.SQLite)
	broker := testamqp.New(t)
	queue := broker.Queue()
	publish(t, db, 1, queue)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	_ = ln.Close() // the broker's port, with nothing on it yet

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	stderr := &testutil.LockedBuffer{}
	ran := make(chan int, 1)
	go func() {
		ran <- Run(ctx, []string{"relay", "--db", db.DSN, "--amqp", "amqp://guest:guest@" + addr + "/", "--listen", "", "--broker-wait", "1m"},
			func(string) string { return "" }, io.Discard, stderr)
	}()
	eventually(t, 30*time.Second, "the relay to say the broker does not answer", func() bool {
		return strings.Contains(stderr.String(), "RabbitMQ does not answer; trying again until --broker-wait passes")
	})
	// The broker comes up on that port: a proxy to the test broker.
	u, err := url.Parse(testdb.AMQPURL())
	if err != nil {
		t.Fatal(err)
	}
	brokerAddr := u.Host
	up, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer up.Close()
	go func() {
		for {
			c, err := up.Accept()
			if err != nil {
				return
			}
			b, err := net.Dial("tcp", brokerAddr)
			if err != nil {
				_ = c.Close()
				continue
			}
			go func() { _, _ = io.Copy(b, c); _ = b.Close() }()
			go func() { _, _ = io.Copy(c, b); _ = c.Close() }()
		}
	}()
	eventually(t, 30*time.Second, "the row published", func() bool {
		return count(t, db, "SELECT COUNT(*) FROM acemq_outbox WHERE published_at IS NOT NULL") == 1
	})
	cancel()
	if code := <-ran; code != 0 {
		t.Errorf("relay exited %d, want 0:\n%s", code, stderr.String())
	}
}

// While the relay waits for the broker (--broker-wait) /healthz answers
// 503, as before the relay runs, and /metrics is served: the port was
// bound and not served, a probe timed out, and a liveness probe with
// Kubernetes' defaults restarted the relay 30 s into the wait it was
// waiting out (a code review).
func TestRelay_WaitingForTheBroker_HealthzAnswers503(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	_ = ln.Close()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	stderr := &testutil.LockedBuffer{}
	ran := make(chan int, 1)
	go func() {
		ran <- Run(ctx, []string{"relay", "--db", db.DSN, "--amqp", "amqp://guest:guest@127.0.0.1:1/", "--listen", addr, "--broker-wait", "30s"},
			func(string) string { return "" }, io.Discard, stderr)
	}()
	defer func() { cancel(); <-ran }()
	eventually(t, 20*time.Second, "the relay to say the broker does not answer", func() bool {
		return strings.Contains(stderr.String(), "RabbitMQ does not answer")
	})
	client := &http.Client{Timeout: time.Second} // a Kubernetes probe's default timeout
	resp, err := client.Get("http://" + addr + "/healthz")
	if err != nil {
		t.Fatalf("/healthz during --broker-wait: %v (no answer: a liveness probe fails, and restarts the relay)", err)
	}
	_ = resp.Body.Close()
	if resp.StatusCode != http.StatusServiceUnavailable {
		t.Errorf("/healthz during --broker-wait: %s, want 503", resp.Status)
	}
	resp, err = client.Get("http://" + addr + "/metrics")
	if err != nil {
		t.Fatalf("/metrics during --broker-wait: %v", err)
	}
	body, _ := io.ReadAll(resp.Body)
	_ = resp.Body.Close()
	if !strings.Contains(string(body), "outbox_forwarder_broker_connect_failures_total") {
		t.Errorf("/metrics during --broker-wait does not count the failed connects:\n%.2000s", body)
	}
}

// One node of --amqp whose name does not resolve (a cluster addressed by
// its pods' names under a headless service, one pod restarting) and the
// other refusing for now: the relay waits --broker-wait. It exited at
// once, the one name's "no such host" ending the wait (a code review).
func TestRelay_OneNodeNotResolvingTheOtherDown_WaitsForTheBroker(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	stderr := &testutil.LockedBuffer{}
	ran := make(chan int, 1)
	go func() {
		ran <- Run(ctx, []string{"relay", "--db", db.DSN, "--amqp", "amqp://guest:guest@127.0.0.1:1/,amqp://guest:guest@rabbitmq-2.rabbitmq-headless.invalid:5672/",
			"--listen", "", "--broker-wait", "30s"}, func(string) string { return "" }, io.Discard, stderr)
	}()
	select {
	case code := <-ran:
		t.Errorf("relay exited %d at once, with one node restarting (its name not resolving) and the other refusing: want it to wait --broker-wait\n%s", code, stderr.String())
	case <-time.After(5 * time.Second):
		cancel()
		<-ran
	}
}

// A broker down behind a TCP load balancer, which takes the connection and
// closes it (504 from amqp091-go): outboxctl relay took it for a refusal
// and exited at once, into CrashLoopBackOff. It waits --broker-wait, as
// for a port with nothing on it.
func TestRelay_LoadBalancerWithNoBrokerBehind_WaitsForTheBroker(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	stderr := &testutil.LockedBuffer{}
	ran := make(chan int, 1)
	go func() {
		ran <- Run(ctx, []string{"relay", "--db", db.DSN, "--amqp", testamqp.NoBackendNode(t), "--listen", "", "--broker-wait", "30s"},
			func(string) string { return "" }, io.Discard, stderr)
	}()
	select {
	case code := <-ran:
		t.Errorf("relay exited %d at once behind a load balancer with no broker: want it to wait --broker-wait\n%s", code, stderr.String())
	case <-time.After(5 * time.Second):
		cancel()
		<-ran
	}
}
