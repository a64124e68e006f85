package outbox

import (
	"context"
	"database/sql"
	"testing"
	"time"

	"github.com/acemq/watermill-outbox/internal/sqldialect"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// Every variant of PendingFirst (through the named indexes or not, from
// the head or a cursor, past skip entries or not, locking or not) runs on
// both databases with its hold column, beside a keyed row in backoff
// whose created_at is NULL and a foreign row in backoff without a seq, and
// reads the backoff's end of a keyed record; the foreign row is not
// passed as one.
func TestPendingFirst_EveryVariant_ReadsTheBackoffsEnd(t *testing.T) {
	t.Parallel()
	eachFloorKind(t, func(t *testing.T, db *testdb.DB, d Dialect) {
		allowNullCreatedAt(db)
		s := floorStore(t, db, d, time.Hour)
		ctx := context.Background()
		old := time.Now().Add(-time.Minute)
		writeKeyed(t, db, "k#1", "k", 1, old, 1)
		writeKeyed(t, db, "k#2", "k", 2, old.Add(time.Second), 0)
		end := time.Now().Add(time.Hour)
		holdBack(t, db, "k#1", end)
		writeAt(t, db, "a", old.Add(2*time.Second))
		// a keyed row with a NULL created_at in backoff, and one claimable
		db.MustExec(db.Rebind("INSERT INTO acemq_outbox (id, exchange_name, routing_key, body, headers, created_at, aggregate_id, seq) VALUES ('n#1', 'x', 'k', 'b', '{}', NULL, 'n', 1)"))
		holdBack(t, db, "n#1", end)
		// a foreign row: retry-after without seq
		db.MustExec(db.Rebind("INSERT INTO acemq_outbox (id, exchange_name, routing_key, body, headers, created_at, aggregate_id) VALUES ('f', 'x', 'k', 'b', '{}', ?, 'f')"), old.Add(10*time.Second).UTC())
		holdBack(t, db, "f", end)

		conn, err := db.DB.Conn(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		tx, err := conn.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelReadCommitted})
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback()
		index, keyIndex, err := s.claimIndexes(ctx, tx)
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("index %q keyIndex %q", index, keyIndex)
		for _, idx := range [][2]string{{"", ""}, {index, keyIndex}} {
			for _, after := range []*sqldialect.Cursor{nil, {CreatedAt: old.Add(-time.Hour)}} {
				for _, skip := range [][]sqldialect.KeySeq{nil, {{Key: "zz", Seq: 3}, {Key: "k", Seq: 0}}} {
					for _, lock := range []bool{false, true} {
						r, err := s.readFirst(ctx, tx, s.pendingParams(idx[0], idx[1], after, skip, lock))
						if err != nil {
							t.Errorf("index %v after %v skip %v lock %v: %v", idx, after, skip, lock, err)
							continue
						}
						id := ""
						if r.first != nil {
							id = r.first.ID
						}
						t.Logf("index %v after %v skip %v lock %v: %s key %v hold %v", idx, after != nil, skip, lock, id, r.key, r.hold)
						switch {
						case id == "k#1" && (r.hold.Sub(end).Abs() > time.Second || !r.inBackoff()):
							t.Errorf("index %v after %v skip %v lock %v: k#1 read with hold %v, want its backoff's end %v", idx, after != nil, skip, lock, r.hold, end)
						case id == "f" && r.inBackoff():
							t.Errorf("index %v after %v skip %v lock %v: a foreign row without a seq read as in backoff", idx, after != nil, skip, lock)
						}
					}
				}
			}
		}
	})
}
