package outbox_test

import (
	"slices"
	"testing"
	"time"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// A windowed claim on PostgreSQL locks only the rows it returns. Its first
// version locked up to its shortfall of key heads and of unkeyed rows
// beyond its window each, and returned the oldest: the others stayed
// locked, unsent, for as long as its batch was out, and every other claim
// (the relay's next, another relay's) skipped them. (Found by a reviewer.)
func TestClaim_WindowedOnPostgres_LocksOnlyTheRowsItReturns(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.Postgres)
	base := time.Now().Add(-time.Hour).UTC().Truncate(time.Second)
	var rows []keyedRow
	// A key whose head is stuck, in front: the window sees only it.
	for s := int64(1); s <= 3; s++ {
		rows = append(rows, keyedRow{id: keyedID("hot", s), exchange: "x", routingKey: "k", aggregate: "hot", seq: s, createdAt: base.Add(time.Duration(s) * time.Second)})
	}
	var want []string // claim order of everything claimable
	for i := int64(0); i < 4; i++ {
		k := string(rune('a' + i))
		rows = append(rows, keyedRow{id: keyedID(k, 1), exchange: "x", routingKey: "k", aggregate: k, seq: 1, createdAt: base.Add(time.Duration(10+2*i) * time.Second)})
		rows = append(rows, keyedRow{id: "u" + k, exchange: "x", routingKey: "k", createdAt: base.Add(time.Duration(11+2*i) * time.Second)})
		want = append(want, keyedID(k, 1), "u"+k)
	}
	insertKeyed(t, db, rows)
	db.MustExec("UPDATE acemq_outbox SET attempts = 10 WHERE id = $1", keyedID("hot", 1))

	windowed, err := outbox.NewStore(db.DB, outbox.StoreConfig{Dialect: outbox.Postgres})
	if err != nil {
		t.Fatal(err)
	}
	outbox.SetClaimWindow(windowed, func(int) int { return 1 })
	plain, err := outbox.NewStore(db.DB, outbox.StoreConfig{Dialect: outbox.Postgres})
	if err != nil {
		t.Fatal(err)
	}
	outbox.SetClaimWindow(plain, func(int) int { return 1 << 20 }) // never windowed

	got1, held1, err := outbox.Claim(windowed, 2, "relay-1")
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = held1.Abandon() }()
	if !slices.Equal(got1, want[:2]) {
		t.Fatalf("first claim took %q, want %q", got1, want[:2])
	}
	// The first claim's batch is in flight. The next claim, by any relay,
	// takes the next claimable rows.
	got2, held2, err := outbox.Claim(plain, 2, "relay-2")
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = held2.Abandon() }()
	if !slices.Equal(got2, want[2:4]) {
		var locked []string
		_ = held2.Abandon()
		if err := db.Select(&locked, "SELECT id FROM acemq_outbox WHERE published_at IS NULL AND attempts < 10 AND id <> ALL($1) AND id NOT IN (SELECT id FROM acemq_outbox WHERE published_at IS NULL FOR UPDATE SKIP LOCKED) ORDER BY created_at, id", got1); err != nil {
			t.Log(err)
		}
		t.Errorf("while the first claim %q is held, the next claim took %q, want %q; rows locked by the first claim but not returned: %q", got1, got2, want[2:4], locked)
	}
}
