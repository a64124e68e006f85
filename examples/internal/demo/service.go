package demo

import (
	"context"
	"errors"
	"fmt"
	"io"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"

	outbox "github.com/acemq/watermill-outbox"
)

// Service is what an example's program works with once Command.Run has
// checked the broker and opened the database. A process that does without
// Command.Run, as a program's child may, fills in the fields it uses.
type Service struct {
	// Name is the program's, at the head of what it reports.
	Name string
	DB   *DB
	// AMQPURL is the broker's URL, or a cluster's nodes' separated by
	// commas.
	AMQPURL string
	Stderr  io.Writer
	Log     watermill.LoggerAdapter

	stops []func() error // of what the service started, in that order
}

// stop stops what the service started, the last first, as deferred calls
// run, and joins their errors.
func (s *Service) stop() error {
	var errs []error
	for i := len(s.stops) - 1; i >= 0; i-- {
		errs = append(errs, s.stops[i]())
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

// Consumer is one of a program's consumers: a router handler behind an
// inbox of its own.
type Consumer struct {
	// Exchange is the durable topic exchange the consumer's durable Queue is
	// bound to, with Topic as the routing key.
	Exchange, Queue, Topic string
	// Publishes is the topic of the messages Handler returns, which the
	// inbox writes into the outbox ("" for a handler that returns none): the
	// handler is added with it and the inbox's Publisher.
	Publishes string
	// Inbox configures the consumer's inbox; its Logger is the service's.
	Inbox outbox.InboxConfig
	// Handler runs behind the inbox, once per message id that its
	// transaction commits (or, with Inbox.AtMostOnce, at most once). Its
	// handler is named after Queue, and so is the inbox's consumer name.
	Handler message.HandlerFunc
	// Outside run around the inbox: they see every delivery, the duplicates
	// the inbox absorbs included, and what they do after the handler
	// returned comes after the inbox's commit.
	Outside []message.HandlerMiddleware
}

// Router is a program's Watermill router.
type Router struct {
	Consumers []Consumer
	// Plugins run when the router starts, before any handler. A Forwarder's
	// plugin adds the relay as a handler of the router's: it starts with the
	// consumers, and stops, its batch in flight finished, when the router
	// closes.
	Plugins []message.RouterPlugin
}

// StartConsumer runs a router with c alone: StartRouter.
func (s *Service) StartConsumer(ctx context.Context, c Consumer) error {
	return s.StartRouter(ctx, Router{Consumers: []Consumer{c}})
}

// StartRouter runs a Watermill router with r's consumers and plugins until
// the program ends. It returns once the router runs: every consumer has
// subscribed, which declared its exchange, queue and binding, so what is
// published from then on has a route.
func (s *Service) StartRouter(ctx context.Context, r Router) error {
	// The default CloseTimeout, 30 s, is twice a relay's default
	// PublishTimeout: a relay plugin's last batch has the time to be
	// confirmed and marked.
	router, err := message.NewRouter(message.RouterConfig{}, s.Log)
	if err != nil {
		return err
	}
	var subs []*wamqp.Subscriber
	closeSubs := func() error {
		var errs []error
		for _, sub := range subs {
			errs = append(errs, sub.Close())
		}
		return errors.Join(errs...)
	}
	for _, c := range r.Consumers {
		sub, err := s.addConsumer(router, c)
		if err != nil {
			return errors.Join(fmt.Errorf("consumer %s: %w", c.Queue, err), closeSubs())
		}
		subs = append(subs, sub)
	}
	for _, plugin := range r.Plugins {
		router.AddPlugin(plugin)
	}

	done := make(chan error, 1)
	go func() { done <- router.Run(ctx) }()
	select {
	case <-router.Running():
		s.stops = append(s.stops, func() error {
			err := router.Close() // waits for the handlers, the relay's included, and closes their subscribers
			return errors.Join(err, <-done, closeSubs())
		})
		return nil
	case err := <-done:
		// A plugin failed or a subscription was refused: Run has cancelled
		// what it started. Close would wait CloseTimeout for the handlers
		// that never started.
		return errors.Join(fmt.Errorf("router: %w", err), closeSubs())
	}
}

// addConsumer adds c's handler, behind its inbox, to router, and returns
// its subscriber.
func (s *Service) addConsumer(router *message.Router, c Consumer) (*wamqp.Subscriber, error) {
	cfg := c.Inbox
	cfg.Logger = s.Log
	inbox, err := outbox.NewInbox(s.DB.DB, cfg)
	if err != nil {
		return nil, err
	}
	sub, err := subscriber(s.AMQPURL, c.Exchange, c.Queue, s.Log)
	if err != nil {
		return nil, fmt.Errorf("subscribe: %w", err)
	}
	// The inbox is a middleware of this handler alone: each consumer has
	// its own inbox, and its own way of committing the key.
	middleware := append(append([]message.HandlerMiddleware{}, c.Outside...), inbox.Middleware)
	router.AddHandler(c.Queue, c.Topic, sub, c.Publishes, inbox.Publisher(), c.Handler).AddMiddleware(middleware...)
	return sub, nil
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
	// Config is the Forwarder's; the relay sets its Logger, and its OnError
	// if it has none.
	Config outbox.ForwarderConfig
}

// NewRelay is a Forwarder of the outbox's rows to RabbitMQ, for the caller
// to run, under its Run or a router's plugin. Its errors are reported on
// Stderr, if the service has one. The service closes it when the program
// ends, after whatever the service started since (a router that runs it
// closes it first; this Close is for one that never started).
func (s *Service) NewRelay(r Relay) (*outbox.Forwarder, error) {
	amqpDest, err := outbox.NewAMQPDestination(outbox.AMQPConfig{URLs: SplitURLs(s.AMQPURL), ConnectionName: s.Name + " " + r.Name, Logger: s.Log})
	if err != nil {
		return nil, err
	}
	var dest outbox.Destination = amqpDest
	if r.Wrap != nil {
		dest = r.Wrap(amqpDest)
	}
	cfg := r.Config
	cfg.Logger = s.Log
	if s.Stderr != nil && cfg.OnError == nil {
		cfg.OnError = func(err error, _ outbox.ErrorContext) {
			fmt.Fprintf(s.Stderr, "%s: %s: %v\n", s.Name, r.Name, err)
		}
	}
	fwd, err := outbox.NewForwarder(s.DB.DB, dest, cfg)
	if err != nil {
		_ = amqpDest.Close()
		return nil, err
	}
	s.stops = append(s.stops, fwd.Close)
	return fwd, nil
}

// StartRelay runs a relay of NewRelay's until the program ends.
func (s *Service) StartRelay(ctx context.Context, r Relay) (*outbox.Forwarder, error) {
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
