package outbox

import (
	"context"
	"database/sql"
	"testing"
	"time"

	"github.com/acemq/watermill-outbox/internal/testdb"
)

// delayedQuerier runs statements on a connection and delays the one at
// index delayed (counting from 0) by delay before it is sent, as a busy
// machine delays a read now and then.
type delayedQuerier struct {
	conn    *sql.Conn
	delayed int
	delay   time.Duration
	sent    int
}

func (q *delayedQuerier) QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row {
	if q.sent == q.delayed {
		time.Sleep(q.delay)
	}
	q.sent++
	return q.conn.QueryRowContext(ctx, query, args...)
}

// With no snapshot held, no dead entry in the pending index, one read of a
// measure that the machine delays does not turn the floor on: CI's load
// delayed a read from the head by 2 ms or more and turned it on beside
// 100 KB records, whose claims were slow for their size alone. Whichever
// read is delayed, the floor stays off; with none delayed too.
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
		index := ""
		if d == MySQL {
			index = s.pendingIndexName()
		}
		for delayed := -1; delayed < 2*floorRounds; delayed++ {
			q := &delayedQuerier{conn: conn, delayed: delayed, delay: 20 * time.Millisecond}
			on, _, err := s.measureFloor(ctx, q, index, time.Now())
			if err != nil {
				t.Fatal(err)
			}
			if on {
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
		ok, _, err := s.measureFloor(ctx, q, "", time.Now())
		if err != nil {
			t.Fatal(err)
		}
		if ok {
			on++
		}
		if ok && q.sent != 2*floorRounds {
			t.Errorf("a measure that kept the floor sent %d reads, want %d", q.sent, 2*floorRounds)
		}
	}
	if on == 0 {
		t.Errorf("3 measures beside 100,000 dead entries: none kept the floor")
	}
	// A floor already on is measured again in one round, two reads.
	s.floor.on = true
	q := &delayedQuerier{conn: conn, delayed: -1}
	if _, _, err := s.measureFloor(ctx, q, "", time.Now()); err != nil {
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
	slow := f.checkAbove + time.Millisecond
	for missed := 0; missed < 3; missed++ {
		f.check, f.checked = false, time.Time{}
		s.headWalked(slow)
		if !f.check {
			t.Fatalf("after %d measures without gain, a slow walk long after the last did not make the next measure", missed)
		}
		if _, err := s.headBound(ctx, db.DB, "", true); err != nil {
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
