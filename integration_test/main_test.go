package integration_test

import (
	"context"
	"fmt"
	"io"
	stdlog "log"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/go-sql-driver/mysql"
	"github.com/jmoiron/sqlx"

	outbox "github.com/acemq/watermill-outbox"
	_ "github.com/acemq/watermill-outbox/internal/testdb" // registers the pgx, mysql and sqlite3 drivers
)

// The environment of a relay process. The test binary started with envRelay
// set is not a test run but a relay: the end-to-end test starts it, kills it
// with SIGKILL at moments of its choosing, and starts it again, as an
// orchestrator would restart a crashed service.
const (
	envRelay       = "OUTBOX_E2E_RELAY"        // set: run as a relay process
	envRelayDriver = "OUTBOX_E2E_RELAY_DRIVER" // database/sql driver name
	envRelayDSN    = "OUTBOX_E2E_RELAY_DSN"    // the relay's own DSN (own application_name or user)
	envRelayAMQP   = "OUTBOX_E2E_RELAY_AMQP"   // broker URL
	envRelayConn   = "OUTBOX_E2E_RELAY_CONN"   // RabbitMQ connection name, so chaos closes only ours
	// envRelayDie, "<point>:<n>", makes the relay SIGKILL itself at a point
	// of its n-th batch (see dyingDestination).
	envRelayDie   = "OUTBOX_E2E_RELAY_DIE"
	envRelayDebug = "OUTBOX_TEST_DEBUG"
)

// relayReady is the line a relay process prints on stdout once SIGTERM
// stops it cleanly; before that, SIGTERM kills it like any Go program.
const relayReady = "relay ready"

// TestMain lets the test binary double as the relay process of the
// end-to-end test (see relayMain).
func TestMain(m *testing.M) {
	if os.Getenv(envRelayDebug) == "" {
		// The driver logs every connection the chaos killed ("closing bad
		// idle connection"); database/sql retries those on its own.
		_ = mysql.SetLogger(stdlog.New(io.Discard, "", 0))
	}
	if os.Getenv(envRelay) != "" {
		os.Exit(relayMain())
	}
	os.Exit(m.Run())
}

// relayConfig is the relay process's Forwarder configuration: small batches
// so that a kill lands mid-stream often, a short poll (MySQL and SQLite have
// no LISTEN/NOTIFY, and the placers run in another process), a quick retry so
// that reconnecting after chaos takes milliseconds, and on SQLite a lease
// short enough that the rows a killed relay leased are free again within
// seconds (it must still outlast two publish timeouts).
var relayConfig = outbox.ForwarderConfig{
	BatchSize:      25,
	PollInterval:   200 * time.Millisecond,
	PublishTimeout: 3 * time.Second,
	Lease:          6 * time.Second,
	RetryMin:       20 * time.Millisecond,
	RetryMax:       500 * time.Millisecond,
}

// relayMain runs a Forwarder until SIGTERM (a clean stop: it finishes the
// batch in flight and exits 0) or SIGKILL. Its exit code tells the test what
// happened: 0 stopped cleanly, 2 could not start, 3 Run failed.
func relayMain() int {
	log := watermill.NewStdLoggerWithOut(os.Stderr, os.Getenv(envRelayDebug) != "", false)
	db, err := sqlx.Open(os.Getenv(envRelayDriver), os.Getenv(envRelayDSN))
	if err != nil {
		fmt.Fprintln(os.Stderr, "relay:", err)
		return 2
	}
	defer db.Close()
	db.SetMaxOpenConns(8)

	amqpDest, err := outbox.NewAMQPDestination(outbox.AMQPConfig{
		URLs:           []string{os.Getenv(envRelayAMQP)},
		ConnectionName: os.Getenv(envRelayConn),
		Logger:         log,
	})
	if err != nil {
		fmt.Fprintln(os.Stderr, "relay:", err)
		return 2
	}
	var dest outbox.Destination = amqpDest
	if spec := os.Getenv(envRelayDie); spec != "" {
		point, n, _ := strings.Cut(spec, ":")
		left, err := strconv.Atoi(n)
		if err != nil || left < 1 || (point != dieAfterConfirm && point != dieHoldingClaim) {
			fmt.Fprintf(os.Stderr, "relay: %s=%q: want %s:<n> or %s:<n>\n", envRelayDie, spec, dieAfterConfirm, dieHoldingClaim)
			return 2
		}
		dest = &dyingDestination{inner: amqpDest, point: point, left: left}
	}

	cfg := relayConfig
	cfg.Logger = log
	f, err := outbox.NewForwarder(db, dest, cfg)
	if err != nil {
		fmt.Fprintln(os.Stderr, "relay:", err)
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	go dieWithParent()
	// From here on SIGTERM stops the relay cleanly: tell the test.
	fmt.Fprintln(os.Stdout, relayReady)
	runErr := f.Run(ctx)
	closeErr := f.Close()
	if runErr != nil || closeErr != nil {
		fmt.Fprintf(os.Stderr, "relay: run: %v, close: %v\n", runErr, closeErr)
		return 3
	}
	fmt.Fprintln(os.Stderr, "relay: stopped cleanly")
	return 0
}

// The points at which a dyingDestination kills its relay.
const (
	// dieAfterConfirm: after Publish returned the broker's confirms and
	// before the Forwarder marks the rows, the one window in which a relay's
	// death duplicates messages. The rows stay pending, the next relay
	// publishes them again, and the consumer's inbox must absorb the copies.
	dieAfterConfirm = "after-confirm"
	// dieHoldingClaim: with a batch claimed and nothing of it sent. On
	// PostgreSQL and MySQL the claim's row locks die with the connection; on
	// SQLite the rows wait for their lease to run out.
	dieHoldingClaim = "holding-claim"
)

// dyingDestination is a Destination that wraps the AMQP one and SIGKILLs
// its own process at point of its left-th non-empty batch (for
// dieAfterConfirm, of its left-th batch with a confirmed record).
//
// Wrapping the destination costs the relay its pipelining (the Forwarder
// pipelines only through the library's own AMQPDestination), so the relays
// started in these modes also exercise the serial publish path.
type dyingDestination struct {
	inner *outbox.AMQPDestination
	point string
	left  int
}

func (d *dyingDestination) Publish(ctx context.Context, records []outbox.Record) []error {
	if d.point == dieHoldingClaim && len(records) > 0 {
		d.left--
		if d.left == 0 {
			die(fmt.Sprintf("%d records claimed, none sent; dying", len(records)))
		}
	}
	results := d.inner.Publish(ctx, records)
	confirmed := 0
	for _, err := range results {
		if err == nil {
			confirmed++
		}
	}
	if d.point == dieAfterConfirm && confirmed > 0 {
		d.left--
		if d.left == 0 {
			die(fmt.Sprintf("%d of %d records confirmed by the broker; dying before the mark", confirmed, len(records)))
		}
	}
	return results
}

// die SIGKILLs the process: no deferred call, no Close, nothing after.
func die(why string) {
	fmt.Fprintln(os.Stderr, "relay:", why)
	_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
	select {} // the signal is on its way
}

// Connect keeps the Forwarder's "claim nothing while the broker is down".
func (d *dyingDestination) Connect(ctx context.Context) error { return d.inner.Connect(ctx) }

// Close lets the Forwarder close the connection as it would the bare one.
func (d *dyingDestination) Close() error { return d.inner.Close() }

// dieWithParent ends the relay when the test process is gone (a test
// binary killed by its timeout runs no cleanup), so that no relay outlives
// the test run.
func dieWithParent() {
	parent := os.Getppid()
	for range time.Tick(250 * time.Millisecond) {
		if os.Getppid() != parent {
			_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
		}
	}
}
