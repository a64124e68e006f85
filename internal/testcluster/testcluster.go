// Package testcluster gives tests and benchmarks a three-node RabbitMQ
// cluster of their own on this machine, started and stopped by
// scripts/rabbitmq-cluster: nodes acemq-test-1..3@localhost, AMQP on
// 127.0.0.1:5681..5683 (OUTBOX_TEST_RABBIT_CLUSTER_PORT moves them), joined
// into one cluster. It never touches the machine's own node on 5672, which
// other tests use at the same time.
//
// A test whose cluster cannot start is skipped with the reason printed,
// except under CI=true, where it fails, as testdb.Require does.
// OUTBOX_TEST_RABBIT_CLUSTER=off skips without trying (and still fails under
// CI=true: CI must never pass by skipping).
//
// # One user at a time
//
// go test runs packages in parallel, and there is one cluster per machine
// (one set of ports and node names). A Cluster therefore holds an exclusive
// flock on ${OUTBOX_TEST_RABBIT_CLUSTER_DIR}.use.lock from start to Stop: a
// second package that wants the cluster waits for the first to stop it (or
// for its context to end), and then starts a fresh one. The script's own
// start and stop, typed by hand or run by .ci/run, take the same lock, so
// they never stop a cluster a test is using. A package that wants the
// cluster in several tests starts it once, with Shared and Main.
//
// Starting takes 15 to 25 seconds on two cores; stopping, about 3.
package testcluster

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// Size is how many nodes a cluster has.
const Size = 3

// Switch is the environment variable that turns the cluster off locally.
const Switch = "OUTBOX_TEST_RABBIT_CLUSTER"

// startTimeout bounds one start, the cluster's boot and joins included;
// the script's own deadline (OUTBOX_TEST_RABBIT_CLUSTER_TIMEOUT, 120 s) is
// within it, so the script reports which node was late before this fires.
const startTimeout = 180 * time.Second

// Cluster is a running three-node cluster. Node indexes count from 0, as
// URLs does: node i is named acemq-test-(i+1)@localhost.
type Cluster struct {
	script string
	urls   []string
	nodes  []string
	lock   *os.File
	// Log is what the script printed to stderr while starting: the timing
	// of the start, which a test may want to show.
	Log string

	stopOnce sync.Once
	stopErr  error
}

// URLs are the AMQP URLs of the nodes, one per node, in node order.
func (c *Cluster) URLs() []string { return append([]string(nil), c.urls...) }

// URL is the AMQP URL of node i.
func (c *Cluster) URL(i int) string { return c.urls[i] }

// Node is the Erlang node name of node i.
func (c *Cluster) Node(i int) string { return c.nodes[i] }

// Nodes are the Erlang node names, in node order.
func (c *Cluster) Nodes() []string { return append([]string(nil), c.nodes...) }

// StopApp stops the rabbit application on node i: its AMQP listener
// closes and its connections drop, the Erlang node stays, as in a node
// being restarted. The other nodes see it leave the cluster's running set.
func (c *Cluster) StopApp(ctx context.Context, i int) error {
	_, err := c.run(ctx, "stop-app", c.arg(i))
	return err
}

// StartApp starts the rabbit application on node i again; it rejoins the
// cluster. It returns once the node has booted.
func (c *Cluster) StartApp(ctx context.Context, i int) error {
	_, err := c.run(ctx, "start-app", c.arg(i))
	return err
}

// Running is the set of running nodes as node i sees it, sorted.
func (c *Cluster) Running(ctx context.Context, i int) ([]string, error) {
	out, err := c.run(ctx, "running", c.arg(i))
	if err != nil {
		return nil, err
	}
	return strings.Fields(out), nil
}

// Ctl runs rabbitmqctl with args against node i and returns its stdout.
func (c *Cluster) Ctl(ctx context.Context, i int, args ...string) (string, error) {
	return c.run(ctx, append([]string{"ctl", c.arg(i)}, args...)...)
}

// QueueLeader is the index of the node that leads the quorum queue named
// queue (in the default vhost), as node 0 sees it.
func (c *Cluster) QueueLeader(ctx context.Context, queue string) (int, error) {
	out, err := c.Ctl(ctx, 0, "-q", "list_queues", "name", "leader", "--formatter", "json")
	if err != nil {
		return -1, err
	}
	var rows []struct{ Name, Leader string }
	if err := json.Unmarshal([]byte(out), &rows); err != nil {
		return -1, fmt.Errorf("testcluster: list_queues: %w in %q", err, out)
	}
	for _, r := range rows {
		if r.Name != queue {
			continue
		}
		if i := c.NodeIndex(r.Leader); i >= 0 {
			return i, nil
		}
		return -1, fmt.Errorf("testcluster: the leader of %s is %q, not a node of %v", queue, r.Leader, c.nodes)
	}
	return -1, fmt.Errorf("testcluster: list_queues does not list %s", queue)
}

// NodeIndex is the index of a node name, or -1.
func (c *Cluster) NodeIndex(node string) int {
	for i, n := range c.nodes {
		if n == node {
			return i
		}
	}
	return -1
}

// Stop stops the three nodes, removes their data and lets another package
// have the cluster. It is safe to call twice.
func (c *Cluster) Stop() error {
	c.stopOnce.Do(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
		defer cancel()
		_, c.stopErr = c.run(ctx, "stop")
		unlock(c.lock)
	})
	return c.stopErr
}

func (c *Cluster) arg(i int) string {
	if i < 0 || i >= Size {
		panic(fmt.Sprintf("testcluster: node index %d, want 0..%d", i, Size-1))
	}
	return fmt.Sprint(i + 1)
}

func (c *Cluster) run(ctx context.Context, args ...string) (string, error) {
	return runScript(ctx, c.script, args...)
}

// heldEnv tells the script that its caller holds the use lock, so it must
// not wait for it itself.
const heldEnv = "OUTBOX_TEST_RABBIT_CLUSTER_HELD=1"

func runScript(ctx context.Context, script string, args ...string) (string, error) {
	var stdout, stderr bytes.Buffer
	cmd := exec.CommandContext(ctx, script, args...)
	cmd.Env = append(os.Environ(), heldEnv)
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	// The script waits on its own children; give them a moment once it is
	// killed, rather than hang on their inherited pipes.
	cmd.WaitDelay = 5 * time.Second
	if err := cmd.Run(); err != nil {
		return stdout.String(), fmt.Errorf("%s %s: %w\n%s", filepath.Base(script), strings.Join(args, " "), err, strings.TrimSpace(stderr.String()))
	}
	return stdout.String(), nil
}

// StartCluster starts a fresh cluster, after waiting for any other user of
// it to stop theirs. The caller must Stop it. Use it from TestMain or a
// benchmark program; tests use Start or Shared.
func StartCluster(ctx context.Context) (*Cluster, error) {
	if v := os.Getenv(Switch); v == "off" || v == "0" || v == "false" {
		return nil, fmt.Errorf("the RabbitMQ cluster is turned off by %s=%s", Switch, v)
	}
	script, err := scriptPath()
	if err != nil {
		return nil, err
	}
	lock, err := acquire(ctx, dir()+".use.lock")
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(ctx, startTimeout)
	defer cancel()
	var stdout, stderr bytes.Buffer
	cmd := exec.CommandContext(ctx, script, "start")
	cmd.Env = append(os.Environ(), heldEnv)
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	cmd.WaitDelay = 5 * time.Second
	if err := cmd.Run(); err != nil {
		// The script stops what it started when it fails, but not when it
		// is killed by the deadline.
		stopCtx, stopCancel := context.WithTimeout(context.Background(), 90*time.Second)
		defer stopCancel()
		_, _ = runScript(stopCtx, script, "stop")
		unlock(lock)
		return nil, fmt.Errorf("testcluster: %s start: %w\n%s", script, err, strings.TrimSpace(stderr.String()))
	}
	urls := strings.Fields(stdout.String())
	if len(urls) != Size {
		stopCtx, stopCancel := context.WithTimeout(context.Background(), 90*time.Second)
		defer stopCancel()
		_, _ = runScript(stopCtx, script, "stop")
		unlock(lock)
		return nil, fmt.Errorf("testcluster: %s start printed %d URLs, want %d: %q", script, len(urls), Size, stdout.String())
	}
	c := &Cluster{script: script, urls: urls, lock: lock, Log: strings.TrimSpace(stderr.String())}
	prefix := env("OUTBOX_TEST_RABBIT_CLUSTER_PREFIX", "acemq-test")
	for i := range Size {
		c.nodes = append(c.nodes, fmt.Sprintf("%s-%d@localhost", prefix, i+1))
	}
	return c, nil
}

// Start starts a cluster for one test and stops it when the test ends. It
// skips the test when the cluster cannot start, or fails it under CI=true.
func Start(tb testing.TB) *Cluster {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	c, err := StartCluster(ctx)
	if err != nil {
		skipOrFail(tb, err)
	}
	tb.Logf("testcluster: %s", c.Log)
	tb.Cleanup(func() {
		if err := c.Stop(); err != nil {
			tb.Errorf("testcluster: %v", err)
		}
	})
	return c
}

var shared struct {
	sync.Mutex
	c   *Cluster
	err error
	// tried says that a start was attempted: a failed start is not retried
	// by every test of the package.
	tried bool
}

// Shared returns the package's one cluster, starting it on first use; Main
// stops it when the package's tests end. A test that calls it without Main
// leaves the cluster running until the next start or
// `scripts/rabbitmq-cluster stop`. It skips the test when the cluster cannot
// start, or fails it under CI=true.
func Shared(tb testing.TB) *Cluster {
	tb.Helper()
	shared.Lock()
	defer shared.Unlock()
	if !shared.tried {
		shared.tried = true
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
		shared.c, shared.err = StartCluster(ctx)
		cancel()
		if shared.err == nil {
			tb.Logf("testcluster: %s", shared.c.Log)
		}
	}
	if shared.err != nil {
		skipOrFail(tb, shared.err)
	}
	return shared.c
}

// Main runs the package's tests and stops the shared cluster afterwards,
// if a test started it. Call it from TestMain: os.Exit(testcluster.Main(m)).
func Main(m *testing.M) int {
	code := m.Run()
	shared.Lock()
	defer shared.Unlock()
	if shared.c != nil {
		if err := shared.c.Stop(); err != nil {
			fmt.Fprintf(os.Stderr, "testcluster: %v\n", err)
			if code == 0 {
				code = 1
			}
		}
	}
	return code
}

func skipOrFail(tb testing.TB, err error) {
	tb.Helper()
	if os.Getenv("CI") == "true" {
		tb.Fatalf("%v (required under CI=true; see README, Run the tests)", err)
	}
	tb.Skipf("skipping: %v (set CI=true to make this a failure)", err)
}

func scriptPath() (string, error) {
	if p := os.Getenv("OUTBOX_TEST_RABBIT_CLUSTER_SCRIPT"); p != "" {
		return p, nil
	}
	_, file, _, ok := runtime.Caller(0)
	if !ok {
		return "", errors.New("testcluster: cannot find scripts/rabbitmq-cluster: no caller information")
	}
	p := filepath.Join(filepath.Dir(file), "..", "..", "scripts", "rabbitmq-cluster")
	if _, err := os.Stat(p); err != nil {
		return "", fmt.Errorf("testcluster: %w (set OUTBOX_TEST_RABBIT_CLUSTER_SCRIPT to the script)", err)
	}
	return filepath.Clean(p), nil
}

// dir is the script's data dir, computed as the script does.
func dir() string {
	if d := os.Getenv("OUTBOX_TEST_RABBIT_CLUSTER_DIR"); d != "" {
		return d
	}
	return filepath.Join(env("TMPDIR", "/tmp"), "acemq-rabbit-cluster")
}

func env(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}

// acquire takes an exclusive flock on path, waiting until ctx ends. The
// file descriptor is close-on-exec, so the nodes the script starts do not
// inherit it and the lock ends with Stop, or with the process.
func acquire(ctx context.Context, path string) (*os.File, error) {
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o666)
	if err != nil {
		return nil, fmt.Errorf("testcluster: lock: %w", err)
	}
	tick := time.NewTicker(250 * time.Millisecond)
	defer tick.Stop()
	for {
		err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
		if err == nil {
			return f, nil
		}
		if !errors.Is(err, syscall.EWOULDBLOCK) {
			f.Close()
			return nil, fmt.Errorf("testcluster: lock %s: %w", path, err)
		}
		select {
		case <-ctx.Done():
			f.Close()
			return nil, fmt.Errorf("testcluster: waiting for another package's cluster to stop (%s): %w", path, ctx.Err())
		case <-tick.C:
		}
	}
}

func unlock(f *os.File) {
	_ = syscall.Flock(int(f.Fd()), syscall.LOCK_UN)
	_ = f.Close()
}
