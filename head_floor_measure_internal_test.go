package outbox

import (
	"context"
	"database/sql"
	"slices"
	"testing"
	"time"

	"github.com/acemq/watermill-outbox/internal/sqldialect"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// delayedQuerier runs statements on a connection and delays the one at
// index delayed (counting from 0) by delay before it is sent, as a busy
// machine delays a read now and then; every one where all is set, as a
// database that far away does.
type delayedQuerier struct {
	conn    *sql.Conn
	delayed int
	all     bool
	delay   time.Duration
	sent    int
}

func (q *delayedQuerier) QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row {
	if q.all || q.sent == q.delayed {
		time.Sleep(q.delay)
	}
	q.sent++
	return q.conn.QueryRowContext(ctx, query, args...)
}

func (q *delayedQuerier) QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error) {
	if q.all || q.sent == q.delayed {
		time.Sleep(q.delay)
	}
	q.sent++
	return q.conn.QueryContext(ctx, query, args...)
}

// With no snapshot held, no dead entry in the pending index, one read of a
// measure that the machine delays does not turn the floor on: CI's load
// delayed a read from the head by 2 ms or more and turned it on beside
// 100 KB records, whose claims were slow for their size alone. Whichever
// read is delayed (by 20 ms, against a gain of 10 ms here: the machine's
// own delays, beside this package's other tests, are not what is
// measured), the floor stays off; with none delayed too.
func TestMeasureFloor_OneDelayedRead_FloorStaysOff(t *testing.T) {
	t.Parallel()
	eachFloorKind(t, func(t *testing.T, db *testdb.DB, d Dialect) {
		ctx := context.Background()
		s, err := NewStore(db.DB, StoreConfig{Dialect: d})
		if err != nil {
			t.Fatal(err)
		}
		writeAt(t, db, "first", time.Now().Add(-time.Minute))
		conn, err := db.DB.Conn(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		s.floor.gainAbove = 10 * time.Millisecond
		index, keyIndex := "", ""
		if d == MySQL {
			index, keyIndex = s.indexNames()
		}
		for delayed := -1; delayed < 2*floorRounds; delayed++ {
			q := &delayedQuerier{conn: conn, delayed: delayed, delay: 20 * time.Millisecond}
			m, err := s.measureFloor(ctx, q, index, keyIndex, time.Now())
			if err != nil {
				t.Fatal(err)
			}
			if m.on {
				t.Errorf("read %d of the measure delayed by %v (%d reads): the floor is on, with no dead entry to skip", delayed, q.delay, q.sent)
			}
		}
	})
}

// Beside a held snapshot of 100,000 published rows, where a read from the
// head walks 100,000 dead entries (17 ms on PostgreSQL), the measure's
// three rounds keep the floor, in six reads. A read from the floor that a
// busy machine delays can make one measure miss it, so one of three must
// keep it. A floor already on is measured again in one round.
func TestMeasureFloor_BesideAHeldSnapshot_FloorOn(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, testdb.Postgres)
	ctx := context.Background()
	if err := Migrate(ctx, db.DB, Postgres); err != nil {
		t.Fatal(err)
	}
	holdSnapshot(t, db)
	publishOld(t, db, 100_000)
	writeAt(t, db, "pending", time.Now())
	s, err := NewStore(db.DB, StoreConfig{Dialect: Postgres})
	if err != nil {
		t.Fatal(err)
	}
	conn, err := db.DB.Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	on := 0
	for i := 0; i < 3; i++ {
		q := &delayedQuerier{conn: conn, delayed: -1}
		m, err := s.measureFloor(ctx, q, "", "", time.Now())
		if err != nil {
			t.Fatal(err)
		}
		if m.on {
			on++
		}
		if m.on && q.sent != 2*floorRounds {
			t.Errorf("a measure that kept the floor sent %d reads, want %d", q.sent, 2*floorRounds)
		}
	}
	if on == 0 {
		t.Errorf("3 measures beside 100,000 dead entries: none kept the floor")
	}
	// A floor already on is measured again in one round, two reads.
	s.floor.on = true
	q := &delayedQuerier{conn: conn, delayed: -1}
	if _, err := s.measureFloor(ctx, q, "", "", time.Now()); err != nil {
		t.Fatal(err)
	}
	if q.sent != 2 {
		t.Errorf("the measure of a floor already on sent %d reads, want 2", q.sent)
	}
}

// A walk from the head that is slow for another reason than dead entries
// (a database 5 ms away, large records) makes the relay measure, and each
// measure in a row that finds no gain doubles the wait for the next, from
// checkEvery to 32 times it: at 2 s apart for good, such a relay sent two
// statements more every 2 s, for nothing.
func TestHeadWalked_MeasuresThatFindNoGain_WaitLongerEachTime(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, testdb.Postgres)
	ctx := context.Background()
	if err := Migrate(ctx, db.DB, Postgres); err != nil {
		t.Fatal(err)
	}
	s, err := NewStore(db.DB, StoreConfig{Dialect: Postgres})
	if err != nil {
		t.Fatal(err)
	}
	writeAt(t, db, "first", time.Now().Add(-time.Minute))
	f := s.floor
	// What is tested is the wait, not the measure: against a gain of 10 ms,
	// the machine's own delays beside this package's other tests (one run
	// found 2 ms three rounds in a row) do not turn the floor on.
	f.gainAbove = 10 * time.Millisecond
	slow := f.checkAbove + time.Millisecond
	for missed := 0; missed < 3; missed++ {
		f.check, f.checked = false, time.Time{}
		s.headWalked(slow)
		if !f.check {
			t.Fatalf("after %d measures without gain, a slow walk long after the last did not make the next measure", missed)
		}
		if _, _, err := s.headBound(ctx, db.DB, "", "", true); err != nil {
			t.Fatal(err)
		}
		if f.on || f.missed != missed+1 {
			t.Fatalf("a measure with no dead entry: floor on %v, missed %d; want off, %d", f.on, f.missed, missed+1)
		}
	}
	for _, c := range []struct {
		missed int
		since  time.Duration
		check  bool
	}{
		{0, f.checkEvery + time.Second, true},
		{1, f.checkEvery + time.Second, false},
		{1, 2*f.checkEvery + time.Second, true},
		{3, 7 * f.checkEvery, false},
		{3, 8*f.checkEvery + time.Second, true},
		{20, 31 * f.checkEvery, false},
		{20, 32*f.checkEvery + time.Second, true},
	} {
		f.check, f.missed, f.checked = false, c.missed, time.Now().Add(-c.since)
		s.headWalked(slow)
		if f.check != c.check {
			t.Errorf("%d measures without gain, the last %v ago: a slow walk makes the next measure: %v, want %v", c.missed, c.since, f.check, c.check)
		}
	}
}

// The period's claim measures and starts at the floor its read from the
// head gives, below every pending row, those below the last floor too:
// a claim from the head, which walks every dead entry with a locking read
// (65–86 ms on MariaDB behind 100,000), held up once a period what came
// meanwhile. A row whose created_at is NULL, which no floor is below
// (PostgreSQL orders it last), sends that claim to the head.
func TestClaim_FloorOn_PeriodsClaimStartsAtTheFloorItReads(t *testing.T) {
	t.Parallel()
	eachFloorKind(t, func(t *testing.T, db *testdb.DB, d Dialect) {
		s := floorStore(t, db, d, time.Hour)
		claim := func() ([]string, *sqldialect.Cursor) { return claimAll(t, s) }
		writeAt(t, db, "first", time.Now())
		if ids, from := claim(); !slices.Equal(ids, []string{"first"}) || from == nil {
			t.Fatalf("the claim that turned the floor on took %v from %v, want [first] from the floor", ids, from)
		}
		late := time.Now().Add(-time.Minute).UTC().Truncate(time.Millisecond)
		writeAt(t, db, "late", late)
		writeAt(t, db, "fresh", time.Now())
		if ids, _ := claim(); !slices.Equal(ids, []string{"fresh"}) {
			t.Fatalf("the claim within the period took %v, want [fresh]", ids)
		}
		s.floor.next = time.Time{} // the period is over
		ids, from := claim()
		if !slices.Equal(ids, []string{"late"}) || from == nil || from.CreatedAt.After(late) {
			t.Fatalf("the period's claim took %v from %v, want [late] from a floor at or below %v", ids, from, late)
		}
		if !s.floor.on || !s.floor.next.After(time.Now()) {
			t.Fatalf("after the period's measure: floor on %v, next measure %v", s.floor.on, s.floor.next)
		}

		allowNullCreatedAt(db)
		writeAt(t, db, "fresh2", time.Now())
		db.MustExec("INSERT INTO acemq_outbox (id, exchange_name, routing_key, body, headers, created_at) VALUES ('nullcreated', 'x', 'k', 'b', '{}', NULL)")
		s.floor.next = time.Time{}
		ids, from = claim()
		if !slices.Contains(ids, "nullcreated") || from != nil {
			t.Fatalf("the period's claim beside a row whose created_at is NULL took %v from %v, want it among them, from the head", ids, from)
		}
	})
}
