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

// PublishJSON writes payload, as JSON, into tx's outbox: a message to
// exchange with topic as its routing key, which a relay publishes once tx
// has committed, and never if it does not. It returns the message's id.
func PublishJSON(ctx context.Context, tx *sqlx.Tx, exchange, topic string, payload any) (messageID string, err error) {
	pub, err := outbox.NewTxPublisher(tx, outbox.TxPublisherConfig{Exchange: exchange, ContentType: "application/json"})
	if err != nil {
		return "", err
	}
	data, err := json.Marshal(payload)
	if err != nil {
		return "", err
	}
	msg := message.NewMessage(watermill.NewUUID(), data)
	msg.SetContext(ctx)
	if err := pub.Publish(topic, msg); err != nil {
		return "", err
	}
	return msg.UUID, nil
}

// InboxHandler is a handler for behind the inbox: it decodes the JSON
// payload of a message of topic into a T and hands it to handle with the
// inbox's transaction. What handle does goes through tx, so that it commits
// with the (consumer, message id) key or not at all, and the message is
// acked only after.
func InboxHandler[T any](topic string, handle func(msg *message.Message, tx *sqlx.Tx, payload T) error) message.NoPublishHandlerFunc {
	return func(msg *message.Message) error {
		var payload T
		if err := json.Unmarshal(msg.Payload, &payload); err != nil {
			return fmt.Errorf("%s %s: %w", topic, msg.UUID, err)
		}
		tx, ok := outbox.TxFromContext(msg.Context())
		if !ok {
			return errors.New("no inbox transaction: the handler must run behind inbox.Middleware")
		}
		return handle(msg, tx, payload)
	}
}
