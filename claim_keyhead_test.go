package outbox_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// A claim takes each key's first pending record and no other, whatever the
// created_at order, whoever wrote the rows (here SQL, as another library
// would), and whatever state the key's earlier records are in: published
// ones do not hold it, a stuck one does until it is retried, one published
// and made pending again does, one claimed by another relay does; a record
// without a seq has no place in its key's order and holds nothing. On MySQL
// the same with the index of a key's pending rows the probe names, and
// without it (a table migrated before 0007, or by other SQL), when the
// optimizer chooses.
func TestClaim_TakesOnlyEachKeysFirstPendingRecord(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, d outbox.Dialect) {
		t.Run("migrated", func(t *testing.T) {
			if db.Kind == testdb.MySQL {
				if got := keyIndexOf(t, db, d); got != "acemq_outbox_pending_key" {
					t.Errorf("the claim's key-head probe names index %q, want acemq_outbox_pending_key", got)
				}
			}
			claimKeyHeads(t, db, d, "m", 0)
		})
		if db.Kind != testdb.MySQL {
			// Every claim windowed, and so narrowly that each takes its
			// rows beyond the window: the same rows, in the same order.
			for _, window := range []int{1, 3} {
				t.Run(fmt.Sprintf("window of %d", window), func(t *testing.T) {
					if _, err := db.Exec("DELETE FROM acemq_outbox"); err != nil {
						t.Fatal(err)
					}
					claimKeyHeads(t, db, d, fmt.Sprintf("w%d", window), window)
				})
			}
			return
		}
		t.Run("without the key index", func(t *testing.T) {
			for _, q := range []string{"DELETE FROM acemq_outbox", "DROP INDEX acemq_outbox_pending_key ON acemq_outbox"} {
				if _, err := db.Exec(q); err != nil {
					t.Fatal(err)
				}
			}
			if got := keyIndexOf(t, db, d); got != "" {
				t.Errorf("the claim's key-head probe names index %q, which is gone", got)
			}
			claimKeyHeads(t, db, d, "x", 0)
		})
	})
}

// keyIndexOf is the index of a key's pending rows a new store's claims name.
func keyIndexOf(t *testing.T, db *testdb.DB, d outbox.Dialect) string {
	t.Helper()
	s, err := outbox.NewStore(db.DB, outbox.StoreConfig{Dialect: d})
	if err != nil {
		t.Fatal(err)
	}
	tx, err := db.DB.DB.Begin()
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback() }()
	index, err := outbox.KeyIndex(s, tx)
	if err != nil {
		t.Fatal(err)
	}
	return index
}

// claimKeyHeads writes rows whose keys start with prefix and checks what
// claims take of them, one claim after the other as a drain does. A window
// other than 0 is the claims' (see outbox.SetClaimWindow).
func claimKeyHeads(t *testing.T, db *testdb.DB, d outbox.Dialect, prefix string, window int) {
	t.Helper()
	id := func(key string, seq int64) string { return keyedID(prefix+key, seq) }
	var rows []keyedRow
	add := func(key string, seq int64) {
		aggregate := ""
		if key != "" {
			aggregate = prefix + key
		}
		rows = append(rows, keyedRow{id: id(key, seq), exchange: "x", routingKey: "k", aggregate: aggregate, seq: seq})
	}
	add("e", 2) // written before its predecessor
	add("e", 1)
	add("a", 1) // published
	add("a", 3)
	add("a", 2)
	add("b", 1) // stuck (at MaxAttempts)
	add("b", 2)
	add("c", 3)
	add("c", 2) // published
	add("c", 1) // pending behind a published successor, as after a republish
	add("d", 1)
	add("d", 0) // its seq is set NULL below
	add("d", 2)
	add("", 1) // unkeyed
	for s := int64(1); s <= 30; s++ {
		add("f", s) // a long key: its head's probe must not read its tail
	}
	add(odd, 1) // an id JSON and SQL must both carry exactly
	add(odd, 2)
	base := time.Now().Add(-time.Hour).UTC().Truncate(time.Second)
	for i := range rows {
		rows[i].createdAt = base.Add(time.Duration(i) * time.Millisecond)
	}
	insertKeyed(t, db, rows)
	in := func(ids ...string) string { return "('" + strings.Join(ids, "', '") + "')" }
	for _, q := range []string{
		"UPDATE acemq_outbox SET published_at = created_at WHERE id IN " + in(id("a", 1), id("c", 2)),
		"UPDATE acemq_outbox SET attempts = 10 WHERE id IN " + in(id("b", 1)),
		"UPDATE acemq_outbox SET seq = NULL WHERE id IN " + in(id("d", 0)),
	} {
		if _, err := db.Exec(q); err != nil {
			t.Fatal(err)
		}
	}

	s, err := outbox.NewStore(db.DB, outbox.StoreConfig{Dialect: d})
	if err != nil {
		t.Fatal(err)
	}
	if window > 0 {
		outbox.SetClaimWindow(s, func(int) int { return window })
	}
	claimWith := func(relay string, inFlight []string, want ...string) *outbox.HeldClaim {
		t.Helper()
		got, held, err := outbox.ClaimInFlight(s, 100, relay, inFlight)
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(got, want) {
			t.Errorf("%s with %q in flight claimed %q, want %q", relay, inFlight, got, want)
		}
		return held
	}
	claim := func(relay string, want ...string) *outbox.HeldClaim {
		t.Helper()
		return claimWith(relay, nil, want...)
	}

	firstIDs := []string{id("e", 1), id("a", 2), id("c", 1), id("d", 1), id("d", 0), id("", 1), id("f", 1), id(odd, 1)}
	first := claim("relay-1", firstIDs...)
	// While relay-1 has them in flight, relay-2 takes none of their keys'
	// next records.
	if err := claim("relay-2").Abandon(); err != nil {
		t.Fatal(err)
	}
	secondIDs := []string{id("e", 2), id("a", 3), id("c", 3), id("d", 2), id("f", 2), id(odd, 2)}
	if db.Kind != testdb.MySQL {
		// Relay-1 itself may take each key's next record, the one after
		// its own in flight, and no further; a key whose earlier record it
		// does not hold (b's stuck one, e's when only a's is named) stays
		// where it is. (On MySQL the first claim keeps every row it passed
		// over locked until it ends, these among them: see
		// TestClaim_KeysNextRecord_ClaimableWhileItsPredecessorsAreInFlightHere.)
		if err := claimWith("relay-1", []string{id("a", 2)}, id("a", 3)).Abandon(); err != nil {
			t.Fatal(err)
		}
		second := claimWith("relay-1", firstIDs, secondIDs...)
		if err := claimWith("relay-1", append(firstIDs, secondIDs...), id("f", 3)).Abandon(); err != nil {
			t.Fatal(err)
		}
		// Named with only its second record in flight, f's third waits
		// for the first.
		if err := claimWith("relay-1", []string{id("f", 2)}).Abandon(); err != nil {
			t.Fatal(err)
		}
		if err := second.Abandon(); err != nil {
			t.Fatal(err)
		}
	}
	if err := first.Publish(); err != nil {
		t.Fatal(err)
	}
	next := claim("relay-2", secondIDs...)
	if err := next.Abandon(); err != nil {
		t.Fatal(err)
	}
	// The stuck record, retried, is its key's head again, and only it.
	if n, err := s.Retry(context.Background(), id("b", 1)); n != 1 || err != nil {
		t.Fatalf("retry: %d, %v", n, err)
	}
	if err := claim("relay-1", id("e", 2), id("a", 3), id("b", 1), id("c", 3), id("d", 2), id("f", 2), id(odd, 2)).Abandon(); err != nil {
		t.Fatal(err)
	}
}

// odd is a key whose records' ids hold quotes, a backslash and a letter
// outside ASCII: the relay's in-flight ids reach SQL as JSON.
const odd = `o'"\ü`

// A relay that has a key's record in flight may claim the key's next record
// (the relay sends it once the first is confirmed), and only the next: the
// one after that waits until the next is in flight too. Another relay, or
// this one naming too little, takes none of them. Keys' records written in
// sequence order, each claim's LIMIT reached before the rows of the next
// sequence number: on MySQL a claim keeps the rows it passed over locked
// until it ends.
func TestClaim_KeysNextRecord_ClaimableWhileItsPredecessorsAreInFlightHere(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, d outbox.Dialect) {
		claimKeysNext(t, db, d, 0)
		if db.Kind == testdb.MySQL {
			return
		}
		for _, window := range []int{1, 4} {
			t.Run(fmt.Sprintf("window of %d", window), func(t *testing.T) {
				if _, err := db.Exec("DELETE FROM acemq_outbox"); err != nil {
					t.Fatal(err)
				}
				claimKeysNext(t, db, d, window)
			})
		}
	})
}

// claimKeysNext is TestClaim_KeysNextRecord_ClaimableWhileItsPredecessorsAreInFlightHere
// on db, with claims of window (0: as the store chooses).
func claimKeysNext(t *testing.T, db *testdb.DB, d outbox.Dialect, window int) {
	t.Helper()
	{
		keys := []string{"a", "b", odd}
		var rows []keyedRow
		base := time.Now().Add(-time.Hour).UTC().Truncate(time.Second)
		for seq := int64(1); seq <= 3; seq++ {
			for _, k := range keys {
				rows = append(rows, keyedRow{id: keyedID(k, seq), exchange: "x", routingKey: "k", aggregate: k, seq: seq, createdAt: base.Add(time.Duration(len(rows)) * time.Millisecond)})
			}
		}
		insertKeyed(t, db, rows)
		s, err := outbox.NewStore(db.DB, outbox.StoreConfig{Dialect: d})
		if err != nil {
			t.Fatal(err)
		}
		if window > 0 {
			outbox.SetClaimWindow(s, func(int) int { return window })
		}
		ids := func(seq int64) []string {
			var out []string
			for _, k := range keys {
				out = append(out, keyedID(k, seq))
			}
			return out
		}
		claim := func(relay string, n int, inFlight []string, want ...string) *outbox.HeldClaim {
			t.Helper()
			got, held, err := outbox.ClaimInFlight(s, n, relay, inFlight)
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(got, want) {
				t.Errorf("%s with %q in flight claimed %q, want %q", relay, inFlight, got, want)
			}
			return held
		}
		abandon := func(h *outbox.HeldClaim) {
			t.Helper()
			if err := h.Abandon(); err != nil {
				t.Fatal(err)
			}
		}
		first := claim("relay-1", 3, nil, ids(1)...)
		abandon(claim("relay-2", 10, nil))
		abandon(claim("relay-1", 1, []string{keyedID("b", 1)}, keyedID("b", 2)))
		second := claim("relay-1", 3, ids(1), ids(2)...)
		abandon(claim("relay-1", 10, ids(2))) // the first records are not named
		abandon(claim("relay-2", 10, nil))
		third := claim("relay-1", 10, append(ids(1), ids(2)...), ids(3)...)
		abandon(third)
		abandon(second)
		if err := first.Publish(); err != nil {
			t.Fatal(err)
		}
		abandon(claim("relay-2", 10, nil, ids(2)...))
	}
}
