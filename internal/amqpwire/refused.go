package amqpwire

import (
	"errors"

	amqp "github.com/rabbitmq/amqp091-go"
)

// Refused reports whether err, a connect's, is the broker's refusal of the
// connection: credentials, a vhost, permissions (ACCESS_REFUSED,
// NOT_ALLOWED, INVALID_PATH). Another AMQP error in a connect is no
// answer: a load balancer with no broker behind it (HAProxy in TCP mode)
// takes the connection and closes it, which amqp091-go reports as 504
// "channel/connection is not open", and was told a refusal, sending the
// on-call to check passwords, and outboxctl relay to exit rather than
// wait for the broker (a review).
func Refused(err error) bool {
	var e *amqp.Error
	if !errors.As(err, &e) {
		return false
	}
	switch e.Code {
	case amqp.AccessRefused, amqp.NotAllowed, amqp.InvalidPath:
		return true
	}
	return false
}
