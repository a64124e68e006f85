package outbox

import (
	"context"
	"database/sql"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/acemq/watermill-outbox/internal/sqldialect"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// A keyed record stuck at MaxAttempts holds the records after it in its
// key until it is retried: pending, under MaxAttempts, and no claim takes
// them. Read as where the pending rows start, the first of them kept the
// floor an hour back beside a held snapshot, every claim walked the dead
// entries since, and the measure found no gain: one stuck key, an
// ordinary state, turned the floor off. The floor passes them; a Retry of
// the stuck record makes the next claim measure, and it is claimed, then
// the one it held.
func TestClaim_StuckKeyBesideAHeldSnapshot_FloorPassesWhatItHolds(t *testing.T) {
	t.Parallel()
	eachFloorKind(t, func(t *testing.T, db *testdb.DB, d Dialect) {
		ctx := context.Background()
		holdSnapshot(t, db)
		publishOld(t, db, 100_000)
		hourAgo := time.Now().Add(-time.Hour).UTC()
		writeKeyed(t, db, "k#1", "k", 1, hourAgo, 1000)
		writeKeyed(t, db, "k#2", "k", 2, hourAgo.Add(time.Millisecond), 0)
		s, err := NewStore(db.DB, StoreConfig{Dialect: d})
		if err != nil {
			t.Fatal(err)
		}
		claim := func() []string { ids, _ := claimAll(t, s); return ids }
		for i := 0; i < 5 && !s.floor.on; i++ {
			writeAt(t, db, fmt.Sprintf("new%d", i), time.Now())
			s.floor.check, s.floor.missed = true, 0 // measure now
			claim()
		}
		if !s.floor.on || !s.floor.at.After(hourAgo.Add(time.Minute)) {
			t.Fatalf("beside 100,000 dead entries and a stuck key: floor on %v at %v; want on, past the records the stuck one holds (%v)", s.floor.on, s.floor.at, hourAgo)
		}
		if n, err := s.Retry(ctx, "k#1"); err != nil || n != 1 {
			t.Fatalf("Retry: %d, %v", n, err)
		}
		if ids := claim(); !slices.Equal(ids, []string{"k#1"}) {
			t.Fatalf("the claim after the Retry took %v, want [k#1]", ids)
		}
		if ids := claim(); !slices.Equal(ids, []string{"k#2"}) {
			t.Fatalf("the claim after k#1 was published took %v, want [k#2]", ids)
		}
	})
}

// The floor's read passes the records a stuck one holds by reading the
// record before the first of them, one point read. A first form asked
// whether any earlier record of the key was stuck, and MariaDB answered
// through the unique (aggregate_id, seq) index, one lookup per earlier
// record, published ones included: 107 ms a read for a key with 100,000
// published records kept, against 0.15 ms. Here such a key has its next
// record stuck and one held behind it, and a second key of the same
// history is not stuck: the read from the head finds the right row and
// reads a few index entries, not the keys' histories; a Retry of the stuck
// record makes it the first again.
func TestPendingStart_KeyWithLongHistory_ReadsOneRecordOfIt(t *testing.T) {
	t.Parallel()
	eachFloorKind(t, func(t *testing.T, db *testdb.DB, d Dialect) {
		ctx := context.Background()
		const history = 100_000
		hourAgo := time.Now().Add(-time.Hour).UTC().Truncate(time.Second)
		// Published as a relay does on MySQL, where InnoDB's statistics
		// after it made MariaDB choose the wrong index; inserted published
		// on PostgreSQL, where another test's held snapshot (in the same
		// database) would keep VACUUM from removing the entries an UPDATE
		// leaves in the pending index, and they would be counted here.
		byUpdate := db.Kind == testdb.MySQL
		publishKeyHistory(t, db, "k", history, hourAgo, byUpdate)
		publishKeyHistory(t, db, "j", history, hourAgo, byUpdate)
		writeKeyed(t, db, "k#stuck", "k", history+1, hourAgo.Add(2*time.Minute), 1000)
		writeKeyed(t, db, "k#held", "k", history+2, hourAgo.Add(3*time.Minute), 0)
		writeKeyed(t, db, "j#next", "j", history+1, hourAgo.Add(4*time.Minute), 0)
		writeAt(t, db, "unkeyed", hourAgo.Add(5*time.Minute))
		vacuum(t, db)
		s, err := NewStore(db.DB, StoreConfig{Dialect: d})
		if err != nil {
			t.Fatal(err)
		}
		index, keyIndex := indexesOf(t, s)
		first := func() (string, int) {
			t.Helper()
			tx, err := db.DB.BeginTx(ctx, nil)
			if err != nil {
				t.Fatal(err)
			}
			defer tx.Rollback()
			before := entriesRead(t, db, tx)
			start, err := s.pendingStart(ctx, tx, index, keyIndex)
			c := start.first
			if err != nil {
				t.Fatal(err)
			}
			read := entriesRead(t, db, tx) - before
			if c == nil {
				return "", read
			}
			return c.ID, read
		}
		if id, read := first(); id != "j#next" || read > 100 {
			t.Fatalf("where the pending rows start beside a stuck key of %d published records: %q, %d index entries read; want j#next, at most 100", history, id, read)
		}
		if n, err := s.Retry(ctx, "k#stuck"); err != nil || n != 1 {
			t.Fatalf("Retry: %d, %v", n, err)
		}
		if id, read := first(); id != "k#stuck" || read > 100 {
			t.Fatalf("after the Retry: %q, %d index entries read; want k#stuck, at most 100", id, read)
		}
	})
}

// Beside a held snapshot, a stuck key holds 5,000 records, after 5,000 of
// its records published since the snapshot (whose entries the index of a
// key's pending rows keeps), in a table whose statistics were taken before
// (autoanalyze waits for a tenth of the table to change). A form that
// asked the database, for each row it walked, whether its key's head was
// stuck read the key's head again for each held record, where PostgreSQL
// did not memoize it: 1.6 s, 25 million entries. The read from the head
// reads the stuck record once: about 10,000 entries, the held records and
// the dead entries of the pending index once each.
func TestPendingStart_StuckKeyHoldingManyBesideASnapshot_ReadsTheStuckRecordOnce(t *testing.T) {
	t.Parallel()
	eachFloorKind(t, func(t *testing.T, db *testdb.DB, d Dialect) {
		ctx := context.Background()
		threeHoursAgo := time.Now().Add(-3 * time.Hour).UTC().Truncate(time.Second)
		published := time.Now().UTC()
		insertRows(t, db, 50_000, func(i int) (string, time.Time, any, any, any) { // many keys, published long ago
			return fmt.Sprintf("p%06d", i), threeHoursAgo.Add(time.Duration(i) * time.Millisecond), fmt.Sprintf("key%06d", i), 1, published
		})
		vacuum(t, db)
		if db.Kind == testdb.MySQL {
			db.MustExec("ANALYZE TABLE acemq_outbox")
		}
		holdSnapshot(t, db)
		const n = 5_000
		publishKeyHistory(t, db, "k", n, threeHoursAgo.Add(time.Hour), true)
		heldFrom := threeHoursAgo.Add(2 * time.Hour)
		writeKeyed(t, db, "k#stuck", "k", n+1, heldFrom, 1000)
		insertRows(t, db, n, func(i int) (string, time.Time, any, any, any) {
			return fmt.Sprintf("k#held%05d", i), heldFrom.Add(time.Duration(i+1) * time.Millisecond), "k", n + 2 + i, nil
		})
		writeAt(t, db, "u", heldFrom.Add(time.Minute))
		s, err := NewStore(db.DB, StoreConfig{Dialect: d})
		if err != nil {
			t.Fatal(err)
		}
		index, keyIndex := indexesOf(t, s)
		tx, err := db.DB.BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		before := entriesRead(t, db, tx)
		start, err := s.pendingStart(ctx, tx, index, keyIndex)
		first, skip := start.first, start.skip
		read := entriesRead(t, db, tx) - before
		_ = tx.Rollback()
		switch {
		case err != nil:
			t.Fatal(err)
		case first == nil || first.ID != "u" || len(skip) != 1 || skip[0] != (sqldialect.KeySeq{Key: "k", Seq: n + 1}):
			t.Fatalf("from the head: %+v, passing %v; want u, passing k at %d", first, skip, n+1)
		case read > 20_000:
			t.Fatalf("from the head past %d records a stuck one holds, beside %d dead entries of its key: %d rows and index entries read, want about 10,000", n, n, read)
		}
		// Measure now, as the relay's claim would, keeping the floor
		// whatever it gains: where it stands is what is tested here.
		s.floor.check, s.floor.missed, s.floor.gainAbove = true, 0, -time.Hour
		if ids, _ := claimAll(t, s); !slices.Equal(ids, []string{"u"}) || !s.floor.on || !s.floor.at.After(heldFrom.Add(time.Second)) {
			t.Fatalf("the claim that measures took %v, floor on %v at %v; want [u], the floor on past the held records (%v)", ids, s.floor.on, s.floor.at, heldFrom)
		}
	})
}

// Beside a held snapshot, a key whose 50,000 records were published under
// it keeps their entries in the index of a key's pending rows; its next
// record is the first pending row, nothing stuck. The floor's read before
// each claim reads from the floor in the pending index alone, and the
// measure's read from the head reads the record before it in its key, a
// point read: forms that looked up the key's first pending record walked
// those 50,000 entries, at every claim (3.8 ms against 0.17) or at every
// measure. Only PostgreSQL's half counts them: MariaDB's Handler_read_*
// counters do not count the entries InnoDB has marked deleted.
func TestFloorReads_HotKeyBesideASnapshot_NoKeyStuck_ReadAFewEntries(t *testing.T) {
	t.Parallel()
	eachFloorKind(t, func(t *testing.T, db *testdb.DB, d Dialect) {
		ctx := context.Background()
		holdSnapshot(t, db)
		const history = 50_000
		publishKeyHistory(t, db, "k", history, time.Now().Add(-time.Hour).UTC().Truncate(time.Second), true)
		writeKeyed(t, db, "k#next", "k", history+1, time.Now().Add(-time.Minute), 0)
		s, err := NewStore(db.DB, StoreConfig{Dialect: d})
		if err != nil {
			t.Fatal(err)
		}
		index, keyIndex := indexesOf(t, s)
		tx, err := db.DB.BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback()
		b0 := entriesRead(t, db, tx)
		r, err := s.pendingFirst(ctx, tx, index, keyIndex, &sqldialect.Cursor{CreatedAt: time.Now().Add(-2 * time.Minute)}, nil)
		first := r.first
		b1 := entriesRead(t, db, tx)
		if err != nil || first == nil || first.ID != "k#next" || b1-b0 > 100 {
			t.Fatalf("the floor's read before a claim: %+v (%v), %d rows and index entries read; want k#next, a few", first, err, b1-b0)
		}
		r, err = s.pendingFirst(ctx, tx, index, keyIndex, nil, nil)
		first = r.first
		b2 := entriesRead(t, db, tx)
		if err != nil || first == nil || first.ID != "k#next" {
			t.Fatalf("from the head: %+v, %v; want k#next", first, err)
		}
		start, err := s.pendingStart(ctx, tx, index, keyIndex)
		first, skip, sent := start.first, start.skip, start.sent
		b3 := entriesRead(t, db, tx)
		if err != nil || first == nil || first.ID != "k#next" || len(skip) != 0 || sent != 2 {
			t.Fatalf("passing stuck keys: %+v, passing %v, %d statements, %v; want k#next, none passed, 2", first, skip, sent, err)
		}
		if more := (b3 - b2) - (b2 - b1); more > 100 {
			t.Errorf("the record before k#next, beside %d of its key's records published under a snapshot: %d entries read, want a few", history, more)
		}
	})
}

// The measure of a floor already on compares one read from the head with
// one from the floor. Where the first pending row is keyed, or stuck keys
// are passed, the read from the head is several statements: timed whole,
// each round trip counted as a gain, and with no dead entry a floor kept
// by mistake stayed on for good (a database 5 ms away and a keyed first
// row; 20 stuck keys on a local one). Here each statement is 25 ms away
// and a gain must be 15 ms, one round trip but not this machine's own
// delays: the floor is turned off, as with an unkeyed first row.
func TestMeasureFloor_FloorOnWithoutDeadEntries_KeyedOrStuck_TurnsItOff(t *testing.T) {
	t.Parallel()
	eachFloorKind(t, func(t *testing.T, db *testdb.DB, d Dialect) {
		ctx := context.Background()
		s, err := NewStore(db.DB, StoreConfig{Dialect: d})
		if err != nil {
			t.Fatal(err)
		}
		s.floor.gainAbove = 15 * time.Millisecond
		index, keyIndex := indexesOf(t, s)
		conn, err := db.DB.Conn(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		// Measures of a floor already on, turned on beside a snapshot
		// since ended, after one that warms the caches and prepares the
		// statements: one a busy machine delayed by 15 ms keeps it on a
		// period, as it may; three in a row keep it on for good.
		measure := func(what string) {
			t.Helper()
			var (
				m   floorMeasure
				q   *delayedQuerier
				err error
			)
			for i := range 4 {
				s.floor.on = true
				q = &delayedQuerier{conn: conn, all: true, delay: 25 * time.Millisecond}
				if m, err = s.measureFloor(ctx, q, index, keyIndex, time.Now()); err != nil {
					t.Fatal(err)
				}
				if i > 0 && !m.on {
					return
				}
			}
			t.Errorf("%s, each statement 25 ms away, no dead entry: three measures of a floor already on kept it on (the last: %d statements, head %v)", what, q.sent, m.head)
		}
		writeAt(t, db, "unkeyed", time.Now().Add(-time.Minute))
		measure("an unkeyed first row")
		db.MustExec("DELETE FROM acemq_outbox")
		writeKeyed(t, db, "k#1", "k", 1, time.Now().Add(-2*time.Minute), 1000)
		writeKeyed(t, db, "k#2", "k", 2, time.Now().Add(-time.Minute), 0)             // held, its predecessor read
		writeKeyed(t, db, "j#2", "j", 2, time.Now().Add(-time.Minute+time.Second), 0) // its predecessor gone
		measure("a keyed first row, its predecessor stuck")
		db.MustExec("DELETE FROM acemq_outbox")
		writeKeyedFlow(t, db)
		measure("a keyed first row, its predecessor published")
		db.MustExec("DELETE FROM acemq_outbox")
		for i := range 4 {
			key := fmt.Sprintf("s%02d", i)
			at := time.Now().Add(-time.Hour + time.Duration(i)*time.Second)
			writeKeyed(t, db, key+"#1", key, 1, at, 1000)
			writeKeyed(t, db, key+"#2", key, 2, at.Add(time.Millisecond), 0)
		}
		writeAt(t, db, "u", time.Now().Add(-time.Minute))
		measure("4 stuck keys")
	})
}

// A key whose seq 1 is published and whose seq 2, the first pending row,
// is not stuck: the ordinary state of a keyed flow.
func writeKeyedFlow(t *testing.T, db *testdb.DB) {
	t.Helper()
	db.MustExec(db.Rebind("INSERT INTO acemq_outbox (id, exchange_name, routing_key, body, headers, created_at, aggregate_id, seq, published_at) VALUES ('k#1', 'x', 'k', 'b', '{}', ?, 'k', 1, ?)"),
		time.Now().Add(-2*time.Minute).UTC(), time.Now().UTC())
	writeKeyed(t, db, "k#2", "k", 2, time.Now().Add(-time.Minute), 0)
}

// recordingQuerier runs statements on q and records them.
type recordingQuerier struct {
	q    rowQuerier
	sent []string
}

func (r *recordingQuerier) QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row {
	r.sent = append(r.sent, query)
	return r.q.QueryRowContext(ctx, query, args...)
}

func (r *recordingQuerier) QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error) {
	r.sent = append(r.sent, query)
	return r.q.QueryContext(ctx, query, args...)
}

// fromHead counts the reads from the head of the pending index, the only
// ones with the part that reads a NULL created_at.
func (r *recordingQuerier) fromHead() int {
	n := 0
	for _, s := range r.sent {
		if strings.Contains(s, "nulls_last") {
			n++
		}
	}
	return n
}

// In a keyed flow (the first pending row's predecessor published, nothing
// stuck), a measure sends one statement more than with an unkeyed first
// row: three where it finds no gain, and two more where that row is older
// than lag (the rows below lag before now, and the walk from the first of
// them, which finds no entry worth points here). Timed alone where it had nothing to
// pass, the first read from the head is the measure's only one; beside a
// held snapshot, timing it again walked from the head twice in the claim
// due at each period's end (40,005 entries beside 20,000, PostgreSQL).
func TestMeasureFloor_KeyedFlow_ReadsFromTheHeadOnce(t *testing.T) {
	t.Parallel()
	eachFloorKind(t, func(t *testing.T, db *testdb.DB, d Dialect) {
		ctx := context.Background()
		holdSnapshot(t, db)
		publishOld(t, db, 20_000)
		s, err := NewStore(db.DB, StoreConfig{Dialect: d})
		if err != nil {
			t.Fatal(err)
		}
		index, keyIndex := indexesOf(t, s)
		measure := func(what string, on bool, want int) {
			t.Helper()
			// No gain: the first round ends it (a floor kept on MySQL gets
			// a second). Whether 20,000 dead entries show a gain depends
			// on the server's other transactions on MySQL (see lockMeasure).
			s.floor.on, s.floor.gainAbove, s.floor.pointsAbove = on, time.Hour, time.Hour
			tx, err := db.DB.BeginTx(ctx, nil)
			if err != nil {
				t.Fatal(err)
			}
			defer tx.Rollback()
			q := &recordingQuerier{q: tx}
			if _, err := s.measureFloor(ctx, q, index, keyIndex, time.Now()); err != nil {
				t.Fatal(err)
			}
			heads := 1
			if on && d == MySQL {
				// A floor kept on MySQL gets one more round, of two
				// statements, before a miss (see measureFloor).
				heads, want = 2, want+2
			}
			if q.fromHead() != heads || len(q.sent) != want {
				t.Errorf("%s, the floor on %v: %d reads from the head of %d statements; want %d of %d", what, on, q.fromHead(), len(q.sent), heads, want)
			}
		}
		writeAt(t, db, "u", time.Now().Add(-time.Minute))
		measure("an unkeyed first row", true, 4)
		measure("an unkeyed first row", false, 4)
		db.MustExec("DELETE FROM acemq_outbox WHERE id = 'u'")
		writeKeyedFlow(t, db)
		measure("a keyed first row, its predecessor published", true, 5)
		measure("a keyed first row, its predecessor published", false, 5)
	})
}

// indexesOf looks up the indexes s's claims name, as a relay does when it
// starts: on MySQL its pending index and its index of a key's pending
// rows, which must both be there; "" elsewhere.
func indexesOf(t testing.TB, s *Store) (index, keyIndex string) {
	t.Helper()
	if _, ok := s.q.PendingIndex(); !ok {
		return "", ""
	}
	index, keyIndex, err := s.findIndexes(context.Background(), s.db)
	if err != nil || index == "" || keyIndex == "" {
		t.Fatalf("the indexes of %s: %q, %q, %v", s.q.Table(), index, keyIndex, err)
	}
	return index, keyIndex
}

// writeKeyed writes a pending record of key at seq, created at at, after
// attempts attempts.
func writeKeyed(t testing.TB, db *testdb.DB, id, key string, seq int64, at time.Time, attempts int) {
	t.Helper()
	db.MustExec(db.Rebind("INSERT INTO acemq_outbox (id, exchange_name, routing_key, body, headers, created_at, aggregate_id, seq, attempts) VALUES (?, 'x', 'k', 'b', '{}', ?, ?, ?, ?)"),
		id, at.UTC(), key, seq, attempts)
}

// publishKeyHistory writes n published records of key, seq 1 to n,
// created a millisecond apart from from on: pending, then published by an
// UPDATE, as a relay does, where byUpdate is set (the entries the pending
// rows' indexes keep of them stay there while a snapshot is held); as
// published, never in those indexes, where it is not.
func publishKeyHistory(t testing.TB, db *testdb.DB, key string, n int, from time.Time, byUpdate bool) {
	t.Helper()
	now := time.Now().UTC()
	var published any
	if !byUpdate {
		published = now
	}
	insertRows(t, db, n, func(i int) (string, time.Time, any, any, any) {
		return fmt.Sprintf("%s#%06d", key, i+1), from.Add(time.Duration(i) * time.Millisecond), key, i + 1, published
	})
	if byUpdate {
		db.MustExec(db.Rebind("UPDATE acemq_outbox SET published_at = ? WHERE aggregate_id = ? AND published_at IS NULL"), now, key)
	}
}

// vacuum removes, on PostgreSQL, the index entries of the outbox's rows
// since published, and brings the planner's statistics up to date, as
// autovacuum does some while after a bulk write. MySQL's purge removes
// them by itself, with no snapshot held; its statistics are left as InnoDB
// keeps them after the write, which is when MariaDB chose the wrong index.
func vacuum(t testing.TB, db *testdb.DB) {
	t.Helper()
	if db.Kind == testdb.Postgres {
		db.MustExec("VACUUM ANALYZE acemq_outbox")
	}
}

// entriesRead is how many rows and index entries the statements of tx
// have read so far: on PostgreSQL those its scans of the outbox and its
// indexes returned, on MySQL its handler reads (the session's; a few
// hundred come with each status read itself).
func entriesRead(t testing.TB, db *testdb.DB, tx *sql.Tx) int {
	t.Helper()
	var n int
	if db.Kind == testdb.Postgres {
		if err := tx.QueryRow(`SELECT pg_stat_get_xact_tuples_returned('acemq_outbox'::regclass) +
			(SELECT COALESCE(SUM(pg_stat_get_xact_tuples_returned(indexrelid)), 0) FROM pg_index WHERE indrelid = 'acemq_outbox'::regclass)`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	rows, err := tx.Query("SHOW SESSION STATUS WHERE Variable_name IN ('Handler_read_key', 'Handler_read_next', 'Handler_read_prev', 'Handler_read_rnd_next', 'Handler_read_first', 'Handler_read_last')")
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	for rows.Next() {
		var name string
		var v int
		if err := rows.Scan(&name, &v); err != nil {
			t.Fatal(err)
		}
		n += v
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return n
}
