package testamqp

import (
	"encoding/binary"
	"io"
	"net"
	"net/url"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/acemq/watermill-outbox/internal/testdb"
)

// Proxy stands between a client and the test broker, and can stop reading
// what the client sends while still passing on what the broker sends
// (heartbeats included): what a client sees of a broker under a memory
// alarm, which stops reading from publishing connections and answers
// nothing, without raising an alarm on the shared broker.
type Proxy struct {
	t      testing.TB
	broker string // host:port

	mu      sync.Mutex
	stalled chan struct{} // nil while the proxy passes everything on
	alarm   *alarm        // nil while no alarm is raised
	conns   []net.Conn
	dialed  int
	closed  bool

	loseConfirms atomic.Bool  // drop the broker's basic.ack frames
	blackhole    atomic.Bool  // drop every frame, both ways
	bodies       atomic.Int64 // content body frames read from the clients
}

// alarm is a memory alarm the proxy plays (see Alarm).
type alarm struct {
	reason  string
	cleared chan struct{}
	blocked int // connections blocked under it
}

// NewProxy returns a proxy to the test broker, closed when the test ends.
func NewProxy(t testing.TB) *Proxy {
	t.Helper()
	u, err := url.Parse(testdb.AMQPURL())
	if err != nil {
		t.Fatalf("testamqp: broker URL: %v", err)
	}
	p := &Proxy{t: t, broker: u.Host}
	t.Cleanup(p.close)
	return p
}

// Dial is an amqp.Config Dial that connects through the proxy, whatever
// address it is given.
func (p *Proxy) Dial(network, _ string) (net.Conn, error) {
	client, proxySide := net.Pipe()
	upstream, err := net.DialTimeout(network, p.broker, 10*time.Second)
	if err != nil {
		return nil, err
	}
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		_ = upstream.Close()
		return nil, net.ErrClosed
	}
	p.conns = append(p.conns, proxySide, upstream)
	p.dialed++
	p.mu.Unlock()
	toClient := &frameWriter{w: proxySide}
	go p.fromClient(proxySide, upstream, toClient)
	go func() {
		defer proxySide.Close()
		for {
			frame, err := readFrame(upstream)
			if err != nil {
				return
			}
			if p.blackhole.Load() || p.loseConfirms.Load() && isAck(frame) {
				continue
			}
			if toClient.write(frame) != nil {
				return
			}
		}
	}()
	return client, nil
}

// frameWriter writes whole frames to the client, so that the proxy's own
// (connection.blocked, unblocked) go between the broker's, never inside one.
type frameWriter struct {
	mu sync.Mutex
	w  io.Writer
}

func (f *frameWriter) write(frame []byte) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	_, err := f.w.Write(frame)
	return err
}

// readFrame reads one AMQP frame: type, channel, size, payload, frame end.
func readFrame(r io.Reader) ([]byte, error) {
	head := make([]byte, 7)
	if _, err := io.ReadFull(r, head); err != nil {
		return nil, err
	}
	frame := make([]byte, 7+int(binary.BigEndian.Uint32(head[3:7]))+1)
	copy(frame, head)
	_, err := io.ReadFull(r, frame[7:])
	return frame, err
}

// connectionFrame is a method frame of class connection on channel 0.
func connectionFrame(method uint16, args []byte) []byte {
	payload := binary.BigEndian.AppendUint16(binary.BigEndian.AppendUint16(nil, 10), method)
	payload = append(payload, args...)
	frame := []byte{1, 0, 0}
	frame = binary.BigEndian.AppendUint32(frame, uint32(len(payload)))
	return append(append(frame, payload...), 0xCE)
}

// isPublish reports whether frame is basic.publish.
func isAck(frame []byte) bool {
	return frame[0] == 1 && len(frame) >= 11 && binary.BigEndian.Uint16(frame[7:9]) == 60 && binary.BigEndian.Uint16(frame[9:11]) == 80
}

func isPublish(frame []byte) bool {
	return frame[0] == 1 && len(frame) >= 12 && binary.BigEndian.Uint16(frame[7:9]) == 60 && binary.BigEndian.Uint16(frame[9:11]) == 40
}

// fromClient passes the client's frames on, and reads nothing while
// stalled; under an alarm it blocks the connection at its first publish.
func (p *Proxy) fromClient(client, upstream net.Conn, toClient *frameWriter) {
	defer upstream.Close()
	p.waitWhileStalled()
	header := make([]byte, 8) // "AMQP" 0 0 9 1
	if _, err := io.ReadFull(client, header); err != nil {
		return
	}
	if _, err := upstream.Write(header); err != nil {
		return
	}
	for {
		p.waitWhileStalled()
		frame, err := readFrame(client)
		if err != nil {
			return
		}
		if frame[0] == 3 {
			p.bodies.Add(1)
		}
		p.mu.Lock()
		a := p.alarm
		if a != nil && isPublish(frame) {
			a.blocked++
		}
		p.mu.Unlock()
		if a != nil && isPublish(frame) {
			// As RabbitMQ: connection.blocked, then nothing read until the
			// alarm clears.
			if toClient.write(connectionFrame(60, append([]byte{byte(len(a.reason))}, a.reason...))) != nil {
				return
			}
			<-a.cleared
			if toClient.write(connectionFrame(61, nil)) != nil {
				return
			}
		}
		if p.blackhole.Load() {
			continue
		}
		if _, err := upstream.Write(frame); err != nil {
			return
		}
	}
}

// LoseConfirms drops (on) or passes (off) the broker's basic.ack frames:
// the broker has the messages, and its confirms never reach the client (a
// quorum queue without its majority, a one-way partition).
func (p *Proxy) LoseConfirms(on bool) { p.loseConfirms.Store(on) }

// Blackhole drops (on) or passes (off) every frame both ways on the
// connections open and to come: a partition the kernel does not see,
// where connections stay open and nothing answers.
func (p *Proxy) Blackhole(on bool) { p.blackhole.Store(on) }

// Bodies is how many content body frames the clients sent through the
// proxy, passed on or dropped: the last frame of a publish whose body is
// not empty (and under the frame size), so that a client has written
// every publish of a batch once Bodies has grown by its size.
func (p *Proxy) Bodies() int64 { return p.bodies.Load() }

// DropConns closes every connection open through the proxy, both sides, as
// a broker that went away would; connections dialed after it are passed
// on as before.
func (p *Proxy) DropConns() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, c := range p.conns {
		_ = c.Close()
	}
	p.conns = nil
}

// Dialed is how many connections were made through the proxy.
func (p *Proxy) Dialed() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.dialed
}

// waitWhileStalled returns once the proxy is not stalled.
func (p *Proxy) waitWhileStalled() {
	for {
		p.mu.Lock()
		stalled := p.stalled
		p.mu.Unlock()
		if stalled == nil {
			return
		}
		<-stalled
	}
}

// Alarm plays a memory alarm of the broker: connections open and work as
// before until they publish; at its first basic.publish a connection gets
// connection.blocked, and nothing more it sends is read until ClearAlarm.
// reason is at most 255 bytes.
func (p *Proxy) Alarm(reason string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.alarm == nil {
		p.alarm = &alarm{reason: reason, cleared: make(chan struct{})}
	}
}

// ClearAlarm ends the alarm: blocked connections get connection.unblocked
// and are read again.
func (p *Proxy) ClearAlarm() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.alarm != nil {
		close(p.alarm.cleared)
		p.alarm = nil
	}
}

// Blocked is how many connections the current alarm has blocked.
func (p *Proxy) Blocked() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.alarm == nil {
		return 0
	}
	return p.alarm.blocked
}

// Stall stops reading from the clients (from their next read on).
func (p *Proxy) Stall() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.stalled == nil {
		p.stalled = make(chan struct{})
	}
}

// Resume reads from the clients again.
func (p *Proxy) Resume() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.stalled != nil {
		close(p.stalled)
		p.stalled = nil
	}
}

func (p *Proxy) close() {
	p.Resume()
	p.ClearAlarm()
	p.mu.Lock()
	defer p.mu.Unlock()
	p.closed = true
	for _, c := range p.conns {
		_ = c.Close()
	}
}
