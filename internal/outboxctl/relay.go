package outboxctl

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	amqp "github.com/rabbitmq/amqp091-go"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/amqpwire"
	"github.com/acemq/watermill-outbox/internal/sqldialect"
)

// stopTimeout bounds a stop: twice the relay's publish timeout (15 s), the
// batches in flight and their marks.
const stopTimeout = 30 * time.Second

// stallBound is how long a running relay may go without ending a sweep
// before /healthz calls it stalled: a sweep takes the publish timeout twice
// at most (15 s each), and the loop waits the poll or a backoff (10 s at
// most) between two; half a minute more of slack.
func stallBound(poll time.Duration) time.Duration {
	return 2*15*time.Second + max(poll, 10*time.Second) + 30*time.Second
}

// shutdownTimeout bounds the wait for /metrics and /healthz requests in
// progress when the relay stops; the relay's own batch is not bounded by it.
const shutdownTimeout = 5 * time.Second

// splitURLs reads --amqp: one URL, or the nodes of a cluster separated by
// commas (a comma in a password is written %2C). Blanks around them and
// empty items are dropped.
func splitURLs(s string) []string {
	var urls []string
	for _, u := range strings.Split(s, ",") {
		if u = strings.TrimSpace(u); u != "" {
			urls = append(urls, u)
		}
	}
	return urls
}

// nodeFailures is the destination's account of a connect to several nodes
// that all failed, without the sentinel and the prefix the library wraps it
// in: "host:port: error; host:port: error".
func nodeFailures(err error) string {
	msg := strings.TrimPrefix(err.Error(), outbox.ErrBrokerUnreachable.Error()+": ")
	return oneLine(strings.TrimPrefix(msg, "connect to RabbitMQ: "))
}

func (c *cli) relay(args []string) error {
	fs := c.flagSet("relay")
	batch := fs.Int("batch-size", 100, "rows one claim takes in a flow, and the first claim of a drain; 1 to 1000")
	maxBatch := fs.Int("max-batch-size", 1000, "rows a drain's claims grow to, doubling while they come back full; --batch-size to 1000 (--batch-size keeps every claim at it)")
	poll := fs.Duration("poll-interval", 250*time.Millisecond, "the longest the relay waits for new rows when nothing woke it (PostgreSQL's NOTIFY and SQLite's file watch wake it at commit; on MySQL the poll tightens to 1 ms while rows flow); an idle relay sends one statement per poll")
	quietAbove := fs.Int("quiet-above", 600, "PostgreSQL: the flow, in records claimed per second over a second, above which the relay keeps the NOTIFY trigger quiet and polls instead (notifying commits go one per WAL flush); negative: never")
	listen := fs.String("listen", ":9464", `address of /metrics and /healthz; "" serves neither`)
	stats := fs.Duration("stats-interval", 15*time.Second, "how often the pending, oldest-pending and stuck gauges are read (one COUNT each time)")
	relayID := fs.String("relay-id", "", "this relay's name in locked_by and the logs (default host-pid-random)")
	brokerWait := fs.Duration("broker-wait", time.Minute, "how long the relay, as it starts, tries again to reach a RabbitMQ that does not answer (refused, timed out) before it exits 1; one that answers and refuses (credentials, vhost) or a host name that does not resolve fails at once; 0: at once")
	stallAfterFlag := fs.Duration("stall-after", 0, "/healthz answers 503 once no sweep has ended for this long: a relay held by a database that does not answer (default 2 × the 15 s publish timeout + max(--poll-interval, 10 s) + 30 s)")
	rest, err := c.parse(fs, args, "outboxctl relay [--amqp URL[,URL…]] [--batch-size N] [--max-batch-size N] [--poll-interval D] [--listen ADDR]")
	if err != nil {
		return err
	}
	if err := noArgs(fs, rest); err != nil {
		return err
	}
	switch {
	case *batch < 1 || *batch > 1000:
		return usagef("--batch-size: %d; want 1 to 1000", *batch)
	case *maxBatch < *batch || *maxBatch > 1000:
		return usagef("--max-batch-size: %d; want --batch-size (%d) to 1000", *maxBatch, *batch)
	case *poll < time.Millisecond:
		return usagef("--poll-interval: %s; want 1ms or more", *poll)
	case *stats <= 0:
		return usagef("--stats-interval: %s; want more than 0", *stats)
	case *stallAfterFlag < 0:
		return usagef("--stall-after: %s; want 0 (the default) or more", *stallAfterFlag)
	case len(*relayID) > 64:
		return usagef("--relay-id: longer than the 64 characters locked_by holds")
	case *relayID == sqldialect.RetryHold:
		return usagef("--relay-id: %q marks a failed keyed record's backoff in locked_by; choose another name", *relayID)
	case len(splitURLs(c.g.amqp)) == 0:
		return usagef("relay: no broker: pass --amqp or set OUTBOX_AMQP_URL (amqp://user:pass@host:5672/vhost, or a comma-separated list of a cluster's nodes)")
	}
	// The database's form is checked before anything is dialled: a flag
	// out of range or a DSN the relay cannot work with is the operator's
	// to mend, and a broker error would hide it.
	if t, err := parseTarget(c.g.db, true); err != nil {
		return err
	} else if t.readOnly {
		return usagef("--db %s: opened read-only (mode=ro); the relay writes its claims and marks", t.shown)
	}
	amqpURLs := splitURLs(c.g.amqp)
	shown := make([]string, len(amqpURLs))
	for i, u := range amqpURLs {
		shown[i] = redactURL(u)
	}
	amqpShown := strings.Join(shown, ",")

	log := slog.New(slog.NewTextHandler(c.stderr, nil))
	wlog := watermill.NewSlogLogger(log)

	reg := prometheus.NewRegistry()
	reg.MustRegister(
		collectors.NewGoCollector(),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
	)
	metrics, err := outbox.NewMetrics(reg)
	if err != nil {
		return err
	}
	// A URL that does not parse is a usage error, before any database. The
	// destination has the metrics from the start: the nodes that do not
	// answer the first connect count.
	// Named for the relay, so that an operator finds its connection on a
	// broker where every relay was "outboxctl relay" (a user review matched
	// source ports): --relay-id, else the host and process.
	name := *relayID
	if name == "" {
		host, _ := os.Hostname()
		name = host + "-" + strconv.Itoa(os.Getpid())
	}
	dest, err := outbox.NewAMQPDestination(outbox.AMQPConfig{URLs: amqpURLs, ConnectionName: "outboxctl relay " + name, Logger: wlog, Metrics: metrics})
	if err != nil {
		return usagef("--amqp %s: %v", amqpShown, err)
	}
	d, err := c.openOutbox()
	if err != nil {
		_ = dest.Close()
		return c.stoppedAtStart(err)
	}
	defer d.Close()

	// Bound before the broker is dialled: a port another process holds (a
	// second relay on the host) is the operator's to mend, and the relay
	// connected to RabbitMQ first, then stopped (a README review). After
	// the database, whose mistakes (a file that is not there) come first.
	var ln net.Listener
	var srv *http.Server
	shutDown := false // srv shut down as the relay stopped
	if *listen != "" {
		if ln, err = net.Listen("tcp", *listen); err != nil {
			_ = dest.Close()
			return fmt.Errorf("--listen %s: %v (a second relay on this host needs a --listen of its own, or \"\" for none)", *listen, err)
		}
		defer func() {
			if srv == nil { // not served: stopped before the relay ran
				_ = ln.Close()
			}
		}()
	}

	// healthy: 200 on /healthz while the forwarder runs and sweeps, 503
	// before it starts (while it waits for the broker, too: a probe that
	// timed out there killed the relay its wait was for, a code review),
	// from the moment it is told to stop, and while no sweep has ended for
	// stallAfter (a database that does not answer). /metrics is served as
	// the relay waits: the broker's connect failures are counted.
	var (
		healthy      atomic.Bool
		runningSince atomic.Int64
		running      atomic.Pointer[outbox.Forwarder]
	)
	stallAfter := *stallAfterFlag
	if stallAfter == 0 {
		stallAfter = stallBound(*poll)
	}
	reg.MustRegister(collectors.NewDBStatsCollector(d.db, "outbox"))
	served := make(chan error, 1)
	if ln != nil {
		mux := http.NewServeMux()
		mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
		mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) {
			fwd := running.Load()
			if !healthy.Load() || fwd == nil {
				http.Error(w, "not running", http.StatusServiceUnavailable)
				return
			}
			last := fwd.LastSweep()
			if last.IsZero() {
				last = time.Unix(0, runningSince.Load())
			}
			if idle := time.Since(last); idle > stallAfter {
				http.Error(w, fmt.Sprintf("stalled: no sweep has ended for %s (a statement or connection that does not answer holds the relay)", idle.Round(time.Second)), http.StatusServiceUnavailable)
				return
			}
			fmt.Fprintln(w, "ok")
		})
		srv = &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
		go func() { served <- srv.Serve(ln) }()
		log.Info("Serving /metrics and /healthz", "addr", ln.Addr().String())
		defer func() {
			if !shutDown { // returned before the relay ran
				_ = srv.Close()
				<-served
			}
		}()
	}

	// A broker that is down when the relay starts is waited for up to
	// --broker-wait (a relay that exited at once went into Kubernetes'
	// CrashLoopBackOff, and came back up to 5 minutes after the broker did,
	// where a running relay reconnects within seconds: an on-call drill);
	// a broker that answers and refuses, or a host that does not resolve,
	// is an operator's to fix, and said at once. One lost later is the
	// relay's to wait out (it backs off and claims nothing meanwhile).
	deadline := time.Now().Add(*brokerWait)
	for try := 0; ; try++ {
		connectCtx, cancel := context.WithTimeout(c.ctx, connectTimeout)
		err = dest.Connect(connectCtx)
		cancel()
		if err == nil || !brokerDown(err) || !time.Now().Before(deadline) || c.ctx.Err() != nil {
			break
		}
		if try == 0 {
			wlog.Error("outboxctl relay: RabbitMQ does not answer; trying again until --broker-wait passes", err,
				watermill.LogFields{"amqp": amqpShown, "broker_wait": brokerWait.String()})
		}
		select {
		case <-c.ctx.Done():
		case <-time.After(brokerRetry):
		}
	}
	if err != nil {
		_ = dest.Close()
		var amqpErr *amqp.Error
		switch {
		case errors.As(err, &amqpErr):
			err = fmt.Errorf("cannot connect to RabbitMQ at %s: %v", amqpShown, amqpErr)
		case len(amqpURLs) > 1:
			// Each node's failure, named by its host:port.
			err = fmt.Errorf("cannot connect to RabbitMQ at any of %s: %s", amqpShown, nodeFailures(err))
		default:
			err = fmt.Errorf("cannot connect to RabbitMQ at %s: %v", amqpShown, connectError(err))
		}
		return c.stoppedAtStart(err)
	}

	fwd, err := outbox.NewForwarder(d.db, dest, outbox.ForwarderConfig{
		Dialect:       d.dialect,
		Table:         c.g.table,
		BatchSize:     *batch,
		MaxBatchSize:  *maxBatch,
		MaxAttempts:   c.g.maxAttempts,
		PollInterval:  *poll,
		QuietAbove:    *quietAbove,
		RelayID:       *relayID,
		Logger:        wlog,
		Metrics:       metrics,
		StatsInterval: *stats,
	})
	if err != nil {
		_ = dest.Close() // the forwarder owns it only once made
		return usagef("%v", err)
	}

	running.Store(fwd)
	ran := make(chan error, 1)
	go func() { ran <- fwd.Run(c.ctx) }()
	var runErr error
	select {
	case <-fwd.Running():
		runningSince.Store(time.Now().UnixNano())
		healthy.Store(true)
		log.Info("Relay running", "db", d.shown, "amqp", amqpShown, "table", c.g.table)
		select {
		case <-c.ctx.Done():
		case runErr = <-ran:
			ran = nil
		}
	case <-c.ctx.Done():
	case runErr = <-ran:
		ran = nil
	}
	healthy.Store(false)
	if c.ctx.Err() != nil {
		log.Info("Stop requested: finishing the batch in flight")
	}
	// Close waits for Run to finish the batches in flight (a publish
	// timeout at most, then their marks), then closes the connection. A
	// database that stopped answering (a partition: the connections stay
	// open, nothing comes back) would hold the statement in flight, and so
	// the stop, until the kernel gives the connection up, minutes later, past
	// any grace period: the stop is bounded, and nothing is lost to it (what
	// was not marked is sent again).
	closed := make(chan error, 1)
	go func() { closed <- fwd.Close() }()
	var closeErr error
	select {
	case closeErr = <-closed:
	case <-time.After(stopTimeout):
		log.Error("The relay did not stop within the bound: the database or the broker does not answer. Exiting; what it claimed and did not mark is released when its transactions or leases end, and sent again", "bound", stopTimeout)
		return fmt.Errorf("relay did not stop within %s", stopTimeout)
	}
	if ran != nil {
		runErr = <-ran
		if c.ctx.Err() != nil && errors.Is(runErr, outbox.ErrForwarderClosed) {
			runErr = nil // stopped before Run had begun
		}
	}
	if srv != nil {
		shutDown = true
		shutCtx, cancel := context.WithTimeout(context.Background(), shutdownTimeout)
		_ = srv.Shutdown(shutCtx)
		cancel()
		<-served
	}
	if closeErr != nil {
		// Nothing is lost: the rows were marked before the connection closed.
		log.Warn("Closing the RabbitMQ connection failed", "error", closeErr)
	}
	if runErr != nil {
		return fmt.Errorf("relay stopped: %w", runErr)
	}
	if c.ctx.Err() == nil {
		return errors.New("relay stopped on its own")
	}
	log.Info("Relay stopped")
	return nil
}

// stoppedAtStart is the relay's answer to err, a failure to open the
// database or to connect to the broker as it starts: a relay told to stop
// meanwhile (SIGINT, SIGTERM) exits 0, as a stop does, having said on
// stderr what it was doing (a node that refused it, say); not a usage
// error, which exits 2 whatever.
func (c *cli) stoppedAtStart(err error) error {
	var usage *usageError
	if c.ctx.Err() == nil || errors.As(err, &usage) {
		return err
	}
	fmt.Fprintf(c.stderr, "outboxctl: relay stopped as it started: %s\n", oneLine(err.Error()))
	return nil
}

// brokerRetry is the pause between two connects of a relay waiting, as it
// starts, for a broker that does not answer.
const brokerRetry = 2 * time.Second

// brokerDown reports whether err, a connect's, says a node did not answer
// (refused, timed out, unreachable), which waiting may mend: not every
// node a broker that answered and refused (an *amqp.Error: credentials,
// vhost, a handshake) or a host name that does not resolve. One node of
// several that does not resolve (a cluster's pod restarting under a
// headless service's name) ended the wait while the others were only down
// (a code review).
func brokerDown(err error) bool {
	var nodes interface{ Unwrap() []error }
	if errors.As(err, &nodes) {
		return slices.ContainsFunc(nodes.Unwrap(), nodeDown)
	}
	return nodeDown(err)
}

// nodeDown is brokerDown of one node's failure.
func nodeDown(err error) bool {
	if amqpwire.Refused(err) {
		return false
	}
	var dnsErr *net.DNSError
	return !errors.As(err, &dnsErr) || !dnsErr.IsNotFound
}
