package main

import (
	"cmp"
	"context"
	"errors"
	"flag"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/signal"
	"slices"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	amqp "github.com/rabbitmq/amqp091-go"
)

// The floor of the relay on PostgreSQL: the least any relay could do there,
// in a process of its own, on the same machine and at the same load as the
// relay's process variants, so that issue 17's targets can be read against
// what this machine allows rather than against a figure from elsewhere.
//
//	commit_to_broker_p50/p99_postgres_process_<rate>_floor  ms
//	commit_to_broker_p50/p99_postgres_process_<rate>_vs_floor
//	                       ratio, the relay's figure over the floor's, both from this run
//
//	commit_to_broker_p50/p99_postgres_process_<rate>_floor_poll  ms, and
//	commit_to_broker_p50/p99_postgres_process_<rate>_vs_floor_poll
//	                       the same with the NOTIFY trigger disabled and the
//	                       floor claiming every floorPoll
//
// The floor relay is the bench's own binary started as `outbox-bench
// floorrelay`: it runs one statement, with no transaction, that marks a
// batch of pending rows published and returns them, then publishes them on
// a confirm channel without waiting for the confirms (drained as they
// come), and claims again at once while its claims find rows. One round
// trip to the database and one write to the broker per batch, nothing
// else: no lease, no retries, no order kept across a failure, no wait for
// a confirm before the mark. It is not a relay anyone should run (a crash
// between its statement and the broker loses the batch); it is what a
// relay that is right can at best approach.
//
// When a claim finds nothing it waits: for a NOTIFY (it LISTENs on the
// channel the outbox's trigger sends to, and never keeps the trigger quiet,
// so every commit notifies, as in the _loud variants, and PostgreSQL
// serialises the notifying commits), or with --poll, for that long (the
// bench disables the trigger: the services' commits notify nobody, and an
// idle floor claims hundreds of times a second, which no relay should).

// floorArg, as the first argument, makes the bench the floor relay.
const floorArg = "floorrelay"

// floorBatch is the most rows one of the floor's statements takes: the
// relay's MaxBatchSize at its default, so that a backlog drains in as few
// statements.
const floorBatch = 500

// floorClaim marks the oldest pending rows published and returns them. The
// subquery locks them, skipping rows another statement holds, so that two
// wake-ups never send a row twice.
const floorClaim = `UPDATE acemq_outbox o SET published_at = now(), attempts = o.attempts + 1
WHERE o.id IN (SELECT id FROM acemq_outbox WHERE published_at IS NULL ORDER BY created_at, id LIMIT $1 FOR UPDATE SKIP LOCKED)
RETURNING o.id, o.exchange_name, o.routing_key, o.body, o.content_type, o.created_at`

// maybeFloorRelay runs the floor relay and exits when the bench was started
// as one.
func maybeFloorRelay() {
	if len(os.Args) > 1 && os.Args[1] == floorArg {
		os.Exit(floorRelayMain(os.Args[2:]))
	}
}

func floorRelayMain(args []string) int {
	fs := flag.NewFlagSet(floorArg, flag.ContinueOnError)
	dsn := fs.String("db", "", "PostgreSQL DSN of the outbox's database")
	url := fs.String("amqp", "", "RabbitMQ URL")
	listen := fs.String("listen", "127.0.0.1:0", "address of /metrics and /healthz")
	poll := fs.Duration("poll", 0, "claim again this long after a claim that found nothing, rather than at a NOTIFY (0: LISTEN)")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	if err := floorRelay(ctx, *dsn, *url, *listen, *poll); err != nil && ctx.Err() == nil {
		fmt.Fprintf(os.Stderr, "floorrelay: %v\n", err)
		return 1
	}
	return 0
}

// floorRelay runs until ctx ends. It serves process_cpu_seconds_total and
// outbox_forwarder_statements_total (its statements) on /metrics, and
// announces the address on stderr as outboxctl relay does, so that the
// bench measures it as it measures the relay (relayProcess).
func floorRelay(ctx context.Context, dsn, url, addr string, poll time.Duration) error {
	listener, err := pgx.Connect(ctx, dsn)
	if err != nil {
		return err
	}
	defer listener.Close(context.WithoutCancel(ctx))
	if poll == 0 {
		if _, err := listener.Exec(ctx, "LISTEN acemq_outbox"); err != nil {
			return err
		}
	}
	claimer, err := pgx.Connect(ctx, dsn)
	if err != nil {
		return err
	}
	defer claimer.Close(context.WithoutCancel(ctx))

	conn, err := amqp.DialConfig(url, amqp.Config{Properties: amqp.Table{"connection_name": "outbox-bench floor relay"}})
	if err != nil {
		return err
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return err
	}
	if err := ch.Confirm(false); err != nil {
		return err
	}
	confirms := ch.NotifyPublish(make(chan amqp.Confirmation, 1024))
	returns := ch.NotifyReturn(make(chan amqp.Return, 16))
	go func() {
		for range confirms {
		}
	}()
	go func() {
		for r := range returns {
			fmt.Fprintf(os.Stderr, "floorrelay: %s returned: %s\n", r.MessageId, r.ReplyText)
		}
	}()

	reg := prometheus.NewRegistry()
	statements := prometheus.NewCounter(prometheus.CounterOpts{Name: "outbox_forwarder_statements_total", Help: "Statements the floor relay sent."})
	reg.MustRegister(collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}), statements)
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusOK) })
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return err
	}
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }()
	defer func() {
		_ = srv.Close()
		<-served
	}()
	// The line relayProcess waits for (servingRE).
	fmt.Fprintf(os.Stderr, "Serving /metrics and /healthz addr=%s\n", ln.Addr())

	wake := make(chan struct{}, 1)
	heard := make(chan error, 1)
	listening, stopListening := context.WithCancel(ctx)
	if poll > 0 {
		stopListening() // the goroutine below ends at once
	} else {
		poll = 100 * time.Millisecond // a NOTIFY lost on a dropped connection
	}
	go func() {
		for {
			if _, err := listener.WaitForNotification(listening); err != nil {
				heard <- err
				return
			}
			select {
			case wake <- struct{}{}:
			default:
			}
		}
	}()
	defer func() {
		stopListening()
		if err := <-heard; err != nil && !errors.Is(err, context.Canceled) {
			fmt.Fprintf(os.Stderr, "floorrelay: LISTEN: %v\n", err)
		}
	}()

	type row struct {
		id, exchange, routingKey, body, contentType string
		createdAt                                   time.Time
	}
	var rows []row
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-wake:
		case <-time.After(poll):
		}
		for {
			rows = rows[:0]
			rs, err := claimer.Query(ctx, floorClaim, floorBatch)
			if err != nil {
				return err
			}
			for rs.Next() {
				var r row
				if err := rs.Scan(&r.id, &r.exchange, &r.routingKey, &r.body, &r.contentType, &r.createdAt); err != nil {
					rs.Close()
					return err
				}
				rows = append(rows, r)
			}
			rs.Close()
			statements.Inc()
			if err := rs.Err(); err != nil {
				return err
			}
			slices.SortFunc(rows, func(a, b row) int {
				return cmp.Or(a.createdAt.Compare(b.createdAt), cmp.Compare(a.id, b.id))
			})
			for _, r := range rows {
				err := ch.PublishWithContext(ctx, r.exchange, r.routingKey, true, false, amqp.Publishing{
					MessageId:    r.id,
					ContentType:  r.contentType,
					DeliveryMode: amqp.Persistent,
					Body:         []byte(r.body),
				})
				if err != nil {
					return fmt.Errorf("publishing %s: %w", r.id, err)
				}
			}
			if len(rows) == 0 {
				break
			}
		}
	}
}

// floorPoll is the floor's wait after a claim that found nothing, where
// no NOTIFY wakes it: a quarter of the relay's MinPollInterval, so that the
// wait adds 0.125 ms at the mean.
const floorPoll = 250 * time.Microsecond
