package outbox

import (
	"context"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/acemq/watermill-outbox/internal/sqldialect"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// Where the pending rows start is never past a row the claim itself would
// take. Random tables of a few keys, with seq ties (no unique index), NULL
// seqs, NULL aggregate_ids, NULL attempts, NULL created_ats, stuck heads,
// published rows and live and lapsed leases. The claim's own rows (the
// real Claim statement, rolled back) are the truth: from the head
// (pendingStart, the measure's read) and from a cursor without an id (the
// floor's read before each claim, passing what the measure passed), the
// row read must come at or before every row the claim takes from there.
func TestPendingStart_NeverAboveAClaimableRow(t *testing.T) {
	t.Parallel()
	eachFloorKind(t, func(t *testing.T, db *testdb.DB, d Dialect) {
		ctx := context.Background()
		if db.Kind == testdb.MySQL {
			db.MustExec("DROP INDEX acemq_outbox_aggregate_seq ON acemq_outbox")
			db.MustExec("ALTER TABLE acemq_outbox MODIFY attempts INT NULL")
		} else {
			db.MustExec("DROP INDEX acemq_outbox_aggregate_seq")
			db.MustExec("ALTER TABLE acemq_outbox ALTER attempts DROP NOT NULL")
		}
		allowNullCreatedAt(db)
		s, err := NewStore(db.DB, StoreConfig{Dialect: d, MaxAttempts: 3})
		if err != nil {
			t.Fatal(err)
		}
		index, keyIndex := indexesOf(t, s)
		rng := rand.New(rand.NewPCG(1, 2))
		base := time.Now().Add(-time.Hour).UTC().Truncate(time.Second)
		type row struct {
			id      string
			created *time.Time
		}
		var nClaimed, nNullFirst, nNone, nHeld, nSkipped int
		defer func() {
			t.Logf("%s: rows claimed %d, first NULL-created %d, none %d, held rows %d, stuck keys passed %d", db.Kind, nClaimed, nNullFirst, nNone, nHeld, nSkipped)
			if nSkipped == 0 && !t.Failed() {
				t.Errorf("no stuck key passed in 150 tables: the test tests nothing new")
			}
		}()
		for iter := range 150 {
			db.MustExec("DELETE FROM acemq_outbox")
			var rows []row
			n := 4 + rng.IntN(14)
			for i := range n {
				id := fmt.Sprintf("r%02d", i)
				var created any
				var ct *time.Time
				if rng.IntN(12) != 0 {
					c := base.Add(time.Duration(rng.IntN(8)) * time.Second)
					ct, created = &c, c
				}
				var key any
				if rng.IntN(5) != 0 {
					key = []string{"a", "b", "c"}[rng.IntN(3)]
				}
				var seq any
				if rng.IntN(7) != 0 {
					seq = int64(1 + rng.IntN(4))
				}
				var attempts any
				switch rng.IntN(6) {
				case 0:
					attempts = nil
				case 1, 2:
					attempts = 3 + rng.IntN(2) // stuck
				default:
					attempts = rng.IntN(3)
				}
				var published, lockedUntil any
				if rng.IntN(5) == 0 {
					published = time.Now().UTC()
				}
				switch rng.IntN(6) {
				case 0:
					lockedUntil = time.Now().Add(time.Hour).UTC()
				case 1:
					lockedUntil = time.Now().Add(-time.Hour).UTC()
				}
				db.MustExec(db.Rebind("INSERT INTO acemq_outbox (id, exchange_name, routing_key, body, headers, created_at, aggregate_id, seq, attempts, published_at, locked_until) VALUES (?, 'x', 'k', 'b', '{}', ?, ?, ?, ?, ?, ?)"),
					id, created, key, seq, attempts, published, lockedUntil)
				rows = append(rows, row{id, ct})
			}
			created := map[string]*time.Time{}
			for _, r := range rows {
				created[r.id] = r.created
			}
			var dump string
			if t.Failed() {
				return
			}
			dumpRows := func() string {
				if dump != "" {
					return dump
				}
				rs, err := db.DB.Query("SELECT id, COALESCE(CAST(created_at AS CHAR(40)), '-'), COALESCE(aggregate_id, '-'), COALESCE(CAST(seq AS CHAR(10)), '-'), COALESCE(CAST(attempts AS CHAR(10)), '-'), published_at IS NOT NULL, COALESCE(CAST(locked_until AS CHAR(40)), '-') FROM acemq_outbox ORDER BY id")
				if err != nil {
					t.Fatal(err)
				}
				defer rs.Close()
				for rs.Next() {
					var a, b, c, e, f, h string
					var g bool
					if err := rs.Scan(&a, &b, &c, &e, &f, &g, &h); err != nil {
						t.Fatal(err)
					}
					dump += fmt.Sprintf("\n  %s created %s key %s seq %s attempts %s published %v locked_until %s", a, b, c, e, f, g, h)
				}
				return dump
			}
			var skip []sqldialect.KeySeq
			for _, after := range []*sqldialect.Cursor{nil, {CreatedAt: base.Add(time.Duration(rng.IntN(8)) * time.Second)}} {
				tx, err := db.DB.BeginTx(ctx, nil)
				if err != nil {
					t.Fatal(err)
				}
				var first *sqldialect.Cursor
				if after == nil {
					var start pendingStartRead
					start, err = s.pendingStart(ctx, tx, index, keyIndex)
					first, skip = start.first, start.skip
				} else {
					var r pendingRow
					r, err = s.pendingFirst(ctx, tx, index, keyIndex, after, skip)
					first = r.first
				}
				if err != nil {
					t.Fatal(err)
				}
				q := s.q.Claim(sqldialect.ClaimParams{Limit: 1000, MaxAttempts: 3, Now: time.Now(), After: after, Index: index, KeyIndex: keyIndex})
				rs, err := tx.QueryContext(ctx, q.SQL, q.Args...)
				if err != nil {
					t.Fatal(err)
				}
				claimed, err := s.q.ScanClaimed(rs)
				if err != nil {
					t.Fatal(err)
				}
				var held int
				if err := tx.QueryRowContext(ctx, db.Rebind("SELECT COUNT(*) FROM acemq_outbox WHERE published_at IS NULL AND COALESCE(attempts, 0) < 3 AND created_at IS NOT NULL AND aggregate_id IS NOT NULL AND seq IS NOT NULL AND EXISTS (SELECT 1 FROM acemq_outbox h WHERE h.aggregate_id = acemq_outbox.aggregate_id AND h.published_at IS NULL AND h.seq < acemq_outbox.seq AND COALESCE(h.attempts, 0) >= 3)")).Scan(&held); err != nil {
					t.Fatal(err)
				}
				nHeld += held
				if after == nil {
					nSkipped += len(skip)
				}
				nClaimed += len(claimed)
				if first == nil {
					nNone++
				} else if first.CreatedAt.IsZero() {
					nNullFirst++
				}
				_ = tx.Rollback()
				for _, c := range claimed {
					ct := created[c.ID]
					switch {
					case first == nil:
						t.Errorf("iteration %d, after %v: where the pending rows start: none; the claim takes %s%s", iter, after, c.ID, dumpRows())
					case ct == nil && after == nil && !first.CreatedAt.IsZero():
						t.Errorf("iteration %d: where the pending rows start: %s at %v; the claim takes %s, created_at NULL%s", iter, first.ID, first.CreatedAt, c.ID, dumpRows())
					case ct == nil || first.CreatedAt.IsZero():
					case ct.Before(first.CreatedAt) || ct.Equal(first.CreatedAt) && c.ID < first.ID:
						t.Errorf("iteration %d, after %v: where the pending rows start: %s at %v; the claim takes %s at %v, before it%s", iter, after, first.ID, first.CreatedAt, c.ID, *ct, dumpRows())
					}
				}
			}
		}
	})
}
