package outbox_test

import (
	"context"
	"errors"
	"math"
	"sync"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// refusingPublisher is a Watermill publisher that refuses the message of
// id bad with the error text reason and takes every other one, counting
// how many times it took each.
type refusingPublisher struct {
	mu     sync.Mutex
	bad    string
	reason string
	took   map[string]int
}

func newRefusingPublisher(bad, reason string) *refusingPublisher {
	return &refusingPublisher{bad: bad, reason: reason, took: map[string]int{}}
}

func (p *refusingPublisher) Publish(_ string, msgs ...*message.Message) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, m := range msgs {
		if m.UUID == p.bad {
			return errors.New(p.reason)
		}
		p.took[m.UUID]++
	}
	return nil
}

func (p *refusingPublisher) Close() error { return nil }

func (p *refusingPublisher) sent(id string) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.took[id]
}

// attempts is a 32-bit column on PostgreSQL and MySQL: a MaxAttempts above
// it (math.MaxInt for "never give up") made every claim fail on
// PostgreSQL, and on MySQL the mark of a record failed for good, which
// undid the marks of the records published beside it.
func TestMaxAttempts_AboveTheAttemptsColumn_ConfigError(t *testing.T) {
	db := testdb.New(t, testdb.SQLite)
	dest := outbox.NewPublisherDestination(gochannel.NewGoChannel(gochannel.Config{}, nil), nil)
	for _, n := range []int{math.MaxInt32 + 1, math.MaxInt} {
		_, err := outbox.NewForwarder(db.DB, dest, outbox.ForwarderConfig{MaxAttempts: n})
		var cerr *outbox.ConfigError
		if !errors.As(err, &cerr) || cerr.Field != "MaxAttempts" {
			t.Errorf("NewForwarder with MaxAttempts %d: err = %v, want a *ConfigError naming MaxAttempts", n, err)
		}
		_, err = outbox.NewStore(db.DB, outbox.StoreConfig{MaxAttempts: n})
		if !errors.As(err, &cerr) || cerr.Field != "MaxAttempts" {
			t.Errorf("NewStore with MaxAttempts %d: err = %v, want a *ConfigError naming MaxAttempts", n, err)
		}
	}
}

// At the largest MaxAttempts taken, a record that can never be published
// is stuck with attempts at it, and the record beside it is marked
// published once.
func TestMaxAttempts_AtTheAttemptsColumnsLimit_MalformedRowStuckGoodOneMarked(t *testing.T) {
	eachMigrated(t, func(t *testing.T, db *testdb.DB, d outbox.Dialect) {
		ids := publishN(t, db, "", "orders", 1)
		insertRaw(t, db, "bad-headers", "", "orders", "[1]", "utf-8")
		pub := newRefusingPublisher("", "")
		f, err := outbox.NewForwarder(db.DB, outbox.NewPublisherDestination(pub, nil), outbox.ForwarderConfig{Dialect: d, MaxAttempts: math.MaxInt32})
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		for i := 0; i < 3; i++ {
			_, err := f.Sweep(context.Background()) // the malformed row's error
			t.Logf("sweep %d: %.200v", i, err)
		}
		if n := pub.sent(ids[0]); n != 1 || !stateOf(t, db, ids[0]).Published {
			t.Errorf("good record sent %d times, published %v; want once, marked", n, stateOf(t, db, ids[0]).Published)
		}
		if st := stateOf(t, db, "bad-headers"); st.Attempts != math.MaxInt32 || st.Published {
			t.Errorf("malformed row: %+v; want stuck at attempts %d", st, math.MaxInt32)
		}
	})
}
