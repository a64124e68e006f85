package demo

import (
	"context"
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	outbox "github.com/acemq/watermill-outbox"
)

// Service is what an example's program works with once Command.Run has
// checked the broker and opened the database. A process that does without
// Command.Run, as a program's child may, fills in the fields it uses.
type Service struct {
	// Name is the program's, at the head of what it reports.
	Name    string
	DB      *DB
	AMQPURL string
	Stderr  io.Writer
	Log     watermill.LoggerAdapter

	stops []func() error // of what the service started, in that order
}

// stop stops what the service started, in the order it started it, and
// joins their errors.
func (s *Service) stop() error {
	var errs []error
	for _, stop := range s.stops {
		errs = append(errs, stop())
	}
	return errors.Join(errs...)
}

// Migrate creates the outbox's and the inbox's tables, then the program's
// own from ddl, which its errors call tables.
func (s *Service) Migrate(ctx context.Context, tables string, ddl []string) error {
	if err := outbox.Migrate(ctx, s.DB.DB.DB, s.DB.Dialect); err != nil {
		return err
	}
	for _, stmt := range ddl {
		if _, err := s.DB.ExecContext(ctx, stmt); err != nil {
			return fmt.Errorf("create %s: %w", tables, err)
		}
	}
	return nil
}

// Consumer is a program's consumer: one router handler, behind the inbox.
type Consumer struct {
	// Exchange is the durable topic exchange the consumer's durable Queue is
	// bound to, with Topic as the routing key.
	Exchange, Queue, Topic string
	// Handler runs at most once per message id. Its handler is named after
	// Queue, and so is the inbox's consumer name.
	Handler message.NoPublishHandlerFunc
	// Outside run around the inbox: they see every delivery, the duplicates
	// the inbox absorbs included.
	Outside []message.HandlerMiddleware
}

// StartConsumer runs a Watermill router with c's handler until the program
// ends. It returns once the router runs: subscribing has declared the
// exchange, the queue and the binding, so a relay started after publishes
// to a route that is there.
func (s *Service) StartConsumer(ctx context.Context, c Consumer) error {
	inbox, err := outbox.NewInbox(s.DB.DB, outbox.InboxConfig{Logger: s.Log})
	if err != nil {
		return err
	}
	sub, err := subscriber(s.AMQPURL, c.Exchange, c.Queue, s.Log)
	if err != nil {
		return fmt.Errorf("subscribe: %w", err)
	}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 15 * time.Second}, s.Log)
	if err != nil {
		_ = sub.Close()
		return err
	}
	middleware := append(append([]message.HandlerMiddleware{}, c.Outside...), inbox.Middleware)
	router.AddConsumerHandler(c.Queue, c.Topic, sub, c.Handler).AddMiddleware(middleware...)

	done := make(chan error, 1)
	go func() { done <- router.Run(ctx) }()
	stop := func() error {
		err := router.Close() // waits for the handlers, closes the subscriber
		return errors.Join(err, <-done, sub.Close())
	}
	select {
	case <-router.Running():
		s.stops = append(s.stops, stop)
		return nil
	case err := <-done:
		done <- err
		return errors.Join(fmt.Errorf("consumer: %w", err), stop())
	}
}

// Relay is how a program sets up one of its relays.
type Relay struct {
	// Name tells the relay from the program's others: it is named
	// "<program> <Name>" in the broker's list of connections, and its
	// errors begin so.
	Name string
	// Wrap, if not nil, is the destination the Forwarder publishes through,
	// around RabbitMQ's.
	Wrap func(*outbox.AMQPDestination) outbox.Destination
	// Config is the Forwarder's; the relay sets its Logger.
	Config outbox.ForwarderConfig
}

// NewRelay is a Forwarder of the outbox's rows to RabbitMQ, for the caller
// to run.
func (s *Service) NewRelay(r Relay) (*outbox.Forwarder, error) {
	amqpDest, err := outbox.NewAMQPDestination(outbox.AMQPConfig{URL: s.AMQPURL, ConnectionName: s.Name + " " + r.Name, Logger: s.Log})
	if err != nil {
		return nil, err
	}
	var dest outbox.Destination = amqpDest
	if r.Wrap != nil {
		dest = r.Wrap(amqpDest)
	}
	cfg := r.Config
	cfg.Logger = s.Log
	fwd, err := outbox.NewForwarder(s.DB.DB, dest, cfg)
	if err != nil {
		_ = amqpDest.Close()
		return nil, err
	}
	return fwd, nil
}

// StartRelay runs a relay of NewRelay's until the program ends, and reports
// its errors on Stderr.
func (s *Service) StartRelay(ctx context.Context, r Relay) (*outbox.Forwarder, error) {
	r.Config.OnError = func(err error, _ outbox.ErrorContext) {
		fmt.Fprintf(s.Stderr, "%s: %s: %v\n", s.Name, r.Name, err)
	}
	fwd, err := s.NewRelay(r)
	if err != nil {
		return nil, err
	}
	done := make(chan error, 1)
	go func() { done <- fwd.Run(ctx) }()
	s.stops = append(s.stops, func() error {
		closeErr := fwd.Close() // finishes the batch in flight, closes the destination
		return errors.Join(closeErr, <-done)
	})
	return fwd, nil
}
