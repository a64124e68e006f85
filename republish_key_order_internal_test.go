package outbox

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/acemq/watermill-outbox/internal/testdb"
)

// republishHook serialises the tests that set republishBatched.
var republishHook sync.Mutex

// A key's records made pending by a Republish never leave a later one
// pending and an earlier one published, at any point a relay's claim
// could come: the walk goes by published_at, and a key's earlier record
// can have the later one (an earlier boot or a resend sent it again), or
// an equal one split at a batch's end. Made pending batch by batch in the
// walk's order, seq 2 was pending alone between two batches, and a relay
// claiming then sent it before seq 1 (a review). Here 30 keys of 5
// records each, published in a shuffled order among unkeyed records, in
// batches of 10; after every update of the walk, each key's pending
// records are its first ones.
func TestRepublish_KeysRecordsMadePendingInSeqOrder_AtEveryUpdate(t *testing.T) {
	republishHook.Lock()
	defer republishHook.Unlock()
	for _, c := range []struct {
		kind string
		d    Dialect
	}{{testdb.Postgres, Postgres}, {testdb.MySQL, MySQL}, {testdb.SQLite, SQLite}} {
		t.Run(c.kind, func(t *testing.T) {
			db := testdb.New(t, c.kind)
			ctx := context.Background()
			if err := Migrate(ctx, db.DB.DB, c.d); err != nil {
				t.Fatal(err)
			}
			const keys, perKey, unkeyed = 30, 5, 60
			var msgs []*message.Message
			for k := range keys {
				for range perKey {
					m := message.NewMessage(watermill.NewUUID(), []byte("x"))
					m.Metadata.Set(MetadataAggregateID, fmt.Sprintf("key-%02d", k))
					msgs = append(msgs, m)
				}
			}
			for range unkeyed {
				msgs = append(msgs, message.NewMessage(watermill.NewUUID(), []byte("x")))
			}
			// Published in a shuffled order, an hour ago and before, a
			// few at the same instant: a key's later record is often
			// published first.
			place := rand.New(rand.NewPCG(1, 2)).Perm(len(msgs))
			base := time.Now().UTC().Add(-time.Hour).Truncate(time.Second)
			publishAt(t, db, c.d, msgs, func(i int) time.Time { return base.Add(-time.Duration(place[i]/3) * time.Second) })

			r, err := NewRepublisher(db.DB, RepublisherConfig{Dialect: c.d, TrackedTopics: NewTrackedTopics("rk"), Grace: time.Minute})
			if err != nil {
				t.Fatal(err)
			}
			r.store.cfg.PurgeBatch = 10
			checks := 0
			pending := db.Rebind("SELECT aggregate_id, seq FROM acemq_outbox WHERE aggregate_id IS NOT NULL AND published_at IS NULL")
			republishBatched = func() {
				checks++
				rows, err := db.Query(pending)
				if err != nil {
					t.Error(err)
					return
				}
				defer rows.Close()
				seqs := map[string][]int64{}
				for rows.Next() {
					var (
						key []byte
						seq int64
					)
					if err := rows.Scan(&key, &seq); err != nil {
						t.Error(err)
						return
					}
					seqs[string(key)] = append(seqs[string(key)], seq)
				}
				for key, s := range seqs {
					slices.Sort(s)
					if s[len(s)-1] != int64(len(s)) {
						t.Errorf("after update %d key %s has seqs %v pending, the ones before published: a relay would send the later first", checks, key, s)
					}
				}
			}
			defer func() { republishBatched = nil }()
			n, err := r.Republish(ctx)
			if err != nil || n != keys*perKey+unkeyed {
				t.Fatalf("Republish made %d pending (%v); want %d", n, err, keys*perKey+unkeyed)
			}
			if checks < (keys*perKey+unkeyed)/10 {
				t.Errorf("checked after %d updates; want one after each batch", checks)
			}
			var left int
			if err := db.Get(&left, "SELECT COUNT(*) FROM acemq_outbox WHERE published_at IS NOT NULL"); err != nil || left != 0 {
				t.Errorf("%d records still published (%v); want none", left, err)
			}
		})
	}
}

// A Republish cut short (its Timeout, here its ctx cancelled after the
// first batch) still makes pending the keyed records its walk had found,
// within a bound of its own, as the unkeyed ones of the batches before
// are: held for the walk's end, they would wait for a boot whose walk
// ends in time.
func TestRepublish_CutShort_KeyedRecordsFoundMadePending(t *testing.T) {
	republishHook.Lock()
	defer republishHook.Unlock()
	for _, c := range []struct {
		kind string
		d    Dialect
	}{{testdb.Postgres, Postgres}, {testdb.SQLite, SQLite}} {
		t.Run(c.kind, func(t *testing.T) {
			db := testdb.New(t, c.kind)
			ctx := context.Background()
			if err := Migrate(ctx, db.DB.DB, c.d); err != nil {
				t.Fatal(err)
			}
			var msgs []*message.Message
			for i := range 30 {
				m := message.NewMessage(watermill.NewUUID(), []byte("x"))
				m.Metadata.Set(MetadataAggregateID, fmt.Sprintf("key-%d", i%3))
				msgs = append(msgs, m)
			}
			base := time.Now().UTC().Add(-time.Hour)
			publishAt(t, db, c.d, msgs, func(i int) time.Time { return base.Add(time.Duration(i) * time.Second) })
			r, err := NewRepublisher(db.DB, RepublisherConfig{Dialect: c.d, TrackedTopics: NewTrackedTopics("rk"), Grace: time.Minute})
			if err != nil {
				t.Fatal(err)
			}
			r.store.cfg.PurgeBatch = 10
			cut, cancel := context.WithCancel(ctx)
			defer cancel()
			republishBatched = cancel // after the first batch's walk
			defer func() { republishBatched = nil }()
			n, err := r.Republish(cut)
			if err == nil {
				t.Fatal("Republish cut short returned no error")
			}
			var pending int
			if err := db.Get(&pending, "SELECT COUNT(*) FROM acemq_outbox WHERE published_at IS NULL"); err != nil {
				t.Fatal(err)
			}
			if n != 10 || pending != 10 {
				t.Errorf("cut short after the first batch: %d made pending, %d pending; want the batch's 10 (%v)", n, pending, err)
			}
		})
	}
}

// publishAt commits msgs on the topic rk and marks each msgs[i] published
// at at(i).
func publishAt(t *testing.T, db *testdb.DB, d Dialect, msgs []*message.Message, at func(i int) time.Time) {
	t.Helper()
	ctx := context.Background()
	tx, err := db.DB.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback() }()
	pub, err := NewTxPublisher(tx, TxPublisherConfig{Dialect: d})
	if err != nil {
		t.Fatal(err)
	}
	if err := pub.Publish("rk", msgs...); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	set := db.Rebind("UPDATE acemq_outbox SET published_at = ? WHERE id = ?")
	for i, m := range msgs {
		if _, err := db.Exec(set, d.sql().TimeArg(at(i)), m.UUID); err != nil {
			t.Fatal(err)
		}
	}
}
