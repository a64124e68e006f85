package outbox

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/acemq/watermill-outbox/internal/amqpwire"
	"github.com/acemq/watermill-outbox/internal/rowcodec"
)

// pipelineCapacity is the most records the destination's pipeline takes
// sent and not yet waited for (its Capacity), and so the capacity of the
// channel that receives basic.return: every one of them can come back
// while no wait is draining the channel, and the client's reader must never
// block on a return (amqp091-go drops one it cannot deliver within 5 s). A
// wait drains it as it goes (waitConfirm), so a Sweep's batch sent behind a
// full pipeline fits too. 3000 is
// three batches of the Forwarder's largest claim (MaxBatchSize 1000, the
// default), as many as Run keeps in flight at that size: smaller, Run
// would keep fewer; larger, every channel would hold a bigger buffer for
// nothing.
const pipelineCapacity = 3000

// maxWindow bounds AMQPConfig.Window. A window's returns come back
// together, so it must fit the returns channel (pipelineCapacity); and at
// the Forwarder's largest claim (1000) a window is the whole batch.
const maxWindow = 1000

// AMQPConfig configures an AMQPDestination.
type AMQPConfig struct {
	// URLs of the broker, amqp://user:pass@host:5672/vhost: one for a single
	// broker, one per node for a cluster. Required. The destination connects
	// to the first node that answers; after a lost connection it tries the
	// next node first, then the others in order, the one it lost last, so a
	// node that went down is not waited for while another answers. A round
	// in which no node answers fails as a lost connection, and the
	// Forwarder tries again after its backoff. Each node is dialled with its
	// own URL: user, password, vhost and TLS server name may differ between
	// them.
	URLs []string
	// AMQP is passed to amqp091-go's DialConfig for each node (TLS,
	// heartbeat, vhost, …). Its Dial is called once per node with that
	// node's address. A nil Dial dials with a 10 s timeout per node, cut
	// short when the Forwarder's PublishTimeout ends.
	AMQP amqp.Config
	// Window is how many publishes may wait for the broker's confirm at once.
	// 0 (the default) sends all of a batch and, under Forwarder.Run, the
	// next batch too before the first one's confirms are in, so the broker
	// never waits for the database. When a record fails, the records behind
	// it that were already in flight are not marked published: they are
	// sent again after it, and the consumers' inbox absorbs that copy. A
	// record that failed before is always sent alone, and confirmed before
	// anything behind it is sent. Window 1 waits for each confirm before the
	// next publish, so that even the first failure of a record is not
	// overtaken on the broker, at the cost of a round trip per message.
	Window int
	// MaxMessageSize is the largest body the broker takes, in bytes: its
	// max_message_size (RabbitMQ 3.x's default is 128 MiB, 4.x's 16 MiB).
	// A record whose body is larger is never sent: it is stuck at once
	// with a *MessageTooLargeError. 0 (the default): the limit is not
	// known beforehand, and the first such record goes out, whole; the
	// broker reads it all, closes the channel over it (406
	// PRECONDITION_FAILED, naming its limit), and the record is stuck at
	// once all the same; the destination then refuses larger bodies
	// itself for as long as that connection lasts. Set it to the broker's
	// limit to spare the broker that transfer and the channel close
	// (below it, bodies the broker would take are refused; above it, the
	// bodies between the two go out and are refused as with 0).
	MaxMessageSize int
	// ConnectionName is shown in RabbitMQ's management UI. Default
	// "watermill-outbox relay".
	ConnectionName string
	// Metrics, if set, shows which node the destination is connected to
	// (outbox_forwarder_broker_connected) and counts its connects and
	// failed dials per node. NewForwarder sets it from
	// ForwarderConfig.Metrics when it is nil and the destination is handed
	// to it as it is; set it here for one wrapped in a Destination of your
	// own.
	Metrics *Metrics
	// Logger logs the destination's connects, losses and closes by the
	// broker, naming the node. NewForwarder sets it from
	// ForwarderConfig.Logger (with the relay_id) when it is nil and the
	// destination is handed to it as it is.
	Logger watermill.LoggerAdapter
}

// dialTimeout bounds the dial of one node when AMQPConfig.AMQP.Dial is nil:
// amqp091-go's own default is 30 s, which would spend two PublishTimeouts
// on a node that does not answer before the next node is tried.
const dialTimeout = 10 * time.Second

func (c *AMQPConfig) setDefaults() {
	if c.ConnectionName == "" {
		c.ConnectionName = "watermill-outbox relay"
	}
	// A table of its own: the caller's may be shared with another
	// destination or client, which then took this one's connection_name
	// (and amqp091-go writes its capabilities into it at every dial).
	if c.AMQP.Properties == nil {
		c.AMQP.Properties = amqp.NewConnectionProperties()
	} else {
		c.AMQP.Properties = maps.Clone(c.AMQP.Properties)
	}
	if _, ok := c.AMQP.Properties["connection_name"]; !ok {
		c.AMQP.Properties.SetClientConnectionName(c.ConnectionName)
	}
	if c.Logger == nil {
		c.Logger = watermill.NopLogger{}
	}
}

func (c AMQPConfig) validate() error {
	if len(c.URLs) == 0 {
		return &ConfigError{Field: "URLs", Reason: "required: at least one broker URL"}
	}
	for i, u := range c.URLs {
		if _, err := parseNode(u); err != nil {
			return &ConfigError{Field: fmt.Sprintf("URLs[%d]", i), Reason: err.Error()}
		}
	}
	if c.AMQP.Recovery != nil {
		// amqp091-go's recovery reopens channels in place and restarts their
		// confirms under the destination, which reconnects on its own.
		return &ConfigError{Field: "AMQP.Recovery", Reason: "not supported: the destination reconnects by itself"}
	}
	if c.MaxMessageSize < 0 {
		return &ConfigError{Field: "MaxMessageSize", Reason: fmt.Sprintf("%d; want 0 (the broker's limit, as it refuses a message) or the largest body in bytes", c.MaxMessageSize)}
	}
	if c.Window < 0 || c.Window > maxWindow {
		return &ConfigError{Field: "Window", Reason: fmt.Sprintf("%d; want 0 (all of a batch) to %d", c.Window, maxWindow)}
	}
	return nil
}

// brokerNode is one node of AMQPConfig.URLs.
type brokerNode struct {
	url  string
	addr string // host:port, what logs and metrics name it by: never the password
}

// parseNode reads one broker URL. Its error never holds the URL: a URL that
// does not parse may still hold a password.
func parseNode(raw string) (brokerNode, error) {
	uri, err := amqp.ParseURI(raw)
	if err != nil {
		var urlErr *url.Error
		if errors.As(err, &urlErr) { // its text quotes the URL
			return brokerNode{}, fmt.Errorf("not a URL: %w", urlErr.Err)
		}
		return brokerNode{}, err
	}
	return brokerNode{url: raw, addr: net.JoinHostPort(uri.Host, strconv.Itoa(uri.Port))}, nil
}

// AMQPDestination publishes records to RabbitMQ on a confirm channel with
// confirms pipelined over a window, the mandatory flag set (a message no
// queue takes comes back, and counts as a failure of its record), persistent
// delivery, and the id in the message_id property and the x-acemq-id header.
//
// It connects on first use, to the first node of its URLs that answers,
// and again after the connection or channel is lost, to the next node
// first; the Forwarder's backoff spaces the attempts. It owns no goroutine of
// its own beyond amqp091-go's, which end with the connection on Close.
type AMQPDestination struct {
	cfg   AMQPConfig
	nodes []brokerNode

	mu        sync.Mutex // one Publish or Connect at a time
	conn      *amqp.Connection
	wire      *amqpwire.Wire  // conn's socket
	blocked   *blockedFlag    // conn's connection.blocked, as the broker last said
	cc        *confirmChannel // the one new windows go out on; nil until opened
	exchanges map[string]bool // known to exist on this connection
	suspects  map[string]bool // records that each go alone (see blame)
	renew     bool            // a nack came: a fresh connection once no window is out on this one
	retire    bool            // a window on cc was given up on: cc takes no window more, and goes once the windows out on it are collected
	retiredAt time.Time       // when retire was set
	nacks     nackRenewal     // spaces the renewals of a stream of nacks
	inflight  []*sent         // windows whose confirms are not collected yet, oldest first
	short     []*sent         // windows not collected yet whose send stopped short (see behindAShortWindow)
	closed    bool
	next      int    // the node a connect tries first
	last      string // the node of the latest connection, for the log of a failover
	counted   string // the node this destination counts as connected in cfg.Metrics
	ownLogger bool   // cfg.Logger was given, not NewForwarder's to set

	// brokerMax is the broker's max_message_size as it named it closing a
	// channel over a larger message on this connection, 0 until then, and
	// brokerMaxBy the close that named it.
	brokerMax   int
	brokerMaxBy string

	current atomic.Pointer[nodeConn] // for Node, which does not wait for mu
	// For Close, which may have to cut a call it waits behind: closing is
	// set as it begins (no connect starts after it), dialing is the socket
	// of a connect in its handshake.
	closing atomic.Bool
	dialing atomic.Pointer[amqpwire.Wire]
}

// nodeConn is the connection a destination has open, and its node.
type nodeConn struct {
	node string
	conn *amqp.Connection
	wire *amqpwire.Wire // conn's socket, which Close may cut
}

// confirmChannel is one confirm channel and what the broker sends back on
// it. A window keeps the one it went out on, and reads its confirms, returns
// and close there, even after the destination moved on to a new channel: a
// return read from the wrong channel would let an unroutable message be
// marked published.
type confirmChannel struct {
	conn     *amqp.Connection
	blocked  *blockedFlag // conn's
	ch       *amqp.Channel
	returns  chan amqp.Return
	returned map[string][]amqp.Return // drained, not yet taken by a wait; see file
	closes   chan *amqp.Error
	reason   string // the close's, once read from closes
	refusal  string // the broker's words in it, unquoted
	byBroker bool   // the broker closed it (channel.close), as read from closes
	dropped  bool   // closed by the destination, over a failure or a new connection

	// blamed, once the broker closed the channel, the confirms of the
	// records that closed it (see blame).
	blamed map[*amqp.DeferredConfirmation]bool
	// maxBody is the broker's max_message_size when it closed the channel
	// over a larger message, as it named it; 0 otherwise.
	maxBody int
}

// ErrDestinationClosed is returned by a destination used after Close.
var ErrDestinationClosed = errors.New("outbox: destination is closed")

// NewAMQPDestination returns a destination for the broker at cfg.URLs. It
// does not connect until first used.
func NewAMQPDestination(cfg AMQPConfig) (*AMQPDestination, error) {
	ownLogger := cfg.Logger != nil
	cfg.setDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	d := &AMQPDestination{cfg: cfg, suspects: map[string]bool{}, ownLogger: ownLogger}
	for _, u := range cfg.URLs {
		n, _ := parseNode(u) // validated
		d.nodes = append(d.nodes, n)
	}
	d.cfg.URLs = slices.Clone(cfg.URLs)
	d.cfg.Metrics.brokerNodes(d.nodeAddrs())
	return d, nil
}

func (d *AMQPDestination) nodeAddrs() []string {
	addrs := make([]string, len(d.nodes))
	for i, n := range d.nodes {
		addrs[i] = n.addr
	}
	return addrs
}

// Node is the broker node the destination is connected to, host:port as
// its URL names it, or "" while it has no open connection.
func (d *AMQPDestination) Node() string {
	c := d.current.Load()
	if c == nil || c.conn.IsClosed() {
		return ""
	}
	return c.node
}

// useMetrics is how NewForwarder hands its Metrics to a destination that
// has none.
func (d *AMQPDestination) useMetrics(m *Metrics) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.cfg.Metrics != nil || m == nil {
		return
	}
	d.cfg.Metrics = m
	m.brokerNodes(d.nodeAddrs())
	if c := d.current.Load(); c != nil && !d.closed {
		d.counted = c.node
		m.brokerConnected(c.node, 1)
	}
}

// useLogger is how NewForwarder hands its Logger to a destination given
// none: the quick start's relay said nothing of its broker's connects and
// losses (a README review), outboxctl relay's did.
func (d *AMQPDestination) useLogger(l watermill.LoggerAdapter) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.ownLogger || l == nil {
		return
	}
	d.cfg.Logger = l
}

// connected reports whether a connection and a confirm channel are open,
// as Connect would leave them.
func (d *AMQPDestination) connected() bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.conn != nil && !d.conn.IsClosed() && d.cc != nil && !d.cc.ch.IsClosed()
}

// Connect makes sure a connection and a confirm channel are open.
func (d *AMQPDestination) Connect(ctx context.Context) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.ensure(ctx)
}

func (d *AMQPDestination) ensure(ctx context.Context) error {
	if d.closed || d.closing.Load() {
		return ErrDestinationClosed
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	if d.conn == nil || d.conn.IsClosed() {
		if d.conn != nil {
			d.cfg.Logger.Info("Connection to RabbitMQ lost", watermill.LogFields{"node": d.last, "connection_name": d.cfg.ConnectionName})
		}
		d.dropLocked()
		if err := d.dialLocked(ctx); err != nil {
			return err
		}
	}
	if d.cc == nil || d.cc.ch.IsClosed() {
		if d.cc != nil {
			// The broker closed the channel over something published on it:
			// an exchange deleted since it was checked, say. Check again.
			d.exchanges = map[string]bool{}
		}
		d.dropChannelLocked()
		ch, err := d.openConfirmChannel(ctx)
		if err != nil {
			return err
		}
		d.cc = &confirmChannel{
			conn:     d.conn,
			blocked:  d.blocked,
			ch:       ch,
			returns:  ch.NotifyReturn(make(chan amqp.Return, pipelineCapacity)),
			returned: map[string][]amqp.Return{},
			closes:   ch.NotifyClose(make(chan *amqp.Error, 1)),
		}
	}
	return nil
}

// dialLocked connects to the first node that answers, from d.next on and
// round the list, so that the node of a lost connection is tried last. It
// gives up once every node failed or ctx ended. Each node has an equal
// share of the time ctx leaves, so that a node that takes connections and
// never answers (a wedged or stopped broker) cannot spend it all, and a
// round cut short starts the next one after the last node it tried: a hung
// node first in line kept every round from the healthy nodes after it. The
// log of the connect names the node, the one before it if another, and the
// nodes that did not answer first.
func (d *AMQPDestination) dialLocked(ctx context.Context) error {
	var failed nodeErrors
	start := d.next
	for i := range d.nodes {
		if d.closing.Load() {
			return ErrDestinationClosed // Close waits behind this connect
		}
		k := (start + i) % len(d.nodes)
		node := d.nodes[k]
		nodeCtx, cancel := shareOf(ctx, len(d.nodes)-i)
		conn, w, err := d.dialNode(nodeCtx, node)
		cancel()
		if err != nil {
			d.cfg.Metrics.brokerConnectFailed(node.addr)
			failed = append(failed, fmt.Errorf("%s: %w", node.addr, err))
			d.next = (k + 1) % len(d.nodes)
			if ctx.Err() != nil {
				break
			}
			continue
		}
		d.conn, d.wire = conn, w
		d.blocked = watchBlocked(conn)
		d.exchanges = map[string]bool{}
		// Another node, or the broker restarted since: its limit may be
		// another.
		d.brokerMax, d.brokerMaxBy = 0, ""
		// The next connect starts after this node: if it is lost, the next
		// one is the likelier to answer.
		d.next = (k + 1) % len(d.nodes)
		fields := watermill.LogFields{"node": node.addr, "connection_name": d.cfg.ConnectionName}
		if d.last != "" && d.last != node.addr {
			fields["previous_node"] = d.last
		}
		if len(failed) > 0 {
			// Said once the round is over, with its outcome: a round that
			// fails says it all in its error, which the caller logs.
			fields["unanswered"] = failed.Error()
		}
		d.last = node.addr
		d.current.Store(&nodeConn{node: node.addr, conn: conn, wire: w})
		d.counted = node.addr
		d.cfg.Metrics.brokerConnected(node.addr, 1)
		go d.uncountWhenClosed(conn, conn.NotifyClose(make(chan *amqp.Error, 1)))
		d.cfg.Logger.Info("Connected to RabbitMQ", fields)
		return nil
	}
	refused := len(failed) > 0 && !slices.ContainsFunc(failed, func(err error) bool { return !amqpwire.Refused(err) })
	return connectFailed{err: fmt.Errorf("connect to RabbitMQ: %w", failed), refused: refused}
}

// shareOf is ctx with 1/n of the time it has left, or ctx itself when it
// has no deadline or n is 1.
func shareOf(ctx context.Context, n int) (context.Context, context.CancelFunc) {
	deadline, ok := ctx.Deadline()
	if !ok || n <= 1 {
		return ctx, func() {}
	}
	return context.WithTimeout(ctx, time.Until(deadline)/time.Duration(n))
}

// dialNode opens a connection to node, within ctx.
func (d *AMQPDestination) dialNode(ctx context.Context, node brokerNode) (*amqp.Connection, *amqpwire.Wire, error) {
	cfg := d.cfg.AMQP
	if cfg.TLSClientConfig != nil {
		// amqp091-go sets an empty ServerName to the host of the URL it
		// dials, in the config it is given: a copy keeps each node's own.
		cfg.TLSClientConfig = cfg.TLSClientConfig.Clone()
	}
	dial := cfg.Dial
	if dial == nil {
		dial = contextDial(ctx, dialTimeout)
	}
	var (
		w    *amqpwire.Wire
		stop = func() bool { return true }
	)
	cfg.Dial = amqpwire.Dial(dial, func(opened *amqpwire.Wire) {
		// The handshake, too, is cut short when ctx ends, whatever
		// deadline the Dial set, if any.
		w = opened
		stop = context.AfterFunc(ctx, func() { _ = opened.Conn.SetDeadline(time.Now()) })
		d.dialing.Store(opened)
	})
	conn, err := amqp.DialConfig(node.url, cfg)
	d.dialing.Store(nil)
	if cut := !stop(); cut || err != nil {
		if conn != nil { // amqp091-go can return one with its error
			_ = conn.CloseDeadline(time.Now())
		}
		if err == nil {
			err = ctx.Err()
		}
		return nil, nil, err
	}
	return conn, w, nil
}

// contextDial is amqp091-go's DefaultDial, cut short when ctx ends.
func contextDial(ctx context.Context, timeout time.Duration) func(network, addr string) (net.Conn, error) {
	return func(network, addr string) (net.Conn, error) {
		dialer := net.Dialer{Timeout: timeout}
		conn, err := dialer.DialContext(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		// As DefaultDial does: a deadline for the handshake, which the
		// client clears once the connection is open.
		if err := conn.SetDeadline(time.Now().Add(timeout)); err != nil {
			_ = conn.Close()
			return nil, err
		}
		return conn, nil
	}
}

// nodeErrors are the failures of a round of connects, one per node tried.
type nodeErrors []error

func (e nodeErrors) Error() string {
	msgs := make([]string, len(e))
	for i, err := range e {
		msgs[i] = err.Error()
	}
	return strings.Join(msgs, "; ")
}

func (e nodeErrors) Unwrap() []error { return e }

// openConfirmChannel opens a channel in confirm mode, within ctx.
func (d *AMQPDestination) openConfirmChannel(ctx context.Context) (*amqp.Channel, error) {
	var ch *amqp.Channel
	err := d.rpc(ctx, func() error {
		var err error
		if ch, err = d.conn.Channel(); err != nil {
			return fmt.Errorf("outbox: open channel: %w", err)
		}
		if err := ch.Confirm(false); err != nil {
			_ = ch.Close()
			return fmt.Errorf("outbox: enable publisher confirms: %w", err)
		}
		return nil
	})
	return ch, err
}

// rpc runs fn, whose calls wait for the broker's answers, and cuts the
// connection if ctx ends first: amqp091-go waits for an answer without
// limit, and a broker that stops reading (a memory alarm) never sends one.
// A cut connection is dropped, and the error says the connection was lost.
func (d *AMQPDestination) rpc(ctx context.Context, fn func() error) error {
	w := d.wire
	stop := context.AfterFunc(ctx, func() { _ = w.Conn.SetDeadline(time.Now()) })
	err := fn()
	if !stop() {
		d.dropLocked()
		return connectionLost(fmt.Errorf("the broker did not answer in time: %w", errors.Join(ctx.Err(), err)))
	}
	return err
}

// dropLocked closes the channel and connection, if any, so that the next use
// opens fresh ones. The channel goes with the connection, and the close
// waits closeTimeout at most for the broker's answer: a broker that stops
// reading (a memory alarm) never gives one.
func (d *AMQPDestination) dropLocked() { d.dropWithin(closeTimeout) }

// dropWithin is dropLocked waiting at most wait for the broker's answer to
// the close.
func (d *AMQPDestination) dropWithin(wait time.Duration) {
	d.renew = false
	d.forgetChannelLocked()
	if d.conn != nil {
		_ = d.conn.CloseDeadline(time.Now().Add(wait))
		d.conn, d.wire = nil, nil
	}
	d.exchanges = nil
	d.current.Store(nil)
	if d.counted != "" {
		d.cfg.Metrics.brokerConnected(d.counted, -1)
		d.counted = ""
	}
}

// blockedFlag is what the broker last said of a connection with
// connection.blocked and connection.unblocked: the reason while it is
// blocked (a memory or disk alarm), nil otherwise.
type blockedFlag struct{ reason atomic.Pointer[string] }

// watchBlocked follows conn's blocked notifications until it closes. The
// client's reader sends each one and waits until it is taken, so they are
// taken at once, never under d.mu (held through a wait for confirms).
func watchBlocked(conn *amqp.Connection) *blockedFlag {
	f := &blockedFlag{}
	notes := conn.NotifyBlocked(make(chan amqp.Blocking, 1))
	go func() {
		for b := range notes {
			if b.Active {
				f.reason.Store(&b.Reason)
			} else {
				f.reason.Store(nil)
			}
		}
	}()
	return f
}

// markBlocked makes each ErrConnectionLost of res also ErrBrokerBlocked
// when the broker had blocked the connection it went out on: under a
// memory or disk alarm RabbitMQ blocks a connection at its first publish
// and reads nothing more from it, so that the publish times out.
func markBlocked(res []error, f *blockedFlag) {
	if f == nil {
		return
	}
	reason := f.reason.Load()
	if reason == nil {
		return
	}
	for i, err := range res {
		if errors.Is(err, ErrConnectionLost) && !errors.Is(err, ErrBrokerBlocked) {
			res[i] = fmt.Errorf("%w (%w: %s)", err, ErrBrokerBlocked, *reason)
		}
	}
}

// uncountWhenClosed takes conn out of outbox_forwarder_broker_connected
// once it closes, however it closes. dropLocked does so when the relay next
// uses the destination, and an idle relay uses it only when a row comes:
// until then an alert on the gauge would not see the broker gone.
func (d *AMQPDestination) uncountWhenClosed(conn *amqp.Connection, closed <-chan *amqp.Error) {
	reason := <-closed
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.conn == conn && d.counted != "" {
		d.cfg.Metrics.brokerConnected(d.counted, -1)
		d.counted = ""
	}
	if d.conn == conn && reason != nil {
		// Said as it happens, with the broker's reason: the relay saw it
		// only at its next publish, and its log said "lost" then, without
		// why (a user review closed the connection from the broker's side).
		d.cfg.Logger.Info("Connection to RabbitMQ closed; the relay connects again at its next poll or publish",
			watermill.LogFields{"node": d.last, "connection_name": d.cfg.ConnectionName, "reason": reason.Reason, "code": reason.Code, "by_broker": reason.Server})
	}
}

// closeTimeout bounds the wait for the broker's answer to connection.close.
const closeTimeout = 5 * time.Second

// retireWait bounds how long a retired channel waits for the windows out on
// it to be collected: the relay collects each within its PublishTimeout
// (15 s by default).
const retireWait = time.Minute

// dropChannelLocked lets the confirm channel go (a retired one, or one the
// broker closed), and closes it without waiting under d.mu for the
// broker's answer (close-ok), which a broker that stops reading (a memory
// alarm) does not send: the relay's waits, sends and Close queued behind
// it for as long as the alarm lasted. The close ends when the broker
// answers or the connection goes.
func (d *AMQPDestination) dropChannelLocked() {
	if ch := d.forgetChannelLocked(); ch != nil {
		go func() { _ = ch.Close() }()
	}
}

// forgetChannelLocked lets the confirm channel go, and returns it if it is
// still open, marked dropped. One the broker closed keeps that as its
// reason, for the windows still waiting on it.
func (d *AMQPDestination) forgetChannelLocked() *amqp.Channel {
	cc := d.cc
	d.cc = nil
	d.retire = false
	if cc != nil {
		d.inflight = slices.DeleteFunc(d.inflight, func(w *sent) bool { return w.abandoned && w.on == cc })
	}
	if cc == nil || cc.ch.IsClosed() {
		return nil
	}
	cc.dropped = true
	return cc.ch
}

// Close closes the connection. Publish and Connect fail afterwards. Calling it
// again does nothing. A Publish or Connect in progress has 5 s to end; then
// Close cuts the connection's socket, which ends one that would wait for
// ever (a context without a deadline, and a broker that stops reading or
// confirming): it fails with ErrConnectionLost.
func (d *AMQPDestination) Close() error {
	d.closing.Store(true)
	if !d.mu.TryLock() {
		locked := make(chan struct{})
		go func() {
			d.mu.Lock()
			close(locked)
		}()
		cut := time.After(closeTimeout)
		for waiting := true; waiting; {
			select {
			case <-locked:
				waiting = false
			case <-cut:
				// The call's reads and writes fail, and amqp091-go shuts
				// its connection down. Again until the call ends: its
				// connect may have reached the handshake since.
				if c := d.current.Load(); c != nil && c.wire != nil {
					_ = c.wire.Close()
				}
				if w := d.dialing.Load(); w != nil {
					_ = w.Close()
				}
				cut = time.After(100 * time.Millisecond)
			}
		}
	}
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
//
// ctx bounds the wait for the confirms. A ctx that ended before a window is
// sent sends nothing more, but once a window's writes begin they go out
// whole, within 15 s, whatever ctx does: a write cut short would leave the
// connection unusable, and the windows of others out on it would lose
// their confirms (see writeContext).
func (d *AMQPDestination) Publish(ctx context.Context, records []Record) []error {
	results := make([]error, 0, len(records))
	for start := 0; start < len(records); {
		end := d.windowEnd(records, start)
		res := d.wait(ctx, d.send(ctx, records[start:end]))
		results = append(results, res...)
		if failedAny(res) {
			for len(results) < len(records) {
				results = append(results, ErrNotSent)
			}
			break
		}
		start = end
	}
	return results
}

// windowEnd is where the window starting at start ends: at Window records,
// and before any record that failed before or is a suspect (see blame),
// which goes alone and is confirmed before anything behind it is sent, so
// that nothing overtakes a record on its retry, and a suspect that closes
// the channel again is the only one to blame.
func (d *AMQPDestination) windowEnd(records []Record, start int) int {
	d.mu.Lock()
	defer d.mu.Unlock()
	alone := func(r Record) bool { return r.Attempts > 0 || d.suspects[r.ID] }
	if alone(records[start]) {
		return start + 1
	}
	limit := len(records)
	if d.cfg.Window > 0 {
		limit = min(limit, start+d.cfg.Window)
	}
	for i := start + 1; i < limit; i++ {
		if alone(records[i]) {
			return i
		}
	}
	return limit
}

// Pipeline returns the destination's pipeline when no Window is set: then
// the Forwarder's Run sends the next batch before waiting for the confirms
// of the one before, so the broker's confirm pipeline never runs dry between
// batches. With a Window set it returns nil, and every batch goes through
// Publish, window by window.
func (d *AMQPDestination) Pipeline() Pipeline {
	if d.cfg.Window != 0 {
		return nil
	}
	return amqpPipeline{d}
}

// amqpPipeline is an AMQPDestination's Pipeline: its send and wait, which
// Publish runs window by window.
type amqpPipeline struct{ d *AMQPDestination }

func (p amqpPipeline) Destination() Destination { return p.d }

func (p amqpPipeline) Capacity() int { return pipelineCapacity }

func (p amqpPipeline) Send(ctx context.Context, records []Record) Sent {
	return p.d.send(ctx, records)
}

func (p amqpPipeline) Wait(ctx context.Context, s Sent) []error {
	return p.d.wait(ctx, s.(*sent))
}

func failedAny(res []error) bool {
	for _, err := range res {
		if err != nil {
			return true
		}
	}
	return false
}

// sent is a window of records published and not yet confirmed.
type sent struct {
	recs     []Record
	res      []error // failures known at send time
	confirms []*amqp.DeferredConfirmation
	on       *confirmChannel // the channel they went out on
	at       time.Time       // when they went out
	// abandoned: its caller stopped waiting for its confirms (a Sweep
	// whose request ended) while other windows were out on its channel.
	// It stays in inflight, as a record of what is out on the channel
	// (blame), until the channel goes (see retire).
	abandoned bool
}

func (p *sent) Records() []Record { return p.recs }

// send publishes recs without waiting for their confirms. It stops at the
// first record it cannot publish; the records after it are not sent.
func (d *AMQPDestination) send(ctx context.Context, recs []Record) *sent {
	ctx, connectCtx, bound, cancel := writeContext(ctx)
	defer cancel()
	d.mu.Lock()
	defer d.mu.Unlock()
	p := &sent{recs: recs, res: make([]error, len(recs)), at: time.Now()}
	// A window that stops short, this one refused included, holds back the
	// ones after it until it is collected.
	defer func() {
		if slices.ContainsFunc(p.res, func(err error) bool { return err != nil }) {
			d.short = append(d.short, p)
		}
		if p.on != nil { // a connect that failed is no blocked connection's
			markBlocked(p.res, p.on.blocked)
		}
	}()
	if d.behindAShortWindow() {
		fillNotSent(p.res, 0, errBehindShortWindow)
		return p
	}
	if d.renew && d.cc != nil && !slices.ContainsFunc(d.inflight, func(w *sent) bool { return w.on == d.cc && !w.abandoned }) {
		d.dropLocked() // a nack came on it (see wait): a fresh connection
	}
	if d.retire && d.cc != nil {
		// Windows nobody collects (a caller that panicked) hold it no
		// longer than retireWait: then they lose their confirms, as they
		// did before channels were retired.
		if time.Since(d.retiredAt) < retireWait && slices.ContainsFunc(d.inflight, func(w *sent) bool { return w.on == d.cc && !w.abandoned }) {
			fillNotSent(p.res, 0, errBehindRetired)
			return p
		}
		d.dropChannelLocked()
	}
	if bound.spent() {
		fillNotSent(p.res, 0, errWriteTimeSpent)
		return p
	}
	err := d.ensure(connectCtx)
	if err == nil {
		err = connectCtx.Err() // a caller's own ctx that ended while it connected
	}
	if err != nil {
		// Nothing of the window went out: an outage's, not its head
		// record's, however often it comes there (see unprobedLost).
		fillNotSent(p.res, 0, unprobedLost{connectionLost(err)})
		return p
	}
	if d.behindAClosedChannel() {
		fillNotSent(p.res, 0, errBehindClosedChannel)
		return p
	}
	p.on = d.cc
	// Exchanges first, on a side channel: publishing to a missing one would
	// close the confirm channel and fail every message in flight with it.
	limit := len(recs)
	_ = d.rpc(ctx, func() error {
		for i, r := range recs {
			if len(r.Exchange) > maxShortString {
				// As encodable refuses it, before amqp091-go fails to
				// write the check and shuts the connection down over it,
				// with the windows of others out on it.
				p.res[i] = Permanent(fmt.Errorf("publish: exchange of %d bytes: AMQP allows %d", len(r.Exchange), maxShortString))
				limit = i
				return nil
			}
			if !utf8.ValidString(r.Exchange) {
				// Another library's row (SQLite's TEXT holds any bytes):
				// RabbitMQ answers the check by closing the connection
				// (501 FRAME_ERROR, malformed UTF-8), which the relay took
				// for a lost connection, again at each try, the rows
				// behind it held up a minute (a review).
				p.res[i] = Permanent(fmt.Errorf("publish: exchange %q is not valid UTF-8, which RabbitMQ refuses in a name", r.Exchange))
				limit = i
				return nil
			}
			if err := d.checkExchange(r.Exchange); err != nil {
				p.res[i] = err
				limit = i
				return err
			}
		}
		return nil
	})
	if d.conn == nil { // cut: the broker did not answer the checks in time
		fillNotSent(p.res, 0, unprobedLost{connectionLost(fmt.Errorf("check exchanges: %w", ctx.Err()))})
		p.on = nil
		return p
	}
	// The publishes go out together when the loop ends, by ctx's deadline:
	// a broker that stops reading (a memory alarm) cannot block the relay.
	release := d.wire.Hold(ctx)
	lost := false
	for i := 0; i < limit; i++ {
		msg := publishing(recs[i])
		if err := encodable(recs[i], msg, d.conn.Config.FrameSize); err != nil {
			// The client would refuse the message itself (and close the
			// connection over it): no retry changes that.
			p.res[i] = Permanent(fmt.Errorf("publish: %w", err))
			break
		}
		if err := d.overMaxSize(recs[i]); err != nil {
			// The broker would read it all and close the channel over
			// it, taking the records in flight behind it along.
			p.res[i] = Permanent(err)
			break
		}
		dc, err := p.on.ch.PublishWithDeferredConfirmWithContext(ctx, recs[i].Exchange, recs[i].RoutingKey, true, false, msg)
		if err != nil && p.on.ch.IsClosed() && !d.conn.IsClosed() && p.on.closedByBroker() {
			// The broker closed the channel over a message this window or
			// one before it published (a channel error; the wire flushes a
			// large window while it is written): this record and those
			// after it are not sent, and wait blames the one at fault
			// among those out on the channel, as for a close seen after
			// the send. The connection stays. (Taken for a lost
			// connection, it charged an innocent record.)
			break
		}
		if err != nil {
			// The message was valid, so the channel or the connection is
			// gone (its closing may not be visible on the channel yet), or
			// the write failed: the broker's fault, not the record's. The
			// channel goes too: after a failed write the broker's count of
			// deliveries may no longer match the client's.
			p.res[i] = connectionLost(fmt.Errorf("publish: %w", err))
			lost = true
			break
		}
		p.confirms = append(p.confirms, dc)
	}
	if err := release(); err != nil {
		// Whether the broker got any of them is unknown, and the records
		// are not at fault.
		if len(p.confirms) > 0 {
			fillNotSent(p.res, 0, connectionLost(fmt.Errorf("publish: %w", err)))
			p.confirms = nil
		}
		lost = true
	}
	if lost {
		d.dropLocked()
	}
	for i := len(p.confirms); i < len(recs); i++ {
		if p.res[i] == nil {
			p.res[i] = ErrNotSent
		}
	}
	if len(p.confirms) > 0 {
		p.at = time.Now()
		d.inflight = append(d.inflight, p)
	}
	return p
}

// errBehindShortWindow is the result of the records of a window not sent
// because a window sent before it stopped short and is not collected yet.
var errBehindShortWindow = fmt.Errorf("%w: a window sent before it stopped short of its records", ErrNotSent)

// behindAShortWindow reports whether a window sent earlier stopped short (a
// record failed or was not sent: a missing exchange, a message the client
// refuses, a lost connection) and is not collected yet. The records it did
// not send are released when it is settled, and claimed again; a window
// sent now would overtake them, so nothing goes out until it is. A window
// nobody collected for staleWindow is forgotten, as in
// behindAClosedChannel.
func (d *AMQPDestination) behindAShortWindow() bool {
	d.short = slices.DeleteFunc(d.short, func(w *sent) bool { return time.Since(w.at) > staleWindow })
	return len(d.short) > 0
}

// errBehindClosedChannel is the result of the records of a window not sent
// because windows before it are still out on a channel that closed.
var errBehindClosedChannel = fmt.Errorf("%w: windows sent before it are out on a channel that closed", ErrNotSent)

// behindAClosedChannel reports whether windows are still out on a channel
// the destination has moved on from (closed by the broker or with its
// connection): what they carried may be released and sent again, and a
// window sent now on the new channel would overtake it. It goes out once
// they are collected. A window nobody collected for staleWindow is
// forgotten: a caller that never will must not stop every send after it.
func (d *AMQPDestination) behindAClosedChannel() bool {
	d.inflight = slices.DeleteFunc(d.inflight, func(w *sent) bool { return time.Since(w.at) > staleWindow })
	for _, w := range d.inflight {
		if w.on != d.cc {
			return true
		}
	}
	return false
}

// othersOut reports whether windows other than p, not abandoned, are out
// on p's channel.
func (d *AMQPDestination) othersOut(p *sent) bool {
	return slices.ContainsFunc(d.inflight, func(w *sent) bool { return w != p && w.on == p.on && !w.abandoned })
}

// errBehindRetired is the result of the records of a window not sent
// because the channel is retired (see AMQPDestination.retire) and windows
// are still out on it.
var errBehindRetired = fmt.Errorf("%w: a publish on the channel was given up on by its caller; a fresh channel is opened once the windows out on it are collected", ErrNotSent)

// nackRenewal spaces the connection renewals that nacks ask for. The first
// nack of a stream renews at once, as a channel left nacking by a lost
// quorum leader needs; the next ones wait nackRenewFirstGap after that
// renewal, then twice as long each time, up to nackRenewMaxGap. A queue
// that nacks every publish to it (full, reject-publish) so costs a
// connection every half minute, not one per window: each was a handshake,
// a channel, the exchanges checked again, and a hop to the next node of a
// cluster. A stream ends after nackStreakEnd without a nack.
type nackRenewal struct {
	last time.Time     // the latest nack
	next time.Time     // no renewal for a nack before it
	gap  time.Duration // the wait after the latest renewal
}

const (
	nackRenewFirstGap = time.Second
	nackRenewMaxGap   = 30 * time.Second
	nackStreakEnd     = 2 * nackRenewMaxGap
)

// due notes a nack at now, and reports whether it renews the connection.
func (r *nackRenewal) due(now time.Time) bool {
	if now.Sub(r.last) > nackStreakEnd {
		r.next, r.gap = time.Time{}, 0 // a new stream
	}
	r.last = now
	if now.Before(r.next) {
		return false
	}
	r.gap = min(max(nackRenewFirstGap, 2*r.gap), nackRenewMaxGap)
	r.next = now.Add(r.gap)
	return true
}

// staleWindow is how long a window may stay uncollected before
// behindAClosedChannel forgets it; the relay collects each within its
// PublishTimeout, far shorter.
const staleWindow = time.Hour

// wait collects the confirms and returns of a sent window, one result per
// record.
func (d *AMQPDestination) wait(ctx context.Context, p *sent) []error {
	d.mu.Lock()
	defer d.mu.Unlock()
	res := p.res
	d.short = slices.DeleteFunc(d.short, func(w *sent) bool { return w == p })
	if p.on == nil {
		return res // not connected: nothing went out
	}
	defer func() {
		if !p.abandoned {
			d.inflight = slices.DeleteFunc(d.inflight, func(w *sent) bool { return w == p })
		}
	}()
	timedOut, nacked := false, false
	lastAcked := -1      // the window's last record the broker confirmed
	var unanswered []int // the records whose confirms did not come in time
	for i, dc := range p.confirms {
		acked, err := p.on.waitConfirm(ctx, dc)
		switch {
		case acked:
			delete(d.suspects, p.recs[i].ID)
			lastAcked = i
		case err != nil:
			// The broker is up but does not confirm (a memory or disk alarm,
			// a quorum queue without its majority) or the network went
			// quiet: nothing this record did (see silent below). Or the
			// caller stopped waiting (see brokerSilent).
			if brokerSilent(ctx) {
				res[i] = connectionLost(fmt.Errorf("no confirm from the broker: %w", err))
			} else {
				res[i] = connectionLost(fmt.Errorf("the caller stopped waiting for the broker's confirm: %w", context.Cause(ctx)))
			}
			unanswered = append(unanswered, i)
			timedOut = true
		case p.on.dropped || p.on.conn.IsClosed():
			// The connection went, or the channel was closed over another
			// window's failure: whether the broker has the message is
			// unknown, and the record is not at fault.
			res[i] = connectionLost(fmt.Errorf("channel closed before the broker confirmed: %s", p.on.closeReason()))
		case p.on.ch.IsClosed() && d.blame(ctx, p.on, dc):
			// The broker closed this channel and kept the connection: a
			// channel error, caused by this record.
			res[i] = fmt.Errorf("channel closed by the broker before it confirmed: %s", p.on.closeReason())
			switch {
			case p.on.tooLarge(p.recs[i]):
				// Over the broker's max_message_size: no retry will send
				// it, and each would send it whole and hold back what is
				// behind it.
				res[i] = Permanent(&MessageTooLargeError{Size: len(p.recs[i].Body), Max: p.on.maxBody,
					detail: "the broker closed the channel over it: " + p.on.closeReason()})
			case invalidMessage(p.on.closeReason()):
				// The broker refused the message for what it holds (a
				// header of a type it does not take where it reads one):
				// every try would close the channel again, and an unkeyed
				// record would hold back all behind it until MaxAttempts.
				res[i] = Permanent(res[i])
			}
		case p.on.ch.IsClosed():
			// Closed over another record: the broker dropped this one, or
			// has it unconfirmed. Not its fault, so it counts no attempt,
			// and it is sent again (the consumers' inbox absorbs a copy).
			res[i] = fmt.Errorf("%w: the broker closed the channel over another message before it confirmed this one: %s", ErrNotSent, p.on.closeReason())
		default:
			// RabbitMQ nacks for a queue's reasons: it says which
			// in no frame, and last_error is where an operator looks.
			res[i] = fmt.Errorf("%w: a queue it routes to refused it (full under x-overflow reject-publish, without the majority of its quorum, or a queue error); it counts an attempt, but never makes the record stuck", errNacked)
			nacked = true
		}
	}

	silent(res, unanswered, lastAcked)

	// RabbitMQ sends basic.return before the basic.ack of the same message,
	// and the client delivers frames in order, so every return of this
	// window is in its channel's buffer once its confirms are in.
	p.on.drainReturns()
	for i := range p.confirms {
		if ret, ok := p.on.takeReturn(p.recs[i].ID); ok {
			if res[i] == nil {
				res[i] = &UnroutableError{Exchange: ret.Exchange, RoutingKey: ret.RoutingKey, ReplyCode: ret.ReplyCode, ReplyText: ret.ReplyText}
			}
		}
	}
	markBlocked(res, p.on.blocked)
	if nacked && p.on == d.cc && d.nacks.due(time.Now()) {
		// After its quorum queue's leader was lost, a channel on another
		// node went on nacking every publish while a fresh one was acked:
		// the connection is renewed once no other window is out on it
		// (dropped now, their confirms would be lost with it). A queue
		// that nacks for its own reasons (full, x-overflow reject-publish)
		// nacks on every connection: the renewals of a stream of nacks
		// are spaced (see nackRenewal).
		d.renew = true
	}
	if timedOut && p.on == d.cc && !brokerSilent(ctx) && d.othersOut(p) {
		// The caller stopped waiting (a Sweep bounded by a request) while
		// other windows (Run's batches) are out on the channel: dropped
		// now, it took their confirms with it, and they went out again.
		// The channel is retired instead: no window more goes out on it,
		// and it is closed once those are collected, with what the
		// broker may still say of this window: a return of one of its
		// records, filed by id, would otherwise be taken by the record's
		// next send on the channel, and a record of it that closes the
		// channel is blamed among the windows out (it stays one of them).
		p.abandoned, d.retire, d.retiredAt = true, true, time.Now()
	}
	switch {
	case timedOut && p.on == d.cc && !p.abandoned:
		// Late confirms of a timed-out window must not be read as confirms
		// of the next: a fresh connection starts afresh. Without waiting for
		// the broker's answer to the close, which a broker that confirms
		// nothing does not send either; unless the relay is stopping.
		wait := time.Duration(0)
		if errors.Is(ctx.Err(), context.Canceled) {
			wait = closeTimeout
		}
		d.dropWithin(wait)
	case d.renew && p.on == d.cc && !d.othersOut(p):
		d.dropLocked()
	case d.retire && p.on == d.cc && !d.othersOut(p):
		d.dropChannelLocked()
	}
	return res
}

// errNoConfirmInTime is the cause the relay gives the contexts of its
// waits for confirms when their PublishTimeout ends (see brokerSilent).
var errNoConfirmInTime = errors.New("no confirm within PublishTimeout")

// brokerSilent reports whether ctx, a wait's that ended, ended because the
// broker kept the wait's confirms past the relay's PublishTimeout, rather
// than because its caller gave up on it (a Sweep bounded by a request).
// Only then is the connection known to be at fault, and dropped with the
// windows of others out on it.
func brokerSilent(ctx context.Context) bool {
	return errors.Is(context.Cause(ctx), errNoConfirmInTime)
}

// writeBoundKey is the key of a context's value set by withWriteBound.
type writeBoundKey struct{}

// writeBound is the time a send's writes to the broker must end by, and
// how long it had from when it was set.
type writeBound struct {
	until time.Time
	span  time.Duration
}

// withWriteBound marks ctx, a Publish's or a Send's under a Forwarder, with
// the time its writes to the broker must end by: the relay's
// PublishTimeout from the batch's start (see writeContext).
func withWriteBound(ctx context.Context, until time.Time) context.Context {
	return context.WithValue(ctx, writeBoundKey{}, writeBound{until, time.Until(until)})
}

// writeMargin is the least of its bound a send must have left, once it
// holds the destination, to begin its writes: a quarter of the bound where
// that is shorter. A send waits for d.mu behind the confirm waits of
// others (Run's, up to PublishTimeout), and a bound that ran out during
// its exchanges' check or its writes cut them and dropped the connection,
// and with it the confirms of every window out on it.
const writeMargin = 100 * time.Millisecond

// spent reports whether too little of b is left to begin a send's writes.
func (b writeBound) spent() bool { return time.Until(b.until) < min(writeMargin, b.span/4) }

// errWriteTimeSpent is the result of the records of a window not sent
// because its bound was spent (see writeBound.spent) by the time it held
// the destination: the broker is not at fault, nor the records.
var errWriteTimeSpent = fmt.Errorf("%w: the time for its writes was spent waiting for the confirms of earlier publishes", ErrNotSent)

// writeTimeout bounds the writes of a send whose ctx withWriteBound did not
// mark (a caller's own Publish): the Forwarder's default PublishTimeout.
const writeTimeout = 15 * time.Second

// writeContext gives the contexts a send works under. It checks exchanges
// and writes under ctx without its end, bounded by the write bound
// withWriteBound gave it, or writeTimeout from now. A write cut short
// leaves the channel's count of deliveries out of step with the broker's
// (the client numbered publishes that never went out), and so the
// connection is dropped, and the windows of others out on it lose their
// confirms with it: they go out again, and count towards their head
// record's losses. A caller that gives up on a Publish (a Sweep bounded by
// a request, a deadline of a few milliseconds) stops waiting for its
// confirms instead (see brokerSilent); a healthy broker takes a window in
// milliseconds. A deadline that passed while its timer had not fired yet
// (a loaded machine) cut the write just the same, and 255 of another
// window's 1000 records failed in one CI run.
//
// It connects under the same context when ctx is marked, and under ctx
// itself when not (a caller's own Publish): nobody's window is out on a
// connection being dialled or a channel being opened, so a caller that
// gives up cuts its connect, and sends nothing.
func writeContext(ctx context.Context) (write, connect context.Context, bound writeBound, cancel context.CancelFunc) {
	bound, marked := ctx.Value(writeBoundKey{}).(writeBound)
	if !marked {
		bound = writeBound{time.Now().Add(writeTimeout), writeTimeout}
	}
	write, cancel = context.WithDeadlineCause(context.WithoutCancel(ctx), bound.until, errNoConfirmInTime)
	if marked {
		return write, write, bound, cancel
	}
	return write, ctx, bound, cancel
}

// errNacked is the result of a record the broker nacked. RabbitMQ nacks
// for a queue's reasons only (full under x-overflow reject-publish, a
// quorum queue without its majority, a queue process that failed), never
// for what the message holds: a nack counts an attempt (the record's
// backoff grows, and it goes alone) but never makes the record stuck, as
// an outage of any length makes no row stuck (see Forwarder.charge).
var errNacked = errors.New("nacked by the broker")

// silent makes the records of unanswered (their confirms did not come in
// time) after the window's last confirmed one, lastAcked, an outage's:
// they count no attempt however often the relay meets them at the same
// record (unprobedLost). The broker fell silent there (a quorum queue
// without its majority, a network gone quiet one way), and the relay drops
// the connection itself: counted at the head record once the timeouts came
// there more than three times in a row, as a connection lost at one record
// is, a sound record was stuck after a few minutes of such an outage, and
// the records behind it overtook it. A confirm missing before one that
// came is the broker answering the others but not this record: that
// counts as before.
func silent(res []error, unanswered []int, lastAcked int) {
	for _, i := range unanswered {
		if i > lastAcked {
			res[i] = unprobedLost{res[i]}
		}
	}
}

// waitConfirm waits for dc, filing the channel's returns as they come
// rather than after: the buffer of returns holds pipelineCapacity, and more
// can be out on one channel (a Sweep's batch behind Run's full pipeline).
// Once it is full the client's reader waits 5 s for room, then drops the
// return and reads on, and the ack that follows would mark an unroutable
// message published. The wait runs under d.mu, so no other wait drains
// them meanwhile.
//
// A confirm already in wins over a ctx already ended: the relay may collect
// a window after its deadline, and select chooses at random among the
// cases ready.
func (c *confirmChannel) waitConfirm(ctx context.Context, dc *amqp.DeferredConfirmation) (bool, error) {
	for {
		select {
		case <-dc.Done():
			return dc.Acked(), nil
		default:
		}
		select {
		case <-dc.Done():
			return dc.Acked(), nil
		case ret, ok := <-c.returns:
			c.receive(ret, ok) // closed with the channel: dc is settled too
		case <-ctx.Done():
			return false, ctx.Err()
		}
	}
}

// tooLarge reports whether r's body is over the limit the broker named
// closing c over a larger message (maxBody).
func (c *confirmChannel) tooLarge(r Record) bool { return c.maxBody > 0 && len(r.Body) > c.maxBody }

func (c *confirmChannel) drainReturns() {
	for {
		select {
		case ret, ok := <-c.returns:
			c.receive(ret, ok)
			if !ok {
				return
			}
		default:
			return
		}
	}
}

// receive files a return read from the channel's returns, or, when they
// closed with the channel, lets them go (a nil channel is never ready).
func (c *confirmChannel) receive(ret amqp.Return, ok bool) {
	if !ok {
		c.returns = nil
		return
	}
	c.file(ret)
}

// file keeps a return until the wait of its record takes it. One id may be
// out twice on a channel (a claim whose lease ran out while its batch was
// in flight, claimed again by the same relay), so each id keeps its returns
// in order: one return per copy, taken by one wait each.
func (c *confirmChannel) file(ret amqp.Return) {
	c.returned[ret.MessageId] = append(c.returned[ret.MessageId], ret)
}

// takeReturn takes the oldest return filed for id.
func (c *confirmChannel) takeReturn(id string) (amqp.Return, bool) {
	rets := c.returned[id]
	if len(rets) == 0 {
		return amqp.Return{}, false
	}
	if len(rets) == 1 {
		delete(c.returned, id)
	} else {
		c.returned[id] = rets[1:]
	}
	return rets[0], true
}

// blame reports whether the record of confirm dc, unconfirmed when the
// broker closed the channel, is what closed it. Every record unconfirmed
// then gets a nack, from this window and from those in flight behind it,
// and charging each an attempt would make one refused record (an internal
// exchange, one the relay's user may not write to) take the others down
// with it, every try, until all are stuck. The broker names the exchange
// it refused ("… exchange 'x' in vhost '/'", cut short past 255 bytes):
// the records to it are to blame. A close over a message's size names the
// broker's limit ("message size 134217729 is larger than configured max
// size 134217728"): the records whose bodies are larger are to blame, and
// the destination refuses larger bodies itself from then on, on this
// connection. A close that names neither (a header the
// broker refuses) blames the record if it
// was the only one unconfirmed; else nobody, and each of those records
// becomes a suspect, which goes alone until it is through (see isolates),
// so that the next close has one record to blame. (The first record left
// unconfirmed is no good guess: the broker confirms in bursts, and holds
// the records before the refused one unconfirmed.) Decided once per
// channel, over every window still in flight on it.
func (d *AMQPDestination) blame(ctx context.Context, c *confirmChannel, dc *amqp.DeferredConfirmation) bool {
	if c.blamed == nil {
		c.blamed = map[*amqp.DeferredConfirmation]bool{}
		c.closeReason()
		exchange, named := refusedExchange(c.refusal)
		if limit, ok := refusedSize(c.refusal); ok {
			c.maxBody = limit
			if c.conn == d.conn {
				d.brokerMax, d.brokerMaxBy = limit, c.reason
			}
		}
		var unconfirmed []string
		var only *amqp.DeferredConfirmation
		for _, w := range d.inflight {
			if w.on != c {
				continue
			}
			for i, conf := range w.confirms {
				select { // the close nacks them all at once
				case <-conf.Done():
				case <-ctx.Done():
				}
				if conf.Acked() {
					continue
				}
				unconfirmed = append(unconfirmed, w.recs[i].ID)
				only = conf
				if named && sameExchange(w.recs[i].Exchange, exchange) || c.tooLarge(w.recs[i]) {
					c.blamed[conf] = true
				}
			}
		}
		switch {
		case len(c.blamed) > 0:
		case len(unconfirmed) == 1:
			c.blamed[only] = true
		default:
			if len(d.suspects) > maxSuspects {
				clear(d.suspects) // rows published by another relay, say: never seen again
			}
			for _, id := range unconfirmed {
				d.suspects[id] = true
			}
		}
	}
	return c.blamed[dc]
}

// maxSuspects bounds the suspects a destination remembers.
const maxSuspects = 10000

// isolates reports whether records hold a suspect (see blame), which the
// relay then sends through Publish, where it goes alone.
func (d *AMQPDestination) isolates(records []Record) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, r := range records {
		if d.suspects[r.ID] {
			return true
		}
	}
	return false
}

// refusedExchange reads the exchange a channel close names, as RabbitMQ
// writes it: "NOT_FOUND - no exchange 'x' in vhost '/'", "ACCESS_REFUSED -
// cannot publish to internal exchange 'x' in vhost '/'". A reason the
// broker cut short at 255 bytes ends within the name: what is left of it,
// less the "..." of the cut, is a prefix (named, but not whole).
func refusedExchange(reason string) (exchange, bool) {
	_, rest, ok := strings.Cut(reason, "exchange '")
	if !ok {
		return exchange{}, false
	}
	if name, _, ok := strings.Cut(rest, "' in vhost '"); ok {
		return exchange{name: name, whole: true}, true
	}
	return exchange{name: strings.TrimSuffix(rest, "...")}, rest != ""
}

// refusedSize reads the limit a channel close over a message's size names,
// as RabbitMQ 3.8 to 4.x write it: "PRECONDITION_FAILED - message size
// 134217729 is larger than configured max size 134217728" ("larger than
// max size" at its ceiling, 512 MiB).
func refusedSize(reason string) (int, bool) {
	_, rest, ok := strings.Cut(reason, "message size ")
	if !ok {
		return 0, false
	}
	_, rest, ok = strings.Cut(rest, "max size ")
	if !ok {
		return 0, false
	}
	end := 0
	for end < len(rest) && rest[end] >= '0' && rest[end] <= '9' {
		end++
	}
	limit, err := strconv.Atoi(rest[:end])
	if err != nil || limit <= 0 {
		return 0, false
	}
	return limit, true
}

// overMaxSize refuses r when its body is larger than the broker takes, as
// far as the destination knows its limit: AMQPConfig.MaxMessageSize, or
// what the broker named refusing a larger message on this connection.
func (d *AMQPDestination) overMaxSize(r Record) error {
	switch limit := d.cfg.MaxMessageSize; {
	case limit > 0 && len(r.Body) > limit && (d.brokerMax == 0 || limit <= d.brokerMax):
		return &MessageTooLargeError{Size: len(r.Body), Max: limit, detail: "AMQPConfig.MaxMessageSize; not sent"}
	case d.brokerMax > 0 && len(r.Body) > d.brokerMax:
		return &MessageTooLargeError{Size: len(r.Body), Max: d.brokerMax,
			detail: "as the broker named it closing a channel over a larger message on this connection (" + d.brokerMaxBy + "); not sent"}
	}
	return nil
}

// MessageTooLargeError is the failure of a record whose body is larger
// than the broker takes: its max_message_size, which RabbitMQ checks once
// it has read the whole body, closing the channel over it. It is
// permanent: the record is stuck at once, visible with this in last_error,
// and holds back nothing but its key. Raise the broker's limit (and
// AMQPConfig.MaxMessageSize) and retry it, or send the payload another way.
type MessageTooLargeError struct {
	Size int // the body's bytes
	Max  int // the limit it is over
	// detail says where the limit comes from and whether the message went
	// out.
	detail string
}

func (e *MessageTooLargeError) Error() string {
	return fmt.Sprintf("body of %d bytes is over the broker's max_message_size of %d bytes (%s): no retry will send it; raise the limit and retry the record, or send a smaller message",
		e.Size, e.Max, e.detail)
}

// exchange is the exchange a channel close names, whole or cut short.
type exchange struct {
	name  string
	whole bool
}

// sameExchange: RabbitMQ names the default exchange amq.default.
func sameExchange(recExchange string, named exchange) bool {
	if recExchange == "" {
		recExchange = "amq.default"
	}
	if named.whole {
		return recExchange == named.name
	}
	return strings.HasPrefix(recExchange, named.name)
}

// closeReason says why the channel closed, as the broker or the client
// told it.
// closedByBroker reports whether the broker closed the channel
// (channel.close: a channel error), as against the client or a lost
// connection. amqp091-go marks the channel closed before it hands the
// close's error out, so it waits for that error a moment.
func (c *confirmChannel) closedByBroker() bool {
	c.readClose(closeErrorWait)
	return c.byBroker
}

// closeErrorWait is how long closedByBroker waits for a closed channel's
// error.
const closeErrorWait = 50 * time.Millisecond

// readClose takes the channel's close error, once, if it comes within
// wait (0: only if it is there already).
func (c *confirmChannel) readClose(wait time.Duration) {
	if c.reason != "" {
		return
	}
	take := func(e *amqp.Error, ok bool) {
		if ok && e != nil {
			c.reason, c.refusal, c.byBroker = e.Error(), e.Reason, e.Server
		}
	}
	select {
	case e, ok := <-c.closes:
		take(e, ok)
		return
	default:
	}
	if wait > 0 {
		select {
		case e, ok := <-c.closes:
			take(e, ok)
		case <-time.After(wait):
		}
	}
}

// closeReason is why the channel closed, as far as it is known.
// invalidMessage reports whether a channel's close reason is RabbitMQ's
// refusal of a published message for its content ("PRECONDITION_FAILED -
// invalid message: …", from basic.publish): the same message is refused
// at every try.
func invalidMessage(reason string) bool {
	return strings.Contains(reason, "PRECONDITION_FAILED - invalid message")
}

func (c *confirmChannel) closeReason() string {
	c.readClose(0)
	switch {
	case c.reason != "":
		return c.reason
	case c.dropped:
		return "closed by the relay over another failure"
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
		return connectionLost(fmt.Errorf("open channel to check exchange %q: %w", name, err))
	}
	err = side.ExchangeDeclarePassive(name, amqp.ExchangeDirect, true, false, false, false, nil)
	var amqpErr *amqp.Error
	if errors.As(err, &amqpErr) && amqpErr.Code == amqp.NotFound {
		return &MissingExchangeError{Exchange: name} // the 404 closed the side channel
	}
	_ = side.Close()
	if err != nil {
		err = fmt.Errorf("check exchange %q: %w", name, err)
		if d.conn.IsClosed() {
			return connectionLost(err)
		}
		return err // refused for this exchange (access, …): the record's to carry
	}
	d.exchanges[name] = true
	return nil
}

// maxShortString is the most bytes an AMQP short string holds: names, the
// routing key, content type, message id and header keys.
const maxShortString = 255

// routingHeaders are the headers RabbitMQ reads as sender-selected routing
// (extra routing keys): it takes them as arrays only, and closes the
// channel over a message with any other value in them. TxPublisher refuses
// them as metadata (strings); another library's row can hold them.
var routingHeaders = []string{"CC", "BCC"}

// encodable checks what amqp091-go would refuse to encode, or the broker or
// an AMQP client refuse to read, in a message: CC or BCC that is no array, a short string over 255
// bytes (names, the routing key, content type, message id, header names and
// the keys of tables nested in headers), a header value of no AMQP field
// type, nesting or containers beyond what amqp091-go reads, or properties
// larger than a frame (frameSize, 0 if unknown). Rows written by hand or by
// another library can hold any of these; decodeRecord refuses most of them
// already, and this is the check for every Record a destination is given.
func encodable(r Record, msg amqp.Publishing, frameSize int) error {
	for _, f := range []struct{ what, s string }{
		{"exchange", r.Exchange}, {"routing key", r.RoutingKey},
		{"content type", msg.ContentType}, {"message id", msg.MessageId},
	} {
		if len(f.s) > maxShortString {
			return fmt.Errorf("%s of %d bytes: AMQP allows %d", f.what, len(f.s), maxShortString)
		}
	}
	for _, k := range routingHeaders {
		if v, ok := msg.Headers[k]; ok {
			if _, array := v.([]any); !array {
				return fmt.Errorf("header %q of type %T: RabbitMQ reads %s as sender-selected routing and refuses any value but an array (406 unacceptable_type_in_header)", k, v, k)
			}
		}
	}
	if len(msg.Headers) > rowcodec.MaxElements {
		return fmt.Errorf("%d headers with the ids (and a keyed record's aggregateId and seq): AMQP clients read at most %d", len(msg.Headers), rowcodec.MaxElements)
	}
	// The properties travel in one frame: the fixed fields, the two short
	// strings, and the headers table, each header as its name and its
	// value as amqp091-go writes it.
	size := 64 + len(msg.ContentType) + len(msg.MessageId)
	for k, v := range msg.Headers {
		if len(k) > maxShortString {
			return fmt.Errorf("header name of %d bytes (%.20q…): AMQP allows %d", len(k), k, maxShortString)
		}
		n, err := fieldSize(v, 1)
		if err != nil {
			return fmt.Errorf("header %q: %w", k, err)
		}
		size += 1 + len(k) + n
	}
	if frameSize > 0 && size > frameSize {
		return fmt.Errorf("headers of about %d bytes do not fit the broker's frame of %d bytes", size, frameSize)
	}
	return nil
}

// fieldSize is how many bytes amqp091-go writes for v as a field value, its
// type octet included (writeField in its write.go), or an error for what it
// cannot write or its reader refuses. depth is the nesting of v if it is an
// array or a table: 1 for a header's own value.
func fieldSize(v any, depth int) (int, error) {
	switch v := v.(type) {
	case nil:
		return 1, nil
	case bool, byte, int8:
		return 2, nil
	case int16, uint16:
		return 3, nil
	case int32, uint32, float32:
		return 5, nil
	case amqp.Decimal:
		return 6, nil
	case int64, float64, time.Time:
		return 9, nil
	case string:
		return 5 + len(v), nil
	case []byte:
		return 5 + len(v), nil
	case []any:
		if err := containerReadable(len(v), depth); err != nil {
			return 0, err
		}
		size := 5
		for _, e := range v {
			n, err := fieldSize(e, depth+1)
			if err != nil {
				return 0, err
			}
			size += n
		}
		return size, nil
	case amqp.Table:
		if err := containerReadable(len(v), depth); err != nil {
			return 0, err
		}
		size := 5
		for k, e := range v {
			if len(k) > maxShortString {
				return 0, fmt.Errorf("nested key of %d bytes (%.20q…): AMQP allows %d", len(k), k, maxShortString)
			}
			n, err := fieldSize(e, depth+1)
			if err != nil {
				return 0, err
			}
			size += 1 + len(k) + n
		}
		return size, nil
	}
	return 0, fmt.Errorf("a value of type %T, which AMQP has no field type for", v)
}

// containerReadable refuses an array or table amqp091-go's reader would
// refuse, closing the consumer's connection over it.
func containerReadable(n, depth int) error {
	if depth > rowcodec.MaxDepth {
		return fmt.Errorf("arrays and tables nested %d deep: AMQP clients read at most %d", depth, rowcodec.MaxDepth)
	}
	if n > rowcodec.MaxElements {
		return fmt.Errorf("%d elements in an array or table: AMQP clients read at most %d", n, rowcodec.MaxElements)
	}
	return nil
}

// publishing is the AMQP message of r: its headers, then the ids, and a
// keyed record's key and number, which win over row headers of the same
// names (the columns are what the relay ordered by).
func publishing(r Record) amqp.Publishing {
	headers := make(amqp.Table, len(r.Headers)+4)
	for k, v := range r.Headers {
		headers[k] = fieldValue(v)
	}
	headers[HeaderMessageID] = r.ID
	headers[HeaderWatermillUUID] = r.ID
	if r.AggregateID != "" {
		headers[HeaderAggregateID] = r.AggregateID
		headers[HeaderSeq] = r.Seq // int64: an AMQP long ('l'), as the reference design's consumers read it
	}
	return amqp.Publishing{
		Headers:      headers,
		ContentType:  r.ContentType,
		DeliveryMode: amqp.Persistent,
		MessageId:    r.ID,
		Timestamp:    r.CreatedAt,
		Body:         r.Body,
	}
}

// fieldValue is a header value as amqp091-go writes it: an object becomes a
// nested amqp.Table (it has no field type for a map[string]any, and would
// refuse the message), the elements of an array likewise (in a copy: the
// record is sent again after a failure), an int an int64 (it would write an
// int in 32 bits). Every other value goes as it is.
func fieldValue(v any) any {
	switch v := v.(type) {
	case map[string]any:
		t := make(amqp.Table, len(v))
		for k, e := range v {
			t[k] = fieldValue(e)
		}
		return t
	case []any:
		a := make([]any, len(v))
		for i, e := range v {
			a[i] = fieldValue(e)
		}
		return a
	case int:
		return int64(v)
	}
	return v
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

// fillNotSent sets every result from i on to ErrNotSent, and the i-th to
// first if it is not nil.
func fillNotSent(results []error, i int, first error) {
	for j := i; j < len(results); j++ {
		results[j] = ErrNotSent
	}
	if first != nil && i < len(results) {
		results[i] = first
	}
}
