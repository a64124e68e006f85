package main

import (
	"context"
	"database/sql"
	"errors"
	"flag"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/acemq/watermill-outbox/internal/testdb"
)

// The floor of the relay: the least any relay could do on a database, in a
// process of its own, on the same machine and at the same load as the
// relay's process variants, so that issue 17's targets can be read against
// what this machine allows rather than against a figure from elsewhere.
//
//	commit_to_broker_p50/p99_<db>_process_<rate>_floor  ms
//	commit_to_broker_p50/p99_<db>_process_<rate>_vs_floor
//	                       ratio, the relay's figure over the floor's, both from this run
//	commit_to_broker_p50/p99_postgres_process_<rate>_floor_poll  ms, and
//	commit_to_broker_p50/p99_postgres_process_<rate>_vs_floor_poll
//	                       on PostgreSQL the floor is woken by NOTIFY; these are
//	                       it with the trigger disabled and claiming every floorPoll
//
// The floor relay is the bench's own binary started as `outbox-bench
// floorrelay`: it runs one statement, with no transaction, that marks a
// batch of pending rows published and returns them (on MySQL, which has no
// UPDATE … RETURNING, two: see mysqlFloor), then publishes them on
// a confirm channel without waiting for the confirms (drained as they
// come), and claims again at once while its claims find rows. One round
// trip to the database and one write to the broker per batch, nothing
// else: no lease, no retries, no order kept across a failure, no wait for
// a confirm before the mark. It is not a relay anyone should run (a crash
// between its statement and the broker loses the batch); it is what a
// relay that is right can at best approach.
//
// When a claim finds nothing it waits: on PostgreSQL for a NOTIFY (it
// LISTENs on the channel the outbox's trigger sends to, and never keeps the
// trigger quiet, so every commit notifies, as in the _loud variants, and
// PostgreSQL serialises the notifying commits), or with --poll, for that
// long (on PostgreSQL the bench then disables the trigger). MySQL and
// SQLite always poll: an idle floor claims thousands of times a second,
// which no relay should, and on SQLite each of its claims takes the write
// lock the services' commits wait for.

// floorArg, as the first argument, makes the bench the floor relay.
const floorArg = "floorrelay"

// floorBatch is the most rows one of the floor's claims takes: the relay's
// MaxBatchSize at its default, so that a backlog drains in as few
// statements.
const floorBatch = 500

// floorPoll is the floor's wait after a claim that found nothing, where no
// NOTIFY wakes it: a quarter of the relay's MinPollInterval, so that the
// wait adds 0.125 ms at the mean.
const floorPoll = 250 * time.Microsecond

// floorRow is what the floor publishes of a row.
type floorRow struct {
	id, exchange, routingKey, body, contentType string
}

// floorClaimer marks up to n pending rows published and returns them, the
// oldest first where the database says (the order of a batch does not
// move its latency).
type floorClaimer interface {
	claim(ctx context.Context, n int) ([]floorRow, error)
	// statements is how many statements a claim sends.
	statements() int
	close() error
}

// maybeFloorRelay runs the floor relay and exits when the bench was started
// as one.
func maybeFloorRelay() {
	if len(os.Args) > 1 && os.Args[1] == floorArg {
		os.Exit(floorRelayMain(os.Args[2:]))
	}
}

func floorRelayMain(args []string) int {
	fs := flag.NewFlagSet(floorArg, flag.ContinueOnError)
	kind := fs.String("kind", testdb.Postgres, "the database: postgres, mysql or sqlite")
	dsn := fs.String("db", "", "DSN of the outbox's database")
	url := fs.String("amqp", "", "RabbitMQ URL")
	listen := fs.String("listen", "127.0.0.1:0", "address of /metrics and /healthz")
	poll := fs.Duration("poll", 0, "claim again this long after a claim that found nothing (0 on PostgreSQL: at a NOTIFY)")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	if err := floorRelay(ctx, *kind, *dsn, *url, *listen, *poll); err != nil && ctx.Err() == nil {
		fmt.Fprintf(os.Stderr, "floorrelay: %v\n", err)
		return 1
	}
	return 0
}

// floorRelay runs until ctx ends. It serves process_cpu_seconds_total and
// outbox_forwarder_statements_total (its statements) on /metrics, and
// announces the address on stderr as outboxctl relay does, so that the
// bench measures it as it measures the relay (relayProcess).
func floorRelay(ctx context.Context, kind, dsn, url, addr string, poll time.Duration) error {
	var (
		c   floorClaimer
		err error
	)
	switch kind {
	case testdb.Postgres:
		c, err = newPostgresFloor(ctx, dsn)
	case testdb.MySQL:
		c, err = newMySQLFloor(ctx, dsn)
	case testdb.SQLite:
		c, err = newSQLiteFloor(ctx, dsn)
	default:
		err = fmt.Errorf("no floor for %q", kind)
	}
	if err != nil {
		return err
	}
	defer c.close()
	wake := make(chan struct{}, 1)
	if kind == testdb.Postgres && poll == 0 {
		stop, err := listenFloor(ctx, dsn, wake)
		if err != nil {
			return err
		}
		defer stop()
		poll = 100 * time.Millisecond // a NOTIFY lost on a dropped connection
	} else if poll <= 0 {
		return fmt.Errorf("%s: --poll must be positive", kind)
	}

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

	for {
		for {
			rows, err := c.claim(ctx, floorBatch)
			statements.Add(float64(c.statements()))
			if err != nil {
				return err
			}
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
		select {
		case <-ctx.Done():
			return nil
		case <-wake:
		case <-time.After(poll):
		}
	}
}

// listenFloor LISTENs on the outbox's NOTIFY channel on a connection of its
// own and signals wake at each notification, until stop.
func listenFloor(ctx context.Context, dsn string, wake chan<- struct{}) (stop func(), err error) {
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		return nil, err
	}
	if _, err := conn.Exec(ctx, "LISTEN acemq_outbox"); err != nil {
		_ = conn.Close(ctx)
		return nil, err
	}
	listening, cancel := context.WithCancel(ctx)
	heard := make(chan error, 1)
	go func() {
		for {
			if _, err := conn.WaitForNotification(listening); err != nil {
				heard <- err
				return
			}
			select {
			case wake <- struct{}{}:
			default:
			}
		}
	}()
	return func() {
		cancel()
		if err := <-heard; err != nil && !errors.Is(err, context.Canceled) {
			fmt.Fprintf(os.Stderr, "floorrelay: LISTEN: %v\n", err)
		}
		_ = conn.Close(context.WithoutCancel(ctx))
	}, nil
}

// postgresFloor claims in one statement: the subquery locks the oldest
// pending rows, skipping rows another statement holds.
type postgresFloor struct{ conn *pgx.Conn }

func newPostgresFloor(ctx context.Context, dsn string) (*postgresFloor, error) {
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		return nil, err
	}
	return &postgresFloor{conn: conn}, nil
}

func (f *postgresFloor) claim(ctx context.Context, n int) ([]floorRow, error) {
	rs, err := f.conn.Query(ctx, `UPDATE acemq_outbox o SET published_at = now(), attempts = o.attempts + 1
WHERE o.id IN (SELECT id FROM acemq_outbox WHERE published_at IS NULL ORDER BY created_at, id LIMIT $1 FOR UPDATE SKIP LOCKED)
RETURNING o.id, o.exchange_name, o.routing_key, o.body, o.content_type`, n)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rs, func(row pgx.CollectableRow) (r floorRow, err error) {
		err = row.Scan(&r.id, &r.exchange, &r.routingKey, &r.body, &r.contentType)
		return r, err
	})
}

func (*postgresFloor) statements() int { return 1 }

func (f *postgresFloor) close() error { return f.conn.Close(context.Background()) }

// mysqlFloor claims in two statements on one connection, both outside a
// transaction: an UPDATE that sets the oldest pending rows' published_at to
// an instant of its own (in 1970, unique to the claim: the floor runs
// alone, and its database is dropped after), then a SELECT of the rows at
// that instant, a range of the pending index (published_at, created_at,
// id). READ COMMITTED, so that the UPDATE locks the rows it changes and no
// gap a service's insert waits for.
type mysqlFloor struct {
	db     *sql.DB
	conn   *sql.Conn
	claims int64
}

func newMySQLFloor(ctx context.Context, dsn string) (*mysqlFloor, error) {
	db, err := sql.Open("mysql", dsn)
	if err != nil {
		return nil, err
	}
	conn, err := db.Conn(ctx)
	if err == nil {
		_, err = conn.ExecContext(ctx, "SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
	}
	if err != nil {
		_ = db.Close()
		return nil, err
	}
	return &mysqlFloor{db: db, conn: conn}, nil
}

func (f *mysqlFloor) claim(ctx context.Context, n int) ([]floorRow, error) {
	f.claims++
	at := time.Unix(0, 0).UTC().Add(time.Duration(f.claims) * time.Microsecond).Format("2006-01-02 15:04:05.000000")
	res, err := f.conn.ExecContext(ctx, "UPDATE acemq_outbox SET published_at = ?, attempts = attempts + 1 WHERE published_at IS NULL ORDER BY published_at, created_at, id LIMIT ?", at, n)
	if err != nil {
		return nil, err
	}
	if changed, err := res.RowsAffected(); err != nil || changed == 0 {
		return nil, err
	}
	return scanFloorRows(f.conn.QueryContext(ctx, "SELECT id, exchange_name, routing_key, body, content_type FROM acemq_outbox WHERE published_at = ? ORDER BY created_at, id", at))
}

// statements: a claim that finds nothing sends one; counted as two, the
// idle floor's figure is its most.
func (*mysqlFloor) statements() int { return 2 }

func (f *mysqlFloor) close() error { return errors.Join(f.conn.Close(), f.db.Close()) }

// sqliteFloor claims in one statement, as on PostgreSQL: SQLite has one
// writer, so nothing need be skipped.
type sqliteFloor struct{ db *sql.DB }

func newSQLiteFloor(ctx context.Context, dsn string) (*sqliteFloor, error) {
	db, err := sql.Open("sqlite3", dsn)
	if err != nil {
		return nil, err
	}
	db.SetMaxOpenConns(1)
	if err := db.PingContext(ctx); err != nil {
		_ = db.Close()
		return nil, err
	}
	return &sqliteFloor{db: db}, nil
}

func (f *sqliteFloor) claim(ctx context.Context, n int) ([]floorRow, error) {
	return scanFloorRows(f.db.QueryContext(ctx, `UPDATE acemq_outbox SET published_at = strftime('%Y-%m-%d %H:%M:%f', 'now'), attempts = attempts + 1
WHERE id IN (SELECT id FROM acemq_outbox WHERE published_at IS NULL ORDER BY created_at, id LIMIT ?)
RETURNING id, exchange_name, routing_key, body, content_type`, n))
}

func (*sqliteFloor) statements() int { return 1 }

func (f *sqliteFloor) close() error { return f.db.Close() }

func scanFloorRows(rs *sql.Rows, err error) ([]floorRow, error) {
	if err != nil {
		return nil, err
	}
	defer rs.Close()
	var rows []floorRow
	for rs.Next() {
		var r floorRow
		if err := rs.Scan(&r.id, &r.exchange, &r.routingKey, &r.body, &r.contentType); err != nil {
			return nil, err
		}
		rows = append(rows, r)
	}
	return rows, rs.Err()
}
