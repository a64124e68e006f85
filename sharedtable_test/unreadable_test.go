package sharedtable_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testamqp"
	"github.com/acemq/watermill-outbox/internal/testdb"
	"github.com/acemq/watermill-outbox/internal/testrails"
)

// noTime is a created_at no driver reads as a time, which each database
// stores and sorts before every real time: PostgreSQL's -infinity, MySQL's
// zero date (go-sql-driver reads it as the zero time), and on SQLite text
// that is no date at all.
var noTime = map[string]string{
	testdb.Postgres: "'-infinity'",
	testdb.MySQL:    "'0000-00-00 00:00:00'",
	testdb.SQLite:   "'2000-13-45 25:61:00'",
}

// unreadableRows makes a hand-made table (Rails' with headers nullable),
// writes a row whose created_at is no time at the head of the order and
// one with NULL headers behind it, then good rows written by Ruby and by
// TxPublisher, and returns the good rows' ids.
func unreadableRows(t *testing.T, c *conn, exchange string) []string {
	t.Helper()
	ctx := context.Background()
	testrails.CreateTable(t, c.db, "headers")
	c.migrate(t)
	conn, err := c.db.Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if c.db.Kind == testdb.MySQL {
		// MySQL 8's default NO_ZERO_DATE refuses the zero date; older
		// servers and other clients wrote it, and it is there.
		if _, err := conn.ExecContext(ctx, "SET SESSION sql_mode = ''"); err != nil {
			t.Fatal(err)
		}
	}
	insert := "INSERT INTO acemq_outbox (id, exchange_name, routing_key, body, body_encoding, content_type, headers, created_at, attempts)" +
		" VALUES (?, ?, 'ok', 'x', 'utf-8', 'text/plain', ?, " + noTime[c.db.Kind] + ", 0)"
	if _, err := conn.ExecContext(ctx, c.q(insert), "bad-time", exchange, "{}"); err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	testrails.Insert(t, c.db, testrails.Row{ID: "rb-1", Exchange: exchange, RoutingKey: "ok", Body: "1", CreatedAt: now.Add(-2 * time.Minute)})
	if _, err := c.db.Exec(c.q("UPDATE acemq_outbox SET id = 'null-headers', headers = NULL WHERE id = 'rb-1'")); err != nil {
		t.Fatal(err)
	}
	good := []string{"rb-2", "rb-3", "rb-4"}
	for i, id := range good {
		testrails.Insert(t, c.db, testrails.Row{ID: id, Exchange: exchange, RoutingKey: "ok", Body: id, CreatedAt: now.Add(time.Duration(i-60) * time.Second)})
	}
	tx, err := c.lib.Beginx()
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback() }()
	pub, err := outbox.NewTxPublisher(tx, outbox.TxPublisherConfig{Exchange: exchange})
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 2; i++ {
		msg := message.NewMessage(watermill.NewUUID(), []byte("go"))
		good = append(good, msg.UUID)
		if err := pub.Publish("ok", msg); err != nil {
			t.Fatal(err)
		}
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	return good
}

// A row the relay cannot even read, a created_at that is no time or a NULL
// in a column a hand-made table left nullable, fails by itself, at once and
// for good, with last_error naming the column; the rows behind it go out in
// the same sweep, and the next sweep has nothing to retry. The operator's
// stats, stuck (library and outboxctl) read such rows too.
func TestForwarder_UnreadableRow_FailsAloneNamingTheColumn_RowsBehindFlow(t *testing.T) {
	eachConn(t, func(t *testing.T, c *conn) {
		ctx := context.Background()
		b := testamqp.New(t)
		queue := b.Queue("ok")
		good := unreadableRows(t, c, b.Exchange)

		f := c.forwarder(t, outbox.ForwarderConfig{})
		if st, err := f.Store().Stats(ctx); err != nil || st.Pending != int64(len(good))+2 {
			t.Errorf("stats before the relay: %+v (%v), want %d pending", st, err, len(good)+2)
		}
		n, err := f.Sweep(ctx)
		if n != len(good) || !outbox.IsPermanent(err) {
			t.Fatalf("sweep published %d (%v), want the %d readable rows and permanent failures", n, err, len(good))
		}
		for id, want := range map[string]string{"bad-time": "column created_at: ", "null-headers": "column headers: NULL"} {
			s := c.state(t, id)
			if s.Published || s.Attempts != outbox.DefaultMaxAttempts || !strings.Contains(s.LastError, want) {
				t.Errorf("%s: %+v, want stuck at once, last_error naming %q", id, s, want)
			}
		}
		if n, err := f.Sweep(ctx); n != 0 || err != nil {
			t.Errorf("the next sweep: %d, %v; want nothing left to do", n, err)
		}
		got := map[string]int{}
		drain(t, b, queue, len(good), got)
		for _, id := range good {
			if got[id] != 1 {
				t.Errorf("%s arrived %d times, want once", id, got[id])
			}
		}

		store := f.Store()
		if st, err := store.Stats(ctx); err != nil || st.Pending != 0 || st.Stuck != 2 {
			t.Errorf("stats %+v (%v), want 0 pending, 2 stuck", st, err)
		}
		stuck, err := store.Stuck(ctx, 10)
		if err != nil || len(stuck) != 2 {
			t.Fatalf("stuck %+v (%v), want both rows", stuck, err)
		}
		var out struct {
			Total int `json:"total"`
		}
		c.ctlJSON(t, &out, "stuck")
		if out.Total != 2 {
			t.Errorf("outboxctl stuck lists %d, want 2", out.Total)
		}
	})
}

// Under Run, in batches of two, the unreadable rows at the head and in the
// middle of the order neither stop the drain nor send it round for ever:
// every readable row arrives, and the two are stuck.
func TestForwarder_Run_UnreadableRows_DrainGoesOnEveryReadableRowArrives(t *testing.T) {
	eachConn(t, func(t *testing.T, c *conn) {
		b := testamqp.New(t)
		queue := b.Queue("ok")
		good := unreadableRows(t, c, b.Exchange)

		f := c.forwarder(t, outbox.ForwarderConfig{BatchSize: 2, PollInterval: 20 * time.Millisecond, RetryMin: 10 * time.Millisecond, RetryMax: 50 * time.Millisecond})
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- f.Run(ctx) }()
		eventually(t, 30*time.Second, "every readable row published and the two stuck", func() bool {
			st, err := f.Store().Stats(context.Background())
			return err == nil && st.Pending == 0 && st.Stuck == 2
		})
		cancel()
		if err := <-done; err != nil {
			t.Fatal(err)
		}
		got := map[string]int{}
		for _, d := range b.Drain(queue, len(good), 10*time.Second) {
			got[d.MessageId]++
		}
		for _, id := range good {
			if got[id] == 0 {
				t.Errorf("%s never arrived", id)
			}
		}
	})
}
