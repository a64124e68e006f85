package outbox_test

import (
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// skewed is a clock off the real one by d.
func skewed(d time.Duration) func() time.Time { return func() time.Time { return time.Now().Add(d) } }

// Two processes of one at-most-once consumer, their hosts' clocks 40 s
// apart (the copy's ahead): a copy delivered while the first handler runs
// waits for it, and runs once that handler failed and took its key back.
// Before, the copy compared the first process's "running until" stamp
// with its own clock, took the key for done, and acked the message as a
// duplicate: the handler ran once, failed, and the message was lost.
// SQLite's processes share one host, and one clock.
func TestInbox_AtMostOnce_CopyOnAHostWhoseClockIsAhead_WaitsAndRunsOnceTheKeyIsTakenBack(t *testing.T) {
	t.Parallel()
	for _, kind := range []string{testdb.Postgres, testdb.MySQL} {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			db := migrated(t, kind)
			var ran atomic.Int32
			started, release := make(chan struct{}), make(chan struct{})
			h := func(*message.Message) ([]*message.Message, error) {
				if ran.Add(1) == 1 {
					close(started)
					<-release
					return nil, errors.New("SMTP down: not sent")
				}
				return nil, nil
			}
			behind := newInbox(t, db, outbox.InboxConfig{AtMostOnce: true})
			outbox.SetInboxClock(behind, skewed(-40*time.Second))
			ahead := newInbox(t, db, outbox.InboxConfig{AtMostOnce: true})
			msg := message.NewMessage(watermill.NewUUID(), []byte("x"))
			first := make(chan error, 1)
			go func() { _, err := behind.Middleware(h)(msg.Copy()); first <- err }()
			<-started
			second := make(chan error, 1)
			go func() { _, err := ahead.Middleware(h)(msg.Copy()); second <- err }()
			select {
			case err := <-second:
				t.Fatalf("the copy returned (%v; nil: acked as a duplicate) while the first handler still ran", err)
			case <-time.After(time.Second):
			}
			close(release)
			if err := <-first; err == nil {
				t.Fatal("the first delivery: want its handler's failure")
			}
			if err := <-second; err != nil {
				t.Fatalf("the copy: %v", err)
			}
			if got := ran.Load(); got != 2 {
				t.Errorf("handler ran %d times; want 2: the copy runs once the first took its key back", got)
			}
		})
	}
}

// The other way round: a key stamped done by a process whose clock is 40 s
// ahead is done for a copy on a host behind it at once, not running until
// the other's clock comes round (a copy waited, holding its delivery, for
// as long as the clocks were apart).
func TestInbox_AtMostOnce_KeyDoneOnAHostAhead_CopyBehindIsADuplicateAtOnce(t *testing.T) {
	t.Parallel()
	for _, kind := range []string{testdb.Postgres, testdb.MySQL} {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			db := migrated(t, kind)
			var ran atomic.Int32
			h := func(*message.Message) ([]*message.Message, error) { ran.Add(1); return nil, nil }
			ahead := newInbox(t, db, outbox.InboxConfig{AtMostOnce: true})
			outbox.SetInboxClock(ahead, skewed(40*time.Second))
			behind := newInbox(t, db, outbox.InboxConfig{AtMostOnce: true})
			msg := message.NewMessage(watermill.NewUUID(), []byte("x"))
			if _, err := ahead.Middleware(h)(msg.Copy()); err != nil {
				t.Fatal(err)
			}
			start := time.Now()
			if _, err := behind.Middleware(h)(msg.Copy()); err != nil {
				t.Fatal(err)
			}
			if took := time.Since(start); took > 5*time.Second {
				t.Errorf("the copy waited %s for a key done already", took.Round(time.Millisecond))
			}
			if got := ran.Load(); got != 1 {
				t.Errorf("handler ran %d times, want 1", got)
			}
		})
	}
}
