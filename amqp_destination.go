package outbox

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	amqp "github.com/rabbitmq/amqp091-go"
)

// maxWindow bounds the unconfirmed publishes of one window. The channel that
// receives basic.return is buffered to it, so the client's reader never
// blocks on a return while the relay waits for confirms.
const maxWindow = 1024

// AMQPConfig configures an AMQPDestination.
type AMQPConfig struct {
	// URL of the broker, amqp://user:pass@host:5672/vhost. Required.
	URL string
	// AMQP is passed to amqp091-go's DialConfig (TLS, heartbeat, vhost, …).
	// A zero Dial gets a 10 s connection timeout.
	AMQP amqp.Config
	// Window is how many publishes may wait for the broker's confirm at once.
	// 0 sends all of a batch, then waits (at most 1024). Records already in
	// flight when an earlier one fails are on the broker and are marked
	// published; Window 1 waits for each confirm before the next publish, so
	// that no record ever reaches the broker ahead of one that failed before
	// it, at the cost of a round trip per message.
	Window int
	// ConnectionName is shown in RabbitMQ's management UI. Default
	// "watermill-outbox relay".
	ConnectionName string
	Logger         watermill.LoggerAdapter
}

func (c *AMQPConfig) setDefaults() {
	if c.ConnectionName == "" {
		c.ConnectionName = "watermill-outbox relay"
	}
	if c.AMQP.Dial == nil {
		c.AMQP.Dial = amqp.DefaultDial(10 * time.Second)
	}
	if c.AMQP.Properties == nil {
		c.AMQP.Properties = amqp.NewConnectionProperties()
	}
	if _, ok := c.AMQP.Properties["connection_name"]; !ok {
		c.AMQP.Properties.SetClientConnectionName(c.ConnectionName)
	}
	if c.Logger == nil {
		c.Logger = watermill.NopLogger{}
	}
}

func (c AMQPConfig) validate() error {
	if c.URL == "" {
		return &ConfigError{Field: "URL", Reason: "required"}
	}
	if _, err := amqp.ParseURI(c.URL); err != nil {
		return &ConfigError{Field: "URL", Reason: err.Error()}
	}
	if c.Window < 0 || c.Window > maxWindow {
		return &ConfigError{Field: "Window", Reason: fmt.Sprintf("%d; want 0 (all of a batch) to %d", c.Window, maxWindow)}
	}
	return nil
}

// AMQPDestination publishes records to RabbitMQ on a confirm channel with
// confirms pipelined over a window, the mandatory flag set (a message no
// queue takes comes back, and counts as a failure of its record), persistent
// delivery, and the id in the message_id property and the x-acemq-id header.
//
// It connects on first use and again after the connection or channel is
// lost; the Forwarder's backoff spaces the attempts. It owns no goroutine of
// its own beyond amqp091-go's, which end with the connection on Close.
type AMQPDestination struct {
	cfg AMQPConfig

	mu        sync.Mutex // one Publish or Connect at a time
	conn      *amqp.Connection
	ch        *amqp.Channel
	returns   chan amqp.Return
	chClosed  chan *amqp.Error
	exchanges map[string]bool // known to exist on this connection
	closed    bool
}

// ErrDestinationClosed is returned by a destination used after Close.
var ErrDestinationClosed = errors.New("outbox: destination is closed")

// NewAMQPDestination returns a destination for the broker at cfg.URL. It
// does not connect until first used.
func NewAMQPDestination(cfg AMQPConfig) (*AMQPDestination, error) {
	cfg.setDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	return &AMQPDestination{cfg: cfg}, nil
}

// Connect makes sure a connection and a confirm channel are open.
func (d *AMQPDestination) Connect(ctx context.Context) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.ensure(ctx)
}

func (d *AMQPDestination) ensure(ctx context.Context) error {
	if d.closed {
		return ErrDestinationClosed
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	if d.conn == nil || d.conn.IsClosed() {
		d.dropLocked()
		conn, err := amqp.DialConfig(d.cfg.URL, d.cfg.AMQP)
		if err != nil {
			return fmt.Errorf("outbox: connect to RabbitMQ: %w", err)
		}
		d.conn = conn
		d.exchanges = map[string]bool{}
		d.cfg.Logger.Info("Connected to RabbitMQ", watermill.LogFields{"connection_name": d.cfg.ConnectionName})
	}
	if d.ch == nil || d.ch.IsClosed() {
		ch, err := d.conn.Channel()
		if err != nil {
			return fmt.Errorf("outbox: open channel: %w", err)
		}
		if err := ch.Confirm(false); err != nil {
			_ = ch.Close()
			return fmt.Errorf("outbox: enable publisher confirms: %w", err)
		}
		d.returns = ch.NotifyReturn(make(chan amqp.Return, maxWindow))
		d.chClosed = ch.NotifyClose(make(chan *amqp.Error, 1))
		d.ch = ch
	}
	return nil
}

// dropLocked closes the channel and connection, if any, so that the next use
// opens fresh ones.
func (d *AMQPDestination) dropLocked() {
	if d.ch != nil {
		_ = d.ch.Close()
		d.ch = nil
	}
	if d.conn != nil {
		_ = d.conn.Close()
		d.conn = nil
	}
	d.exchanges = nil
}

// Close closes the connection. Publish and Connect fail afterwards. Calling it
// again does nothing.
func (d *AMQPDestination) Close() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.closed = true
	d.dropLocked()
	return nil
}

// UnroutableError is the failure of a message the broker returned: no queue
// is bound for its routing key on its exchange.
type UnroutableError struct {
	Exchange, RoutingKey string
	ReplyCode            uint16
	ReplyText            string
}

func (e *UnroutableError) Error() string {
	return fmt.Sprintf("returned by the broker as unroutable (%d %s): no queue is bound to exchange %q for routing key %q",
		e.ReplyCode, e.ReplyText, e.Exchange, e.RoutingKey)
}

// MissingExchangeError is the failure of a message whose exchange does not
// exist on the broker.
type MissingExchangeError struct{ Exchange string }

func (e *MissingExchangeError) Error() string {
	return fmt.Sprintf("exchange %q does not exist on the broker", e.Exchange)
}

// Publish sends the records in windows, waits for each window's confirms,
// and stops at the first failure. See Destination.
func (d *AMQPDestination) Publish(ctx context.Context, records []Record) []error {
	d.mu.Lock()
	defer d.mu.Unlock()
	results := make([]error, len(records))
	if err := d.ensure(ctx); err != nil {
		fillNotSent(results, 0, err)
		return results
	}
	window := d.cfg.Window
	if window == 0 || window > maxWindow {
		window = maxWindow
	}
	for start := 0; start < len(records); start += window {
		end := min(start+window, len(records))
		if d.publishWindow(ctx, records[start:end], results[start:end]) {
			fillNotSent(results, end, nil)
			break
		}
	}
	return results
}

// fillNotSent sets every result from i on to ErrNotSent; the first to first
// if it is not nil.
func fillNotSent(results []error, i int, first error) {
	for j := i; j < len(results); j++ {
		results[j] = ErrNotSent
	}
	if first != nil && i < len(results) {
		results[i] = first
	}
}

// publishWindow publishes recs and waits for their confirms, filling res.
// It reports whether any record failed.
func (d *AMQPDestination) publishWindow(ctx context.Context, recs []Record, res []error) (failed bool) {
	// Exchanges first, on a side channel: publishing to a missing one would
	// close the confirm channel and fail every message in flight with it.
	limit := len(recs)
	for i, r := range recs {
		if err := d.checkExchange(r.Exchange); err != nil {
			res[i] = err
			limit = i
			break
		}
	}

	// A broker that stops reading (a memory alarm) blocks the socket write;
	// closing the connection when the context ends is what unblocks it.
	conn := d.conn
	stop := context.AfterFunc(ctx, func() { _ = conn.Close() })
	defer stop()

	confirms := make([]*amqp.DeferredConfirmation, 0, limit)
	for i := 0; i < limit; i++ {
		dc, err := d.ch.PublishWithDeferredConfirmWithContext(ctx, recs[i].Exchange, recs[i].RoutingKey, true, false, publishing(recs[i]))
		if err != nil {
			if !d.ch.IsClosed() && ctx.Err() == nil {
				// The client refused the message itself (a header it cannot
				// encode): no retry will change that.
				err = Permanent(err)
			}
			res[i] = fmt.Errorf("publish: %w", err)
			limit = i
			break
		}
		confirms = append(confirms, dc)
	}

	broken := false
	for i, dc := range confirms {
		acked, err := dc.WaitContext(ctx)
		switch {
		case err != nil:
			res[i] = fmt.Errorf("no confirm from the broker: %w", err)
			broken = true
		case !acked && d.ch.IsClosed():
			res[i] = fmt.Errorf("channel closed before the broker confirmed: %v", d.closeReason())
			broken = true
		case !acked:
			res[i] = errors.New("nacked by the broker")
		}
	}

	// RabbitMQ sends basic.return before the basic.ack of the same message,
	// and the client delivers frames in order, so every return of this
	// window is in the buffer once its confirms are in.
	returned := map[string]amqp.Return{}
drain:
	for {
		select {
		case ret, ok := <-d.returns:
			if !ok {
				break drain
			}
			returned[ret.MessageId] = ret
		default:
			break drain
		}
	}
	for i := range confirms {
		if ret, ok := returned[recs[i].ID]; ok && res[i] == nil {
			res[i] = &UnroutableError{Exchange: ret.Exchange, RoutingKey: ret.RoutingKey, ReplyCode: ret.ReplyCode, ReplyText: ret.ReplyText}
		}
	}

	if broken || d.ch.IsClosed() {
		// Late confirms of a timed-out window must not be read as confirms
		// of the next: a fresh channel restarts the delivery tags.
		d.dropLocked()
	}
	for i := range recs {
		if res[i] != nil {
			failed = true
		}
		if i >= limit && res[i] == nil {
			res[i] = ErrNotSent
			failed = true
		}
	}
	return failed
}

func (d *AMQPDestination) closeReason() string {
	select {
	case e, ok := <-d.chClosed:
		if ok && e != nil {
			return e.Error()
		}
	default:
	}
	return "connection lost"
}

// checkExchange verifies that an exchange exists, once per connection.
func (d *AMQPDestination) checkExchange(name string) error {
	if name == "" || d.exchanges[name] {
		return nil // the default exchange always exists
	}
	side, err := d.conn.Channel()
	if err != nil {
		return fmt.Errorf("open channel to check exchange %q: %w", name, err)
	}
	err = side.ExchangeDeclarePassive(name, amqp.ExchangeDirect, true, false, false, false, nil)
	var amqpErr *amqp.Error
	if errors.As(err, &amqpErr) && amqpErr.Code == amqp.NotFound {
		return &MissingExchangeError{Exchange: name} // the 404 closed the side channel
	}
	_ = side.Close()
	if err != nil {
		return fmt.Errorf("check exchange %q: %w", name, err)
	}
	d.exchanges[name] = true
	return nil
}

func publishing(r Record) amqp.Publishing {
	headers := make(amqp.Table, len(r.Headers)+2)
	for k, v := range r.Headers {
		headers[k] = v
	}
	headers[HeaderID] = r.ID
	headers[WatermillUUIDHeader] = r.ID
	return amqp.Publishing{
		Headers:      headers,
		ContentType:  r.ContentType,
		DeliveryMode: amqp.Persistent,
		MessageId:    r.ID,
		Timestamp:    r.CreatedAt,
		Body:         r.Body,
	}
}

// permanentError marks a failure no retry can mend.
type permanentError struct{ err error }

func (e *permanentError) Error() string { return e.err.Error() }
func (e *permanentError) Unwrap() error { return e.err }

// Permanent marks err as a failure no retry can mend: the Forwarder sets the
// record's attempts to MaxAttempts at once (stuck, with last_error) instead of
// trying it again. A Destination returns it for a record the broker will
// never take as it is.
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	return &permanentError{err: err}
}

// IsPermanent reports whether err was marked with Permanent.
func IsPermanent(err error) bool {
	var p *permanentError
	return errors.As(err, &p)
}
