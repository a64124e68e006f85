package outbox_test

import (
	"context"
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
	eachMigrated(t, func(t *testing.T, db *testdb.DB, d outbox.Dialect) {
		t.Run("migrated", func(t *testing.T) {
			if db.Kind == testdb.MySQL {
				if got := keyIndexOf(t, db, d); got != "acemq_outbox_pending_key" {
					t.Errorf("the claim's key-head probe names index %q, want acemq_outbox_pending_key", got)
				}
			}
			claimKeyHeads(t, db, d, "m")
		})
		if db.Kind != testdb.MySQL {
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
			claimKeyHeads(t, db, d, "x")
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
// claims take of them, one claim after the other as a drain does.
func claimKeyHeads(t *testing.T, db *testdb.DB, d outbox.Dialect, prefix string) {
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
	claim := func(relay string, want ...string) *outbox.HeldClaim {
		t.Helper()
		got, held, err := outbox.Claim(s, 100, relay)
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(got, want) {
			t.Errorf("%s claimed %q, want %q", relay, got, want)
		}
		return held
	}

	first := claim("relay-1", id("e", 1), id("a", 2), id("c", 1), id("d", 1), id("d", 0), id("", 1), id("f", 1))
	// While relay-1 has them in flight, relay-2 takes none of their keys'
	// next records.
	if err := claim("relay-2").Abandon(); err != nil {
		t.Fatal(err)
	}
	if err := first.Publish(); err != nil {
		t.Fatal(err)
	}
	next := claim("relay-2", id("e", 2), id("a", 3), id("c", 3), id("d", 2), id("f", 2))
	if err := next.Abandon(); err != nil {
		t.Fatal(err)
	}
	// The stuck record, retried, is its key's head again, and only it.
	if n, err := s.Retry(context.Background(), id("b", 1)); n != 1 || err != nil {
		t.Fatalf("retry: %d, %v", n, err)
	}
	if err := claim("relay-1", id("e", 2), id("a", 3), id("b", 1), id("c", 3), id("d", 2), id("f", 2)).Abandon(); err != nil {
		t.Fatal(err)
	}
}
