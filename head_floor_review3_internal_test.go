package outbox

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/acemq/watermill-outbox/internal/testdb"
)

// Retry and Republish through a Store over the relay's pool make its next
// claim start at the head, also where that Store names the table
// schema-qualified ("myschema.acemq_outbox", as a multi-schema deployment
// or outboxctl's flag would) and the relay's does not. Keyed by the name as
// configured, the floors' registry left the relay's floor alone, and the
// retried row waited a whole period (up to floorEveryMax).
func TestStore_Floors_SchemaQualifiedTable_RetryLowersTheRelaysFloor(t *testing.T) {
	eachFloorKind(t, func(t *testing.T, db *testdb.DB, d Dialect) {
		ctx := context.Background()
		s := floorStore(t, db, d, time.Hour) // the relay's: Table unqualified
		op, err := NewStore(db.DB, StoreConfig{Dialect: d, Table: db.Name + ".acemq_outbox"})
		if err != nil {
			t.Fatal(err)
		}
		writeFreshAndStuck(t, db)

		// The relay's period claim from the head, then one at the floor.
		for range 2 {
			cl, err := s.claimBatch(ctx, 100, "r", time.Minute, nil, nil)
			if err != nil {
				t.Fatal(err)
			}
			_ = s.abandon(ctx, cl)
		}
		if n, err := op.Retry(ctx, "stuck"); err != nil || n != 1 {
			t.Fatalf("Retry: %d, %v", n, err)
		}
		cl, err := s.claimBatch(ctx, 100, "r", time.Minute, nil, nil)
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = s.abandon(ctx, cl) }()
		for _, r := range cl.rows {
			if r.ID == "stuck" {
				return
			}
		}
		t.Fatalf("the claim after a Retry through a Store naming the table %q took %d rows, not the retried one: its floor was not lowered, and the row waits %v", db.Name+".acemq_outbox", len(cl.rows), s.floorDue().Round(time.Second))
	})
}

// The CHANGELOG: "Nothing changes while walks from the head are quick: no
// statement is added." headWalked times the whole claim, BEGIN-side
// statements to its rows read back, not the walk: with no snapshot held
// and nothing dead in the pending index, a claim of 100 records of 100 KB
// each takes more than floorCheckAbove to transfer, turns the floor on,
// and every period's claim from the head (the same kind of rows) keeps it
// on: each claim costs a statement more, and rows committed late wait a
// period, with no long snapshot anywhere.
func TestClaim_NoHeldSnapshot_LargeRecords_FloorStaysOff(t *testing.T) {
	eachFloorKind(t, func(t *testing.T, db *testdb.DB, d Dialect) {
		ctx := context.Background()
		s, err := NewStore(db.DB, StoreConfig{Dialect: d})
		if err != nil {
			t.Fatal(err)
		}
		body := strings.Repeat("x", 100_000)
		q := db.Rebind("INSERT INTO acemq_outbox (id, exchange_name, routing_key, body, headers, created_at) VALUES (?, 'x', 'k', ?, '{}', ?)")
		for i := range 300 {
			db.MustExec(q, "big"+string(rune('a'+i/26%26))+string(rune('a'+i%26))+string(rune('0'+i/676)), body, time.Now().UTC().Add(time.Duration(i)*time.Microsecond))
		}
		var tooks []time.Duration
		for range 3 {
			start := time.Now()
			cl, err := s.claimBatch(ctx, 100, "r", time.Minute, nil, nil)
			tooks = append(tooks, time.Since(start))
			if err != nil {
				t.Fatal(err)
			}
			_ = s.abandon(ctx, cl)
			s.floor.mu.Lock()
			s.floor.next = time.Time{} // the period over: the next claim walks from the head
			s.floor.mu.Unlock()
		}
		if on, at, points := floorState(s); on {
			t.Fatalf("no snapshot held, no dead entry in the pending index, and the floor is on after 3 claims from the head (took %v), %v before now, with %d points: the measure counts the rows' transfer, not the walk", tooks, time.Since(at).Round(time.Millisecond), len(points))
		}
	})
}
