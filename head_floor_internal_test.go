package outbox

import (
	"context"
	"database/sql"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/acemq/watermill-outbox/internal/sqldialect"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// floorKinds are the databases whose pending index keeps the entries of
// rows published under a held snapshot, where the relay keeps a floor.
var floorKinds = []struct {
	kind string
	d    Dialect
}{{testdb.Postgres, Postgres}, {testdb.MySQL, MySQL}}

// eachFloorKind runs fn as a parallel subtest on a migrated database of
// each of floorKinds.
func eachFloorKind(t *testing.T, fn func(t *testing.T, db *testdb.DB, d Dialect)) {
	t.Helper()
	for _, c := range floorKinds {
		t.Run(c.kind, func(t *testing.T) {
			t.Parallel()
			db := testdb.New(t, c.kind)
			if err := Migrate(context.Background(), db.DB, c.d); err != nil {
				t.Fatal(err)
			}
			fn(t, db, c.d)
		})
	}
}

// holdSnapshot starts a transaction on a connection of its own that holds
// a snapshot, as a pg_dump or a mysqldump --single-transaction does, until
// the test ends.
func holdSnapshot(t testing.TB, db *testdb.DB) {
	t.Helper()
	holdSnapshotUntil(t, db)
}

// holdSnapshotUntil is holdSnapshot, and returns what ends the snapshot
// before the test does.
func holdSnapshotUntil(t testing.TB, db *testdb.DB) (end func()) {
	t.Helper()
	ctx := context.Background()
	conn, err := db.DB.Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	begin := "BEGIN ISOLATION LEVEL REPEATABLE READ"
	if db.Kind == testdb.MySQL {
		begin = "START TRANSACTION WITH CONSISTENT SNAPSHOT"
	}
	if _, err := conn.ExecContext(ctx, begin); err != nil {
		t.Fatal(err)
	}
	var n int
	if err := conn.QueryRowContext(ctx, "SELECT COUNT(*) FROM acemq_outbox").Scan(&n); err != nil {
		t.Fatal(err) // the snapshot is taken
	}
	var once sync.Once
	end = func() {
		once.Do(func() {
			_, _ = conn.ExecContext(ctx, "ROLLBACK")
			_ = conn.Close()
		})
	}
	t.Cleanup(end)
	return end
}

// publishOld writes n rows an hour old and marks them published, as a
// relay would have: under a held snapshot their entries stay in the
// pending index.
func publishOld(t testing.TB, db *testdb.DB, n int) {
	t.Helper()
	base := time.Now().Add(-time.Hour).UTC().Truncate(time.Second)
	insertRows(t, db, n, func(i int) (id string, created time.Time, key, seq, published any) {
		return fmt.Sprintf("old%06d", i), base.Add(time.Duration(i) * time.Millisecond), nil, nil, nil
	})
	db.MustExec(db.Rebind("UPDATE acemq_outbox SET published_at = ? WHERE published_at IS NULL"), time.Now().UTC())
}

// insertRows writes n rows of the outbox, 500 a statement, row i as row
// gives it: its id, created_at, aggregate_id, seq and published_at (nil
// for NULL).
func insertRows(t testing.TB, db *testdb.DB, n int, row func(i int) (id string, created time.Time, key, seq, published any)) {
	t.Helper()
	for start := 0; start < n; start += 500 {
		var (
			values []string
			args   []any
		)
		for i := start; i < min(start+500, n); i++ {
			id, created, key, seq, published := row(i)
			values = append(values, "(?, 'x', 'k', 'b', '{}', ?, ?, ?, ?)")
			args = append(args, id, created, key, seq, published)
		}
		db.MustExec(db.Rebind("INSERT INTO acemq_outbox (id, exchange_name, routing_key, body, headers, created_at, aggregate_id, seq, published_at) VALUES "+strings.Join(values, ", ")), args...)
	}
}

// writeAt writes a pending unkeyed row created at at.
func writeAt(t testing.TB, db *testdb.DB, id string, at time.Time) {
	t.Helper()
	db.MustExec(db.Rebind("INSERT INTO acemq_outbox (id, exchange_name, routing_key, body, headers, created_at) VALUES (?, 'x', 'k', 'b', '{}', ?)"), id, at.UTC())
}

// writeFreshAndStuck writes a pending row "fresh", created now, and a row
// "stuck" an hour old at 1,000 attempts, which a Retry makes pending
// below any floor.
func writeFreshAndStuck(t testing.TB, db *testdb.DB) {
	t.Helper()
	writeAt(t, db, "fresh", time.Now())
	writeStuckAt(t, db, "stuck", time.Now().Add(-time.Hour))
}

// writeStuckAt writes an unkeyed row id created at at, stuck at 1,000
// attempts: a Retry makes it pending.
func writeStuckAt(t testing.TB, db *testdb.DB, id string, at time.Time) {
	t.Helper()
	var arg any = at.UTC()
	if db.Kind == testdb.MySQL {
		arg = at.UTC().Format("2006-01-02 15:04:05.000000")
	}
	db.MustExec(db.Rebind("INSERT INTO acemq_outbox (id, exchange_name, routing_key, body, headers, created_at, attempts) VALUES (?, 'x', 'k', 'b', '{}', ?, 1000)"), id, arg)
}

// pendingEntriesRead is how many entries of the pending index the
// statements of tx returned to it so far (PostgreSQL), dead ones with the
// live: the walk a claim from the head makes behind a held snapshot.
func pendingEntriesRead(t testing.TB, tx claimTx) int {
	t.Helper()
	var n int
	if err := tx.QueryRowContext(context.Background(), "SELECT pg_stat_get_xact_tuples_returned('acemq_outbox_pending'::regclass)").Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// floorStore is a Store over db that keeps its floor (floorAlwaysOn).
func floorStore(t testing.TB, db *testdb.DB, d Dialect, every time.Duration) *Store {
	t.Helper()
	s, err := NewStore(db.DB, StoreConfig{Dialect: d})
	if err != nil {
		t.Fatal(err)
	}
	floorAlwaysOn(s, every)
	return s
}

// allowNullCreatedAt lets the outbox of db hold a NULL created_at, as
// another library's table may.
func allowNullCreatedAt(db *testdb.DB) {
	alter := "ALTER TABLE acemq_outbox ALTER created_at DROP NOT NULL"
	if db.Kind == testdb.MySQL {
		alter = "ALTER TABLE acemq_outbox MODIFY created_at DATETIME(6) NULL"
	}
	db.MustExec(alter)
}

// claimAll claims up to 100 rows through s, from where its floor says,
// marks them published, and returns their ids and where the claim started.
func claimAll(t testing.TB, s *Store) (ids []string, from *sqldialect.Cursor) {
	t.Helper()
	ctx := context.Background()
	cl, err := s.claimBatch(ctx, 100, "r", time.Minute, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range cl.rows {
		ids = append(ids, r.ID)
	}
	if err := s.finish(ctx, cl, ids, nil); err != nil {
		t.Fatal(err)
	}
	return ids, cl.from
}

// floorAlwaysOn makes s keep its floor, read from the head by its next
// claim or probe, and walk from the head again only every every; at the
// first pending row, however old, never above it with points (see
// pointsStore).
func floorAlwaysOn(s *Store, every time.Duration) {
	s.floor.checkAbove, s.floor.checkEvery, s.floor.gainAbove, s.floor.pointsAbove = 0, 0, -time.Hour, time.Hour
	s.floor.everyMin, s.floor.everyMax = every, every
	s.floor.on, s.floor.next = true, time.Time{}
}

// Behind 20,000 rows published while a snapshot was held, a claim from the
// head read every one of their entries in the pending index; with the
// floor on, the claims after the first start at the pending rows.
func TestClaim_BesideAHeldSnapshot_StartsAtTheFloorNotTheHead(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, testdb.Postgres)
	ctx := context.Background()
	if err := Migrate(ctx, db.DB, Postgres); err != nil {
		t.Fatal(err)
	}
	holdSnapshot(t, db)
	const published = 20000
	publishOld(t, db, published)
	for i := range 5 {
		writeAt(t, db, fmt.Sprintf("new%d", i), time.Now())
	}
	// One connection, whose statistics are flushed before each claim: the
	// counts a transaction reads are those not flushed yet, its own and
	// those of the transactions before it on the connection.
	pool, err := sql.Open("pgx", db.DSN)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = pool.Close() }()
	pool.SetMaxOpenConns(1)
	flush := func() {
		if _, err := pool.ExecContext(ctx, "SELECT pg_stat_force_next_flush()"); err != nil {
			t.Fatal(err)
		}
	}
	s, err := NewStore(pool, StoreConfig{Dialect: Postgres})
	if err != nil {
		t.Fatal(err)
	}
	floorAlwaysOn(s, time.Hour)
	read := func() (ids []string, entries int) {
		flush()
		cl, err := s.claimBatch(ctx, 100, "r", time.Minute, nil, nil)
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = s.abandon(ctx, cl) }()
		for _, r := range cl.rows {
			ids = append(ids, r.ID)
		}
		return ids, pendingEntriesRead(t, cl.tx)
	}
	want := []string{"new0", "new1", "new2", "new3", "new4"}
	ids, head := read()
	if !slices.Equal(ids, want) || head < published {
		t.Fatalf("the first claim (from the head) took %v and read %d entries of the pending index, want %v and at least %d", ids, head, want, published)
	}
	ids, floor := read()
	if !slices.Equal(ids, want) {
		t.Fatalf("the claim at the floor took %v, want %v", ids, want)
	}
	if floor > 100 {
		t.Errorf("the claim at the floor read %d entries of the pending index (%d from the head): it walked the published rows' entries", floor, head)
	}

	// The idle probe too.
	flush()
	tx, err := pool.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback() }()
	found, err := s.probe(ctx, tx)
	if err != nil || !found {
		t.Fatalf("the probe found nothing (%v)", err)
	}
	if n := pendingEntriesRead(t, tx); n > 100 {
		t.Errorf("the probe at the floor read %d entries of the pending index", n)
	}
}

// Rows that become pending below the floor (a transaction committed long
// after its Publish, a Retry from another process) are not claimed at the
// floor, but by the next claim from the head, which comes within the
// floor's period: none waits longer. And a relay publishes every one.
func TestClaim_FloorOn_RowsBelowTheFloorClaimedWithinItsPeriod(t *testing.T) {
	t.Parallel()
	eachFloorKind(t, func(t *testing.T, db *testdb.DB, d Dialect) {
		ctx := context.Background()
		s := floorStore(t, db, d, time.Hour)
		period := func(every time.Duration) { // from now on
			s.floor.everyMin, s.floor.everyMax, s.floor.next = every, every, time.Now().Add(every)
		}
		writeAt(t, db, "first", time.Now())
		claim := func() []string { ids, _ := claimAll(t, s); return ids }
		if ids := claim(); !slices.Equal(ids, []string{"first"}) { // from the head: the floor is read
			t.Fatalf("claimed %v, want [first]", ids)
		}
		if !s.floor.on {
			t.Fatal("the floor is not on")
		}
		// Committed now, published by its service a minute ago: below the
		// floor, which stands at most floorLag before now.
		writeAt(t, db, "late", time.Now().Add(-time.Minute))
		writeAt(t, db, "fresh", time.Now())
		ids := claim()
		if !slices.Equal(ids, []string{"fresh"}) {
			t.Fatalf("the claim at the floor took %v, want [fresh]: the late row lies below the floor", ids)
		}
		const every = 300 * time.Millisecond
		period(every)
		start := time.Now()
		for len(ids) == 0 || ids[0] != "late" {
			if time.Since(start) > 20*every {
				t.Fatalf("the row below the floor was not claimed in %v, the floor's period being %v", time.Since(start), every)
			}
			ids = claim()
			if len(ids) == 0 {
				time.Sleep(every / 10)
			}
		}
		// A Retry in this process makes the next claim start at the head.
		period(time.Hour)
		writeAt(t, db, "older", time.Now().Add(-time.Hour)) // below the floor: "late" was the first pending row at the last read
		db.MustExec(db.Rebind("UPDATE acemq_outbox SET attempts = 10 WHERE id = ?"), "older")
		if _, err := s.Retry(ctx, "older"); err != nil {
			t.Fatal(err)
		}
		if ids := claim(); !slices.Equal(ids, []string{"older"}) {
			t.Fatalf("the claim after a Retry took %v, want [older]", ids)
		}
	})
}

// The floor is kept only while the walk from the head is slow: a read of
// it from the head that is quick turns it off, and claims start at the
// head again, where nothing waits for a period.
func TestClaim_FloorTurnsOffOnceTheHeadIsQuick(t *testing.T) {
	t.Parallel()
	eachFloorKind(t, func(t *testing.T, db *testdb.DB, d Dialect) {
		ctx := context.Background()
		s := floorStore(t, db, d, time.Hour)
		writeAt(t, db, "first", time.Now())
		cl, err := s.claimBatch(ctx, 100, "r", time.Minute, nil, nil)
		if err != nil {
			t.Fatal(err)
		}
		_ = s.abandon(ctx, cl)
		if !s.floor.on {
			t.Fatal("the floor is not on")
		}
		s.floor.gainAbove = time.Hour // the floor saves too little now
		s.floor.next = time.Time{}    // the period is over
		if cl, err = s.claimBatch(ctx, 100, "r", time.Minute, nil, nil); err != nil {
			t.Fatal(err)
		}
		_ = s.abandon(ctx, cl)
		if d == MySQL {
			// There the plain reads' miss sends the next claim to a
			// locking measure, which decides (see lockMeasure).
			if !s.floor.lockDue {
				t.Fatal("no locking measure due after the plain reads' miss")
			}
			if cl, err = s.claimBatch(ctx, 100, "r", time.Minute, nil, nil); err != nil {
				t.Fatal(err)
			}
			_ = s.abandon(ctx, cl)
		}
		if s.floor.on {
			t.Fatal("the floor stayed on after a quick read from the head")
		}
		writeAt(t, db, "late", time.Now().Add(-time.Minute))
		if cl, err = s.claimBatch(ctx, 100, "r", time.Minute, nil, nil); err != nil {
			t.Fatal(err)
		}
		defer func() { _ = s.abandon(ctx, cl) }()
		if len(cl.rows) != 2 || cl.rows[0].ID != "late" {
			t.Fatalf("claimed %d rows, the first %v; want [late first]", len(cl.rows), cl.rows)
		}
	})
}

// With the floor on, the idle probe asks what the claim would take: a
// key's head below the floor, which the claim leaves to the next walk from
// the head, is not a reason to claim (each poll of the period claimed, and
// took nothing).
func TestProbe_FloorOn_AgreesWithTheClaim(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, testdb.Postgres)
	ctx := context.Background()
	if err := Migrate(ctx, db.DB, Postgres); err != nil {
		t.Fatal(err)
	}
	s := floorStore(t, db, Postgres, time.Hour)
	if found, err := s.probe(ctx, db.DB); err != nil || found { // reads the floor from the head
		t.Fatalf("the probe of an empty outbox found %v (%v)", found, err)
	}
	db.MustExec(db.Rebind("INSERT INTO acemq_outbox (id, exchange_name, routing_key, body, headers, created_at, aggregate_id, seq) VALUES ('k#1', 'x', 'k', 'b', '{}', ?, 'k', 1)"),
		time.Now().Add(-time.Minute).UTC())
	found, err := s.probe(ctx, db.DB)
	if err != nil {
		t.Fatal(err)
	}
	cl, err := s.claimBatch(ctx, 100, "r", time.Minute, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = s.abandon(ctx, cl) }()
	if found != (len(cl.rows) > 0) {
		t.Fatalf("the probe found a row to claim: %v; the claim after it took %d", found, len(cl.rows))
	}
}

// A drain goes on from its cursor, and would pass over what waits below
// the floor until it ends: once the floor's period is over, its claim
// starts at the head.
func TestClaim_FloorOn_DrainsClaimFromTheHeadOncePerPeriod(t *testing.T) {
	t.Parallel()
	eachFloorKind(t, func(t *testing.T, db *testdb.DB, d Dialect) {
		ctx := context.Background()
		s := floorStore(t, db, d, time.Hour)
		writeAt(t, db, "first", time.Now())
		cl, err := s.claimBatch(ctx, 100, "r", time.Minute, nil, nil) // measures: the floor is on
		if err != nil {
			t.Fatal(err)
		}
		_ = s.abandon(ctx, cl)
		writeAt(t, db, "late", time.Now().Add(-time.Minute))
		drain := &sqldialect.Cursor{CreatedAt: time.Now().Add(-time.Second), ID: "x"}
		claim := func() []string {
			cl, err := s.claimBatch(ctx, 100, "r", time.Minute, drain, nil)
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = s.abandon(ctx, cl) }()
			var ids []string
			for _, r := range cl.rows {
				ids = append(ids, r.ID)
			}
			return ids
		}
		if ids := claim(); slices.Contains(ids, "late") {
			t.Fatalf("a drain's claim within the period took %v, behind its cursor", ids)
		}
		s.floor.mu.Lock()
		s.floor.next = time.Time{} // the period is over
		s.floor.mu.Unlock()
		if ids := claim(); !slices.Contains(ids, "late") {
			t.Fatalf("the drain's claim after the period took %v, not the row below the floor", ids)
		}
	})
}
