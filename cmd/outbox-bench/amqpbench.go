package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// Flags of the scenarios that talk to RabbitMQ (relay, latency). They live
// here rather than in main.go because only these scenarios read them.
var (
	amqpURL = flag.String("amqp", testdb.AMQPURL(), "relay, latency: RabbitMQ URL; the bench declares, purges and deletes a queue of its own in it")
	// 0 keeps the library's defaults, so that the numbers are those a user
	// gets without tuning.
	relayBatch  = flag.Int("batch", 0, "relay, latency: ForwarderConfig.BatchSize (0 = the library's default)")
	relayMax    = flag.Int("max-batch", 0, "relay, latency: ForwarderConfig.MaxBatchSize, what a drain's claims grow to (0 = the library's default; -batch's value keeps every claim at -batch)")
	relayWindow = flag.Int("window", 0, "relay, latency: AMQPConfig.Window (0 = the library's default)")
)

// benchQueue is a durable queue of the bench's own, on the default exchange,
// so that a row whose routing key is the queue's name (TxPublisher's default
// for topic = queue name) lands in it. It is deleted by close.
//
// Its connection is opened again when something closes it: other processes
// on a shared machine (the library's own tests) run `rabbitmqctl
// close_all_connections`, which also closes the relay's connection and
// disturbs a measurement. drops counts those closes, so that a scenario can
// tell a disturbed run and run it again (see undisturbed).
type benchQueue struct {
	name  string
	url   string // the broker node it is declared through; *amqpURL if ""
	conn  *amqp.Connection
	ch    *amqp.Channel // admin channel: count, purge, delete
	drops atomic.Int64
}

func openBenchQueue(prefix string) (*benchQueue, error) {
	return openBenchQueueAt(prefix, "", nil)
}

// openBenchQueueAt declares the queue through the node at url (*amqpURL if
// "") with args ({"x-queue-type": "quorum"}, say).
func openBenchQueueAt(prefix, url string, args amqp.Table) (*benchQueue, error) {
	q := &benchQueue{name: "outbox-bench-" + prefix + "-" + testdb.RandomName(), url: url}
	if err := q.reopen(); err != nil {
		return nil, err
	}
	if _, err := q.ch.QueueDeclare(q.name, true, false, false, false, args); err != nil {
		_ = q.conn.Close()
		return nil, fmt.Errorf("declaring queue %s: %w", q.name, err)
	}
	return q, nil
}

// dial opens a connection whose loss from outside counts in drops.
func (q *benchQueue) dial(name string) (*amqp.Connection, error) {
	conn, err := amqp.DialConfig(q.brokerURL(), amqp.Config{
		Dial:       amqp.DefaultDial(10 * time.Second),
		Properties: amqp.Table{"connection_name": "outbox-bench " + name},
	})
	if err != nil {
		return nil, fmt.Errorf("rabbitmq at %s: %w", redactURL(q.brokerURL()), err)
	}
	closed := conn.NotifyClose(make(chan *amqp.Error, 1))
	go func() {
		if e, ok := <-closed; ok && e != nil {
			q.drops.Add(1)
		}
	}()
	return conn, nil
}

// brokerURL is the URL of the node the queue is declared through.
func (q *benchQueue) brokerURL() string {
	if q.url != "" {
		return q.url
	}
	return *amqpURL
}

// reopen makes sure the connection and the admin channel are open.
func (q *benchQueue) reopen() error {
	if q.conn == nil || q.conn.IsClosed() {
		conn, err := q.dial(q.name)
		if err != nil {
			return err
		}
		q.conn, q.ch = conn, nil
	}
	if q.ch != nil && !q.ch.IsClosed() {
		return nil
	}
	ch, err := q.conn.Channel()
	if err != nil {
		return fmt.Errorf("opening a channel: %w", err)
	}
	q.ch = ch
	return nil
}

// undisturbed runs fn, and runs it again (three tries in all) when a
// connection was closed from outside while it ran: its figures, or its
// failure, are then those of the disturbance.
func (q *benchQueue) undisturbed(what string, fn func() error) error {
	for try := 1; ; try++ {
		before := q.drops.Load()
		err := fn()
		if q.drops.Load() == before && q.conn != nil && !q.conn.IsClosed() {
			return err
		}
		if try == 3 {
			return fmt.Errorf("%s: a connection was closed from outside in each of 3 tries (last error: %v)", what, err)
		}
		note("%s: a RabbitMQ connection was closed from outside during the run (error: %v); running it again", what, err)
		time.Sleep(500 * time.Millisecond)
	}
}

// count is the number of messages ready in the queue.
func (q *benchQueue) count() (int, error) {
	if err := q.reopen(); err != nil {
		return 0, err
	}
	st, err := q.ch.QueueDeclarePassive(q.name, true, false, false, false, nil)
	if err != nil {
		return 0, fmt.Errorf("counting queue %s: %w", q.name, err)
	}
	return st.Messages, nil
}

// waitCount waits until the queue holds want messages, or within has passed,
// and returns what it holds then. Confirmed messages are counted at once on
// a classic queue; the wait is only a guard.
func (q *benchQueue) waitCount(ctx context.Context, want int, within time.Duration) (int, error) {
	deadline := time.Now().Add(within)
	for {
		n, err := q.count()
		if err != nil || n == want || time.Now().After(deadline) {
			return n, err
		}
		select {
		case <-ctx.Done():
			return n, ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
}

func (q *benchQueue) purge() error {
	if err := q.reopen(); err != nil {
		return err
	}
	if _, err := q.ch.QueuePurge(q.name, false); err != nil {
		return fmt.Errorf("purging queue %s: %w", q.name, err)
	}
	return nil
}

// close deletes the queue and closes the connection.
func (q *benchQueue) close() error {
	var errs []error
	if err := q.reopen(); err != nil {
		errs = append(errs, err)
	} else if _, err := q.ch.QueueDelete(q.name, false, false, false); err != nil {
		errs = append(errs, fmt.Errorf("deleting queue %s: %w", q.name, err))
	}
	if q.conn != nil {
		if err := q.conn.Close(); err != nil && !errors.Is(err, amqp.ErrClosed) {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// rawPublish is the broker's ceiling for this client: it publishes one
// message per id to the queue on a confirm channel, keeping up to inflight
// unconfirmed, and returns when the broker has confirmed all of them. Each
// message carries what the relay's carries (persistent, mandatory,
// message_id, the two id headers, content type, timestamp), so the
// difference to the relay is the relay's own work, not a lighter message.
//
// With every > 0 it waits for all confirms after each every messages, as a
// relay that publishes a batch and waits for its confirms before the next
// does: what the broker gives that pattern, with no database at all.
//
// keyed adds the headers the relay sends with a keyed record, aggregateId
// and seq, numbered as relayFill numbers the keyed drain's rows.
func rawPublish(ctx context.Context, q *benchQueue, ids []string, payload []byte, inflight, every int, keyed bool) (time.Duration, error) {
	if err := q.reopen(); err != nil {
		return 0, err
	}
	ch, err := q.conn.Channel()
	if err != nil {
		return 0, fmt.Errorf("raw: open channel: %w", err)
	}
	var (
		returned int
		drained  sync.WaitGroup
	)
	// Closing the channel closes returns, which ends the goroutine below.
	defer func() {
		_ = ch.Close()
		drained.Wait()
	}()
	if err := ch.Confirm(false); err != nil {
		return 0, fmt.Errorf("raw: confirm mode: %w", err)
	}
	returns := ch.NotifyReturn(make(chan amqp.Return, 64))
	drained.Add(1)
	go func() {
		defer drained.Done()
		for range returns {
			returned++
		}
	}()

	now := time.Now()
	pending := make([]*amqp.DeferredConfirmation, 0, len(ids))
	head, nacked := 0, 0
	wait := func() error {
		ok, err := pending[head].WaitContext(ctx)
		if err != nil {
			return fmt.Errorf("raw: waiting for a confirm: %w", err)
		}
		if !ok {
			nacked++
		}
		pending[head] = nil
		head++
		return nil
	}
	start := time.Now()
	for i, id := range ids {
		for every > 0 && i > 0 && i%every == 0 && head < len(pending) {
			if err := wait(); err != nil {
				return 0, err
			}
		}
		if len(pending)-head >= inflight {
			if err := wait(); err != nil {
				return 0, err
			}
		}
		headers := amqp.Table{outbox.HeaderMessageID: id, outbox.HeaderWatermillUUID: id}
		if keyed {
			headers[outbox.HeaderAggregateID] = fmt.Sprintf("aggregate-%04d", i%relayKeys)
			headers[outbox.HeaderSeq] = int64(i/relayKeys + 1)
		}
		dc, err := ch.PublishWithDeferredConfirmWithContext(ctx, "", q.name, true, false, amqp.Publishing{
			Headers:      headers,
			ContentType:  outbox.DefaultContentType,
			DeliveryMode: amqp.Persistent,
			MessageId:    id,
			Timestamp:    now,
			Body:         payload,
		})
		if err != nil {
			return 0, fmt.Errorf("raw: publish: %w", err)
		}
		pending = append(pending, dc)
	}
	for head < len(pending) {
		if err := wait(); err != nil {
			return 0, err
		}
	}
	took := time.Since(start)
	_ = ch.Close()
	drained.Wait()
	if nacked > 0 || returned > 0 {
		return 0, fmt.Errorf("raw: %d messages nacked and %d returned by the broker", nacked, returned)
	}
	return took, nil
}

// benchPayload is size bytes of JSON-ish text, stored as utf-8 by the
// publisher, as most event payloads are.
func benchPayload(size int) []byte {
	head := `{"event":"outbox-bench","note":"`
	const tail = `"}`
	return []byte(head + strings.Repeat("x", size-len(head)-len(tail)) + tail)
}

func redactURL(u string) string {
	p, err := amqp.ParseURI(u)
	if err != nil {
		return "(unparsable URL)"
	}
	p.Password = "***"
	return p.String()
}

func rate(n int, d time.Duration) float64 { return float64(n) / d.Seconds() }

func mean(xs ...float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := 0.0
	for _, x := range xs {
		s += x
	}
	return s / float64(len(xs))
}

// cpuSample is the machine's CPU time from /proc/stat: busy and total
// jiffies over all cores. Zero where /proc/stat cannot be read.
type cpuSample struct{ busy, total uint64 }

func readCPU() cpuSample {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return cpuSample{}
	}
	line, _, _ := strings.Cut(string(b), "\n")
	fields := strings.Fields(line)
	if len(fields) < 5 || fields[0] != "cpu" {
		return cpuSample{}
	}
	var s cpuSample
	for i, f := range fields[1:] {
		v, err := strconv.ParseUint(f, 10, 64)
		if err != nil {
			return cpuSample{}
		}
		s.total += v
		if i != 3 && i != 4 { // idle, iowait
			s.busy += v
		}
	}
	return s
}

// busySince is the fraction of the machine's CPU (all cores) that was busy
// since s: near 1 means the run was CPU-bound, whoever used the CPU.
func (s cpuSample) busySince() float64 {
	now := readCPU()
	if now.total <= s.total {
		return 0
	}
	return float64(now.busy-s.busy) / float64(now.total-s.total)
}
