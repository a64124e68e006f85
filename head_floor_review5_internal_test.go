package outbox

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/acemq/watermill-outbox/internal/testdb"
)

// The measure's PendingFirst (the UNION ALL with the NULL branch) on a
// table of another name, schema-qualified on PostgreSQL, through MySQL's
// FORCE INDEX, with a row whose created_at is NULL.
func TestClaim_FloorOn_TableOfAnotherName_PeriodsClaimAndProbe(t *testing.T) {
	eachFloorKind(t, func(t *testing.T, db *testdb.DB, d Dialect) {
		ctx := context.Background()
		table := "other_outbox"
		if d == MySQL {
			db.MustExec("CREATE TABLE other_outbox LIKE acemq_outbox")
			db.MustExec("ALTER TABLE other_outbox MODIFY created_at DATETIME(6) NULL")
		} else {
			db.MustExec("CREATE TABLE other_outbox (LIKE acemq_outbox INCLUDING ALL)")
			db.MustExec("ALTER TABLE other_outbox ALTER created_at DROP NOT NULL")
			table = db.Name + ".other_outbox"
		}
		s, err := NewStore(db.DB, StoreConfig{Dialect: d, Table: table})
		if err != nil {
			t.Fatal(err)
		}
		floorAlwaysOn(s, time.Hour)
		ins := db.Rebind("INSERT INTO other_outbox (id, exchange_name, routing_key, body, headers, created_at) VALUES (?, 'x', 'k', 'b', '{}', ?)")
		db.MustExec(ins, "first", time.Now().UTC())
		claim := func() []string { ids, _ := claimAll(t, s); return ids }
		if ids := claim(); len(ids) != 1 {
			t.Fatalf("claimed %v", ids)
		}
		if !s.floor.on {
			t.Fatal("floor off")
		}
		t.Logf("index %q", s.pendingIndex())
		db.MustExec(ins, "late", time.Now().Add(-time.Minute).UTC())
		s.floor.next = time.Time{}
		if ids := claim(); len(ids) != 1 || ids[0] != "late" {
			t.Fatalf("period claim took %v", ids)
		}
		db.MustExec(ins, "null", nil)
		s.floor.next = time.Time{}
		if ids := claim(); len(ids) != 1 || ids[0] != "null" {
			t.Fatalf("period claim beside a NULL took %v", ids)
		}
		// The probe's measure too.
		db.MustExec(ins, "late2", time.Now().Add(-time.Minute).UTC())
		s.floor.next = time.Time{}
		if found, err := s.probe(ctx, db.DB); err != nil || !found {
			t.Fatalf("probe: %v %v", found, err)
		}
		if ids := claim(); len(ids) != 1 || ids[0] != "late2" {
			t.Fatalf("claim after the period's probe took %v", ids)
		}
	})
}

// A running relay beside a held snapshot, floor on with a short period:
// rows committed below the floor (late commits) go out within the period
// plus a poll, none lost.
func TestForwarder_FloorOn_LateRowsOutWithinThePeriod(t *testing.T) {
	eachFloorKind(t, func(t *testing.T, db *testdb.DB, d Dialect) {
		holdSnapshot(t, db)
		publishOld(t, db, 20000)
		dest := &firstPublishedAt{at: map[string]time.Time{}}
		f, err := NewForwarder(db.DB, dest, ForwarderConfig{Dialect: d})
		if err != nil {
			t.Fatal(err)
		}
		const every = 600 * time.Millisecond
		floorAlwaysOn(f.store, every)
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- f.Run(ctx) }()
		defer func() { cancel(); <-done }()
		<-f.Running()
		committed := map[string]time.Time{}
		start := time.Now()
		for i := 0; time.Since(start) < 6*time.Second; i++ {
			id := fmt.Sprintf("late%04d", i)
			writeAt(t, db, id, time.Now().Add(-time.Minute))
			committed[id] = time.Now()
			if i%3 == 0 {
				writeAt(t, db, fmt.Sprintf("fresh%04d", i), time.Now())
			}
			time.Sleep(time.Duration(20+i*37%90) * time.Millisecond)
		}
		time.Sleep(every + 2*time.Second)
		var worst time.Duration
		var worstID string
		missing := 0
		for id, c := range committed {
			p, ok := dest.get(id)
			if !ok {
				missing++
				continue
			}
			if w := p.Sub(c); w > worst {
				worst, worstID = w, id
			}
		}
		t.Logf("%d late rows, worst wait %v (%s), missing %d", len(committed), worst, worstID, missing)
		// The period, a poll (250 ms) and a claim; and slack for a busy
		// machine, which measured 637 and 750 ms alone.
		if missing > 0 || worst > every+250*time.Millisecond+2*time.Second {
			t.Errorf("late rows: %d missing, worst wait %v (period %v)", missing, worst, every)
		}
	})
}

type firstPublishedAt struct {
	mu sync.Mutex
	at map[string]time.Time
}

func (d *firstPublishedAt) Publish(_ context.Context, recs []Record) []error {
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, r := range recs {
		if _, ok := d.at[r.ID]; !ok {
			d.at[r.ID] = time.Now()
		}
	}
	return make([]error, len(recs))
}

func (d *firstPublishedAt) get(id string) (time.Time, bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	t, ok := d.at[id]
	return t, ok
}

// A keyed record whose created_at is NULL, blocked behind its key's stuck
// head (at MaxAttempts): pending under MaxAttempts, never claimable until
// a Retry. The measure's read from the head that found it first (as the
// first pending row, claimable or not) left the floor off beside a held
// snapshot: every claim walked from the head for as long as the key stayed
// stuck. It reads only such a row a claim could take.
func TestClaim_NullCreatedAtBehindAStuckKey_FloorStillTurnsOn(t *testing.T) {
	eachFloorKind(t, func(t *testing.T, db *testdb.DB, d Dialect) {
		allowNullCreatedAt(db)
		holdSnapshot(t, db)
		publishOld(t, db, 100_000)
		ins := db.Rebind("INSERT INTO acemq_outbox (id, exchange_name, routing_key, body, headers, created_at, aggregate_id, seq, attempts) VALUES (?, 'x', 'k', 'b', '{}', ?, 'k', ?, ?)")
		db.MustExec(ins, "k#1", time.Now().Add(-time.Hour).UTC(), 1, 1000)
		db.MustExec(ins, "k#2", nil, 2, 0)
		s, err := NewStore(db.DB, StoreConfig{Dialect: d})
		if err != nil {
			t.Fatal(err)
		}
		var tooks []time.Duration
		for i := 0; i < 5; i++ {
			writeAt(t, db, fmt.Sprintf("new%d", i), time.Now())
			s.floor.mu.Lock()
			s.floor.check, s.floor.missed = true, 0
			s.floor.mu.Unlock()
			start := time.Now()
			claimAll(t, s)
			tooks = append(tooks, time.Since(start))
		}
		s.floor.mu.Lock()
		on := s.floor.on
		s.floor.mu.Unlock()
		if !on {
			t.Fatalf("beside 100,000 dead entries, 5 measures: floor off (claims took %v): the blocked NULL-created row keeps every claim at the head", tooks)
		}
	})
}
