package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"
	amqp "github.com/rabbitmq/amqp091-go"
	"go.uber.org/goleak"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testamqp"
	"github.com/acemq/watermill-outbox/internal/testdb"
	"github.com/acemq/watermill-outbox/internal/testrelay"
)

// eachMigrated runs fn as a subtest on an isolated database of every kind, the outbox schema applied.
func eachMigrated(t *testing.T, fn func(t *testing.T, db *testdb.DB, d outbox.Dialect)) {
	t.Helper()
	testdb.Each(t, func(t *testing.T, db *testdb.DB) {
		fn(t, db, migrate(t, db))
	})
}

// migrated returns a new database of kind holding the outbox schema.
func migrated(t testing.TB, kind string) *testdb.DB {
	t.Helper()
	db := testdb.New(t, kind)
	migrate(t, db)
	return db
}

// migrate applies the outbox schema to db and returns its dialect.
func migrate(t testing.TB, db *testdb.DB) outbox.Dialect {
	t.Helper()
	d := dialectOf(t, db)
	if err := outbox.Migrate(context.Background(), db.DB.DB, d); err != nil {
		t.Fatalf("migrate: %v", err)
	}
	return d
}

// dialectOf is the outbox dialect of db's driver.
func dialectOf(t testing.TB, db *testdb.DB) outbox.Dialect {
	t.Helper()
	d, ok := map[string]outbox.Dialect{testdb.Postgres: outbox.Postgres, testdb.MySQL: outbox.MySQL, testdb.SQLite: outbox.SQLite}[db.Kind]
	if !ok {
		t.Fatalf("no dialect for database kind %q", db.Kind)
	}
	return d
}

// placeholder is db's SQL placeholder for the nth argument: $n on PostgreSQL, ? elsewhere.
func placeholder(db *testdb.DB, n int) string {
	if db.Kind == testdb.Postgres {
		return fmt.Sprintf("$%d", n)
	}
	return "?"
}

// publishAllAt marks every row of db's acemq_outbox published at at, as a
// relay long ago would have.
func publishAllAt(t testing.TB, db *testdb.DB, at time.Time) {
	t.Helper()
	var arg any = at.UTC()
	if db.Kind != testdb.Postgres {
		arg = at.UTC().Format("2006-01-02 15:04:05.000000")
	}
	if _, err := db.Exec(db.Rebind("UPDATE acemq_outbox SET published_at = ?"), arg); err != nil {
		t.Fatal(err)
	}
}

// countRows counts the rows of acemq_outbox, published or not.
func countRows(t testing.TB, db *testdb.DB) int {
	t.Helper()
	var n int
	if err := db.Get(&n, "SELECT COUNT(*) FROM acemq_outbox"); err != nil {
		t.Fatalf("counting acemq_outbox: %v", err)
	}
	return n
}

// publishInTx publishes msgs on topic in one transaction and commits it.
func publishInTx(t testing.TB, db *testdb.DB, topic string, msgs []*message.Message, cfg ...outbox.TxPublisherConfig) {
	t.Helper()
	if err := commitPublish(db, topic, msgs, cfg...); err != nil {
		t.Fatal(err)
	}
}

// commitPublish is publishInTx reporting its error rather than failing
// the test: for other goroutines than the test's.
func commitPublish(db *testdb.DB, topic string, msgs []*message.Message, cfg ...outbox.TxPublisherConfig) error {
	tx, err := db.Beginx()
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback() }()
	pub, err := outbox.NewTxPublisher(tx, cfg...)
	if err != nil {
		return err
	}
	if err := pub.Publish(topic, msgs...); err != nil {
		return fmt.Errorf("publish: %w", err)
	}
	if err := tx.Commit(); err != nil {
		return fmt.Errorf("commit: %w", err)
	}
	return nil
}

// publishN commits n messages on topic, one transaction each, and returns their ids in order.
func publishN(t testing.TB, db *testdb.DB, exchange, topic string, n int) []string {
	t.Helper()
	ids := make([]string, n)
	for i := range ids {
		msg := message.NewMessage(watermill.NewUUID(), []byte(fmt.Sprintf(`{"n":%d}`, i)))
		ids[i] = msg.UUID
		publishInTx(t, db, topic, []*message.Message{msg}, outbox.TxPublisherConfig{Exchange: exchange})
	}
	return ids
}

// publishBatch commits n messages on topic in one transaction and returns them.
func publishBatch(t testing.TB, db *testdb.DB, exchange, topic string, n int) []*message.Message {
	t.Helper()
	msgs := make([]*message.Message, n)
	for i := range msgs {
		msgs[i] = message.NewMessage(watermill.NewUUID(), []byte("x"))
	}
	publishInTx(t, db, topic, msgs, outbox.TxPublisherConfig{Exchange: exchange})
	return msgs
}

// publishOrdered commits one message per (id, routing key), in this order, in one transaction.
func publishOrdered(t testing.TB, db *testdb.DB, exchange string, idKeys ...[2]string) {
	t.Helper()
	tx, err := db.Beginx()
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback() }()
	pub, err := outbox.NewTxPublisher(tx, outbox.TxPublisherConfig{Exchange: exchange})
	if err != nil {
		t.Fatal(err)
	}
	for _, ik := range idKeys {
		if err := pub.Publish(ik[1], message.NewMessage(ik[0], []byte(ik[0]))); err != nil {
			t.Fatal(err)
		}
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
}

// insertRaw writes a row as another library or a person might, bypassing TxPublisher's checks.
func insertRaw(t testing.TB, db *testdb.DB, id, exchange, routingKey, headers, bodyEncoding string) {
	t.Helper()
	q := db.Rebind("INSERT INTO acemq_outbox (id, exchange_name, routing_key, body, body_encoding, content_type, headers, created_at) VALUES (?, ?, ?, 'x', ?, 'text/plain', ?, ?)")
	var created any = time.Now().UTC()
	if db.Kind != testdb.Postgres {
		created = time.Now().UTC().Format("2006-01-02 15:04:05.000000")
	}
	if _, err := db.Exec(q, id, exchange, routingKey, bodyEncoding, headers, created); err != nil {
		t.Fatal(err)
	}
}

// newForwarder returns a forwarder over db to the test broker, closed when the test ends.
func newForwarder(t testing.TB, db *testdb.DB, cfg outbox.ForwarderConfig, amqpCfg ...outbox.AMQPConfig) *outbox.Forwarder {
	t.Helper()
	return testrelay.New(t, db.DB, cfg, amqpCfg...)
}

// sweepAll sweeps until a sweep publishes nothing, and returns the total.
func sweepAll(t testing.TB, f *outbox.Forwarder) int {
	t.Helper()
	total := 0
	for {
		n, err := f.Sweep(context.Background())
		total += n
		if err != nil {
			t.Fatalf("sweep: %v", err)
		}
		if n == 0 {
			return total
		}
	}
}

// pendingCount is the forwarder's backlog; -1 while the database refuses (its connections killed, say).
func pendingCount(t testing.TB, f *outbox.Forwarder) int64 {
	t.Helper()
	st, err := f.Store().Stats(context.Background())
	if err != nil {
		t.Logf("stats: %v", err)
		return -1
	}
	return st.Pending
}

// rowState is what the relay has done to an outbox row, as stateOf reads it back.
type rowState struct {
	Published bool
	Attempts  int
	LastError string
}

// stateOf reads the relay's state of row id: published, attempts, last_error.
func stateOf(t testing.TB, db *testdb.DB, id string) rowState {
	t.Helper()
	var r struct {
		Published bool    `db:"published"`
		Attempts  int     `db:"attempts"`
		LastError *string `db:"last_error"`
	}
	q := "SELECT published_at IS NOT NULL AS published, attempts, last_error FROM acemq_outbox WHERE id = " + placeholder(db, 1)
	if err := db.Get(&r, q, id); err != nil {
		t.Fatalf("row %s: %v", id, err)
	}
	s := rowState{Published: r.Published, Attempts: r.Attempts}
	if r.LastError != nil {
		s.LastError = *r.LastError
	}
	return s
}

// countIDs counts deliveries per x-acemq-id.
func countIDs(ds []amqp.Delivery) map[string]int {
	m := map[string]int{}
	for _, d := range ds {
		m[d.MessageId]++
	}
	return m
}

// testamqpDeleteQueue deletes a queue that a Watermill subscriber declared.
func testamqpDeleteQueue(t testing.TB, name string) {
	t.Helper()
	testamqp.New(t).With(func(ch *amqp.Channel) error { _, err := ch.QueueDelete(name, false, false, false); return err })
}

// waitFor polls cond until it holds or the deadline passes.
func waitFor(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", timeout, what)
		}
		time.Sleep(20 * time.Millisecond) // polling a condition, with a deadline
	}
}

// ignorePools ignores the goroutines a database/sql driver keeps per pooled connection: the pool's, not the code's.
var ignorePools = goleak.IgnoreTopFunction("github.com/go-sql-driver/mysql.(*mysqlConn).startWatcher.func1")

// killableRelayConfig keeps a killed relay's SQLite lease short, so its rows are not a minute in waiting.
var killableRelayConfig = outbox.ForwarderConfig{PublishTimeout: time.Second, Lease: 2 * time.Second}

// createEffects makes the handler's business table, with no key: a second effect of a message is a second row.
func createEffects(t testing.TB, db *testdb.DB) {
	t.Helper()
	if _, err := db.Exec("CREATE TABLE effects (message_id varchar(64) NOT NULL, note varchar(255) NOT NULL)"); err != nil {
		t.Fatal(err)
	}
}

// countEffects counts the effects the handler made for message id.
func countEffects(t testing.TB, db *testdb.DB, id string) int {
	t.Helper()
	var n int
	if err := db.Get(&n, db.Rebind("SELECT COUNT(*) FROM effects WHERE message_id = ?"), id); err != nil {
		t.Fatal(err)
	}
	return n
}

// writeEffect is a handler that makes its effect in the inbox's transaction.
func writeEffect(t testing.TB, db *testdb.DB, ran *atomic.Int32) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		ran.Add(1)
		tx, ok := outbox.TxFromContext(msg.Context())
		if !ok {
			return nil, errors.New("no transaction in the message context")
		}
		_, err := tx.ExecContext(msg.Context(), db.Rebind("INSERT INTO effects (message_id, note) VALUES (?, ?)"), msg.UUID, string(msg.Payload))
		return nil, err
	}
}

// newInbox returns an inbox over db, its consumer named fulfilment unless cfg names one.
func newInbox(t testing.TB, db *testdb.DB, cfg outbox.InboxConfig) *outbox.Inbox {
	t.Helper()
	if cfg.ConsumerName == "" {
		cfg.ConsumerName = "fulfilment"
	}
	in, err := outbox.NewInbox(db.DB, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return in
}

// runInBackground runs f until the test ends, then stops it and fails t
// if Run failed.
func runInBackground(t *testing.T, f *outbox.Forwarder) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	ran := make(chan error, 1)
	go func() { ran <- f.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-ran; err != nil {
			t.Error(err)
		}
	})
	<-f.Running()
}

// runUntil runs f until cond holds (within timeout), then stops it and
// fails t if Run failed.
func runUntil(t *testing.T, f *outbox.Forwarder, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- f.Run(ctx) }()
	defer func() { _ = f.Close() }()
	waitFor(t, timeout, what, cond)
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

// newRole creates a login role of the test's own on db's PostgreSQL server,
// grants it grants (each "GRANT <grant> TO role"), drops it when the test
// ends, and returns it with a pool that logs in as it (without a password,
// as the test server trusts), with searchPath when it is not "".
func newRole(t testing.TB, db *testdb.DB, searchPath string, grants ...string) (string, *testdb.DB) {
	t.Helper()
	role := "r_" + db.Name
	qs := []string{"CREATE ROLE " + role + " LOGIN"}
	for _, g := range grants {
		qs = append(qs, "GRANT "+g+" TO "+role)
	}
	t.Cleanup(func() {
		_, _ = db.Exec("DROP OWNED BY " + role)
		_, _ = db.Exec("DROP ROLE " + role)
	})
	for _, q := range qs {
		if _, err := db.Exec(q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	u, err := url.Parse(db.DSN)
	if err != nil {
		t.Fatal(err)
	}
	u.User = url.User(role)
	if searchPath != "" {
		q := u.Query()
		q.Set("search_path", searchPath)
		u.RawQuery = q.Encode()
	}
	x, err := sqlx.Open(db.DriverName(), u.String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = x.Close() })
	return role, &testdb.DB{DB: x, Kind: db.Kind, DSN: u.String(), Name: db.Name}
}

// tcpProxy listens on a port of its own, connects each connection it
// accepts to server, and has pipe copy each direction (toServer: from the
// client), the two sharing pair, a flag of the connection's; it returns
// its address. Connections and listener close when the test ends.
func tcpProxy(t *testing.T, server string, pipe func(dst, src net.Conn, pair *atomic.Bool, toServer bool)) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var (
		mu    sync.Mutex
		conns []net.Conn
		wg    sync.WaitGroup
	)
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			s, err := net.Dial("tcp", server)
			if err != nil {
				_ = c.Close()
				continue
			}
			mu.Lock()
			conns = append(conns, c, s)
			mu.Unlock()
			var pair atomic.Bool
			wg.Add(2)
			go func() { defer wg.Done(); pipe(s, c, &pair, true) }()
			go func() { defer wg.Done(); pipe(c, s, &pair, false) }()
		}
	}()
	t.Cleanup(func() {
		_ = ln.Close()
		mu.Lock()
		for _, c := range conns {
			_ = c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	return ln.Addr().String()
}
