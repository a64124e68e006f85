package outboxctl

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// pausedPipe is a stdout whose reader has paused (| less on a payload over
// the 64 KiB pipe buffer, a terminal under Ctrl-S): Write blocks until
// released.
type pausedPipe struct {
	once    sync.Once
	entered chan struct{}
	release chan struct{}
	mu      sync.Mutex
	buf     strings.Builder
}

func (p *pausedPipe) Write(b []byte) (int, error) {
	p.once.Do(func() { close(p.entered) })
	<-p.release
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.buf.Write(b)
}

// skip-held prints the message before it skips it, and printed it inside
// the skip's transaction: while the print blocked, the key's row stayed
// locked (on MySQL its neighbours' too, on SQLite every write to the
// database), and the service's deliveries waited for the pipe. The print
// runs with no transaction open now: a delivery of the key, and another
// write, go through while the pipe is paused.
func TestSkipHeld_StdoutPaused_DeliveriesOfTheKeyGoOn(t *testing.T) {
	eachKind(t, func(t *testing.T, kind string) {
		db := migrated(t, kind)
		holdNext(t, db, kind, "order-7", 1, "poison", "utf-8", `{"aggregateId":"order-7","seq":"2"}`)

		p := &pausedPipe{entered: make(chan struct{}), release: make(chan struct{})}
		released := sync.OnceFunc(func() { close(p.release) })
		defer released()
		done := make(chan int, 1)
		var stderr strings.Builder
		go func() {
			done <- Run(context.Background(), []string{"skip-held", "--db", db.DSN, "--consumer", "billing", "--key", "order-7", "--seq", "2", "--json"},
				func(string) string { return "" }, p, &stderr)
		}()
		<-p.entered

		in, err := outbox.NewInbox(db.DB, outbox.InboxConfig{ConsumerName: "billing", Ordered: true})
		if err != nil {
			t.Fatal(err)
		}
		// 2 is a poison message: its handler fails, and 3 is held behind it.
		h := in.Middleware(func(m *message.Message) ([]*message.Message, error) {
			if m.UUID == "order-7/2" {
				return nil, errors.New("poison")
			}
			return nil, nil
		})
		delivered := make(chan error, 1)
		go func() {
			m := message.NewMessage("order-7-3-"+testdb.RandomName(), []byte("{}"))
			m.Metadata.Set(outbox.HeaderAggregateID, "order-7")
			m.Metadata.Set(outbox.HeaderSeq, "3")
			_, err := h(m)
			delivered <- err
		}()
		select {
		case <-delivered: // held behind 2
		case <-time.After(20 * time.Second):
			t.Errorf("the delivery of the key waited 20 s on skip-held's paused stdout")
		}
		released()
		if code := <-done; code != 0 {
			t.Errorf("skip-held: exit %d, want 0; stderr: %s", code, stderr.String())
		}
		if n := count(t, db, "SELECT COUNT(*) FROM acemq_inbox_sequences WHERE consumer_name = 'billing' AND aggregate_id = 'order-7' AND last_seq = 2"); n != 1 {
			t.Errorf("after the skip of 2 the key's last applied is not 2")
		}
	})
}
