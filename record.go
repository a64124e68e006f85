package outbox

import (
	"fmt"
	"time"

	"github.com/acemq/watermill-outbox/internal/rowcodec"
	"github.com/acemq/watermill-outbox/internal/sqldialect"
)

// HeaderMessageID is the AMQP header that carries the message id, beside the AMQP
// message_id property, in every AceMQ library.
const HeaderMessageID = "x-acemq-id"

// HeaderWatermillUUID is the header watermill-amqp's default marshaler reads
// the message UUID from; the relay sets it so that a Watermill subscriber
// receives the UUID the message was published with.
const HeaderWatermillUUID = "_watermill_message_uuid"

// HeaderAggregateID and HeaderSeq carry a keyed message's ordering key (its
// aggregate's id) and its sequence number within that key, an AMQP long
// integer from 1 up. The names are the reference design's (a relay that
// "sends the aggregate's own sequence number in a header"), so a consumer
// written for it reads ours, and the ordered inbox reads theirs.
const (
	HeaderAggregateID = "aggregateId"
	HeaderSeq         = "seq"
)

// Record is one outbox row, decoded, as a Destination receives it.
type Record struct {
	ID          string
	Exchange    string
	RoutingKey  string
	Body        []byte
	ContentType string
	// Headers are the row's headers (the message metadata), typed as the
	// row's JSON wrote them and as the relay sends them: string; int64 for
	// an integer; float64 for any other number; bool; nil for null (sent
	// as AMQP void); []any for an array and map[string]any for an object,
	// holding the same types. TxPublisher writes strings only; other AceMQ
	// libraries write the rest. The relay adds the id headers when it
	// publishes.
	Headers   map[string]any
	CreatedAt time.Time
	// Attempts is how many publishes of this record failed before.
	Attempts int
	// AggregateID is the record's ordering key (MetadataAggregateID) and
	// Seq its number within the key, from 1; "" and 0 for an unkeyed
	// record. The relay sends them as HeaderAggregateID and HeaderSeq.
	AggregateID string
	Seq         int64
}

// decodeRecord turns a claimed row into a Record. An error means the row
// itself is malformed (written by hand or by another library) and no retry
// can publish it.
func decodeRecord(r sqldialect.ClaimedRow) (Record, error) {
	body, err := rowcodec.DecodeBody(r.Body, r.BodyEncoding)
	if err != nil {
		return Record{}, fmt.Errorf("body: %w", err)
	}
	headers, err := rowcodec.DecodeHeaders(r.Headers)
	if err != nil {
		return Record{}, err
	}
	// A key without a number, or a number without a key, was not written
	// by a publisher: the ordered inbox could not place it.
	switch {
	case r.AggregateID != "" && r.SeqNull:
		return Record{}, fmt.Errorf("aggregate_id %q with seq NULL: want a sequence number from 1 (a keyed row takes its number from %s as it is written)", r.AggregateID, sqldialect.SequencesTable)
	case r.AggregateID != "" && r.Seq < 1:
		return Record{}, fmt.Errorf("aggregate_id %q with seq %d: want a sequence number from 1", r.AggregateID, r.Seq)
	case r.AggregateID == "" && r.Seq != 0:
		return Record{}, fmt.Errorf("seq %d without an aggregate_id", r.Seq)
	}
	return Record{
		ID: r.ID, Exchange: r.Exchange, RoutingKey: r.RoutingKey,
		Body: body, ContentType: r.ContentType, Headers: headers,
		CreatedAt: r.CreatedAt, Attempts: r.Attempts,
		AggregateID: r.AggregateID, Seq: r.Seq,
	}, nil
}
