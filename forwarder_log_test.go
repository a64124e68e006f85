package outbox_test

import (
	"context"
	"errors"
	"net"
	"strings"
	"testing"
	"time"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testamqp"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// A record the destination keeps refusing: each failure was logged as the
// same "Outbox relay failed", never with its attempts, and nothing said
// when it gave up (a user review grepped the relay's log for "stuck" and
// found nothing). Now each says its attempts out of MaxAttempts and what
// it holds back, and the last one that it is stuck and how to send it
// again. A failure of no record's (the claim's statement) named a record
// of the id "" (message_id="\"\"").
func TestForwarder_Logs_RecordFailuresCountAttemptsAndSayStuck_NoRecordFailuresNameNone(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.Postgres)
	ids := publishN(t, db, "", "orders", 2)
	logs := &recordingLogger{}
	f, err := outbox.NewForwarder(db.DB, outbox.NewPublisherDestination(newRefusingPublisher(ids[0], "no such exchange"), nil),
		outbox.ForwarderConfig{Dialect: outbox.Postgres, MaxAttempts: 2, RetryMin: 10 * time.Millisecond, Logger: logs})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	const stuckMsg = "Outbox record stuck: the relay leaves it alone from now on (a keyed one holds its key's later records); outboxctl show ID says why, outboxctl retry ID sends it again"
	const dbFailed = "Outbox relay: a statement on its database failed; it claims again once the database answers, and a batch published but not marked goes out again (the inbox dedupes it)"
	ctx, cancel := context.WithCancel(context.Background())
	ran := make(chan error, 1)
	go func() { ran <- f.Run(ctx) }()
	defer func() { cancel(); <-ran }()
	waitFor(t, 20*time.Second, "the record stuck", func() bool { return len(logs.find(stuckMsg)) > 0 })
	failed := logs.find("Outbox relay failed to publish a record; it tries again, and the records behind it wait for it")
	stuck := logs.find(stuckMsg)
	if len(failed) != 1 || failed[0]["attempts"] != 1 || failed[0]["max_attempts"] != 2 || failed[0]["message_id"] != ids[0] ||
		len(stuck) != 1 || stuck[0]["attempts"] != 2 || stuck[0]["message_id"] != ids[0] {
		t.Errorf("logged a failure %v and stuck %v; want one failure at attempt 1 of 2, then stuck at 2, of %s", failed, stuck, ids[0])
	}

	db.MustExec("DROP TABLE acemq_outbox CASCADE")
	if _, err := db.Exec("NOTIFY acemq_outbox"); err != nil { // wake it, if it listens there
		t.Log(err)
	}
	// Said to be the database's, with the table: "not for a record of its
	// own" left the cause to the driver's text (an SRE review).
	waitFor(t, 20*time.Second, "the claim's failure logged", func() bool { return len(logs.find(dbFailed)) > 0 })
	if got := logs.find(dbFailed)[0]; got["table"] != "acemq_outbox" || got["dialect"] != "postgres" {
		t.Errorf("the database's failure logged with %v; want its table and dialect", got)
	}
	for _, fs := range logs.find("Outbox relay failed") {
		if id := fs["message_id"]; id == `""` {
			t.Errorf("a failure logged with message_id %v", id)
		}
	}
}

// The broker closes the relay's connection: said as it happens, with the
// broker's reason. The relay said nothing until its next publish, then
// "lost" without why (a user review).
func TestAMQPDestination_BrokerClosesTheConnection_LoggedAtOnceWithItsReason(t *testing.T) {
	t.Parallel()
	testdb.Require(t, "amqp")
	logs := &recordingLogger{}
	name := "zz-closed-" + testdb.RandomName()
	d, err := outbox.NewAMQPDestination(outbox.AMQPConfig{URLs: []string{testdb.AMQPURL()}, ConnectionName: name, Logger: logs})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	if err := d.Connect(context.Background()); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "the broker to list the connection", func() bool { return testamqp.CloseConnections(t, name) == 1 })
	const closed = "Connection to RabbitMQ closed; the relay connects again at its next poll or publish"
	waitFor(t, 10*time.Second, "the close logged", func() bool { return len(logs.find(closed)) == 1 })
	if got := logs.find(closed)[0]; got["reason"] != "CONNECTION_FORCED - outbox test: connection closed on purpose" || got["by_broker"] != true {
		t.Errorf("the close logged with %v; want the broker's reason", got)
	}
}

// An AMQPDestination given no Logger logs with its Forwarder's: the
// README's quick start set a Logger on the relay only, and its broker's
// connects and losses went unsaid (a README review). One given its own
// keeps it.
func TestForwarder_AMQPDestinationWithoutALogger_LogsWithTheRelays(t *testing.T) {
	t.Parallel()
	testdb.Require(t, "amqp")
	const connected = "Connected to RabbitMQ"
	for _, own := range []bool{false, true} {
		relayLogs, destLogs := &recordingLogger{}, &recordingLogger{}
		cfg := outbox.AMQPConfig{URLs: []string{testdb.AMQPURL()}}
		if own {
			cfg.Logger = destLogs
		}
		d, err := outbox.NewAMQPDestination(cfg)
		if err != nil {
			t.Fatal(err)
		}
		f, err := outbox.NewForwarder(migrated(t, testdb.SQLite).DB, d, outbox.ForwarderConfig{Dialect: outbox.SQLite, Logger: relayLogs})
		if err != nil {
			t.Fatal(err)
		}
		if err := d.Connect(context.Background()); err != nil {
			t.Fatal(err)
		}
		byRelay, byDest := len(relayLogs.find(connected)), len(destLogs.find(connected))
		if own && (byRelay != 0 || byDest != 1) || !own && byRelay != 1 {
			t.Errorf("own logger %v: %q logged %d times by the relay's logger, %d by the destination's", own, connected, byRelay, byDest)
		}
		_ = f.Close()
	}
}

// A broker no node of which answers: the relay claims nothing, and its
// line said "a batch published but not marked goes out again", with an
// error "connection to the broker lost before it confirmed", every 10 s of
// an outage (an on-call drill read that duplicates were coming). It says
// the broker is unreachable, and its error is ErrBrokerUnreachable, which
// is an ErrConnectionLost still (no attempt is counted), and nothing of
// the records is charged.
func TestForwarder_BrokerUnreachable_LoggedAsUnreachableNothingCharged(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.MySQL)
	ids := publishN(t, db, "", "orders", 3)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	_ = ln.Close() // nothing listens there
	dest, err := outbox.NewAMQPDestination(outbox.AMQPConfig{URLs: []string{"amqp://guest:guest@" + addr + "/"}})
	if err != nil {
		t.Fatal(err)
	}
	logs := &recordingLogger{}
	f, err := outbox.NewForwarder(db.DB, dest, outbox.ForwarderConfig{Dialect: outbox.MySQL, Logger: logs, RetryMin: 10 * time.Millisecond, PollInterval: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	ctx, cancel := context.WithCancel(context.Background())
	ran := make(chan error, 1)
	go func() { ran <- f.Run(ctx) }()
	defer func() { cancel(); <-ran }()
	var line loggedLine
	waitFor(t, 20*time.Second, "the relay's failure logged", func() bool {
		errs := logs.errorLines()
		if len(errs) > 0 {
			line = errs[0]
		}
		return len(errs) > 0
	})
	text := line.msg + " " + line.err.Error()
	if !strings.Contains(line.msg, "cannot reach the broker") || strings.Contains(text, "lost before it confirmed") || strings.Contains(text, "published but not marked") {
		t.Errorf("broker unreachable, nothing claimed; the relay logged msg=%q err=%q", line.msg, line.err)
	}
	if !errors.Is(line.err, outbox.ErrBrokerUnreachable) || !errors.Is(line.err, outbox.ErrConnectionLost) {
		t.Errorf("the error %v: want ErrBrokerUnreachable and ErrConnectionLost", line.err)
	}
	store, err := outbox.NewStore(db.DB, outbox.StoreConfig{Dialect: outbox.MySQL})
	if err != nil {
		t.Fatal(err)
	}
	recs, err := store.Lookup(context.Background(), ids...)
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range recs {
		if r.Attempts != 0 || r.Published {
			t.Errorf("record %s: attempts %d, published %v; want neither while the broker is unreachable", r.ID, r.Attempts, r.Published)
		}
	}
}

// A broker that answers and refuses the connection (a rotated password, a
// vhost gone) is no broker out of reach: its error is an ErrConnectionLost
// (no attempt is counted) but not ErrBrokerUnreachable, and says it was
// refused (a code review: it read "broker unreachable").
func TestAMQPDestination_CredentialsRefused_NotUnreachable(t *testing.T) {
	t.Parallel()
	testdb.Require(t, "amqp")
	u := strings.Replace(testdb.AMQPURL(), "guest:guest@", "guest:wrong@", 1)
	if u == testdb.AMQPURL() {
		t.Skipf("the test broker's URL %s has no guest:guest to replace", u)
	}
	d, err := outbox.NewAMQPDestination(outbox.AMQPConfig{URLs: []string{u}})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	err = d.Connect(ctx)
	if err == nil || errors.Is(err, outbox.ErrBrokerUnreachable) || !errors.Is(err, outbox.ErrConnectionLost) || !strings.Contains(err.Error(), "refused the connection") {
		t.Errorf("a connect with a wrong password: %v; want an ErrConnectionLost, not ErrBrokerUnreachable, saying the broker refused it", err)
	}
}
