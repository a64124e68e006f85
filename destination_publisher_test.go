package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// ctxKey carries a value (a trace, say) on the relay's context.
type ctxKey struct{}

// Through a GoChannel that preserves the message's context (for tracing),
// the subscriber received the relay's per-publish context, which the relay
// cancels as soon as Publish returns: dead on arrival, and an Inbox
// downstream failed at BEGIN on every delivery. The message now carries
// the relay's context's values without its cancellation.
func TestPublisherDestination_GoChannelPreserveContext_InboxHandlesIt(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.SQLite)
	publishN(t, db, "", "orders", 1)
	ch := gochannel.NewGoChannel(gochannel.Config{PreserveContext: true, OutputChannelBuffer: 1}, nil)
	defer ch.Close()
	out, err := ch.Subscribe(context.Background(), "orders")
	if err != nil {
		t.Fatal(err)
	}
	inbox, err := outbox.NewInbox(db.DB, outbox.InboxConfig{ConsumerName: "c"})
	if err != nil {
		t.Fatal(err)
	}
	runs := 0
	h := inbox.Middleware(func(msg *message.Message) ([]*message.Message, error) { runs++; return nil, nil })
	f, err := outbox.NewForwarder(db.DB, outbox.NewPublisherDestination(ch, nil), outbox.ForwarderConfig{Dialect: outbox.SQLite})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	ctx := context.WithValue(context.Background(), ctxKey{}, "trace-1")
	if n, err := f.Sweep(ctx); n != 1 || err != nil {
		t.Fatalf("sweep: %d, %v", n, err)
	}
	for i := 0; i < 3; i++ { // GoChannel redelivers on nack
		select {
		case m := <-out:
			if got := m.Context().Value(ctxKey{}); got != "trace-1" {
				t.Errorf("the message's context lost the relay's values: %v", got)
			}
			_, herr := h(m)
			if herr != nil {
				t.Logf("delivery %d: inbox error: %v (message context: %v)", i, herr, m.Context().Err())
				m.Nack()
				continue
			}
			m.Ack()
			if runs != 1 {
				t.Errorf("handler ran %d times, want 1", runs)
			}
			return
		case <-time.After(5 * time.Second):
			t.Fatal("no message")
		}
	}
	t.Errorf("the inbox failed every delivery with the message's context cancelled; the handler ran %d times", runs)
}

// slowPub takes every message after delay, ignoring the message's context
// (as sarama's sync producer, NATS and GoChannel do). It counts each id at
// the start of its publish: a publish abandoned at the timeout is counted
// even if it never finishes.
type slowPub struct {
	delay   time.Duration
	mu      sync.Mutex
	started map[string]int
}

func (p *slowPub) Publish(_ string, msgs ...*message.Message) error {
	for _, m := range msgs {
		p.mu.Lock()
		p.started[m.UUID]++
		p.mu.Unlock()
		time.Sleep(p.delay) // the broker's slowness, not synchronisation
	}
	return nil
}
func (p *slowPub) Close() error { return nil }
func (p *slowPub) count(id string) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.started[id]
}

// PublishTimeout bounds a batch through PublisherDestination even when the
// publisher ignores the message's context: the loop sent record after
// record, and a batch of slow publishes ran past its SQLite lease while a
// second relay claimed and published the same rows.
func TestPublisherDestination_SlowPublisherIgnoringContext_BatchEndsWithinLease(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	ids := publishN(t, db, "", "orders", 30)
	const (
		publishTimeout = 250 * time.Millisecond
		lease          = 2 * time.Second // 30 publishes of 150 ms would take 4.5 s
	)
	slowA := &slowPub{delay: 150 * time.Millisecond, started: map[string]int{}}
	fastB := &slowPub{started: map[string]int{}}
	cfg := outbox.ForwarderConfig{Dialect: outbox.SQLite, PublishTimeout: publishTimeout, Lease: lease}
	cfgA, cfgB := cfg, cfg
	cfgA.RelayID, cfgB.RelayID = "relay-a", "relay-b"
	fa, err := outbox.NewForwarder(db.DB, outbox.NewPublisherDestination(slowA, nil), cfgA)
	if err != nil {
		t.Fatal(err)
	}
	defer fa.Close()
	fb, err := outbox.NewForwarder(db.DB, outbox.NewPublisherDestination(fastB, nil), cfgB)
	if err != nil {
		t.Fatal(err)
	}
	defer fb.Close()

	start := time.Now()
	var took time.Duration
	done := make(chan struct{})
	go func() {
		defer close(done)
		n, err := fa.Sweep(context.Background())
		took = time.Since(start)
		t.Logf("relay A: %d published in %s (PublishTimeout %s), err %v", n, took.Round(time.Millisecond), publishTimeout, err)
	}()
	// Relay B comes once A's lease has run out, A's sweep over or not.
	time.Sleep(lease + 100*time.Millisecond) // the scenario's time, not synchronisation
	nB := sweepAll(t, fb)
	<-done
	if took >= lease {
		t.Errorf("relay A's batch took %s, past its lease (%s) and PublishTimeout (%s)", took.Round(time.Millisecond), lease, publishTimeout)
	}
	both := 0
	for _, id := range ids {
		a, b := slowA.count(id), fastB.count(id)
		if a+b == 0 {
			t.Errorf("record %s published by neither relay", id)
		}
		if a > 0 && b > 0 {
			both++
		}
	}
	t.Logf("relay B published %d; %d records published by both", nB, both)
	// The one publish A abandoned at its timeout may land too: its record
	// is sent again (at-least-once). Nothing else is published twice.
	if both > 1 {
		t.Errorf("%d of %d records published by both relays, want at most the one relay A abandoned at its timeout", both, len(ids))
	}
}

// hangPub never returns from Publish until released: a publisher whose
// broker stopped answering, ignoring the message's context.
type hangPub struct {
	release chan struct{}
	once    sync.Once
	calls   atomic.Int32
}

func newHangPub() *hangPub { return &hangPub{release: make(chan struct{})} }

// unhang lets every publish return, once however often it is called.
func (p *hangPub) unhang() { p.once.Do(func() { close(p.release) }) }

func (p *hangPub) Publish(string, ...*message.Message) error {
	p.calls.Add(1)
	<-p.release
	return nil
}
func (p *hangPub) Close() error { return nil }

// A publisher that hangs held Run, and Close with it, for ever: Publish
// waited for it past PublishTimeout.
func TestPublisherDestination_HungPublisher_CloseReturns(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.SQLite)
	publishN(t, db, "", "orders", 1)
	pub := newHangPub()
	defer pub.unhang()
	f, err := outbox.NewForwarder(db.DB, outbox.NewPublisherDestination(pub, nil), outbox.ForwarderConfig{Dialect: outbox.SQLite, PublishTimeout: 200 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	ran := make(chan struct{})
	go func() { defer close(ran); _ = f.Run(context.Background()) }()
	<-f.Running()
	waitFor(t, 5*time.Second, "the relay's publish", func() bool { return pub.calls.Load() > 0 })
	closed := make(chan struct{})
	go func() { _ = f.Close(); close(closed) }()
	select {
	case <-closed:
	case <-time.After(5 * time.Second):
		t.Fatalf("Close has not returned 5 s after it was called (PublishTimeout 200 ms): the relay waits on a publish past its timeout")
	}
	<-ran
}

// A publish abandoned at the timeout is waited for by the next, not joined
// by another: a hung publisher has one publish in flight however many
// sweeps come, and a later record never overtakes it. Once it returns,
// the records go out in order.
func TestPublisherDestination_HungPublish_NextSweepWaitsForItNotAnother(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.SQLite)
	ids := publishN(t, db, "", "orders", 3)
	hang := newHangPub()
	after := &slowCapture{} // records the order it is called in
	pub := &switchPub{hang: hang, then: after}
	f, err := outbox.NewForwarder(db.DB, outbox.NewPublisherDestination(pub, nil), outbox.ForwarderConfig{Dialect: outbox.SQLite, PublishTimeout: 200 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	defer hang.unhang() // before Close, which waits for a sweep in a hung publish
	sweep := func() error {
		res := make(chan error, 1)
		go func() { _, err := f.Sweep(context.Background()); res <- err }()
		select {
		case err := <-res:
			return err
		case <-time.After(5 * time.Second):
			t.Fatal("a sweep has not returned 5 s after it began (PublishTimeout 200 ms): it waits on a hung publish")
			return nil
		}
	}
	for i := 0; i < 3; i++ {
		err := sweep()
		if !errors.Is(err, outbox.ErrConnectionLost) {
			t.Errorf("sweep %d with the publisher hung: %v, want ErrConnectionLost", i, err)
		}
	}
	if n := hang.calls.Load(); n != 1 {
		t.Errorf("the hung publisher was called %d times over three sweeps, want once", n)
	}
	hang.unhang()
	if n := sweepAll(t, f); n != len(ids) {
		t.Errorf("%d published once the publisher returned, want %d", n, len(ids))
	}
	sent := after.got()
	if !slices.Equal(sent, ids) {
		t.Errorf("records went out as %v, want %v", sent, ids)
	}
}

// switchPub hangs its first publish on hang, and passes the rest to then.
type switchPub struct {
	hang  *hangPub
	then  message.Publisher
	calls atomic.Int32
}

func (p *switchPub) Publish(topic string, msgs ...*message.Message) error {
	if p.calls.Add(1) == 1 {
		return p.hang.Publish(topic, msgs...)
	}
	return p.then.Publish(topic, msgs...)
}
func (p *switchPub) Close() error { return nil }

// panicPub panics in Publish.
type panicPub struct{}

func (panicPub) Publish(string, ...*message.Message) error { panic("publisher bug") }
func (panicPub) Close() error                              { return nil }

// A publisher's panic reaches Sweep's caller although the publish runs in
// a goroutine of its own (for the timeout), and the claim ends: a
// recovering caller sends the row later.
func TestPublisherDestination_PublisherPanics_PanicReachesCallerClaimEnds(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.SQLite)
	ids := publishN(t, db, "", "orders", 1)
	f, err := outbox.NewForwarder(db.DB, outbox.NewPublisherDestination(panicPub{}, nil), outbox.ForwarderConfig{Dialect: outbox.SQLite})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	func() {
		defer func() {
			if p := recover(); p != "publisher bug" {
				t.Errorf("recovered %v, want the publisher's panic", p)
			}
		}()
		_, _ = f.Sweep(context.Background())
	}()
	good := &slowCapture{}
	g, err := outbox.NewForwarder(db.DB, outbox.NewPublisherDestination(good, nil), outbox.ForwarderConfig{Dialect: outbox.SQLite, RelayID: "good"})
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	sweepAll(t, g)
	if got := good.got(); !slices.Equal(got, ids) {
		t.Errorf("after the panic, published %v, want %v", got, ids)
	}
}

// downPub fails every publish with err until up is set, as a publisher
// does with its broker gone.
type downPub struct {
	err  error
	mu   sync.Mutex
	up   bool
	sent []string
}

func (p *downPub) Publish(_ string, msgs ...*message.Message) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.up {
		return p.err
	}
	for _, m := range msgs {
		p.sent = append(p.sent, m.UUID)
	}
	return nil
}
func (p *downPub) Close() error { return nil }
func (p *downPub) setUp() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.up = true
}

// errKafkaDown is a publisher's own outage error, which only its user can
// tell from a record's fault.
var errKafkaDown = errors.New("kafka: client has run out of available brokers to talk to")

// A broker outage through PublisherDestination counted an attempt per
// sweep against the head record: after MaxAttempts sweeps it was stuck,
// and the records behind it went out first. Nothing was taken for an
// outage, not even a context error; and with the connection lost it was
// charged once lost at it more than three times in a row, as
// AMQPDestination's is, whose Connect keeps the relay from claiming
// through an outage, which this one cannot. An outage of any length now
// makes no row stuck, and the records go out in order once it ends.
func TestPublisherDestination_Outage_HeadNotChargedNothingSteppedOver(t *testing.T) {
	t.Parallel()
	const sweeps = 12 // past lostRepeats (3) + MaxAttempts (3)
	cases := []struct {
		name      string
		err       error
		transient func(error) bool
	}{
		{name: "publisher gives a context error", err: context.DeadlineExceeded},
		{name: "publisher's own outage error, classified by Transient", err: fmt.Errorf("publish: %w", errKafkaDown),
			transient: func(err error) bool { return errors.Is(err, errKafkaDown) }},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			db := migrated(t, testdb.SQLite)
			ids := publishN(t, db, "", "orders", 3)
			pub := &downPub{err: tc.err}
			d := outbox.NewPublisherDestination(pub, nil)
			d.Transient = tc.transient
			f, err := outbox.NewForwarder(db.DB, d, outbox.ForwarderConfig{Dialect: outbox.SQLite, MaxAttempts: 3})
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			attempts := sweepThroughOutage(t, db, f, sweeps, ids[0])
			pub.setUp()
			n := sweepAll(t, f)
			stuck, err := f.Store().Stuck(context.Background(), 10)
			if err != nil {
				t.Fatal(err)
			}
			if attempts != 0 || len(stuck) > 0 || n != len(ids) || !slices.Equal(pub.sent, ids) {
				t.Errorf("after %d sweeps in an outage the head record had %d attempts and %d record(s) were stuck; once it ended %d published as %v, want %v",
					sweeps, attempts, len(stuck), n, pub.sent, ids)
			}
		})
	}
	// The default is not to guess: an error Transient does not tell
	// counts an attempt, as a record's fault.
	t.Run("unclassified error counts attempts", func(t *testing.T) {
		db := migrated(t, testdb.SQLite)
		ids := publishN(t, db, "", "orders", 1)
		f, err := outbox.NewForwarder(db.DB, outbox.NewPublisherDestination(&downPub{err: errKafkaDown}, nil), outbox.ForwarderConfig{Dialect: outbox.SQLite})
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		if _, err := f.Sweep(context.Background()); err == nil || errors.Is(err, outbox.ErrConnectionLost) {
			t.Fatalf("sweep: %v, want the publisher's error, not ErrConnectionLost", err)
		}
		if attempts := attemptsOf(t, db, ids[0]); attempts != 1 {
			t.Errorf("attempts %d, want 1", attempts)
		}
	})
}

// A publisher that hangs through an outage, its publishes past the
// timeout, made the head record stuck the same way.
func TestPublisherDestination_HungThroughOutage_HeadNotCharged(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.SQLite)
	ids := publishN(t, db, "", "orders", 2)
	hang := newHangPub()
	after := &slowCapture{}
	f, err := outbox.NewForwarder(db.DB, outbox.NewPublisherDestination(&switchPub{hang: hang, then: after}, nil),
		outbox.ForwarderConfig{Dialect: outbox.SQLite, PublishTimeout: 100 * time.Millisecond, MaxAttempts: 3})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	defer hang.unhang()                                 // before Close, which waits for a sweep in a hung publish
	attempts := sweepThroughOutage(t, db, f, 8, ids[0]) // past lostRepeats (3) + MaxAttempts (3)
	hang.unhang()
	sweepAll(t, f)
	if got := after.got(); attempts != 0 || !slices.Equal(got, ids) {
		t.Errorf("after 8 sweeps hung the head record had %d attempts; once it returned the records went out as %v, want %v", attempts, got, ids)
	}
}

// sweepThroughOutage sweeps n times with the destination down, and returns
// the attempts counted against head.
func sweepThroughOutage(t *testing.T, db *testdb.DB, f *outbox.Forwarder, n int, head string) int {
	t.Helper()
	for i := 0; i < n; i++ {
		if _, err := f.Sweep(context.Background()); i == 0 && !errors.Is(err, outbox.ErrConnectionLost) {
			t.Errorf("sweep with the destination down: %v, want ErrConnectionLost", err)
		}
	}
	return attemptsOf(t, db, head)
}

func attemptsOf(t *testing.T, db *testdb.DB, id string) int {
	t.Helper()
	var n int
	if err := db.QueryRow("SELECT attempts FROM acemq_outbox WHERE id = ?", id).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// stallPub takes hold over each publish of the message whose UUID is
// stall (or of every message when stall is ""), and then answers late;
// any other message it takes at once. With one stalled message it is a
// publisher that works and cannot get that one message through in time
// (its payload, say); with every message stalled, a publisher whose broker
// is down and which gives up on its own, past the relay's timeout.
type stallPub struct {
	stall string
	hold  time.Duration
	late  error
	mu    sync.Mutex
	sent  []string
}

func (p *stallPub) Publish(_ string, msgs ...*message.Message) error {
	for _, m := range msgs {
		if p.stall == "" || m.UUID == p.stall {
			time.Sleep(p.hold) // the publisher's slowness, not synchronisation
			return p.late
		}
		p.mu.Lock()
		p.sent = append(p.sent, m.UUID)
		p.mu.Unlock()
	}
	return nil
}
func (p *stallPub) Close() error { return nil }
func (p *stallPub) got() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Clone(p.sent)
}

// A record whose publish always ran past the timeout, through a publisher
// that answered each of them late, was charged no attempt, ever (a timeout
// was taken for an outage): it held the records behind it for ever and
// never became stuck, so outboxctl stuck never showed it. Once the
// publisher has answered the record's publish cut off at the timeout, a
// timeout at it again is the record's, and is charged past lostRepeats in a
// row: it becomes stuck and the records behind it go. A publisher that
// answers late with an outage's error (or never: see
// TestPublisherDestination_HungThroughOutage_HeadNotCharged) is an outage,
// and charges nothing.
func TestPublisherDestination_RecordTimesOutEachTime_ChargedUntilStuckFollowersGo(t *testing.T) {
	const (
		publishTimeout = 100 * time.Millisecond
		hold           = 150 * time.Millisecond
		maxAttempts    = 3
		sweeps         = 40 // lostRepeats (3) + MaxAttempts (3) of them count, a few do not (see below)
	)
	newRelay := func(t *testing.T, db *testdb.DB, pub message.Publisher) *outbox.Forwarder {
		f, err := outbox.NewForwarder(db.DB, outbox.NewPublisherDestination(pub, nil),
			outbox.ForwarderConfig{Dialect: outbox.SQLite, PublishTimeout: publishTimeout, MaxAttempts: maxAttempts})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = f.Close() })
		return f
	}
	for _, tc := range []struct {
		name string
		late error
	}{
		{name: "answered late, delivered", late: nil},
		{name: "answered late with the publisher's own error", late: errors.New("webhook: upstream hung up")},
	} {
		t.Run(tc.name, func(t *testing.T) {
			db := migrated(t, testdb.SQLite)
			ids := publishN(t, db, "", "orders", 2)
			pub := &stallPub{stall: ids[0], hold: hold, late: tc.late}
			f := newRelay(t, db, pub)
			// A sweep whose wait for the publish cut off before ran out
			// fails as a timeout of that publish, not of the record's, and
			// counts nothing: hence more sweeps than the counted ones.
			n := 0
			for ; n < sweeps && stateOf(t, db, ids[0]).Attempts < maxAttempts; n++ {
				if _, err := f.Sweep(context.Background()); !errors.Is(err, outbox.ErrConnectionLost) {
					t.Fatalf("sweep %d: %v, want ErrConnectionLost", n, err)
				}
			}
			attempts := attemptsOf(t, db, ids[0])
			stuck, err := f.Store().Stuck(context.Background(), 10)
			if err != nil {
				t.Fatal(err)
			}
			// The records behind it go, once the publish cut off last
			// has returned (a sweep may time out waiting for it).
			for i := 0; len(stuck) == 1 && i < 5 && len(pub.got()) < len(ids)-1; i++ {
				_, _ = f.Sweep(context.Background())
			}
			if attempts != maxAttempts || len(stuck) != 1 || stuck[0].ID != ids[0] || !slices.Equal(pub.got(), ids[1:]) {
				t.Errorf("after %d sweeps timing out at the head record, it had %d attempts, %d record(s) stuck; then published %v, want %d attempts, the head stuck and %v published",
					n, attempts, len(stuck), pub.got(), maxAttempts, ids[1:])
			}
		})
	}
	t.Run("every record times out, answered late with an outage error", func(t *testing.T) {
		db := migrated(t, testdb.SQLite)
		ids := publishN(t, db, "", "orders", 2)
		pub := &stallPub{hold: hold, late: fmt.Errorf("publish: %w", context.DeadlineExceeded)}
		f := newRelay(t, db, pub)
		attempts := sweepThroughOutage(t, db, f, 12, ids[0])
		stuck, err := f.Store().Stuck(context.Background(), 10)
		if err != nil {
			t.Fatal(err)
		}
		if attempts != 0 || len(stuck) != 0 {
			t.Errorf("after 12 sweeps in an outage the head record had %d attempts and %d record(s) were stuck, want none", attempts, len(stuck))
		}
	})
}

// closeWatchPub takes hold over each publish, or hangs in it until
// released when hold is 0, and notes the publishes under way when it is
// closed.
type closeWatchPub struct {
	hold     time.Duration
	release  chan struct{}
	inFlight atomic.Int32
	// closedOver is how many publishes were under way when Close came, -1
	// before it came.
	closedOver atomic.Int32
}

func newCloseWatchPub(hold time.Duration) *closeWatchPub {
	p := &closeWatchPub{hold: hold, release: make(chan struct{})}
	p.closedOver.Store(-1)
	return p
}

func (p *closeWatchPub) Publish(string, ...*message.Message) error {
	p.inFlight.Add(1)
	defer p.inFlight.Add(-1)
	if p.hold == 0 {
		<-p.release
		return nil
	}
	time.Sleep(p.hold) // the broker's slowness, not synchronisation
	return nil
}

func (p *closeWatchPub) Close() error {
	p.closedOver.Store(p.inFlight.Load())
	return nil
}

// The Forwarder's Close closed the Watermill publisher while a publish cut
// off at PublishTimeout was still under way in it: the publisher was
// closed, and the caller could close what it uses (its client, its
// connection), from under that publish. Close now waits for it, and a
// publish that never returns holds Close for PublishTimeout, not for ever.
func TestPublisherDestination_Close_WaitsForPublishCutOffBounded(t *testing.T) {
	const publishTimeout = 200 * time.Millisecond
	sweepCutOff := func(t *testing.T, pub message.Publisher) *outbox.Forwarder {
		db := migrated(t, testdb.SQLite)
		publishN(t, db, "", "orders", 1)
		f, err := outbox.NewForwarder(db.DB, outbox.NewPublisherDestination(pub, nil), outbox.ForwarderConfig{Dialect: outbox.SQLite, PublishTimeout: publishTimeout})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := f.Sweep(context.Background()); !errors.Is(err, outbox.ErrConnectionLost) {
			t.Fatalf("sweep: %v, want ErrConnectionLost (the publish cut off)", err)
		}
		return f
	}
	t.Run("publish returns past the timeout", func(t *testing.T) {
		pub := newCloseWatchPub(publishTimeout + 150*time.Millisecond)
		f := sweepCutOff(t, pub)
		if err := f.Close(); err != nil {
			t.Fatal(err)
		}
		if over, now := pub.closedOver.Load(), pub.inFlight.Load(); over != 0 || now != 0 {
			t.Errorf("the publisher was closed over %d publish(es) under way, and %d were under way once Close returned; want none", over, now)
		}
	})
	t.Run("publish never returns", func(t *testing.T) {
		pub := newCloseWatchPub(0)
		defer close(pub.release)
		f := sweepCutOff(t, pub)
		start := time.Now()
		closed := make(chan struct{})
		go func() { _ = f.Close(); close(closed) }()
		select {
		case <-closed:
		case <-time.After(5 * time.Second):
			t.Fatalf("Close has not returned 5 s after it was called (PublishTimeout %s): it waits for ever on a publish that never returns", publishTimeout)
		}
		if took := time.Since(start); took > publishTimeout+time.Second {
			t.Errorf("Close took %s with a publish that never returns, want about PublishTimeout (%s)", took.Round(time.Millisecond), publishTimeout)
		}
		if pub.closedOver.Load() < 0 {
			t.Error("the publisher was not closed")
		}
	})
}

// PublisherDestination dropped the row's content_type: a consumer of a
// relayed message could not tell it, and a copy its handler published
// through a TxPublisher went out with that publisher's default. It now
// comes in the metadata key TxPublisher takes it from
// (MetadataContentType), unless the message carries one of its own.
func TestPublisherDestination_GoChannel_ConsumerReadsContentType(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.SQLite)
	plain := message.NewMessage(watermill.NewUUID(), []byte(`{}`))
	own := message.NewMessage(watermill.NewUUID(), []byte(`{}`))
	own.Metadata.Set(outbox.MetadataContentType, "application/cloudevents+json")
	publishInTx(t, db, "orders", []*message.Message{plain, own}, outbox.TxPublisherConfig{ContentType: "application/json"})
	// Another library's row, whose header of that name differs from its
	// content_type column (text/plain): the message's own header stands.
	raw := watermill.NewUUID()
	insertRaw(t, db, raw, "", "orders", `{"content_type":"application/xml"}`, "")
	want := map[string]string{plain.UUID: "application/json", own.UUID: "application/cloudevents+json", raw: "application/xml"}

	ch := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: int64(len(want))}, nil)
	defer ch.Close()
	out, err := ch.Subscribe(context.Background(), "orders")
	if err != nil {
		t.Fatal(err)
	}
	f, err := outbox.NewForwarder(db.DB, outbox.NewPublisherDestination(ch, nil), outbox.ForwarderConfig{Dialect: outbox.SQLite})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if n := sweepAll(t, f); n != len(want) {
		t.Fatalf("published %d, want %d", n, len(want))
	}
	for range want {
		select {
		case m := <-out:
			m.Ack()
			if got := m.Metadata.Get(outbox.MetadataContentType); got != want[m.UUID] {
				t.Errorf("message %s: metadata %s %q, want %q", m.UUID, outbox.MetadataContentType, got, want[m.UUID])
			}
		case <-time.After(5 * time.Second):
			t.Fatal("a message did not arrive")
		}
	}
}
