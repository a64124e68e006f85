package testdb

import (
	"context"
	"fmt"

	amqp "github.com/rabbitmq/amqp091-go"
)

func pingAMQP(ctx context.Context) error {
	done := make(chan error, 1)
	go func() {
		conn, err := amqp.Dial(AMQPURL())
		if err == nil {
			err = conn.Close()
		}
		done <- err
	}()
	select {
	case err := <-done:
		if err != nil {
			return fmt.Errorf("rabbitmq at %s does not answer: %w", redact(AMQPURL()), err)
		}
		return nil
	case <-ctx.Done():
		return fmt.Errorf("rabbitmq at %s does not answer: %w", redact(AMQPURL()), ctx.Err())
	}
}
