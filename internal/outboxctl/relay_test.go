package outboxctl

import (
	"errors"
	"io"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/acemq/watermill-outbox/internal/testamqp"
	"github.com/acemq/watermill-outbox/internal/testdb"
	"github.com/acemq/watermill-outbox/internal/testutil"
)

// relayProcess is `outboxctl relay` running as a process of its own: the
// test binary re-executed through TestMain.
type relayProcess struct {
	t      *testing.T
	cmd    *exec.Cmd
	stderr *testutil.LockedBuffer
	addr   string // of /metrics and /healthz
	exited chan struct{}
	code   int
}

var listenAddr = regexp.MustCompile(`msg="Serving /metrics and /healthz" addr=(\S+)`)

// startRelay starts a relay on dsn and waits until /healthz answers 200.
// The process is killed when the test ends if it is still running.
func startRelay(t *testing.T, dsn string, args ...string) *relayProcess {
	t.Helper()
	args = append([]string{"relay", "--db", dsn, "--amqp", testdb.AMQPURL(), "--listen", "127.0.0.1:0", "--poll-interval", "50ms"}, args...)
	p := &relayProcess{t: t, cmd: exec.Command(os.Args[0], args...), stderr: &testutil.LockedBuffer{}, exited: make(chan struct{})}
	p.cmd.Env = append(os.Environ(), "OUTBOXCTL_RUN_MAIN=1")
	p.cmd.Stderr = p.stderr
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() {
		err := p.cmd.Wait()
		p.code = 0
		var exitErr *exec.ExitError
		if errors.As(err, &exitErr) {
			p.code = exitErr.ExitCode()
		} else if err != nil {
			p.code = -1
		}
		close(p.exited)
	}()
	t.Cleanup(func() {
		select {
		case <-p.exited:
		default:
			_ = p.cmd.Process.Kill()
			<-p.exited
		}
		if t.Failed() {
			t.Logf("relay %d stderr:\n%s", p.cmd.Process.Pid, p.stderr.String())
		}
	})
	eventually(t, 30*time.Second, "the relay to serve /healthz", func() bool {
		select {
		case <-p.exited:
			t.Fatalf("relay exited with %d before serving:\n%s", p.code, p.stderr.String())
		default:
		}
		if p.addr == "" {
			m := listenAddr.FindStringSubmatch(p.stderr.String())
			if m == nil {
				return false
			}
			p.addr = m[1]
		}
		code, _ := p.get("/healthz")
		return code == http.StatusOK
	})
	return p
}

func (p *relayProcess) get(path string) (int, string) {
	resp, err := http.Get("http://" + p.addr + path)
	if err != nil {
		return 0, err.Error()
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(body)
}

// published is the relay's outbox_forwarder_published_total, summed over
// exchanges.
func (p *relayProcess) published() int {
	p.t.Helper()
	code, body := p.get("/metrics")
	if code != http.StatusOK {
		p.t.Fatalf("/metrics: %d %s", code, body)
	}
	total := 0
	for _, m := range regexp.MustCompile(`(?m)^outbox_forwarder_published_total\{[^}]*\} (\S+)$`).FindAllStringSubmatch(body, -1) {
		v, err := strconv.ParseFloat(m[1], 64)
		if err != nil {
			p.t.Fatalf("metric value %q: %v", m[1], err)
		}
		total += int(v)
	}
	return total
}

// stop sends SIGTERM and waits for the exit code.
func (p *relayProcess) stop() int {
	p.t.Helper()
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		p.t.Fatal(err)
	}
	select {
	case <-p.exited:
	case <-time.After(30 * time.Second):
		p.t.Fatalf("relay did not exit within 30s of SIGTERM:\n%s", p.stderr.String())
	}
	return p.code
}

// relayDSN names the relay's PostgreSQL sessions, so that the test can find
// them in pg_stat_activity.
func relayDSN(db *testdb.DB, appName string) string {
	if db.Kind != testdb.Postgres {
		return db.DSN
	}
	u, err := url.Parse(db.DSN)
	if err != nil {
		panic(err)
	}
	q := u.Query()
	q.Set("application_name", appName)
	u.RawQuery = q.Encode()
	return u.String()
}

// messageIDs reads the queue until want messages arrived, then until it is
// empty, and counts the copies of each message_id.
func messageIDs(t *testing.T, broker *testamqp.Broker, queue string, want int) map[string]int {
	t.Helper()
	got := map[string]int{}
	for _, d := range broker.Drain(queue, want, 30*time.Second) {
		got[d.MessageId]++
	}
	return got
}

func TestRelay_SIGTERMMidStream_ExitsZeroUnlockedAndLosesNothing(t *testing.T) {
	const rows = 2000
	eachKind(t, func(t *testing.T, kind string) {
		testdb.Require(t, "amqp")
		db := migrated(t, kind)
		broker := testamqp.New(t)
		queue := broker.Queue() // bound to nothing: the default exchange routes by its name
		ids := publish(t, db, rows, queue)
		appName := "outboxctl-test-" + testdb.RandomName()
		published := func() int { return count(t, db, "SELECT COUNT(*) FROM acemq_outbox WHERE published_at IS NOT NULL") }

		// Small batches, so that SIGTERM lands while rows are still pending.
		relay := startRelay(t, relayDSN(db, appName), "--batch-size", "5", "--max-batch-size", "5")
		eventually(t, 30*time.Second, "the relay to publish", func() bool { return published() >= 50 })
		if code, body := relay.get("/healthz"); code != http.StatusOK {
			t.Errorf("/healthz while running: %d %q, want 200", code, body)
		}
		if _, body := relay.get("/metrics"); !strings.Contains(body, "outbox_forwarder_published_total") ||
			!strings.Contains(body, "go_goroutines") || !strings.Contains(body, "process_cpu_seconds_total") {
			t.Errorf("/metrics lacks the relay's, Go's or the process's metrics:\n%.2000s", body)
		}
		if code := relay.stop(); code != 0 {
			t.Fatalf("relay exited %d after SIGTERM, want 0:\n%s", code, relay.stderr.String())
		}

		sent := published()
		t.Logf("%d of %d rows published when SIGTERM came", sent, rows)
		if sent == rows {
			t.Errorf("the relay published every row before SIGTERM: the test no longer stops it mid-stream")
		}
		if n := count(t, db, "SELECT COUNT(*) FROM acemq_outbox WHERE locked_by IS NOT NULL OR locked_until IS NOT NULL"); n != 0 {
			t.Errorf("%d rows still locked after the relay stopped", n)
		}
		assertNoOpenTransaction(t, db, appName)

		// Every row marked published is on the queue: the batch in flight was
		// finished, not cut.
		arrived := messageIDs(t, broker, queue, sent)
		var rowsPublished []string
		if err := db.Select(&rowsPublished, "SELECT id FROM acemq_outbox WHERE published_at IS NOT NULL"); err != nil {
			t.Fatal(err)
		}
		for _, id := range rowsPublished {
			if arrived[id] == 0 {
				t.Errorf("row %s is marked published but is not on the queue", id)
			}
		}

		// The rest is still pending, and a second run sends it.
		relay = startRelay(t, relayDSN(db, appName))
		eventually(t, 30*time.Second, "the second relay to drain the outbox", func() bool { return published() == rows })
		if code := relay.stop(); code != 0 {
			t.Fatalf("second relay exited %d, want 0", code)
		}
		for id, n := range messageIDs(t, broker, queue, rows-len(arrived)) {
			arrived[id] += n
		}
		known := map[string]bool{}
		for _, id := range ids {
			known[id] = true
			if arrived[id] == 0 {
				t.Errorf("message %s never arrived", id)
			}
		}
		for id := range arrived {
			if !known[id] {
				t.Errorf("message %q arrived that was never written", id)
			}
		}
	})
}

// assertNoOpenTransaction checks that the relay left no transaction open on
// the server: its sessions end with it on PostgreSQL, and MySQL has no
// InnoDB transaction on the test's database.
func assertNoOpenTransaction(t *testing.T, db *testdb.DB, appName string) {
	t.Helper()
	switch db.Kind {
	case testdb.Postgres:
		eventually(t, 10*time.Second, "the relay's sessions to end", func() bool {
			return count(t, db, "SELECT COUNT(*) FROM pg_stat_activity WHERE application_name = ?", appName) == 0
		})
	case testdb.MySQL:
		eventually(t, 10*time.Second, "no InnoDB transaction on the test database", func() bool {
			return count(t, db, "SELECT COUNT(*) FROM information_schema.innodb_trx t "+
				"JOIN information_schema.processlist p ON p.id = t.trx_mysql_thread_id WHERE p.db = ?", db.Name) == 0
		})
	}
}

func TestRelay_TwoReplicas_PublishEachRowExactlyOnce(t *testing.T) {
	const rows = 3000
	eachKind(t, func(t *testing.T, kind string) {
		testdb.Require(t, "amqp")
		db := migrated(t, kind)
		broker := testamqp.New(t)
		queue := broker.Queue()

		// Both running before the rows commit, so that both compete for them.
		name := "zz-relay-" + testdb.RandomName()
		a := startRelay(t, db.DSN, "--batch-size", "20", "--max-batch-size", "20", "--relay-id", name)
		b := startRelay(t, db.DSN, "--batch-size", "20", "--max-batch-size", "20")
		// A's broker connection is named for it: every relay's was
		// "outboxctl relay", and a user review found its own by port.
		eventually(t, 10*time.Second, "relay A's broker connection, named for it", func() bool {
			out, err := exec.Command("rabbitmqctl", "-q", "list_connections", "client_properties").CombinedOutput()
			return err == nil && strings.Contains(string(out), `{"connection_name","outboxctl relay `+name+`"}`)
		})
		ids := publish(t, db, rows, queue)
		eventually(t, 40*time.Second, "the relays to publish every row", func() bool {
			return count(t, db, "SELECT COUNT(*) FROM acemq_outbox WHERE published_at IS NULL") == 0
		})
		// The counters follow the marks by a moment.
		var byA, byB int
		eventually(t, 10*time.Second, "the relays' counters to add up", func() bool {
			byA, byB = a.published(), b.published()
			return byA+byB >= rows
		})
		t.Logf("relay A published %d, relay B %d", byA, byB)
		if byA+byB != rows {
			t.Errorf("the relays counted %d + %d = %d publishes of %d rows", byA, byB, byA+byB, rows)
		}
		if byA == 0 || byB == 0 {
			t.Errorf("one relay published everything (%d and %d): the test did not make them compete", byA, byB)
		}
		for _, p := range []*relayProcess{a, b} {
			if code := p.stop(); code != 0 {
				t.Errorf("relay exited %d after SIGTERM, want 0", code)
			}
		}

		arrived := messageIDs(t, broker, queue, rows)
		for _, id := range ids {
			if arrived[id] != 1 {
				t.Errorf("message %s arrived %d times, want once", id, arrived[id])
			}
		}
		if len(arrived) != rows {
			t.Errorf("%d distinct messages arrived, want %d", len(arrived), rows)
		}
	})
}
