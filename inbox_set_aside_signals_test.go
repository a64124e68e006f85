package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/prometheus/client_golang/prometheus"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// What an on-call reads of a message set aside (an on-call drill on
// MariaDB): a counter of its own, where the failures counted before could
// not tell a message given up from failures that passed; and a keyed
// message's key and number on its line, which the gap lines and
// resend --key K --seq N take.
func TestInbox_SetAside_CountedAndKeyedLineNamesKeyAndSeq(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.MySQL)
	reg := prometheus.NewRegistry()
	m, err := outbox.NewMetrics(reg)
	if err != nil {
		t.Fatal(err)
	}
	logs := &recordingLogger{}
	in, err := outbox.NewInbox(db.DB, outbox.InboxConfig{Dialect: outbox.MySQL, ConsumerName: "ledger", Metrics: m, Logger: logs})
	if err != nil {
		t.Fatal(err)
	}
	msg := message.NewMessage("keyed-poison-1", []byte(`{}`))
	msg.Metadata.Set(outbox.HeaderAggregateID, "acct-7")
	msg.Metadata.Set(outbox.HeaderSeq, "1")
	msg.Metadata.Set(middleware.ReasonForPoisonedKey, "handler always fails")
	if err := in.PoisonOutbox().Publish("ledger.poison", msg); err != nil {
		t.Fatal(err)
	}
	if got := metricValue(t, reg, "outbox_inbox_set_aside_total", "ledger"); got != 1 {
		t.Errorf("outbox_inbox_set_aside_total{consumer=ledger} = %v after one message set aside, want 1", got)
	}
	var lines int
	for _, l := range logs.errorLines() {
		if !strings.Contains(l.msg, "set aside on the poison topic") {
			continue
		}
		lines++
		if l.fields["aggregate_id"] != "acct-7" || l.fields["seq"] != "1" {
			t.Errorf("the set-aside line of a keyed message: fields %v, want aggregate_id acct-7 and seq 1", l.fields)
		}
		if _, ok := l.fields["reason"]; ok || l.err.Error() != "handler always fails" {
			t.Errorf("the reason once, as the line's err: err %v, fields %v", l.err, l.fields)
		}
	}
	if lines != 1 {
		t.Errorf("%d set-aside lines, want 1", lines)
	}
}

// A key whose first message this inbox's poison queue set aside: its gap
// line says so, with the number to resend, rather than blame a consumer
// new to the key or a renamed handler and point at skip-gap, which gives
// the message up (an on-call drill read that line every 10 s with
// ConsumerName set and nothing renamed).
func TestOrderedInbox_FirstMessageSetAside_GapLineSaysSo(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.MySQL)
	logs := &recordingLogger{}
	in, err := outbox.NewInbox(db.DB, outbox.InboxConfig{Dialect: outbox.MySQL, ConsumerName: "ledger", Ordered: true,
		GapAfter: 200 * time.Millisecond, Logger: logs})
	if err != nil {
		t.Fatal(err)
	}
	pq, err := middleware.PoisonQueue(in.PoisonOutbox(), "ledger.poison")
	if err != nil {
		t.Fatal(err)
	}
	bus := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
	defer func() { _ = bus.Close() }()
	router := newRouter(t)
	router.AddMiddleware(pq, middleware.Retry{MaxRetries: 1, InitialInterval: time.Millisecond, ResetContextOnRetry: true}.Middleware, in.Middleware)
	router.AddConsumerHandler("ledger", "acct.event", in.Subscriber(bus), func(m *message.Message) error {
		if string(m.Payload) == "bad" {
			return errors.New("cannot process: poison")
		}
		return nil
	})
	router.AddPlugin(in.Plugin())
	runRouter(t, router)
	for seq, body := range []string{"bad", "ok", "ok"} {
		m := message.NewMessage(fmt.Sprintf("acct-9-%d", seq+1), []byte(body))
		m.Metadata.Set(outbox.HeaderAggregateID, "acct-9")
		m.Metadata.Set(outbox.HeaderSeq, fmt.Sprint(seq+1))
		if err := bus.Publish("acct.event", m); err != nil {
			t.Fatal(err)
		}
	}
	const gapLine = "Ordered inbox: messages held past GapAfter"
	var gap loggedLine
	waitFor(t, 20*time.Second, "the gap logged", func() bool {
		if err := in.RefreshStats(context.Background()); err != nil {
			t.Fatal(err)
		}
		for _, l := range logs.errorLines() {
			if strings.HasPrefix(l.msg, gapLine) {
				gap = l
				return true
			}
		}
		return false
	})
	if !strings.Contains(gap.msg, "seq 1, was set aside on ledger.poison") || !strings.Contains(gap.msg, "resend --key K --seq 1") ||
		strings.Contains(gap.msg, "new to") || strings.Contains(gap.msg, "renamed") {
		t.Errorf("the gap line of a key whose seq 1 this inbox set aside: %q", gap.msg)
	}
	if gap.fields["aggregate_id"] != "acct-9" || gap.fields["set_aside_id"] != "acct-9-1" || gap.fields["poison_copy_id"] == nil {
		t.Errorf("the gap line's fields: %v", gap.fields)
	}
}
