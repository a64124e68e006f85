package outbox

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/acemq/watermill-outbox/internal/testdb"
)

// A windowed claim whose window falls short reads a slice of
// the keys beyond it, not every key: the first windowed claim from the
// head, behind a stuck key's backlog with 50,000 keys after it, read all
// of them (330 ms). Its read of the key index is counted in the claim's
// own transaction (pg_stat_get_xact_numscans): two probes a key read, the
// next key and its head, and one an entry of the window (its key-head
// probe).
func TestClaim_Windowed_ReadsASliceOfTheKeysNotEveryKey(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, testdb.Postgres)
	ctx := context.Background()
	if err := Migrate(ctx, db.DB, Postgres); err != nil {
		t.Fatal(err)
	}
	const keys = 400
	writeManyKeysBehindStuck(t, db, 300, keys)
	s, err := NewStore(db.DB, StoreConfig{Dialect: Postgres})
	if err != nil {
		t.Fatal(err)
	}
	s.window = func(int) int { return 4 }
	s.slice = func(int) int { return 20 }
	cl, err := s.claimBatch(ctx, 10, "r", time.Minute, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = s.abandon(ctx, cl) }()
	if len(cl.rows) != 10 {
		t.Fatalf("claimed %d rows, want 10", len(cl.rows))
	}
	for _, r := range cl.rows {
		if strings.HasPrefix(r.ID, "hot") {
			t.Fatalf("claimed %s, behind its key's stuck head", r.ID)
		}
	}
	var scans int
	if err := cl.tx.QueryRowContext(ctx, "SELECT pg_stat_get_xact_numscans('acemq_outbox_pending_key'::regclass)").Scan(&scans); err != nil {
		t.Fatal(err)
	}
	if scans > 100 {
		t.Errorf("the claim probed the key index %d times, with %d keys behind its window: it read more than its slice of 20", scans, keys)
	}
}

// Claims whose windows fall short each read the next slice of the keys,
// where the last one's read stopped, and so take every key's records in
// turn, in each key's order: a slice read again from the first key each
// time would take only the first keys' records, for as long as they have
// some, and leave the keys after them behind the stuck key's backlog.
func TestClaim_Windowed_SlicesOfTheKeysInTurn_EveryHeadClaimed(t *testing.T) {
	t.Parallel()
	eachWindowing(t, func(t *testing.T, db *testdb.DB, c windowing) {
		ctx := context.Background()
		base := time.Now().Add(-time.Hour).UTC().Truncate(time.Second)
		i := 0
		insert := func(id, key string, seq, attempts int) {
			i++
			var at any = base.Add(time.Duration(i) * time.Millisecond)
			if c.kind == testdb.SQLite {
				at = at.(time.Time).Format("2006-01-02 15:04:05.000000")
			}
			db.MustExec(db.Rebind("INSERT INTO acemq_outbox (id, exchange_name, routing_key, body, created_at, aggregate_id, seq, attempts) VALUES (?, 'x', 'k', 'b', ?, ?, ?, ?)"),
				id, at, key, seq, attempts)
		}
		for seq := 1; seq <= 30; seq++ {
			attempts := 0
			if seq == 1 {
				attempts = 10 // stuck: its key holds
			}
			insert(fmt.Sprintf("hot#%02d", seq), "m-hot", seq, attempts)
		}
		// Seven keys first in the keys' order, a slice's worth, with fifty
		// records each.
		for seq := 1; seq <= 50; seq++ {
			for k := range 7 {
				insert(fmt.Sprintf("a%d#%02d", k, seq), fmt.Sprintf("a%d", k), seq, 0)
			}
		}
		const keys = 40
		for k := range keys {
			insert(fmt.Sprintf("k%02d#1", k), fmt.Sprintf("k%02d", k), 1, 0)
		}
		s, err := NewStore(db.DB, StoreConfig{Dialect: c.d})
		if err != nil {
			t.Fatal(err)
		}
		s.window = func(int) int { return 4 } // every claim windowed, never narrowed
		s.slice = func(int) int { return 7 }
		seen := map[string]bool{}
		last := map[string]int{} // by key, the last seq claimed
		taken := 0
		for c := 0; c < 30 && taken < keys; c++ {
			cl, err := s.claimBatch(ctx, 5, "r", time.Minute, nil, nil)
			if err != nil {
				t.Fatal(err)
			}
			ids := make([]string, len(cl.rows))
			for j, r := range cl.rows {
				if seen[r.ID] {
					t.Fatalf("claim %d took %s again", c, r.ID)
				}
				if r.Seq != int64(last[r.AggregateID]+1) {
					t.Fatalf("claim %d took %s, seq %d after %d", c, r.ID, r.Seq, last[r.AggregateID])
				}
				seen[r.ID], last[r.AggregateID] = true, int(r.Seq)
				if strings.HasPrefix(r.ID, "k") {
					taken++
				}
				ids[j] = r.ID
			}
			if err := s.finish(ctx, cl, ids, nil); err != nil {
				t.Fatal(err)
			}
		}
		if taken != keys {
			t.Errorf("30 claims took %d of the %d records of the keys after the first slice", taken, keys)
		}
	})
}
