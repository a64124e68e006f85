package main

import (
	"bufio"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"net/http"
	"os"
	"os/exec"
	"regexp"
	"runtime/pprof"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/acemq/watermill-outbox/internal/outboxctl"
)

// The relay as its own process, as a service runs it: `outboxctl relay`,
// with nothing in the publishing process to wake it. The bench runs its own
// binary as outboxctl (`outbox-bench outboxctl relay …` is outboxctl's main
// and nothing else), so the relay is the command's code, built with the
// bench, on the database the bench publishes to.
//
//	commit_to_broker_p50/p99_<db>_process_<rate>  ms, at 500 and 2,000 msg/s
//	relay_cpu_<db>_process_<rate>                 % of one core the relay process used while the messages were sent
//	relay_statements_per_msg_<db>_process_<rate>  statements the relay sent per message over the run
//	publish_tx_p50/p99_<db>_process_<rate>        ms, the publishers' transactions, begin to commit
//	commit_to_broker_p50_vs_publish_tx_<db>_process_<rate>
//	                                              ratio, the first p50 over the second: the relay's
//	                                              latency in units of what one of the services'
//	                                              transactions takes at the same load on the same machine
//	idle_queries_per_s_<db>                       statements the relay sent to an idle outbox, over idleWindow
//	…_postgres_process_<rate>_no_notify           the same figures with the NOTIFY trigger disabled: the
//	                                              services' commits notify nobody, the relay polls adaptively
//	…_postgres_process_<rate>_loud                the same figures with the relay never keeping the trigger
//	                                              quiet in a flow (--quiet-above=-1): every commit notifies
//
// The statements are the relay's own count (outbox_forwarder_statements_total
// on its /metrics: every statement, BEGIN and COMMIT included, that it sends
// to the database), read before and after a spell with nothing to publish.

// relayProcs is the relay process's GOMAXPROCS, when set.
var relayProcs = flag.Int("relay-gomaxprocs", 0, "latency: GOMAXPROCS of the relay process (0 = the Go runtime's default, the machine's cores)")

// relayCPUProfile is a directory where each relay process writes a CPU
// profile of its life, relay_<db><suffix>.prof (go tool pprof the bench's
// binary and it): the bench's own -cpuprofile does not see the relay.
var relayCPUProfile = flag.String("relay-cpuprofile", "", "latency: write a CPU profile of each relay process to relay_<variant>.prof in this directory")

// cpuProfileEnv names, in a relay process's environment, the file its CPU
// profile goes to.
const cpuProfileEnv = "OUTBOX_BENCH_RELAY_CPUPROFILE"

// outboxctlArg, as the first argument, makes the bench outboxctl.
const outboxctlArg = "outboxctl"

// processRates are the rates of the process variants.
var processRates = []int{500, 2000}

// idleWindow is how long the idle cost is measured.
const idleWindow = 30 * time.Second

// maybeOutboxctl runs outboxctl's main and exits when the bench was started
// as outboxctl.
func maybeOutboxctl() {
	if len(os.Args) > 1 && os.Args[1] == outboxctlArg {
		path := os.Getenv(cpuProfileEnv)
		if path == "" {
			os.Exit(outboxctl.Main(os.Args[2:], os.Getenv, os.Stdout, os.Stderr))
		}
		f, err := os.Create(path)
		if err == nil {
			err = pprof.StartCPUProfile(f)
		}
		if err != nil {
			fmt.Fprintf(os.Stderr, "outbox-bench: relay CPU profile: %v\n", err)
			os.Exit(2)
		}
		code := outboxctl.Main(os.Args[2:], os.Getenv, os.Stdout, os.Stderr)
		pprof.StopCPUProfile()
		if err := f.Close(); err != nil {
			fmt.Fprintf(os.Stderr, "outbox-bench: relay CPU profile: %v\n", err)
		}
		os.Exit(code)
	}
}

// relayProcess is an `outboxctl relay` the bench started.
type relayProcess struct {
	name    string // in errors: "outboxctl relay", say
	cmd     *exec.Cmd
	metrics string // URL of its /metrics
	exited  chan error
	stderr  *tailBuffer
}

var servingRE = regexp.MustCompile(`Serving /metrics and /healthz.* addr=(\S+)`)

// startRelayProcess starts outboxctl relay on dsn and waits until it
// serves /healthz.
func startRelayProcess(ctx context.Context, dsn, profile string, extra ...string) (*relayProcess, error) {
	args := []string{outboxctlArg, "relay", "--db", dsn, "--amqp", *amqpURL, "--listen", "127.0.0.1:0", "--relay-id", "outbox-bench-process"}
	if *relayBatch > 0 {
		args = append(args, "--batch-size", strconv.Itoa(*relayBatch))
	}
	if *relayMax > 0 {
		args = append(args, "--max-batch-size", strconv.Itoa(*relayMax))
	}
	return startProcess(ctx, "outboxctl relay", append(args, extra...), profile)
}

// startFloorRelay starts the floor relay (latency_floor.go) on dsn and
// waits until it serves /healthz.
func startFloorRelay(ctx context.Context, kind, dsn string, poll time.Duration) (*relayProcess, error) {
	return startProcess(ctx, "the floor relay", []string{floorArg, "--kind", kind, "--db", dsn, "--amqp", *amqpURL, "--poll", poll.String()}, "")
}

// startProcess starts the bench's own binary with args, as the relay called
// name, and waits until it serves /healthz.
func startProcess(ctx context.Context, name string, args []string, profile string) (*relayProcess, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(self, args...)
	cmd.Env = os.Environ()
	if *relayProcs > 0 {
		cmd.Env = append(cmd.Env, "GOMAXPROCS="+strconv.Itoa(*relayProcs))
	}
	if profile != "" {
		cmd.Env = append(cmd.Env, cpuProfileEnv+"="+profile)
	}
	stderr, err := cmd.StderrPipe()
	if err != nil {
		return nil, err
	}
	cmd.Stdout = io.Discard
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	p := &relayProcess{name: name, cmd: cmd, exited: make(chan error, 1), stderr: &tailBuffer{}}
	addr := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(stderr)
		sent := false
		for sc.Scan() {
			line := sc.Text()
			p.stderr.add(line)
			if m := servingRE.FindStringSubmatch(line); m != nil && !sent {
				addr <- m[1]
				sent = true
			}
		}
		p.exited <- cmd.Wait()
	}()
	deadline := time.After(20 * time.Second)
	var a string
	select {
	case a = <-addr:
	case err := <-p.exited:
		p.exited <- err
		return nil, fmt.Errorf("%s exited: %v\n%s", name, err, p.stderr)
	case <-deadline:
		p.stop()
		return nil, fmt.Errorf("%s did not serve /metrics within 20 s\n%s", name, p.stderr)
	case <-ctx.Done():
		p.stop()
		return nil, ctx.Err()
	}
	p.metrics = "http://" + a + "/metrics"
	for {
		resp, err := http.Get("http://" + a + "/healthz")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return p, nil
			}
		}
		select {
		case <-deadline:
			p.stop()
			return nil, fmt.Errorf("%s not healthy within 20 s\n%s", name, p.stderr)
		case <-ctx.Done():
			p.stop()
			return nil, ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// stop ends the relay with SIGTERM, as a service manager would, and waits.
func (p *relayProcess) stop() error {
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case err := <-p.exited:
		if err != nil {
			return fmt.Errorf("%s: %v\n%s", p.name, err, p.stderr)
		}
		return nil
	case <-time.After(30 * time.Second):
		_ = p.cmd.Process.Kill()
		return fmt.Errorf("%s did not stop within 30 s of SIGTERM\n%s", p.name, p.stderr)
	}
}

// sample reads the relay's CPU seconds and statement count from /metrics;
// statements is NaN when the relay does not count them.
func (p *relayProcess) sample() (cpu, statements float64, err error) {
	resp, err := http.Get(p.metrics)
	if err != nil {
		return 0, 0, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return 0, 0, err
	}
	cpu, statements = math.NaN(), math.NaN()
	for _, line := range strings.Split(string(body), "\n") {
		name, value, ok := strings.Cut(line, " ")
		if !ok || strings.HasPrefix(line, "#") {
			continue
		}
		v, perr := strconv.ParseFloat(strings.TrimSpace(value), 64)
		if perr != nil {
			continue
		}
		switch name {
		case "process_cpu_seconds_total":
			cpu = v
		case "outbox_forwarder_statements_total":
			statements = v
		}
	}
	if math.IsNaN(cpu) {
		return 0, 0, errors.New("the relay's /metrics has no process_cpu_seconds_total")
	}
	return cpu, statements, nil
}

// measureIdle reads how many statements the relay sends while the outbox
// has nothing to publish.
func measureIdle(ctx context.Context, p *relayProcess, kind string, out *reporter) error {
	// Let the last batch's marks and any backoff settle.
	if !sleepCtx(ctx, 2*time.Second) {
		return ctx.Err()
	}
	cpu0, st0, err := p.sample()
	if err != nil {
		return err
	}
	if !sleepCtx(ctx, idleWindow) {
		return ctx.Err()
	}
	cpu1, st1, err := p.sample()
	if err != nil {
		return err
	}
	if math.IsNaN(st0) {
		note("latency %s: the relay does not count its statements; idle_queries_per_s_%s not measured", kind, kind)
	} else {
		out.metric("idle_queries_per_s_"+kind, (st1-st0)/idleWindow.Seconds(), "stmt/s")
	}
	note("latency %s: idle relay used %.2f%% of a core over %s", kind, 100*(cpu1-cpu0)/idleWindow.Seconds(), idleWindow)
	return nil
}

func sleepCtx(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

// tailBuffer keeps the last lines a child wrote, for an error message.
type tailBuffer struct {
	mu    sync.Mutex
	lines []string
}

func (b *tailBuffer) add(line string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.lines = append(b.lines, line)
	if len(b.lines) > 40 {
		b.lines = b.lines[len(b.lines)-40:]
	}
}

func (b *tailBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return strings.Join(b.lines, "\n")
}
