package outbox

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/acemq/watermill-outbox/internal/testdb"
)

// sentDest records what it is given, in order, and confirms every record.
type sentDest struct {
	mu   sync.Mutex
	recs []Record
}

func (d *sentDest) Publish(_ context.Context, recs []Record) []error {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.recs = append(d.recs, recs...)
	return make([]error, len(recs))
}

// On MySQL, aggregate_id's _bin collation ignores trailing spaces: "k" and
// "k " are one key to the sequences table, the unique (aggregate_id, seq)
// index and the relay's key-head probe (the README says so). A row another
// library's producer wrote as "k " takes "k"'s numbers. Sorted by key
// bytes first, Republish put ("k",1), ("k",3) before ("k ",2), and a relay
// claiming between the two updates sent seq 3 before seq 2: lower seqs go
// first, whatever the key's bytes.
func TestRepublish_MySQLKeysEqualToTheRelay_GoOutInSeqOrder(t *testing.T) {
	republishHook.Lock()
	defer republishHook.Unlock()
	db := testdb.New(t, testdb.MySQL)
	ctx := context.Background()
	if err := Migrate(ctx, db.DB.DB, MySQL); err != nil {
		t.Fatal(err)
	}
	var msgs []*message.Message
	for range 3 {
		m := message.NewMessage(watermill.NewUUID(), []byte("x"))
		m.Metadata.Set(MetadataAggregateID, "k")
		msgs = append(msgs, m)
	}
	base := time.Now().UTC().Add(-time.Hour).Truncate(time.Second)
	publishAt(t, db, MySQL, msgs, func(i int) time.Time { return base.Add(time.Duration(i) * time.Second) })
	// seq 2 as another library's producer wrote it: "k " (one key with "k" to MySQL).
	if _, err := db.Exec(db.Rebind("UPDATE acemq_outbox SET aggregate_id = 'k ' WHERE id = ?"), msgs[1].UUID); err != nil {
		t.Fatal(err)
	}

	dest := &sentDest{}
	f, err := NewForwarder(db.DB, dest, ForwarderConfig{Dialect: MySQL, OnError: func(error, ErrorContext) {}})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	r, err := NewRepublisher(db.DB, RepublisherConfig{Dialect: MySQL, TrackedTopics: NewTrackedTopics("rk"), Grace: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	r.store.cfg.PurgeBatch = 2
	// A relay that claims between every two updates of the Republish.
	sweepAll := func() {
		for range 10 {
			n, err := f.Sweep(ctx)
			if err != nil {
				t.Error(err)
			}
			if n == 0 {
				return
			}
		}
	}
	republishBatched = sweepAll
	defer func() { republishBatched = nil }()
	if n, err := r.Republish(ctx); err != nil || n != 3 {
		t.Fatalf("Republish made %d pending (%v); want 3", n, err)
	}
	republishBatched = nil
	sweepAll()
	var seqs []int64
	for _, rec := range dest.recs {
		if strings.TrimRight(rec.AggregateID, " ") == "k" {
			seqs = append(seqs, rec.Seq)
		}
	}
	if fmt.Sprint(seqs) != "[1 2 3]" {
		t.Errorf("the relay sent key k's records (one key to MySQL) in the order %v; want [1 2 3]", seqs)
	}
}

// The keyed records of a walk that ended on its own are made pending under
// a fresh 5 s context, whatever the caller's ctx allows: an update that
// waits for a row lock (a consumer's transaction marking the record, a
// resend) waits under the caller's ctx, as the unkeyed records' updates
// do: bounded at 5 s, an update that waited longer failed the Republish,
// and with it the plugin and the router, though the caller gave it a
// minute.
func TestRepublish_UpdateWaitingOnALock_BoundByCallersContext(t *testing.T) {
	republishHook.Lock()
	t.Cleanup(republishHook.Unlock) // after the parallel subtests
	for _, keyed := range []bool{false, true} {
		t.Run(fmt.Sprintf("keyed=%v", keyed), func(t *testing.T) {
			t.Parallel()
			db := testdb.New(t, testdb.Postgres)
			ctx := context.Background()
			if err := Migrate(ctx, db.DB.DB, Postgres); err != nil {
				t.Fatal(err)
			}
			var msgs []*message.Message
			for range 3 {
				m := message.NewMessage(watermill.NewUUID(), []byte("x"))
				if keyed {
					m.Metadata.Set(MetadataAggregateID, "k")
				}
				msgs = append(msgs, m)
			}
			base := time.Now().UTC().Add(-time.Hour)
			publishAt(t, db, Postgres, msgs, func(i int) time.Time { return base.Add(time.Duration(i) * time.Second) })

			// Another transaction holds seq 1's row for longer than 5 s.
			tx, err := db.DB.BeginTx(ctx, nil)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := tx.Exec(db.Rebind("SELECT id FROM acemq_outbox WHERE id = ? FOR UPDATE"), msgs[0].UUID); err != nil {
				t.Fatal(err)
			}
			released := make(chan struct{})
			go func() {
				defer close(released)
				time.Sleep(wakeTimeout + time.Second)
				_ = tx.Commit()
			}()
			defer func() { <-released }()

			r, err := NewRepublisher(db.DB, RepublisherConfig{Dialect: Postgres, TrackedTopics: NewTrackedTopics("rk"), Grace: time.Minute})
			if err != nil {
				t.Fatal(err)
			}
			rctx, cancel := context.WithTimeout(ctx, time.Minute)
			defer cancel()
			start := time.Now()
			n, err := r.Republish(rctx)
			if err != nil || n != 3 {
				t.Errorf("Republish with a minute to go made %d pending in %s (%v); want 3, no error", n, time.Since(start).Round(time.Millisecond), err)
			}
		})
	}
}

// A walk cut short (its Timeout) while it makes the keyed records it holds
// pending at keyedHeld batches makes the rest of them pending within 5 s
// more, as one cut short in the walk does (the README, Republish's doc):
// they were left published, for the next boot.
func TestRepublish_CutShortDuringHeldFlush_KeyedRecordsFoundMadePending(t *testing.T) {
	republishHook.Lock()
	defer republishHook.Unlock()
	db := testdb.New(t, testdb.SQLite)
	ctx := context.Background()
	if err := Migrate(ctx, db.DB.DB, SQLite); err != nil {
		t.Fatal(err)
	}
	var msgs []*message.Message
	for i := range keyedHeld {
		m := message.NewMessage(watermill.NewUUID(), []byte("x"))
		m.Metadata.Set(MetadataAggregateID, fmt.Sprintf("key-%d", i%5))
		msgs = append(msgs, m)
	}
	base := time.Now().UTC().Add(-time.Hour)
	publishAt(t, db, SQLite, msgs, func(i int) time.Time { return base.Add(time.Duration(i) * time.Second) })
	r, err := NewRepublisher(db.DB, RepublisherConfig{Dialect: SQLite, TrackedTopics: NewTrackedTopics("rk"), Grace: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	r.store.cfg.PurgeBatch = 1 // the walk holds keyedHeld records, then makes them pending
	cut, cancel := context.WithCancel(ctx)
	defer cancel()
	calls := 0
	republishBatched = func() {
		calls++
		if calls == keyedHeld+2 { // the held flush's second update
			cancel()
		}
	}
	defer func() { republishBatched = nil }()
	n, err := r.Republish(cut)
	if err == nil {
		t.Fatal("Republish cut short returned no error")
	}
	var pending int
	if err := db.Get(&pending, "SELECT COUNT(*) FROM acemq_outbox WHERE published_at IS NULL"); err != nil {
		t.Fatal(err)
	}
	if pending != keyedHeld {
		t.Errorf("cut short in the flush of the %d keyed records found: %d made pending, %d pending (%v); want all %d", keyedHeld, n, pending, err, keyedHeld)
	}
}

// An acemq_outbox another AceMQ library made without 0005's aggregate_id
// and seq (the README: a service that publishes only unkeyed messages into
// one still works; its own relay relays it). Republish walks it as before
// it read the keys: selecting aggregate_id and seq, it failed on every
// boot.
func TestRepublish_TableWithoutKeyColumns_UnkeyedRecordsMadePending(t *testing.T) {
	for _, c := range []struct {
		kind string
		d    Dialect
		drop []string // as the other library made it: no aggregate_id, no seq
	}{
		{testdb.Postgres, Postgres, []string{"ALTER TABLE acemq_outbox DROP COLUMN seq, DROP COLUMN aggregate_id"}},
		{testdb.MySQL, MySQL, []string{"ALTER TABLE acemq_outbox DROP COLUMN seq, DROP COLUMN aggregate_id"}},
		{testdb.SQLite, SQLite, []string{"DROP INDEX acemq_outbox_aggregate_seq", "DROP INDEX acemq_outbox_pending_key", "DROP INDEX acemq_outbox_pending_unkeyed",
			"ALTER TABLE acemq_outbox DROP COLUMN seq", "ALTER TABLE acemq_outbox DROP COLUMN aggregate_id"}},
	} {
		t.Run(c.kind, func(t *testing.T) {
			t.Parallel()
			db := testdb.New(t, c.kind)
			ctx := context.Background()
			if err := Migrate(ctx, db.DB.DB, c.d); err != nil {
				t.Fatal(err)
			}
			for _, q := range c.drop {
				if _, err := db.Exec(q); err != nil {
					t.Fatal(err)
				}
			}
			msgs := []*message.Message{message.NewMessage(watermill.NewUUID(), []byte("x")), message.NewMessage(watermill.NewUUID(), []byte("x"))}
			base := time.Now().UTC().Add(-time.Hour)
			publishAt(t, db, c.d, msgs, func(i int) time.Time { return base.Add(time.Duration(i) * time.Second) })
			r, err := NewRepublisher(db.DB, RepublisherConfig{Dialect: c.d, TrackedTopics: NewTrackedTopics("rk"), Grace: time.Minute})
			if err != nil {
				t.Fatal(err)
			}
			if n, err := r.Republish(ctx); err != nil || n != 2 {
				t.Errorf("Republish made %d pending (%v); want 2", n, err)
			}
		})
	}
}
