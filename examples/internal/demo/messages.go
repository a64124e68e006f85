package demo

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"

	outbox "github.com/acemq/watermill-outbox"
)

// ContentTypeJSON is the content type of every example's messages, on their
// outbox rows and so on the broker.
const ContentTypeJSON = "application/json"

// PublishJSON writes payload, as JSON, into tx's outbox: a message to
// exchange with topic as its routing key, which a relay publishes once tx
// has committed, and never if it does not. It returns the message's id.
func PublishJSON(ctx context.Context, tx *sqlx.Tx, exchange, topic string, payload any) (messageID string, err error) {
	pub, err := outbox.NewTxPublisher(tx, outbox.TxPublisherConfig{Exchange: exchange, ContentType: ContentTypeJSON})
	if err != nil {
		return "", err
	}
	msg, err := NewJSONMessage(watermill.NewUUID(), payload)
	if err != nil {
		return "", err
	}
	msg.SetContext(ctx)
	if err := pub.Publish(topic, msg); err != nil {
		return "", err
	}
	return msg.UUID, nil
}

// NewJSONMessage is a message with id whose payload is payload as JSON.
func NewJSONMessage(id string, payload any) (*message.Message, error) {
	data, err := json.Marshal(payload)
	if err != nil {
		return nil, err
	}
	return message.NewMessage(id, data), nil
}

// InboxHandler is a handler for behind the inbox: it decodes the JSON
// payload of a message of topic into a T and hands it to handle with the
// inbox's transaction. What handle does goes through tx, so that it commits
// with the (consumer, message id) key or not at all, and the message is
// acked only after.
func InboxHandler[T any](topic string, handle func(msg *message.Message, tx *sqlx.Tx, payload T) error) message.HandlerFunc {
	return InboxReturningHandler(topic, func(msg *message.Message, tx *sqlx.Tx, payload T) ([]*message.Message, error) {
		return nil, handle(msg, tx, payload)
	})
}

// InboxReturningHandler is InboxHandler for a handler that returns
// messages, as a Consumer with a Publishes topic has: the inbox writes them
// into the outbox through tx, so that they commit with the effect and the
// key, and the relay publishes them.
func InboxReturningHandler[T any](topic string, handle func(msg *message.Message, tx *sqlx.Tx, payload T) ([]*message.Message, error)) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		payload, err := decodeJSON[T](topic, msg)
		if err != nil {
			return nil, err
		}
		tx, ok := outbox.TxFromContext(msg.Context())
		if !ok {
			return nil, errors.New("no inbox transaction: the handler must run behind inbox.Middleware, without AtMostOnce")
		}
		return handle(msg, tx, payload)
	}
}

// AtMostOnceHandler is a handler for behind an inbox with
// InboxConfig.AtMostOnce, for an effect no transaction holds: it decodes
// the JSON payload of a message of topic into a T and hands it to handle,
// with no transaction. The inbox committed the message's key before:
// handle returns an error only when its effect did not happen, and the key
// is taken back for the message to be retried.
func AtMostOnceHandler[T any](topic string, handle func(msg *message.Message, payload T) error) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		payload, err := decodeJSON[T](topic, msg)
		if err != nil {
			return nil, err
		}
		if _, ok := outbox.TxFromContext(msg.Context()); ok {
			// The key would commit after the effect: a rollback, or a crash
			// before the commit, would have the redelivery do it again.
			return nil, errors.New("an inbox transaction: the handler must run behind an inbox with AtMostOnce")
		}
		return nil, handle(msg, payload)
	}
}

// decodeJSON is the payload of msg, a message of topic, as a T.
func decodeJSON[T any](topic string, msg *message.Message) (T, error) {
	var payload T
	if err := json.Unmarshal(msg.Payload, &payload); err != nil {
		return payload, fmt.Errorf("%s %s: %w", topic, msg.UUID, err)
	}
	return payload, nil
}
