package outbox

import (
	"context"
	"database/sql"
	"errors"
	"net"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/acemq/watermill-outbox/internal/testamqp"
	"github.com/acemq/watermill-outbox/internal/testdb"

	_ "github.com/mattn/go-sqlite3"
)

// Guards of code no other test held (a mutation run over 7a0ede3..57a5c26
// found it unguarded): each fails when the code it names is broken.

// A nack renews the connection only once no other window is out on it: a
// window sent after the nacked one, still out when the nack is collected,
// keeps its confirms (dropped at once, they were lost, and its records
// sent again). The connection is renewed when that window is collected.
func TestNackWithAnotherWindowOut_ItsConfirmsKept(t *testing.T) {
	b, ok := brokerWithFullQueue(t)

	d, err := NewAMQPDestination(AMQPConfig{URLs: []string{testdb.AMQPURL()}})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	ctx := context.Background()
	nacked := d.send(ctx, []Record{{ID: "nacked-" + testdb.RandomName(), Exchange: b.Exchange, RoutingKey: "full", Body: []byte("x")}})
	after := d.send(ctx, []Record{{ID: "after-" + testdb.RandomName(), Exchange: b.Exchange, RoutingKey: "ok", Body: []byte("y")}})
	if nacked.res[0] != nil || after.res[0] != nil || after.on != nacked.on {
		t.Fatalf("send: %v, %v (same channel: %v)", nacked.res[0], after.res[0], after.on == nacked.on)
	}
	if res := d.wait(ctx, nacked); res[0] == nil || !strings.Contains(res[0].Error(), "nacked") {
		t.Fatalf("first window: %v, want nacked", res[0])
	}
	if res := d.wait(ctx, after); res[0] != nil {
		t.Fatalf("the window out behind the nacked one: %v, want its confirm (the connection was dropped under it)", res[0])
	}
	d.mu.Lock()
	renewed := d.conn == nil
	d.mu.Unlock()
	if !renewed {
		t.Error("the connection of the nack kept once no window was out on it")
	}
	if got := len(b.Drain(ok, 1, 5e9)); got != 1 {
		t.Errorf("%d messages in the ok queue, want 1", got)
	}
}

// One nack renews the connection once: the windows after the fresh
// connection all go out on it (a renew flag left set would open a
// connection for every window).
func TestNackRenewsTheConnectionOnce(t *testing.T) {
	b, _ := brokerWithFullQueue(t)
	d, err := NewAMQPDestination(AMQPConfig{URLs: []string{testdb.AMQPURL()}})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	ctx := context.Background()
	one := func(key string) (*sent, error) {
		p := d.send(ctx, []Record{{ID: key + "-" + testdb.RandomName(), Exchange: b.Exchange, RoutingKey: key, Body: []byte("x")}})
		if p.res[0] != nil {
			t.Fatalf("send: %v", p.res[0])
		}
		return p, d.wait(ctx, p)[0]
	}
	if _, err := one("full"); err == nil || !strings.Contains(err.Error(), "nacked") {
		t.Fatalf("window to the full queue: %v, want nacked", err)
	}
	var conns []*amqp.Connection
	for range 3 {
		p, err := one("ok")
		if err != nil {
			t.Fatalf("window to the ok queue: %v", err)
		}
		conns = append(conns, p.on.conn)
	}
	if conns[0] != conns[1] || conns[1] != conns[2] {
		t.Error("three acked windows after one nack went out on more than one connection: the nack's renewal did not end")
	}
}

// A queue that nacks every publish (full, reject-publish) nacks on every
// connection: a stream of nacks renews the connection once, then at
// spaced times, not for every window (each renewal a handshake, a channel
// and the exchanges checked again, and on a cluster a hop to the next
// node).
func TestNackStream_RenewsTheConnectionOnceNotPerWindow(t *testing.T) {
	b, _ := brokerWithFullQueue(t)
	d, err := NewAMQPDestination(AMQPConfig{URLs: []string{testdb.AMQPURL()}})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	ctx := context.Background()
	conns := map[*amqp.Connection]bool{}
	for range 10 {
		p := d.send(ctx, []Record{{ID: "full-" + testdb.RandomName(), Exchange: b.Exchange, RoutingKey: "full", Body: []byte("x")}})
		if p.res[0] != nil {
			t.Fatalf("send: %v", p.res[0])
		}
		conns[p.on.conn] = true
		if err := d.wait(ctx, p)[0]; err == nil || !strings.Contains(err.Error(), "nacked") {
			t.Fatalf("window to the full queue: %v, want nacked", err)
		}
	}
	if len(conns) != 2 {
		t.Errorf("ten nacked windows within a second went out on %d connections, want 2 (the first and one renewal)", len(conns))
	}
}

// brokerWithFullQueue is a test broker whose exchange routes "full" to a
// queue that nacks every publish (x-max-length 1, reject-publish, filled)
// and "ok" to the queue it returns.
func brokerWithFullQueue(t *testing.T) (*testamqp.Broker, string) {
	t.Helper()
	b := testamqp.New(t)
	b.FullQueue("full")
	return b, b.Queue("ok")
}

// SQLite's relay transactions are begun without ctx's cancellation (see
// writeTx), yet one whose ctx ended while its statements ran is still
// rolled back, as database/sql did for a transaction begun with ctx: a
// claim or a mark whose caller has gone is not committed behind its error.
func TestSQLiteWriteTx_ContextEndedDuringFn_RolledBack(t *testing.T) {
	db, err := sql.Open("sqlite3", "file:"+filepath.Join(t.TempDir(), "outbox.db")+"?_journal_mode=WAL&_busy_timeout=5000&_txlock=immediate")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	if err := Migrate(context.Background(), db, SQLite); err != nil {
		t.Fatal(err)
	}
	store, err := NewStore(db, StoreConfig{Dialect: SQLite})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	err = store.writeTx(ctx, "test", func(tx *sql.Tx) error {
		if _, err := tx.ExecContext(ctx, "INSERT INTO acemq_outbox (id, exchange_name, routing_key, body) VALUES ('late', 'ex', 'rk', 'b')"); err != nil {
			return err
		}
		cancel() // the caller gives up after the statement
		return nil
	})
	if !errors.Is(err, context.Canceled) {
		t.Errorf("writeTx whose ctx ended during fn: %v, want context.Canceled", err)
	}
	var n int
	if err := db.QueryRow("SELECT COUNT(*) FROM acemq_outbox WHERE id = 'late'").Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 0 {
		t.Error("the transaction of a cancelled writeTx was committed")
	}
}

// A window whose connection cannot be made (the broker refuses new ones:
// a vhost's connection limit, a node going down) sent nothing of its
// records: no attempt is theirs, however often it comes at the same head
// record. Counted as a connection lost there, a sound record was charged
// from the fourth time in a row, each renewal after a nack coming at it
// (a reviewer's lead), and could so be taken to MaxAttempts.
func TestSend_ConnectionNotMade_NoRecordCharged(t *testing.T) {
	b, _ := brokerWithFullQueue(t)
	var refuse atomic.Bool
	d, err := NewAMQPDestination(AMQPConfig{URLs: []string{testdb.AMQPURL()}, AMQP: amqp.Config{
		Dial: func(network, addr string) (net.Conn, error) {
			if refuse.Load() {
				return nil, errors.New("connection refused by the test")
			}
			return amqp.DefaultDial(5*time.Second)(network, addr)
		},
	}})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	ctx := context.Background()
	nacked := d.send(ctx, []Record{{ID: "full-" + testdb.RandomName(), Exchange: b.Exchange, RoutingKey: "full", Body: []byte("x")}})
	if res := d.wait(ctx, nacked); res[0] == nil || !strings.Contains(res[0].Error(), "nacked") {
		t.Fatalf("window to the full queue: %v, want nacked (the connection is then renewed)", res[0])
	}
	refuse.Store(true)
	p := d.send(ctx, []Record{{ID: "head-" + testdb.RandomName(), Exchange: b.Exchange, RoutingKey: "ok", Body: []byte("y")}})
	var outage unprobedLost
	if !errors.Is(p.res[0], ErrConnectionLost) || !errors.As(p.res[0], &outage) {
		t.Errorf("send without a connection: %v, want a lost connection that counts no attempt (unprobedLost)", p.res[0])
	}
}
