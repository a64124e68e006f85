package outbox

import (
	"encoding/json"
	"fmt"
	"time"
)

// HeaderID is the AMQP header that carries the message id, beside the AMQP
// message_id property, in every AceMQ library.
const HeaderID = "x-acemq-id"

// WatermillUUIDHeader is the header watermill-amqp's default marshaler reads
// the message UUID from; the relay sets it so that a Watermill subscriber
// receives the UUID the message was published with.
const WatermillUUIDHeader = "_watermill_message_uuid"

// Record is one outbox row, decoded, as a Destination receives it.
type Record struct {
	ID          string
	Exchange    string
	RoutingKey  string
	Body        []byte
	ContentType string
	// Headers are the row's headers (the message metadata); the relay adds
	// the id headers when it publishes.
	Headers   map[string]string
	CreatedAt time.Time
	// Attempts is how many publishes of this record failed before.
	Attempts int
}

// decodeRecord turns a claimed row into a Record. An error means the row
// itself is malformed (written by hand or by another library) and no retry
// can publish it.
func decodeRecord(r claimedRow) (Record, error) {
	body, err := DecodeBody(r.body, r.bodyEncoding)
	if err != nil {
		return Record{}, fmt.Errorf("body: %w", err)
	}
	headers, err := decodeHeaders(r.headers)
	if err != nil {
		return Record{}, err
	}
	return Record{
		ID: r.id, Exchange: r.exchange, RoutingKey: r.routingKey,
		Body: body, ContentType: r.contentType, Headers: headers,
		CreatedAt: r.createdAt, Attempts: r.attempts,
	}, nil
}

func decodeHeaders(text string) (map[string]string, error) {
	if text == "" {
		return map[string]string{}, nil
	}
	var raw map[string]any
	if err := json.Unmarshal([]byte(text), &raw); err != nil {
		return nil, fmt.Errorf("headers are not a JSON object: %w", err)
	}
	if raw == nil { // the JSON text "null"
		return nil, fmt.Errorf("headers are null; want a JSON object of strings")
	}
	headers := make(map[string]string, len(raw))
	for k, v := range raw {
		s, ok := v.(string)
		if !ok {
			return nil, fmt.Errorf("header %q is %T, not a string; want a JSON object of strings", k, v)
		}
		headers[k] = s
	}
	return headers, nil
}
