package outbox

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/acemq/watermill-outbox/internal/testdb"
)

// keyedAt is a created_at i milliseconds after base, as the kind writes it.
func keyedAt(kind string, base time.Time, i int) any {
	v := base.Add(time.Duration(i) * time.Millisecond)
	if kind == testdb.SQLite {
		return v.Format("2006-01-02 15:04:05.000000")
	}
	return v
}

// keyedRowInsert is the raw insert of a keyed row (as another library writes it).
const keyedRowInsert = "INSERT INTO acemq_outbox (id, exchange_name, routing_key, body, created_at, aggregate_id, seq, attempts) VALUES (?, 'x', 'k', 'b', ?, ?, ?, ?)"

// writeStuckBacklog writes n records of key "hot" whose head is stuck: a
// window over them always comes back short, and narrows the next claims.
func writeStuckBacklog(t *testing.T, db *testdb.DB, kind string, base time.Time, n int) {
	t.Helper()
	q := db.Rebind(keyedRowInsert)
	for seq := 1; seq <= n; seq++ {
		attempts := 0
		if seq == 1 {
			attempts = DefaultMaxAttempts
		}
		db.MustExec(q, fmt.Sprintf("hot#%04d", seq), keyedAt(kind, base, seq), "hot", seq, attempts)
	}
}

// A key another language's producer wrote in bytes that are not UTF-8 (the
// library keeps such keys working elsewhere: see inline.go, inFlight), or
// with a NUL, is claimed by narrowed claims behind a stuck backlog, where
// every claim stays short and narrowed. When a narrowed claim named its
// keys in a JSON argument (a review of the twenty-fifth session's work),
// encoding/json coerced them to UTF-8 (U+FFFD for each bad byte): the key's
// head was looked up under another name and never found, while the probe
// kept saying that something was claimable.
func TestClaim_Narrowed_SQLiteKeyNotUTF8_IsClaimed(t *testing.T) {
	for name, bad := range map[string]string{"not UTF-8": string([]byte{'k', 0xff, 0xfe}), "NUL": "k\x00z"} {
		t.Run(name, func(t *testing.T) { claimNarrowedOddKey(t, bad) })
	}
}

func claimNarrowedOddKey(t *testing.T, bad string) {
	db := testdb.New(t, testdb.SQLite)
	ctx := context.Background()
	if err := Migrate(ctx, db.DB, SQLite); err != nil {
		t.Fatal(err)
	}
	base := time.Now().Add(-time.Hour).UTC().Truncate(time.Second)
	// More entries than the default window of a claim of 5 (2·5+256).
	writeStuckBacklog(t, db, testdb.SQLite, base, 400)
	s, err := NewStore(db.DB, StoreConfig{Dialect: SQLite})
	if err != nil {
		t.Fatal(err)
	}
	claim := func() []string { return claimAndPublish(t, s, 5) }
	if got := claim(); len(got) != 0 {
		t.Fatalf("first claim took %v, want nothing (the hot key is stuck)", got)
	}
	if s.narrowed.Load() == 0 && everyClaimWindow == 0 { // OUTBOX_TEST_CLAIM_WINDOW fixes every window
		t.Fatal("a short windowed claim did not narrow the next ones")
	}
	q := db.Rebind(keyedRowInsert)
	db.MustExec(q, "bad#1", keyedAt(testdb.SQLite, base, 1000), bad, 1, 0)
	db.MustExec(q, "good#1", keyedAt(testdb.SQLite, base, 1001), "good", 1, 0)
	seen := map[string]int{}
	for i := 0; i < 50; i++ {
		for _, id := range claim() {
			seen[id]++
		}
	}
	if seen["good#1"] != 1 {
		t.Errorf("the UTF-8 key's record claimed %d times, want once", seen["good#1"])
	}
	if seen["bad#1"] != 1 {
		probe, err := s.hasClaimable(ctx)
		t.Errorf("the record of key %q (not UTF-8) claimed %d times in 50 narrowed claims, want once (narrowed window %d; probe says claimable: %v, %v)",
			bad, seen["bad#1"], s.narrowed.Load(), probe, err)
	}
}

// Another library's producer that binds its keys as bytes leaves BLOB keys
// on SQLite (TEXT affinity keeps a BLOB a BLOB), which sort after every
// TEXT key. The keys' cursor (Store.keysAfter) keeps the type it was read
// with: a cursor bound back as TEXT (a review found it so) stopped on a
// BLOB key, "aggregate_id > cursor" held for every BLOB key again, the next
// slice was the first BLOB keys again and stopped on the same one; with
// keysPerClaim or more such keys (here stuck ones, which stay pending) it
// never wrapped, and a TEXT key's record beyond the window was never
// claimed while claims stayed narrowed.
func TestClaim_Narrowed_SQLiteBlobKeys_CursorStillReachesEveryKey(t *testing.T) {
	db := testdb.New(t, testdb.SQLite)
	ctx := context.Background()
	if err := Migrate(ctx, db.DB, SQLite); err != nil {
		t.Fatal(err)
	}
	base := time.Now().Add(-time.Hour).UTC().Truncate(time.Second)
	writeStuckBacklog(t, db, testdb.SQLite, base, 400)
	q := db.Rebind(keyedRowInsert)
	for k := range 4*5 + 256 + 20 { // keysPerClaim(5) + 20
		blob := []byte{0xff, byte(k >> 8), byte(k)}
		db.MustExec(q, fmt.Sprintf("blob%04d#1", k), keyedAt(testdb.SQLite, base, 500+k), blob, 1, DefaultMaxAttempts)
	}
	s, err := NewStore(db.DB, StoreConfig{Dialect: SQLite})
	if err != nil {
		t.Fatal(err)
	}
	claim := func() []string { return claimAndPublish(t, s, 5) }
	for i := 0; i < 3; i++ { // narrowed, and the cursor past the TEXT keys
		if got := claim(); len(got) != 0 {
			t.Fatalf("claim %d took %v, want nothing", i, got)
		}
	}
	db.MustExec(q, "good#1", keyedAt(testdb.SQLite, base, 2000), "good", 1, 0)
	seen := 0
	for i := 0; i < 50 && seen == 0; i++ {
		for _, id := range claim() {
			if id == "good#1" {
				seen++
			}
		}
	}
	if seen != 1 {
		s.keysMu.Lock()
		after := s.keysAfter
		s.keysMu.Unlock()
		t.Errorf("key %q's record claimed %d times in 50 narrowed claims, want once (cursor stays at %q)", "good", seen, after)
	}
}

// Four relays at once behind a stuck key's backlog, two sharing one Store
// (their narrowed state and key cursor), two with Stores of their own, each
// claiming small batches with narrowed windows and a small slice of keys:
// every record is claimed exactly once, a key's record only after its
// predecessor was marked, and nothing is left.
func TestClaim_Narrowed_FourRelays_EachRecordOnceInKeyOrder(t *testing.T) {
	t.Parallel()
	eachWindowing(t, func(t *testing.T, db *testdb.DB, c windowing) {
		ctx := context.Background()
		base := time.Now().Add(-time.Hour).UTC().Truncate(time.Second)
		writeStuckBacklog(t, db, c.kind, base, 400)
		q := db.Rebind(keyedRowInsert)
		const keys, per = 60, 5
		total := 0
		for k := range keys {
			for seq := 1; seq <= per; seq++ {
				db.MustExec(q, fmt.Sprintf("k%02d#%d", k, seq), keyedAt(c.kind, base, 1000+k*per+seq), fmt.Sprintf("k%02d", k), seq, 0)
				total++
			}
		}
		uq := db.Rebind("INSERT INTO acemq_outbox (id, exchange_name, routing_key, body, created_at) VALUES (?, 'x', 'k', 'b', ?)")
		for i := range 40 {
			db.MustExec(uq, fmt.Sprintf("u%03d", i), keyedAt(c.kind, base, 3000+i))
			total++
		}
		newStore := func() *Store {
			s, err := NewStore(db.DB, StoreConfig{Dialect: c.d})
			if err != nil {
				t.Fatal(err)
			}
			s.slice = func(int) int { return 7 }
			return s
		}
		shared := newStore()
		stores := []*Store{shared, shared, newStore(), newStore()}
		var mu sync.Mutex
		marked := map[string]bool{} // marked, or about to be committed so
		claimed := map[string]int{}
		var errs []string
		deadline := time.Now().Add(60 * time.Second)
		var wg sync.WaitGroup
		for w, s := range stores {
			wg.Add(1)
			go func() {
				defer wg.Done()
				relay := fmt.Sprintf("r%d", w)
				for time.Now().Before(deadline) {
					mu.Lock()
					done := len(claimed) >= total
					mu.Unlock()
					if done {
						return
					}
					cl, err := s.claimBatch(ctx, 5, relay, time.Minute, nil, nil)
					if err != nil {
						if c.kind == testdb.SQLite && strings.Contains(err.Error(), "locked") {
							continue
						}
						mu.Lock()
						errs = append(errs, err.Error())
						mu.Unlock()
						return
					}
					ids := make([]string, len(cl.rows))
					mu.Lock()
					for i, r := range cl.rows {
						ids[i] = r.ID
						claimed[r.ID]++
						if claimed[r.ID] > 1 {
							errs = append(errs, relay+" claimed "+r.ID+" again")
						}
						var k, seq int
						if _, err := fmt.Sscanf(r.ID, "k%02d#%d", &k, &seq); err == nil && seq > 1 && !marked[fmt.Sprintf("k%02d#%d", k, seq-1)] {
							errs = append(errs, fmt.Sprintf("%s claimed %s before k%02d#%d was marked", relay, r.ID, k, seq-1))
						}
						marked[r.ID] = true
					}
					mu.Unlock()
					if err := s.finish(ctx, cl, ids, nil); err != nil {
						mu.Lock()
						errs = append(errs, err.Error())
						mu.Unlock()
						return
					}
				}
			}()
		}
		wg.Wait()
		for _, e := range errs {
			t.Error(e)
		}
		if len(claimed) != total {
			t.Errorf("%d of %d claimable records claimed", len(claimed), total)
		}
	})
}

// claimAndPublish claims up to n rows of s and marks them published, as a
// relay whose batch went out: it returns their ids, in claim order.
func claimAndPublish(t *testing.T, s *Store, n int) []string {
	t.Helper()
	ctx := context.Background()
	cl, err := s.claimBatch(ctx, n, "r", time.Minute, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	ids := make([]string, len(cl.rows))
	for i, r := range cl.rows {
		ids[i] = r.ID
	}
	if err := s.finish(ctx, cl, ids, nil); err != nil {
		t.Fatal(err)
	}
	return ids
}
