package outbox

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"

	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"
)

// AMQPMarshaler is the marshaler for watermill-amqp subscribers of messages
// that AceMQ relays sent, this library's or another language's: set it as
// the Marshaler of the subscriber's wamqp.Config.
//
// watermill-amqp's DefaultMarshaler refuses a message with a header that is
// not a string, and its subscriber requeues such a message for ever. Relays
// of other AceMQ libraries send numbers, booleans, arrays, tables and void,
// this library's relay sends seq as an integer, and a quorum queue adds
// x-delivery-count, an integer, to what it delivers again (on RabbitMQ 3.x
// after a nack or a lost consumer); a message from another relay has no
// _watermill_message_uuid either. AMQPMarshaler takes every header into the
// metadata, a string as it is and any other value as its JSON text (see
// Unmarshal), and the message UUID from the first of x-acemq-id,
// _watermill_message_uuid and the message_id property that is a non-empty
// string (x-acemq-id first: a service that copies the headers it received
// onto what it sends carries a stale Watermill UUID), but not an x-acemq-id
// beside an empty message_id and a UUID header of another id: a copy of a
// delivery sent through another marshaler, which carried the original's on.
// It marshals as the embedded DefaultMarshaler does, but for x-acemq-id
// (see Marshal).
type AMQPMarshaler struct {
	wamqp.DefaultMarshaler
}

// Marshal is DefaultMarshaler's, with an x-acemq-id header of the metadata
// set to the message's UUID. A message unmarshalled here keeps x-acemq-id
// in its metadata, and msg.Copy() keeps it too: a copy under a UUID of its
// own, published through watermill-amqp with this marshaler, would
// otherwise go out with its original's id first in line, and an inbox
// would take it for the original and ack it without running. A message
// without x-acemq-id is marshalled as DefaultMarshaler does.
//
// A copy of a keyed delivery also carries its aggregateId and seq headers
// (HeaderAggregateID, HeaderSeq), which Marshal leaves as they are: they are
// the ordering of a message an ordered inbox reads, and only the relay
// numbers a key. Delete them from a copy sent this way; a TxPublisher
// drops them from the messages it writes.
func (m AMQPMarshaler) Marshal(msg *message.Message) (amqp.Publishing, error) {
	d := m.DefaultMarshaler
	if _, ok := msg.Metadata[HeaderMessageID]; ok {
		post := d.PostprocessPublishing
		d.PostprocessPublishing = func(p amqp.Publishing) amqp.Publishing {
			p.Headers[HeaderMessageID] = msg.UUID
			if post != nil {
				p = post(p)
			}
			return p
		}
	}
	return d.Marshal(msg)
}

// Unmarshal never fails over a header; it fails only for the zero
// amqp.Delivery (see closedDelivery). The message UUID is the x-acemq-id
// header, else the _watermill_message_uuid header
// (DefaultMarshaler.MessageUUIDHeaderKey if set), else the AMQP message_id
// property; the UUID header first where x-acemq-id is a copy's (see
// AMQPMarshaler). The UUID header is not copied into the metadata,
// x-acemq-id is, as the UUID. Each header
// is in the metadata: a string as it is, any other value as JSON text:
//
//	integers of every width, floats    7, -3, 0.5, 1e+21 (float32 in its shortest form)
//	NaN, +Inf, -Inf                    "NaN", "Infinity", "-Infinity" (JSON has no such numbers)
//	boolean                            true, false
//	void                               null
//	decimal (scale, value)             the exact decimal number: scale 2, value 4250 is 42.50
//	timestamp (seconds)                "2026-09-26T09:14:02Z", RFC 3339 in UTC
//	byte array                         its standard base64 as a JSON string, as encoding/json writes []byte
//	field array                        a JSON array of these, strings quoted
//	table                              a JSON object of these, keys sorted
//
// A string header is in the metadata as it is, not quoted: the metadata of
// a message a TxPublisher wrote reads as it was written.
func (m AMQPMarshaler) Unmarshal(d amqp.Delivery) (*message.Message, error) {
	if closedDelivery(d) {
		return nil, errClosedDelivery
	}
	uuidKey := m.MessageUUIDHeaderKey
	if uuidKey == "" {
		uuidKey = wamqp.DefaultMessageUUIDHeaderKey
	}
	id, copied := messageUUID(d, uuidKey)
	msg := message.NewMessage(id, d.Body)
	msg.Metadata = make(message.Metadata, len(d.Headers))
	for k, v := range d.Headers {
		if k == uuidKey {
			continue
		}
		msg.Metadata[k] = metadataValue(v)
	}
	if v, set := d.Headers[HeaderMessageID]; copied || set && !idHeader(v) {
		// The inbox dedupes by this header first: a copy's stale one, set
		// aside for the UUID, must not come back through it; nor one that
		// is no id (void: a service in another language that forwarded
		// the header of a message that had none), whose JSON text
		// ("null") made every such message one.
		msg.Metadata[HeaderMessageID] = msg.UUID
	}
	return msg, nil
}

// errClosedDelivery is Unmarshal's refusal of the zero amqp.Delivery.
var errClosedDelivery = errors.New("outbox: not a delivery: the zero amqp.Delivery a closed consumer channel yields")

// closedDelivery reports whether d is the zero amqp.Delivery, which a
// receive from the consumer's deliveries channel yields once the channel
// closed. watermill-amqp's subscriber (v3.0.2) receives without checking,
// and, as the close races its close notification, can hand the router a
// message of nothing: no id, no body, no metadata. Behind an inbox it
// failed with ErrNoMessageID, or with AllowMissingID ran the handler.
// Refused here, it goes the way of the close: watermill-amqp cannot nack
// it, and reconnects. A delivery from the broker always has its channel
// (Acknowledger) and a tag.
func closedDelivery(d amqp.Delivery) bool {
	return d.Acknowledger == nil && d.DeliveryTag == 0 && d.Headers == nil && d.Body == nil &&
		d.MessageId == "" && d.ConsumerTag == "" && d.Exchange == "" && d.RoutingKey == ""
}

// idHeader reports whether v, an x-acemq-id header's value, can be an id:
// a string, or an integer (another library's numeric id, which the
// metadata holds as its digits), not void, a boolean, a fraction, a table.
func idHeader(v any) bool {
	switch v.(type) {
	case string, int8, int16, int32, int64, int, uint8, uint16, uint32, uint64:
		return true
	}
	return false
}

// messageUUID is the first non-empty string of x-acemq-id, the UUID header
// and message_id. x-acemq-id first: every AceMQ relay sets it (and
// message_id) to the row's id over whatever the row's headers hold, while
// a _watermill_message_uuid may be a stale copy, carried on by a service in
// another language that copies the headers it received onto what it sends;
// taken first, it made two messages one, and the second was acked as a
// duplicate. This library's relay sends all three alike.
//
// But not an x-acemq-id beside an empty message_id and a UUID header of
// another id: that is a copy of a delivery (msg.Copy() keeps the metadata)
// published under a UUID of its own through watermill-amqp's
// DefaultMarshaler or any publisher that is not AMQPMarshaler, which sets
// no message_id and carries the original's x-acemq-id on. Taken first, it
// made every copy its original, and an inbox acked them as duplicates.
//
// copied reports that case: the metadata's x-acemq-id is then the copy's
// UUID too.
func messageUUID(d amqp.Delivery, uuidKey string) (id string, copied bool) {
	own, _ := d.Headers[uuidKey].(string)
	if s, ok := d.Headers[HeaderMessageID].(string); ok && s != "" {
		if d.MessageId == "" && own != "" && own != s {
			return own, true
		}
		return s, false
	}
	if own != "" {
		return own, false
	}
	return d.MessageId, false
}

// metadataValue is a header value as Watermill metadata holds it: a string
// as it is, anything else as JSON text (AMQPMarshaler.Unmarshal has the
// rendering of each AMQP field type). PublisherDestination renders a
// record's headers with it too, so that a consumer reads the same metadata
// whichever destination relayed the message.
func metadataValue(v any) string {
	if s, ok := v.(string); ok {
		return s
	}
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false) // "<" stays "<", as in the row
	if err := enc.Encode(jsonValue(v)); err != nil {
		// jsonValue leaves nothing encoding/json refuses; should it, the
		// value is still shown rather than dropped.
		return fmt.Sprint(v)
	}
	return strings.TrimSuffix(buf.String(), "\n")
}

// jsonValue is v made of what encoding/json writes as metadataValue
// promises.
func jsonValue(v any) any {
	switch v := v.(type) {
	case float64:
		return finite(v, v)
	case float32:
		return finite(float64(v), v)
	case amqp.Decimal:
		return json.Number(decimalText(v))
	case time.Time:
		return v.UTC().Format(time.RFC3339)
	case []byte:
		return base64.StdEncoding.EncodeToString(v)
	case []any:
		a := make([]any, len(v))
		for i, e := range v {
			a[i] = jsonValue(e)
		}
		return a
	case amqp.Table:
		return jsonObject(v)
	case map[string]any: // a Record's nested header
		return jsonObject(v)
	case nil, bool, string, int, int8, int16, int32, int64, uint8, uint16, uint32, uint64:
		return v
	}
	return fmt.Sprint(v) // no AMQP field type: not from amqp091-go
}

func jsonObject(m map[string]any) map[string]any {
	o := make(map[string]any, len(m))
	for k, e := range m {
		o[k] = jsonValue(e)
	}
	return o
}

// finite is v (f as float64) unless it is NaN or infinite, which JSON has
// no number for: then the name JavaScript prints for it, as a string.
func finite(f float64, v any) any {
	switch {
	case math.IsNaN(f):
		return "NaN"
	case math.IsInf(f, 1):
		return "Infinity"
	case math.IsInf(f, -1):
		return "-Infinity"
	}
	return v
}

// decimalText is an AMQP decimal, Value × 10^-Scale, as exact decimal text
// keeping its scale: scale 2, value 4250 is "42.50".
func decimalText(d amqp.Decimal) string {
	digits := strconv.FormatInt(int64(d.Value), 10)
	sign := ""
	if d.Value < 0 {
		sign, digits = "-", digits[1:]
	}
	scale := int(d.Scale)
	if scale == 0 {
		return sign + digits
	}
	if len(digits) <= scale {
		digits = strings.Repeat("0", scale-len(digits)+1) + digits
	}
	return sign + digits[:len(digits)-scale] + "." + digits[len(digits)-scale:]
}
