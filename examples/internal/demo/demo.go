// Package demo is what the example programs share and what is not the point
// of any of them: their command line and its exit codes (Command), opening
// the database a -db flag names (SQLite in a temporary file when it names
// none), checking that RabbitMQ answers before anything starts, the router
// of a program's consumers, each behind an inbox of its own, and its relays
// (Service), a JSON message written into a transaction or returned by a
// handler, and read behind the inbox (PublishJSON, NewJSONMessage,
// InboxHandler, InboxReturningHandler, AtMostOnceHandler), counting a run's
// own rows, and waiting for a condition with a deadline. What a program is
// about, its business transaction, its handlers' effects, how its inboxes
// and its router are set up, and its report, stays in the program.
package demo

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/go-sql-driver/mysql"
	_ "github.com/jackc/pgx/v5/stdlib" // registers "pgx"
	"github.com/jmoiron/sqlx"
	_ "github.com/mattn/go-sqlite3" // registers "sqlite3"
	amqp "github.com/rabbitmq/amqp091-go"

	outbox "github.com/acemq/watermill-outbox"
)

// defaultAMQPURL is the broker of `docker compose up -d rabbitmq`.
const defaultAMQPURL = "amqp://guest:guest@localhost:5672/"

// sqliteParams: BEGIN IMMEDIATE and a busy timeout, so that the relay, the
// consumer and the program's own writes wait for each other instead of
// failing with SQLITE_BUSY; WAL, so that readers do not block the writer.
const sqliteParams = "_txlock=immediate&_busy_timeout=5000&_journal_mode=WAL&_synchronous=FULL"

// DB is the database of an example.
type DB struct {
	*sqlx.DB
	Dialect outbox.Dialect
	// DSN opens the same database again, from another process.
	DSN string
	// Where names it for people, without its password.
	Where string
	tmp   string // the temporary directory of a default SQLite database
}

// OpenDB opens the database dsn names: a PostgreSQL URL (postgres://…), a
// MySQL DSN (user@tcp(host:port)/db) or an SQLite file (file:….db). An empty
// dsn is a new SQLite database in a temporary directory, named file, which
// Close removes.
func OpenDB(ctx context.Context, dsn, file string) (*DB, error) {
	db := &DB{DSN: dsn}
	driver := ""
	switch {
	case dsn == "":
		dir, err := os.MkdirTemp("", strings.TrimSuffix(file, filepath.Ext(file))+"-")
		if err != nil {
			return nil, err
		}
		path := filepath.Join(dir, file)
		driver, db.Dialect, db.tmp = "sqlite3", outbox.SQLite, dir
		db.DSN, db.Where = "file:"+path+"?"+sqliteParams, "SQLite "+path+" (temporary)"
	case strings.HasPrefix(dsn, "postgres://"), strings.HasPrefix(dsn, "postgresql://"):
		driver, db.Dialect, db.Where = "pgx", outbox.Postgres, "PostgreSQL "+redactURL(dsn)
	case strings.HasPrefix(dsn, "file:"), strings.HasSuffix(dsn, ".db"), strings.HasSuffix(dsn, ".sqlite"):
		if !strings.HasPrefix(dsn, "file:") {
			db.DSN = "file:" + dsn
		}
		if !strings.Contains(db.DSN, "?") {
			db.DSN += "?" + sqliteParams
		}
		driver, db.Dialect, db.Where = "sqlite3", outbox.SQLite, "SQLite "+strings.TrimPrefix(strings.SplitN(db.DSN, "?", 2)[0], "file:")
	case strings.Contains(dsn, "@tcp("), strings.Contains(dsn, "@unix("), strings.HasPrefix(dsn, "tcp("), strings.HasPrefix(dsn, "unix("):
		cfg, err := mysql.ParseDSN(dsn)
		if err != nil {
			return nil, fmt.Errorf("-db: %w", err)
		}
		cfg.ParseTime = true
		db.DSN = cfg.FormatDSN()
		if cfg.Passwd != "" {
			cfg.Passwd = "***"
		}
		driver, db.Dialect, db.Where = "mysql", outbox.MySQL, "MySQL "+cfg.FormatDSN()
	default:
		return nil, fmt.Errorf("-db %q: want a PostgreSQL URL (postgres://user@host:5432/db), a MySQL DSN (user@tcp(host:3306)/db) or an SQLite file (file:/path/to/shop.db)", dsn)
	}
	var err error
	if db.DB, err = sqlx.Open(driver, db.DSN); err != nil {
		_ = db.Close()
		return nil, err
	}
	pingCtx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if err := db.PingContext(pingCtx); err != nil {
		_ = db.Close()
		return nil, fmt.Errorf("no database at %s (%v)", db.Where, err)
	}
	return db, nil
}

// Close closes the pool, and removes a temporary database.
func (db *DB) Close() error {
	var err error
	if db.DB != nil {
		err = db.DB.Close()
	}
	if db.tmp != "" {
		err = errors.Join(err, os.RemoveAll(db.tmp))
	}
	return err
}

// checkBroker dials RabbitMQ once, with a short timeout, so that a program
// without a broker says so in one line instead of retrying in the
// background. Of a cluster's nodes, one that answers is enough.
func checkBroker(amqpURLs string) error {
	urls := SplitURLs(amqpURLs)
	if len(urls) == 0 {
		return errors.New("-amqp: no RabbitMQ URL")
	}
	dial, err := outbox.FailoverDial(urls, 3*time.Second, nil)
	if err != nil {
		return fmt.Errorf("-amqp: %w", err)
	}
	conn, err := amqp.DialConfig(urls[0], amqp.Config{Dial: dial})
	if err != nil {
		var netErr net.Error
		if errors.As(err, &netErr) {
			return fmt.Errorf("no RabbitMQ at %s (%v); start one with: docker compose up -d rabbitmq", redactURLs(amqpURLs), err)
		}
		return fmt.Errorf("RabbitMQ at %s refused the connection (%v)", redactURLs(amqpURLs), err)
	}
	return conn.Close()
}

// SplitURLs reads an -amqp flag: one broker URL, or a cluster's nodes'
// separated by commas.
func SplitURLs(s string) []string {
	var urls []string
	for _, u := range strings.Split(s, ",") {
		if u = strings.TrimSpace(u); u != "" {
			urls = append(urls, u)
		}
	}
	return urls
}

// redactURLs hides the passwords of an -amqp flag's URLs.
func redactURLs(s string) string {
	urls := SplitURLs(s)
	for i, u := range urls {
		urls[i] = redactURL(u)
	}
	return strings.Join(urls, ",")
}

// redactURL hides the password of a URL.
func redactURL(s string) string {
	u, err := url.Parse(s)
	if err != nil {
		return "(a URL that does not parse)"
	}
	if _, ok := u.User.Password(); !ok {
		return s
	}
	return strings.Replace(s, u.User.String()+"@", u.User.Username()+":***@", 1)
}

// subscriber consumes from the durable queue, bound to the durable topic
// exchange with the router handler's topic as the routing key. It declares
// all three when the router subscribes, so they exist before anything is
// published. outbox.AMQPMarshaler reads what relays of every AceMQ library
// send: headers of any AMQP type, and the id without Watermill's UUID header.
//
// The queue is a quorum queue: on a cluster it keeps its messages on a
// majority of the nodes and confirms a publish once they have it, so a node
// that goes down loses none of them and the relay's confirms mean what they
// say. (Classic mirrored queues, the former way, are deprecated since
// RabbitMQ 3.9 and gone in 4.0.) On a single node it costs little, and the
// program runs the same on both. amqpURLs is one URL or a cluster's nodes';
// the subscriber's connection fails over between them
// (outbox.FailoverDial), and watermill-amqp consumes again once it has
// reconnected.
func subscriber(amqpURLs, exchange, queue string, logger watermill.LoggerAdapter) (*wamqp.Subscriber, error) {
	urls := SplitURLs(amqpURLs)
	if len(urls) == 0 {
		return nil, errors.New("no RabbitMQ URL")
	}
	dial, err := outbox.FailoverDial(urls, 0, logger)
	if err != nil {
		return nil, err
	}
	cfg := wamqp.NewDurableTopicConfig(urls[0], exchange, queue)
	cfg.Connection.AmqpConfig = &amqp.Config{Dial: dial}
	cfg.Exchange.Durable = true // NewDurableTopicConfig leaves the exchange transient
	cfg.Queue.Arguments = amqp.Table{amqp.QueueTypeArg: amqp.QueueTypeQuorum}
	cfg.Marshaler = outbox.AMQPMarshaler{}
	return wamqp.NewSubscriber(cfg, logger)
}

// WaitFor asks cond every 50 ms until it reports true or fails, or timeout
// passes (context.DeadlineExceeded).
func WaitFor(ctx context.Context, timeout time.Duration, cond func(context.Context) (bool, error)) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	for {
		ok, err := cond(ctx)
		if err != nil || ok {
			return err
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-tick.C:
		}
	}
}

// syncWriter serialises writes to w: the relay, the router and the program
// all report to the same stderr.
type syncWriter struct {
	mu sync.Mutex
	w  io.Writer
}

func (s *syncWriter) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.w.Write(p)
}

// CountIn runs a COUNT query whose "IN (?)" takes ids, and is 0 for no ids.
// The examples count their own rows: the database may hold other runs'.
func (db *DB) CountIn(ctx context.Context, query string, ids []string) (int, error) {
	if len(ids) == 0 {
		return 0, nil
	}
	q, args, err := sqlx.In(query, ids)
	if err != nil {
		return 0, err
	}
	var n int
	err = db.GetContext(ctx, &n, db.Rebind(q), args...)
	return n, err
}

// CountPublished is how many of the messages ids a relay has marked
// published. A message the broker confirmed to a relay that died before the
// mark does not count: the next relay publishes it again.
func (db *DB) CountPublished(ctx context.Context, ids []string) (int, error) {
	return db.CountIn(ctx, "SELECT COUNT(*) FROM acemq_outbox WHERE published_at IS NOT NULL AND id IN (?)", ids)
}

// NewTable is a report's table on w: columns two spaces apart. Flush
// writes it.
func NewTable(w io.Writer) *tabwriter.Writer { return tabwriter.NewWriter(w, 0, 0, 2, ' ', 0) }

// CountPerID runs a "SELECT id, COUNT(*) … IN (?) GROUP BY id" query over ids
// and returns the count of each id that has rows.
func (db *DB) CountPerID(ctx context.Context, query string, ids []string) (map[string]int, error) {
	counts := map[string]int{}
	if len(ids) == 0 {
		return counts, nil
	}
	q, args, err := sqlx.In(query, ids)
	if err != nil {
		return nil, err
	}
	rows, err := db.QueryxContext(ctx, db.Rebind(q), args...)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	for rows.Next() {
		var id string
		var n int
		if err := rows.Scan(&id, &n); err != nil {
			return nil, err
		}
		counts[id] = n
	}
	return counts, rows.Err()
}
