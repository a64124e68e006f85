package outbox

import (
	"context"
	"errors"
	"reflect"
	"strconv"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/acemq/watermill-outbox/internal/testamqp"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// A window's basic.return is read on the channel the window went out on. A
// relay that has moved to a new channel meanwhile (the next batch's connect
// replaced a closed one) still fails the unroutable record instead of
// marking it published.
func TestAMQPDestination_ReturnOnAReplacedChannel_StillFailsItsRecord(t *testing.T) {
	b := testamqp.New(t) // its exchange has no queue bound for "nowhere"
	d, err := NewAMQPDestination(AMQPConfig{URLs: []string{testdb.AMQPURL()}})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	ctx := context.Background()
	rec := Record{ID: "returned-" + testdb.RandomName(), Exchange: b.Exchange, RoutingKey: "nowhere", Body: []byte("x")}
	p := d.send(ctx, []Record{rec})
	if p.res[0] != nil || len(p.confirms) != 1 {
		t.Fatalf("send: %v", p.res[0])
	}
	<-p.confirms[0].Done() // the broker's ack, which follows its return

	d.mu.Lock()
	d.dropChannelLocked()
	d.mu.Unlock()
	if err := d.Connect(ctx); err != nil {
		t.Fatal(err)
	}
	if d.cc == p.on {
		t.Fatal("the destination did not move to a new channel")
	}

	res := d.wait(ctx, p)
	var unroutable *UnroutableError
	if !errors.As(res[0], &unroutable) {
		t.Fatalf("result %v, want the record failed as unroutable", res[0])
	}
}

// A record's typed headers become the AMQP field values amqp091-go writes:
// an object a nested Table (a map[string]any it refuses), in arrays too,
// an int an int64; the record itself is left as it was, to be sent again.
// More records out on one channel than its buffer of returns holds (Run's
// full pipeline of three windows of 1,000, and a Sweep's batch published
// between their sends and their waits), every one unroutable: each still
// fails as unroutable. With the returns drained only after a window's
// confirms, the client's reader blocked on the full buffer, dropped a
// return after 5 s and read on, and its ack marked the record published.
func TestAMQPDestination_ReturnsBeyondTheBuffer_EveryRecordStillUnroutable(t *testing.T) {
	b := testamqp.New(t) // nothing bound for "nowhere"
	d, err := NewAMQPDestination(AMQPConfig{URLs: []string{testdb.AMQPURL()}})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	ctx := context.Background()
	records := func(prefix string, n int) []Record {
		recs := make([]Record, n)
		for i := range recs {
			recs[i] = Record{ID: prefix + strconv.Itoa(i) + "-" + testdb.RandomName(), Exchange: b.Exchange, RoutingKey: "nowhere", Body: []byte("x")}
		}
		return recs
	}
	pipe := d.Pipeline()
	var windows []Sent
	for w := range 3 {
		windows = append(windows, pipe.Send(ctx, records("run"+strconv.Itoa(w)+"-", maxWindow)))
	}
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	check := func(what string, res []error) {
		t.Helper()
		for i, err := range res {
			var u *UnroutableError
			if !errors.As(err, &u) {
				t.Fatalf("%s, record %d: %v, want an *UnroutableError", what, i, err)
			}
		}
	}
	check("the sweep's batch", d.Publish(wctx, records("sweep-", 100)))
	for w, s := range windows {
		check("window "+strconv.Itoa(w), pipe.Wait(wctx, s))
	}
}

// A window collected after its deadline, its confirms in long before:
// every record is confirmed. The relay collects a window in a later sweep
// than the one that sent it, and what runs between (a claim waiting for a
// connection, the stats' count, SQLite's busy waits) can outlast the
// window's PublishTimeout. With the wait choosing at random between the
// confirm and the expired context, about half of the records came back as
// connection lost: the connection was dropped, and the relay sent the
// whole window, and the windows behind it, again.
func TestAMQPDestination_WaitAfterItsDeadline_ConfirmsAlreadyInCount(t *testing.T) {
	b := testamqp.New(t)
	b.Queue("late")
	d, err := NewAMQPDestination(AMQPConfig{URLs: []string{testdb.AMQPURL()}})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	ctx := context.Background()
	records := func(prefix string, n int) []Record {
		recs := make([]Record, n)
		for i := range recs {
			recs[i] = Record{ID: prefix + strconv.Itoa(i) + "-" + testdb.RandomName(), Exchange: b.Exchange, RoutingKey: "late", Body: []byte("x")}
		}
		return recs
	}
	pipe := d.Pipeline()
	early := pipe.Send(ctx, records("early-", 200))
	// A window sent after it, waited for in time: one queue's confirms come
	// in order, so the early window's are in once this one's are.
	later := pipe.Send(ctx, records("later-", 1))
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if res := pipe.Wait(wctx, later); res[0] != nil {
		t.Fatalf("the later window: %v", res[0])
	}
	// In, but maybe not all settled yet: amqp091-go settles the confirms
	// a multiple ack covers in map order, the later window's among them
	// (3 runs in 30 failed here with "context deadline exceeded" on
	// confirms another goroutine was still settling).
	for _, dc := range early.(*sent).confirms {
		select {
		case <-dc.Done():
		case <-wctx.Done():
			t.Fatal("the early window's confirms never settled")
		}
	}
	expired, cancelExpired := context.WithDeadline(ctx, time.Now().Add(-time.Second))
	defer cancelExpired()
	failed := 0
	for i, err := range pipe.Wait(expired, early) {
		if err != nil {
			failed++
			if failed == 1 {
				t.Errorf("record %d, confirmed before its wait: %v", i, err)
			}
		}
	}
	if failed > 0 {
		t.Errorf("%d of 200 records confirmed before their wait came back failed", failed)
	}
}

// One id out twice on a channel (a claim whose lease ran out in flight,
// claimed again by the same relay), both copies returned: each wait takes
// one return, so neither copy reads as confirmed.
func TestConfirmChannel_TwoReturnsOfOneID_OnePerWait(t *testing.T) {
	c := &confirmChannel{returned: map[string][]amqp.Return{}}
	c.file(amqp.Return{MessageId: "a", RoutingKey: "first"})
	c.file(amqp.Return{MessageId: "a", RoutingKey: "second"})
	for _, want := range []string{"first", "second"} {
		if ret, ok := c.takeReturn("a"); !ok || ret.RoutingKey != want {
			t.Fatalf("takeReturn = %+v, %v; want the %s return", ret, ok, want)
		}
	}
	if _, ok := c.takeReturn("a"); ok || len(c.returned) != 0 {
		t.Fatalf("a third take found a return, or returns are left: %v", c.returned)
	}
}

func TestPublishing_TypedHeaders_BecomeAMQPFieldValues(t *testing.T) {
	tags := []any{"a", map[string]any{"k": 1}}
	rec := Record{ID: "r", Headers: map[string]any{
		"s": "x", "n": int64(7), "f": 0.5, "b": true, "null": nil, "i": 3,
		"tags": tags, "trace": map[string]any{"id": "t1", "in": map[string]any{"n": int64(2)}},
	}}
	msg := publishing(rec)
	want := amqp.Table{
		"s": "x", "n": int64(7), "f": 0.5, "b": true, "null": nil, "i": int64(3),
		"tags": []any{"a", amqp.Table{"k": int64(1)}}, "trace": amqp.Table{"id": "t1", "in": amqp.Table{"n": int64(2)}},
		HeaderMessageID: "r", HeaderWatermillUUID: "r",
	}
	if !reflect.DeepEqual(msg.Headers, want) {
		t.Fatalf("headers %#v, want %#v", msg.Headers, want)
	}
	if err := msg.Headers.Validate(); err != nil {
		t.Fatalf("amqp091-go refuses the headers: %v", err)
	}
	if err := encodable(rec, msg, 4096); err != nil {
		t.Fatalf("encodable: %v", err)
	}
	if _, ok := tags[1].(map[string]any); !ok {
		t.Fatalf("the record's array was changed: %#v", tags)
	}
}

// A keyed record's key and number go as a string and an AMQP long, over row
// headers of the same names; an unkeyed record has neither.
func TestPublishing_KeyedRecord_AggregateIDStringSeqInt64(t *testing.T) {
	msg := publishing(Record{ID: "r", AggregateID: "pay-1", Seq: 3, Headers: map[string]any{HeaderSeq: "forged"}})
	if msg.Headers[HeaderAggregateID] != "pay-1" || msg.Headers[HeaderSeq] != int64(3) {
		t.Fatalf("headers %#v, want aggregateId \"pay-1\" and seq int64(3)", msg.Headers)
	}
	if err := msg.Headers.Validate(); err != nil {
		t.Fatal(err)
	}
	if h := publishing(Record{ID: "u"}).Headers; h[HeaderAggregateID] != nil || h[HeaderSeq] != nil {
		t.Fatalf("unkeyed headers %#v", h)
	}
}

// encodable sizes typed and nested values as amqp091-go writes them, and
// refuses what the client cannot write or an AMQP client cannot read.
func TestEncodable_TypedAndNestedHeaders_SizedAndChecked(t *testing.T) {
	ints := func(n int) []any {
		a := make([]any, n)
		for i := range a {
			a[i] = int64(i)
		}
		return a
	}
	deep := any(int64(1))
	for range 33 {
		deep = []any{deep}
	}
	for _, tc := range []struct {
		name    string
		headers map[string]any
		want    string // "" accepted
	}{
		// An array of 430 int64s is 3,875 bytes as AMQP fields, and fits
		// 4,096 with the ids and the fixed fields; of 450 it is 4,055 and
		// does not: an estimate that counted only strings would pass both.
		{"430 integers fit", map[string]any{"a": ints(430)}, ""},
		{"450 integers do not fit", map[string]any{"a": ints(450)}, "do not fit the broker's frame of 4096 bytes"},
		{"nested in tables", map[string]any{"t": map[string]any{"a": ints(230), "b": ints(230)}}, "do not fit"},
		{"nested key of 256 bytes", map[string]any{"t": map[string]any{strings.Repeat("k", 256): 1}}, `header "t": nested key of 256 bytes`},
		{"33 deep", map[string]any{"d": deep}, `header "d": arrays and tables nested 33 deep`},
		{"no AMQP type", map[string]any{"x": struct{}{}}, `header "x": a value of type struct {}`},
		{"8191 headers and the ids", manyHeaders(8191), "8193 headers with the ids"},
		{"CC a string", map[string]any{"CC": "ops"}, `header "CC" of type string: RabbitMQ reads CC as sender-selected routing`},
		{"BCC an integer", map[string]any{"BCC": int64(1)}, `header "BCC" of type int64`},
		{"CC null", map[string]any{"CC": nil}, `header "CC" of type <nil>`},
		{"CC an array", map[string]any{"CC": []any{"ops", "audit"}, "BCC": []any{}}, ""},
		{"cc in lower case is the application's", map[string]any{"cc": "ops"}, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rec := Record{ID: "r", Headers: tc.headers}
			err := encodable(rec, publishing(rec), 4096)
			if tc.want == "" && err != nil || tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)) {
				t.Fatalf("encodable = %v, want %q", err, tc.want)
			}
		})
	}
}

func manyHeaders(n int) map[string]any {
	m := make(map[string]any, n)
	for i := range n {
		m[strconv.Itoa(i)] = nil
	}
	return m
}

// The exchange a channel close blames, as RabbitMQ words its refusals,
// whole or cut short at 255 bytes; a close that names none blames no record
// among several.
func TestRefusedExchange_ReadsRabbitMQsWording(t *testing.T) {
	for reason, want := range map[string]exchange{
		"ACCESS_REFUSED - cannot publish to internal exchange 'orders.internal' in vhost '/'":           {name: "orders.internal", whole: true},
		"ACCESS_REFUSED - write access to exchange 'orders' in vhost 'shop' refused for user 'relay'":   {name: "orders", whole: true},
		"NOT_FOUND - no exchange 'gone' in vhost '/'":                                                   {name: "gone", whole: true},
		"ACCESS_REFUSED - write access to exchange 'amq.default' in vhost '/' refused for user 'relay'": {name: "amq.default", whole: true},
		"ACCESS_REFUSED - cannot publish to internal exchange 'a-very-long-name...":                     {name: "a-very-long-name"},
		"PRECONDITION_FAILED - invalid message: {unacceptable_type_in_header,\"CC\",longstr}":           {},
	} {
		got, named := refusedExchange(reason)
		if got != want || named != (want.name != "") {
			t.Errorf("refusedExchange(%q) = %+v, %v; want %+v", reason, got, named, want)
		}
	}
	for _, c := range []struct {
		rec   string
		named exchange
		want  bool
	}{
		{"", exchange{name: "amq.default", whole: true}, true},
		{"orders", exchange{name: "amq.default", whole: true}, false},
		{"orders", exchange{name: "orders", whole: true}, true},
		{"orders.internal", exchange{name: "orders", whole: true}, false},
		{"a-very-long-name-of-an-exchange", exchange{name: "a-very-long-name"}, true},
	} {
		if got := sameExchange(c.rec, c.named); got != c.want {
			t.Errorf("sameExchange(%q, %+v) = %v, want %v", c.rec, c.named, got, c.want)
		}
	}
}

// The limit a channel close over a message's size names, as RabbitMQ
// words it (3.8 to 4.x), and none in other closes.
func TestRefusedSize_ReadsRabbitMQsWording(t *testing.T) {
	for reason, want := range map[string]int{
		"PRECONDITION_FAILED - message size 134217729 is larger than configured max size 134217728": 134217728,
		"PRECONDITION_FAILED - message size 536870913 is larger than max size 536870912":            536870912,
		"PRECONDITION_FAILED - message size 2000000 is larger than configured max size 1000000":     1000000,
		"PRECONDITION_FAILED - invalid message: {unacceptable_type_in_header,\"CC\",longstr}":       0,
		"NOT_FOUND - no exchange 'gone' in vhost '/'":                                               0,
		"PRECONDITION_FAILED - message size 7 is larger than configured max size ":                  0,
	} {
		got, ok := refusedSize(reason)
		if got != want || ok != (want > 0) {
			t.Errorf("refusedSize(%q) = %d, %v; want %d", reason, got, ok, want)
		}
	}
}

// The limit a destination refuses bodies over before sending them: the
// configured one, or the broker's as it named it refusing a larger message
// on this connection, whichever is lower.
func TestOverMaxSize_ConfiguredOrLearnedLimit(t *testing.T) {
	body := func(n int) Record { return Record{Body: make([]byte, n)} }
	for _, c := range []struct {
		configured, learned, size, want int // want: the limit named, 0 for none
	}{
		{0, 0, 1 << 30, 0},
		{100, 0, 100, 0},
		{100, 0, 101, 100},
		{0, 100, 101, 100},
		{0, 100, 100, 0},
		{50, 100, 60, 50},
		{200, 100, 150, 100},
	} {
		d := &AMQPDestination{cfg: AMQPConfig{MaxMessageSize: c.configured}, brokerMax: c.learned}
		err := d.overMaxSize(body(c.size))
		var tooLarge *MessageTooLargeError
		switch {
		case c.want == 0 && err != nil:
			t.Errorf("%+v: %v; want none", c, err)
		case c.want > 0 && (!errors.As(err, &tooLarge) || tooLarge.Max != c.want || tooLarge.Size != c.size):
			t.Errorf("%+v: %v; want a *MessageTooLargeError over %d", c, err, c.want)
		}
	}
}

// Destinations built from one amqp.Config whose Properties the caller set
// each name their connections themselves, and leave the caller's table as
// it was: the first used to write its connection_name there, and every
// later one, finding it, took that name.
func TestNewAMQPDestination_SharedConnectionProperties_EachKeepsItsName(t *testing.T) {
	shared := amqp.Config{Properties: amqp.Table{"product": "my-service"}}
	for _, name := range []string{"relay-a", "relay-b"} {
		d, err := NewAMQPDestination(AMQPConfig{URLs: []string{testdb.AMQPURL()}, AMQP: shared, ConnectionName: name})
		if err != nil {
			t.Fatal(err)
		}
		if got := d.cfg.AMQP.Properties["connection_name"]; got != name || d.cfg.AMQP.Properties["product"] != "my-service" {
			t.Errorf("destination %s: connection_name %v, product %v", name, got, d.cfg.AMQP.Properties["product"])
		}
		_ = d.Close()
	}
	if _, ok := shared.Properties["connection_name"]; ok || len(shared.Properties) != 1 {
		t.Errorf("the caller's table was written: %v", shared.Properties)
	}
}

// A message RabbitMQ refuses for what it holds ("PRECONDITION_FAILED -
// invalid message", here a CC header that is no array, as another library's
// row can hold when encodable's check does not know the refusal) fails its
// record permanently once the close is blamed on it: every try would close
// the channel again, and an unkeyed record would hold back every row behind
// it until MaxAttempts.
func TestAMQPDestination_BrokerRefusesTheMessage_PermanentFailure(t *testing.T) {
	b := testamqp.New(t)
	b.Queue("t")
	saved := routingHeaders
	routingHeaders = nil // as if encodable did not know this refusal
	defer func() { routingHeaders = saved }()
	d, err := NewAMQPDestination(AMQPConfig{URLs: []string{testdb.AMQPURL()}})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	rec := Record{ID: "refused-" + testdb.RandomName(), Exchange: b.Exchange, RoutingKey: "t", Body: []byte("x"), Headers: map[string]any{"CC": "ops"}}
	res := d.Publish(context.Background(), []Record{rec}) // alone: the close is its
	if !IsPermanent(res[0]) || !strings.Contains(res[0].Error(), "unacceptable_type_in_header") {
		t.Fatalf("result %v, want a permanent failure with the broker's reason", res[0])
	}
	// The destination goes on: the next record is published.
	ok := Record{ID: "fine-" + testdb.RandomName(), Exchange: b.Exchange, RoutingKey: "t", Body: []byte("x")}
	if res := d.Publish(context.Background(), []Record{ok}); res[0] != nil {
		t.Fatalf("the next record: %v", res[0])
	}
}
