package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strings"
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
	t.Parallel()
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

// A destination's error text that last_error cannot store as it is (a NUL,
// which PostgreSQL refuses in text; bytes that are not UTF-8, which
// PostgreSQL and MySQL's utf8mb4 refuse) made the failure's mark fail,
// which rolled back the marks of the whole batch: the record the broker
// took went out again at every sweep, and the failing one was never
// charged an attempt. Now the text is stored with its NUL and bad bytes
// shown, and cut to the column's 1000 characters.
func TestMarkFailed_ErrorTextTheColumnRefuses_StoredShownAndRecordsBesideItMarked(t *testing.T) {
	for name, c := range map[string]struct{ reason, stored string }{
		"nul":         {"refused: key \x00 in payload", `refused: key \x00 in payload`},
		"invalidUTF8": {"refused: payload \xff\xfe", "refused: payload \uFFFD"},
		"long":        {"\x00" + strings.Repeat("é", 1200), `\x00` + strings.Repeat("é", 993) + "..."},
	} {
		t.Run(name, func(t *testing.T) {
			eachMigrated(t, func(t *testing.T, db *testdb.DB, d outbox.Dialect) {
				ids := publishN(t, db, "", "orders", 2)
				pub := newRefusingPublisher(ids[1], c.reason)
				f, err := outbox.NewForwarder(db.DB, outbox.NewPublisherDestination(pub, nil), outbox.ForwarderConfig{Dialect: d})
				if err != nil {
					t.Fatal(err)
				}
				defer f.Close()
				for i := 0; i < 3; i++ {
					_, err := f.Sweep(context.Background()) // the refused record's error
					t.Logf("sweep %d: %.200q", i, fmt.Sprint(err))
				}
				if n, st := pub.sent(ids[0]), stateOf(t, db, ids[0]); n != 1 || !st.Published {
					t.Errorf("record before the refused one sent %d times, published %v; want once, marked", n, st.Published)
				}
				st := stateOf(t, db, ids[1])
				if st.Attempts != 3 || st.LastError != c.stored {
					t.Errorf("refused record: attempts %d, last_error %.80q; want 3, %.80q", st.Attempts, st.LastError, c.stored)
				}
			})
		})
	}
}

// A last_error another library created in a narrower character set (here
// MySQL's utf8mb3, which has no room for a character past the BMP) refuses
// a reason that is valid UTF-8: the failure is written again in ASCII
// rather than undoing the marks of the records published beside it.
func TestMarkFailed_MySQLLastErrorInUTF8mb3_ASCIIReasonAndRecordsBesideItMarked(t *testing.T) {
	db := migrated(t, testdb.MySQL)
	if _, err := db.Exec("ALTER TABLE acemq_outbox MODIFY last_error varchar(1000) CHARACTER SET utf8mb3 NULL"); err != nil {
		t.Fatal(err)
	}
	ids := publishN(t, db, "", "orders", 2)
	pub := newRefusingPublisher(ids[1], "refused: \U0001F6AB naïve")
	f, err := outbox.NewForwarder(db.DB, outbox.NewPublisherDestination(pub, nil), outbox.ForwarderConfig{Dialect: outbox.MySQL})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	for i := 0; i < 2; i++ {
		_, err := f.Sweep(context.Background())
		t.Logf("sweep %d: %.200v", i, err)
	}
	if n, st := pub.sent(ids[0]), stateOf(t, db, ids[0]); n != 1 || !st.Published {
		t.Errorf("record before the refused one sent %d times, published %v; want once, marked", n, st.Published)
	}
	if st, want := stateOf(t, db, ids[1]), `refused: \U0001F6AB na\u00EFve`; st.Attempts != 2 || st.LastError != want {
		t.Errorf("refused record: attempts %d, last_error %q; want 2, %q", st.Attempts, st.LastError, want)
	}
}
