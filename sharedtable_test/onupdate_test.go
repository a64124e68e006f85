package sharedtable_test

import (
	"context"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testamqp"
	"github.com/acemq/watermill-outbox/internal/testdb"
	"github.com/acemq/watermill-outbox/internal/testrails"
)

// A MySQL table another library made whose created_at updates itself
// (TIMESTAMP … ON UPDATE CURRENT_TIMESTAMP: what MariaDB before 10.10 gives
// a table's first TIMESTAMP NOT NULL column without a default). Every
// update the relay makes of a row (a failure counted, a lease, a mark)
// would move its created_at to now: a failing record would go behind the
// rows written after it, and they would be sent before it. The relay's
// updates leave created_at as it was.
func TestMySQL_CreatedAtOnUpdate_RelayLeavesItAsWritten(t *testing.T) {
	c := alteredTable(t, "mysql", testdb.MySQL, "ALTER TABLE acemq_outbox MODIFY created_at TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6) ON UPDATE CURRENT_TIMESTAMP(6)")
	b := testamqp.New(t)
	queue := b.Queue("ok")
	internal := b.Exchange + "-internal"
	b.With(func(ch *amqp.Channel) error {
		return ch.ExchangeDeclare(internal, amqp.ExchangeDirect, false, true, true, false, nil)
	})
	t.Cleanup(func() { b.With(func(ch *amqp.Channel) error { return ch.ExchangeDelete(internal, false, false) }) })
	written := time.Now().Add(-time.Hour).UTC().Truncate(time.Microsecond)
	testrails.Insert(t, c.db, testrails.Row{ID: "failing", Exchange: internal, RoutingKey: "ok", Body: "x", CreatedAt: written})
	testrails.Insert(t, c.db, testrails.Row{ID: "fine", Exchange: b.Exchange, RoutingKey: "ok", Body: "y", CreatedAt: written.Add(time.Second)})
	f := c.forwarder(t, outbox.ForwarderConfig{MaxAttempts: 2, RetryMin: time.Millisecond, RetryMax: time.Millisecond, OnError: func(error, outbox.ErrorContext) {}})
	for range 4 {
		_, _ = f.Sweep(context.Background())
	}
	for _, id := range []string{"failing", "fine"} {
		var at time.Time
		if err := c.db.Get(&at, "SELECT created_at FROM acemq_outbox WHERE id = ?", id); err != nil {
			t.Fatal(err)
		}
		want := written
		if id == "fine" {
			want = written.Add(time.Second)
		}
		if !at.Equal(want) {
			t.Errorf("%s: created_at %s after the relay's updates, want %s as written", id, at, want)
		}
	}
	if s := c.state(t, "failing"); s.Attempts != 2 {
		t.Errorf("failing row: %+v, want stuck at 2 attempts", s)
	}
	if got := b.Drain(queue, 1, 10*time.Second); len(got) != 1 || got[0].MessageId != "fine" {
		t.Errorf("delivered %d, want the fine row once the failing one is stuck", len(got))
	}
}
