package outbox_test

import (
	"context"
	"fmt"
	"math"
	"testing"
	"time"

	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	amqp "github.com/rabbitmq/amqp091-go"

	outbox "github.com/acemq/watermill-outbox"
)

// Every AMQP field type amqp091-go reads reaches the metadata: a string as
// it is, any other value as its JSON text, never a refused message.
func TestAMQPMarshaler_EveryAMQPFieldType_InMetadataAsJSONText(t *testing.T) {
	t.Parallel()
	berlin := time.FixedZone("CEST", 2*3600)
	for _, tc := range []struct {
		name  string
		value any
		want  string
	}{
		{"string as it is", "pay-1", "pay-1"},
		{"string that looks like JSON", `"quoted" 7`, `"quoted" 7`},
		{"empty string", "", ""},
		{"int8", int8(-8), "-8"},
		{"uint8", byte(200), "200"},
		{"int16", int16(-300), "-300"},
		{"uint16", uint16(65535), "65535"},
		{"int32", int32(-70000), "-70000"},
		{"uint32", uint32(4000000000), "4000000000"},
		{"int64 beyond 2^53", int64(9007199254740993), "9007199254740993"},
		{"min int64", int64(math.MinInt64), "-9223372036854775808"},
		{"float32 shortest", float32(0.1), "0.1"},
		{"float64", 0.5, "0.5"},
		{"float64 integral", float64(1), "1"},
		{"float64 large", 1e21, "1e+21"},
		{"NaN", math.NaN(), `"NaN"`},
		{"+Inf", math.Inf(1), `"Infinity"`},
		{"-Inf float32", float32(math.Inf(-1)), `"-Infinity"`},
		{"true", true, "true"},
		{"false", false, "false"},
		{"void", nil, "null"},
		{"byte array as base64", []byte{0, 1, 2, 255}, `"AAEC/w=="`},
		{"timestamp in UTC", time.Date(2026, 9, 26, 11, 14, 2, 0, berlin), `"2026-09-26T09:14:02Z"`},
		{"decimal keeps its scale", amqp.Decimal{Scale: 2, Value: 4250}, "42.50"},
		{"negative decimal below one", amqp.Decimal{Scale: 3, Value: -5}, "-0.005"},
		{"decimal of scale 0", amqp.Decimal{Scale: 0, Value: -7}, "-7"},
		{"decimal of value 0", amqp.Decimal{Scale: 2, Value: 0}, "0.00"},
		{"field array", []any{"a", int64(1), nil, []byte("x"), float32(0.25)}, `["a",1,null,"eA==",0.25]`},
		{"empty array", []any{}, `[]`},
		{"table, keys sorted", amqp.Table{"b": "x", "a": amqp.Table{"n": int32(1), "d": amqp.Decimal{Scale: 1, Value: 15}}}, `{"a":{"d":1.5,"n":1},"b":"x"}`},
		{"HTML characters unescaped", []any{"<a&b>"}, `["<a&b>"]`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			msg, err := outbox.AMQPMarshaler{}.Unmarshal(amqp.Delivery{
				MessageId: "m-1",
				Headers:   amqp.Table{"h": tc.value},
			})
			if err != nil {
				t.Fatalf("Unmarshal: %v", err)
			}
			got, ok := msg.Metadata["h"]
			if !ok || got != tc.want {
				t.Fatalf("metadata h = %q (present %v), want %q", got, ok, tc.want)
			}
		})
	}
}

// The message UUID is x-acemq-id, else _watermill_message_uuid, else the
// message_id property: a message from any AceMQ relay has its id, and a
// stale Watermill header another service copied on does not override it.
// The UUID header is not copied into the metadata; x-acemq-id is.
func TestAMQPMarshaler_UUID_FromAcemqIDElseWatermillHeaderElseMessageID(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name      string
		marshaler outbox.AMQPMarshaler
		d         amqp.Delivery
		want      string
	}{
		{"all three, a stale Watermill header copied on", outbox.AMQPMarshaler{}, amqp.Delivery{MessageId: "prop", Headers: amqp.Table{"_watermill_message_uuid": "wm", "x-acemq-id": "ace"}}, "ace"},
		{"a Watermill publisher: its header and message_id", outbox.AMQPMarshaler{}, amqp.Delivery{MessageId: "prop", Headers: amqp.Table{"_watermill_message_uuid": "wm"}}, "wm"},
		{"another AceMQ relay: x-acemq-id and message_id", outbox.AMQPMarshaler{}, amqp.Delivery{MessageId: "prop", Headers: amqp.Table{"x-acemq-id": "ace"}}, "ace"},
		{"message_id only", outbox.AMQPMarshaler{}, amqp.Delivery{MessageId: "prop"}, "prop"},
		{"empty UUID header", outbox.AMQPMarshaler{}, amqp.Delivery{MessageId: "prop", Headers: amqp.Table{"_watermill_message_uuid": ""}}, "prop"},
		{"empty x-acemq-id", outbox.AMQPMarshaler{}, amqp.Delivery{MessageId: "prop", Headers: amqp.Table{"_watermill_message_uuid": "wm", "x-acemq-id": ""}}, "wm"},
		{"x-acemq-id void", outbox.AMQPMarshaler{}, amqp.Delivery{MessageId: "prop", Headers: amqp.Table{"x-acemq-id": nil}}, "prop"},
		{"x-acemq-id true", outbox.AMQPMarshaler{}, amqp.Delivery{MessageId: "prop", Headers: amqp.Table{"x-acemq-id": true}}, "prop"},
		{"x-acemq-id a number", outbox.AMQPMarshaler{}, amqp.Delivery{MessageId: "prop", Headers: amqp.Table{"x-acemq-id": int64(42)}}, "prop"},
		{"UUID header not a string", outbox.AMQPMarshaler{}, amqp.Delivery{MessageId: "prop", Headers: amqp.Table{"_watermill_message_uuid": int64(7)}}, "prop"},
		{"no id at all", outbox.AMQPMarshaler{}, amqp.Delivery{DeliveryTag: 1, Body: []byte(`{}`)}, ""},
		{"own UUID header", outbox.AMQPMarshaler{DefaultMarshaler: wamqp.DefaultMarshaler{MessageUUIDHeaderKey: "uuid"}},
			amqp.Delivery{MessageId: "prop", Headers: amqp.Table{"uuid": "own", "_watermill_message_uuid": "wm"}}, "own"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			msg, err := tc.marshaler.Unmarshal(tc.d)
			if err != nil {
				t.Fatal(err)
			}
			if msg.UUID != tc.want {
				t.Errorf("UUID = %q, want %q", msg.UUID, tc.want)
			}
			uuidKey := tc.marshaler.MessageUUIDHeaderKey
			if uuidKey == "" {
				uuidKey = wamqp.DefaultMessageUUIDHeaderKey
			}
			if _, ok := msg.Metadata[uuidKey]; ok {
				t.Errorf("the UUID header %s is in the metadata: %v", uuidKey, msg.Metadata)
			}
			if id, ok := tc.d.Headers[outbox.HeaderMessageID]; ok {
				switch id.(type) {
				case string:
				case int64:
					id = fmt.Sprint(id)
				default:
					id = msg.UUID // no id: the inbox dedupes by the header first
				}
				if msg.Metadata.Get(outbox.HeaderMessageID) != id {
					t.Errorf("x-acemq-id = %q, want %q in the metadata", msg.Metadata.Get(outbox.HeaderMessageID), id)
				}
			}
		})
	}
}

// Marshal is watermill-amqp's, and what it marshals unmarshals to the same
// message.
func TestAMQPMarshaler_MarshalThenUnmarshal_SameMessage(t *testing.T) {
	t.Parallel()
	sent := message.NewMessage("m-1", []byte("payload"))
	sent.Metadata.Set("tenant", "acme")
	m := outbox.AMQPMarshaler{}
	p, err := m.Marshal(sent)
	if err != nil {
		t.Fatal(err)
	}
	want, _ := wamqp.DefaultMarshaler{}.Marshal(sent)
	if p.DeliveryMode != want.DeliveryMode || len(p.Headers) != len(want.Headers) {
		t.Fatalf("Marshal = %+v, want the default marshaler's %+v", p, want)
	}
	got, err := m.Unmarshal(amqp.Delivery{Headers: p.Headers, Body: p.Body})
	if err != nil {
		t.Fatal(err)
	}
	if !got.Equals(sent) {
		t.Fatalf("unmarshalled %s %v %q, want %s %v %q", got.UUID, got.Metadata, got.Payload, sent.UUID, sent.Metadata, sent.Payload)
	}
}

// A copy of a delivered message, under a UUID of its own and sent through
// watermill-amqp with AMQPMarshaler, is read back as the copy, not as its
// original: the x-acemq-id it carried over from the original is set to its
// own UUID. A PostprocessPublishing of the caller's still runs, after it.
func TestAMQPMarshaler_CopyOfADelivery_ReadBackUnderItsOwnUUID(t *testing.T) {
	t.Parallel()
	m := outbox.AMQPMarshaler{DefaultMarshaler: wamqp.DefaultMarshaler{PostprocessPublishing: func(p amqp.Publishing) amqp.Publishing {
		p.CorrelationId = "c-1"
		return p
	}}}
	original, err := m.Unmarshal(amqp.Delivery{MessageId: "a", Headers: amqp.Table{outbox.HeaderMessageID: "a", "tenant": "acme"}, Body: []byte("x")})
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{"b1", "b2"} {
		c := original.Copy()
		c.UUID = id
		p, err := m.Marshal(c)
		if err != nil {
			t.Fatal(err)
		}
		if p.CorrelationId != "c-1" {
			t.Errorf("the caller's PostprocessPublishing did not run: correlation id %q", p.CorrelationId)
		}
		got, err := m.Unmarshal(amqp.Delivery{Headers: p.Headers, Body: p.Body})
		if err != nil {
			t.Fatal(err)
		}
		if got.UUID != id || got.Metadata.Get(outbox.HeaderMessageID) != id || got.Metadata.Get("tenant") != "acme" {
			t.Errorf("copy %s read back as %s (x-acemq-id %q, tenant %q), want itself", id, got.UUID, got.Metadata.Get(outbox.HeaderMessageID), got.Metadata.Get("tenant"))
		}
	}
	if original.Metadata.Get(outbox.HeaderMessageID) != "a" {
		t.Errorf("Marshal changed the copied message's metadata: x-acemq-id %q", original.Metadata.Get(outbox.HeaderMessageID))
	}
}

// The same copy published through watermill-amqp's DefaultMarshaler (a
// publisher left on its default, or any publisher but AMQPMarshaler) keeps
// the original's x-acemq-id and sets no message_id: its own UUID header
// names it, for the UUID and for the inbox's dedupe key alike. A delivery
// straight from a relay, whose UUID header may be a stale copy, keeps its
// x-acemq-id.
func TestAMQPMarshaler_CopyPublishedThroughDefaultMarshaler_ReadBackUnderItsOwnUUID(t *testing.T) {
	t.Parallel()
	m := outbox.AMQPMarshaler{}
	original, err := m.Unmarshal(amqp.Delivery{MessageId: "a", Headers: amqp.Table{outbox.HeaderMessageID: "a", "_watermill_message_uuid": "a"}, Body: []byte("x")})
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{"b1", "b2"} {
		c := original.Copy()
		c.UUID = id
		p, err := wamqp.DefaultMarshaler{}.Marshal(c)
		if err != nil {
			t.Fatal(err)
		}
		got, err := m.Unmarshal(amqp.Delivery{MessageId: p.MessageId, Headers: p.Headers, Body: p.Body})
		if err != nil {
			t.Fatal(err)
		}
		if got.UUID != id || got.Metadata.Get(outbox.HeaderMessageID) != id {
			t.Errorf("copy %s read back as %s (x-acemq-id %q): taken for the original", id, got.UUID, got.Metadata.Get(outbox.HeaderMessageID))
		}
	}
	relayed, err := m.Unmarshal(amqp.Delivery{MessageId: "r", Headers: amqp.Table{outbox.HeaderMessageID: "r", "_watermill_message_uuid": "stale"}})
	if err != nil {
		t.Fatal(err)
	}
	if relayed.UUID != "r" || relayed.Metadata.Get(outbox.HeaderMessageID) != "r" {
		t.Errorf("a relay's delivery with a stale UUID header read back as %s (x-acemq-id %q), want r", relayed.UUID, relayed.Metadata.Get(outbox.HeaderMessageID))
	}
}

// An x-acemq-id that is not a string names no UUID, and stays in the
// metadata as its JSON text, where the inbox dedupes by it: the copy rule
// above rewrote it to the UUID, empty without message_id, and every such
// delivery was refused for having no id.
func TestAMQPMarshaler_AcemqIDNotAString_KeptInTheMetadata(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		d    amqp.Delivery
		uuid string
	}{
		{"alone", amqp.Delivery{DeliveryTag: 1, Headers: amqp.Table{outbox.HeaderMessageID: int64(42)}}, ""},
		{"beside message_id", amqp.Delivery{DeliveryTag: 1, MessageId: "m", Headers: amqp.Table{outbox.HeaderMessageID: int64(42)}}, "m"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			msg, err := outbox.AMQPMarshaler{}.Unmarshal(tc.d)
			if err != nil {
				t.Fatal(err)
			}
			if msg.UUID != tc.uuid || msg.Metadata.Get(outbox.HeaderMessageID) != "42" {
				t.Errorf("UUID %q, x-acemq-id %q in the metadata; want %q and \"42\"", msg.UUID, msg.Metadata.Get(outbox.HeaderMessageID), tc.uuid)
			}
		})
	}
}

// PublisherDestination puts a record's typed headers into the metadata as
// AMQPMarshaler does: a consumer reads the same metadata whichever
// destination relayed the message.
func TestPublisherDestination_TypedHeaders_RenderedAsAMQPMarshalerDoes(t *testing.T) {
	t.Parallel()
	headers := map[string]any{
		"aggregateId": "pay-1", "seq": int64(7), "ratio": 0.5, "priority": true, "note": nil,
		"tags": []any{"a", "b"}, "trace": map[string]any{"id": "t1", "n": int64(2)},
	}
	asAMQP := amqp.Table{
		"aggregateId": "pay-1", "seq": int64(7), "ratio": 0.5, "priority": true, "note": nil,
		"tags": []any{"a", "b"}, "trace": amqp.Table{"id": "t1", "n": int64(2)},
	}
	want, err := outbox.AMQPMarshaler{}.Unmarshal(amqp.Delivery{Headers: asAMQP})
	if err != nil {
		t.Fatal(err)
	}

	ch := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 1, Persistent: true}, nil)
	defer ch.Close()
	d := outbox.NewPublisherDestination(ch, nil)
	rec := outbox.Record{ID: "r-1", RoutingKey: "payments", Body: []byte("{}"), Headers: headers}
	if res := d.Publish(context.Background(), []outbox.Record{rec}); res[0] != nil {
		t.Fatal(res[0])
	}
	out, err := ch.Subscribe(context.Background(), "payments")
	if err != nil {
		t.Fatal(err)
	}
	var got *message.Message
	select {
	case got = <-out:
		got.Ack()
	case <-time.After(10 * time.Second):
		t.Fatal("the message did not arrive")
	}
	for k, v := range want.Metadata {
		if got.Metadata.Get(k) != v {
			t.Errorf("metadata %s = %q, want %q", k, got.Metadata.Get(k), v)
		}
	}
	if got.Metadata.Get("seq") != "7" || got.Metadata.Get("trace") != `{"id":"t1","n":2}` || got.Metadata.Get("note") != "null" {
		t.Errorf("metadata %v", got.Metadata)
	}
}

// The zero amqp.Delivery, which watermill-amqp's subscriber can receive
// from a consumer channel that closed, is refused rather than made a
// message of nothing; a delivery with anything of the broker's in it is a
// message, an empty one included.
func TestAMQPMarshaler_ZeroDelivery_RefusedOthersNot(t *testing.T) {
	t.Parallel()
	if msg, err := (outbox.AMQPMarshaler{}).Unmarshal(amqp.Delivery{}); err == nil {
		t.Fatalf("the zero delivery became a message (%+v), want an error", msg)
	}
	for _, d := range []amqp.Delivery{
		{DeliveryTag: 1},
		{Body: []byte{}},
		{Headers: amqp.Table{}},
		{MessageId: "m-1"},
	} {
		if _, err := (outbox.AMQPMarshaler{}).Unmarshal(d); err != nil {
			t.Errorf("%+v: %v, want a message", d, err)
		}
	}
}
