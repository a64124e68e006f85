package outbox

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/acemq/watermill-outbox/internal/testdb"
)

// stressPool opens another pool to the isolated database of db: another
// process's, as far as the floors' registry can tell.
func stressPool(t testing.TB, db *testdb.DB) *sql.DB {
	t.Helper()
	driver := "pgx"
	if db.Kind == testdb.MySQL {
		driver = "mysql"
	}
	p, err := sql.Open(driver, db.DSN)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Close() })
	return p
}

// stressDest records what reaches the broker: the first time of each id,
// how many times, and each key's order. Ids in poison fail permanently
// (stuck at once) while there; ids in flaky fail (transiently) that many
// times more.
type stressDest struct {
	mu       sync.Mutex
	first    map[string]time.Time
	count    map[string]int
	keyLast  map[string]int64
	disorder []string
	poison   map[string]bool
	flaky    map[string]int
	delay    time.Duration
}

func newStressDest() *stressDest {
	return &stressDest{first: map[string]time.Time{}, count: map[string]int{}, keyLast: map[string]int64{}, poison: map[string]bool{}, flaky: map[string]int{}}
}

func (d *stressDest) Publish(_ context.Context, recs []Record) []error {
	if d.delay > 0 {
		time.Sleep(d.delay)
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	errs := make([]error, len(recs))
	for i, r := range recs {
		if d.poison[r.ID] {
			errs[i] = Permanent(errors.New("poison"))
			continue
		}
		if d.flaky[r.ID] > 0 {
			d.flaky[r.ID]--
			errs[i] = errors.New("flaky")
			continue
		}
		d.count[r.ID]++
		if _, ok := d.first[r.ID]; !ok {
			d.first[r.ID] = time.Now()
		}
		if r.AggregateID != "" {
			last := d.keyLast[r.AggregateID]
			switch {
			case r.Seq == last+1:
				d.keyLast[r.AggregateID] = r.Seq
			case r.Seq <= last:
				// sent again: at-least-once; counted by count
			default:
				d.disorder = append(d.disorder, fmt.Sprintf("%s: seq %d after %d", r.AggregateID, r.Seq, last))
				d.keyLast[r.AggregateID] = r.Seq
			}
		}
	}
	return errs
}

func (d *stressDest) firstAt(id string) (time.Time, bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	at, ok := d.first[id]
	return at, ok
}

func (d *stressDest) setPoison(id string, on bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if on {
		d.poison[id] = true
	} else {
		delete(d.poison, id)
	}
}

// stressWriter writes the rows of the stress tests and remembers when each
// became pending (its commit, or the Retry that made it pending again).
type stressWriter struct {
	t  testing.TB
	db *testdb.DB
	mu sync.Mutex
	// pendingAt: when the row became pending, for the bound.
	pendingAt map[string]time.Time
	kind      map[string]string
	keySeq    map[string]int64
	keyOf     map[string]string
}

func newStressWriter(t testing.TB, db *testdb.DB) *stressWriter {
	return &stressWriter{t: t, db: db, pendingAt: map[string]time.Time{}, kind: map[string]string{}, keySeq: map[string]int64{}, keyOf: map[string]string{}}
}

func (w *stressWriter) insert(id, kind string, created any, key string) {
	w.t.Helper()
	var keyArg, seqArg any
	w.mu.Lock()
	if key != "" {
		w.keySeq[key]++
		keyArg, seqArg = key, w.keySeq[key]
		w.keyOf[id] = key
	}
	w.mu.Unlock()
	if c, ok := created.(time.Time); ok {
		created = c.UTC()
		if w.db.Kind == testdb.MySQL {
			created = c.UTC().Format("2006-01-02 15:04:05.000000")
		}
	}
	if _, err := w.db.Exec(w.db.Rebind("INSERT INTO acemq_outbox (id, exchange_name, routing_key, body, headers, created_at, aggregate_id, seq) VALUES (?, 'x', 'k', 'b', '{}', ?, ?, ?)"), id, created, keyArg, seqArg); err != nil {
		w.t.Error(err)
		return
	}
	w.mu.Lock()
	w.pendingAt[id] = time.Now()
	w.kind[id] = kind
	w.mu.Unlock()
}

// nextKeyedID is the id of the next record of key that insert numbers:
// key#seq.
func (w *stressWriter) nextKeyedID(key string) string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return fmt.Sprintf("%s#%d", key, w.keySeq[key]+1)
}

func (w *stressWriter) madePending(id string, at time.Time) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.pendingAt[id] = at
}

type stressLate struct {
	id, kind string
	wait     time.Duration
}

// check waits until every row written is published (but for those in
// exclude), and reports those published more than once, late beyond bound
// (unkeyed rows, and keyed rows whose wait is not a predecessor's), keys
// out of order.
func (w *stressWriter) check(t *testing.T, dest *stressDest, bound time.Duration, waitUpTo time.Duration) {
	t.Helper()
	deadline := time.Now().Add(waitUpTo)
	var missing []string
	for {
		missing = missing[:0]
		w.mu.Lock()
		for id := range w.pendingAt {
			if _, ok := dest.firstAt(id); !ok {
				missing = append(missing, id)
			}
		}
		w.mu.Unlock()
		if len(missing) == 0 || time.Now().After(deadline) {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	sort.Strings(missing)
	if len(missing) > 0 {
		var states []string
		for _, id := range missing[:min(len(missing), 10)] {
			var attempts sql.NullInt64
			var published sql.NullString
			var created sql.NullString
			_ = w.db.QueryRow(w.db.Rebind("SELECT attempts, CAST(published_at AS CHAR(40)), CAST(created_at AS CHAR(40)) FROM acemq_outbox WHERE id = ?"), id).Scan(&attempts, &published, &created)
			states = append(states, fmt.Sprintf("%s(%s attempts=%v published=%v created=%v)", id, w.kind[id], attempts.Int64, published.String, created.String))
		}
		t.Errorf("%d rows never reached the destination within %v: %v", len(missing), waitUpTo, states)
	}
	dest.mu.Lock()
	defer dest.mu.Unlock()
	var dup []string
	for id, n := range dest.count {
		if n > 1 {
			dup = append(dup, fmt.Sprintf("%s×%d", id, n))
		}
	}
	if len(dup) > 0 {
		sort.Strings(dup)
		t.Errorf("published more than once: %v", dup[:min(len(dup), 20)])
	}
	if len(dest.disorder) > 0 {
		t.Errorf("keys out of order: %v", dest.disorder[:min(len(dest.disorder), 20)])
	}
	// Waits: each row from when it became pending; a keyed row from when
	// its predecessor went out too, if later.
	var late []stressLate
	w.mu.Lock()
	defer w.mu.Unlock()
	prevOf := map[string]string{} // keyed id -> id of seq-1
	bySeq := map[string]map[int64]string{}
	for id, key := range w.keyOf {
		if bySeq[key] == nil {
			bySeq[key] = map[int64]string{}
		}
		var seq int64
		fmt.Sscanf(id[strings.LastIndex(id, "#")+1:], "%d", &seq)
		bySeq[key][seq] = id
	}
	for _, m := range bySeq {
		for seq, id := range m {
			if p, ok := m[seq-1]; ok {
				prevOf[id] = p
			}
		}
	}
	var worst time.Duration
	for id, at := range w.pendingAt {
		got, ok := dest.first[id]
		if !ok {
			continue
		}
		from := at
		if p, ok := prevOf[id]; ok {
			if pt, ok := dest.first[p]; ok && pt.After(from) {
				from = pt
			}
		}
		wait := got.Sub(from)
		worst = max(worst, wait)
		if wait > bound {
			late = append(late, stressLate{id, w.kind[id], wait})
		}
	}
	t.Logf("%d rows, worst wait %v", len(w.pendingAt), worst)
	if len(late) > 0 {
		slices.SortFunc(late, func(a, b stressLate) int { return int(b.wait - a.wait) })
		var s []string
		for _, l := range late[:min(len(late), 15)] {
			s = append(s, fmt.Sprintf("%s(%s) %v", l.id, l.kind, l.wait.Round(time.Millisecond)))
		}
		t.Errorf("%d rows waited longer than %v after they became pending: %v", len(late), bound, s)
	}
}

type stressOpts struct {
	relays int
	period time.Duration // 0: the floor as NewStore keeps it (its defaults)
	dead   int           // rows published beside the snapshot
	endAt  int           // the row at which the snapshot ends; -1 never
	nulls  bool          // some rows with a NULL created_at
	run    time.Duration
	batch  int
}

// floorStress: relays, each over a pool of its own (other processes),
// beside a held snapshot, fresh and late rows, keyed and unkeyed,
// transient and permanent failures, the stuck records retried through
// another pool (an operator's outboxctl) and through relay 0's. Every row
// must reach the destination once, keys in order, each within the period
// plus a poll, the backoff and slack.
func floorStress(t *testing.T, db *testdb.DB, d Dialect, o stressOpts) {
	if o.nulls {
		allowNullCreatedAt(db)
	}
	endSnapshot := holdSnapshotUntil(t, db)
	publishOld(t, db, o.dead)
	dest := newStressDest()
	pools := []*sql.DB{db.DB.DB}
	for len(pools) < o.relays {
		pools = append(pools, stressPool(t, db))
	}
	var relays []*Forwarder
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	defer func() { cancel(); wg.Wait() }()
	for i, p := range pools {
		f, err := NewForwarder(p, dest, ForwarderConfig{Dialect: d, MaxAttempts: 4, BatchSize: o.batch, RetryMax: 400 * time.Millisecond, RelayID: fmt.Sprintf("relay%d", i)})
		if err != nil {
			t.Fatal(err)
		}
		if o.period > 0 {
			floorAlwaysOn(f.store, o.period)
		}
		relays = append(relays, f)
		wg.Add(1)
		go func() { defer wg.Done(); _ = f.Run(ctx) }()
		<-f.Running()
	}
	opsPool := stressPool(t, db)
	ops, err := NewStore(opsPool, StoreConfig{Dialect: d})
	if err != nil {
		t.Fatal(err)
	}
	local, err := NewStore(db.DB, StoreConfig{Dialect: d})
	if err != nil {
		t.Fatal(err)
	}
	w := newStressWriter(t, db)
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 2))
	keys := []string{"ka", "kb", "kc", "kd", "ke", "kf"}
	var stuck, nulls []string
	retryReady := func(via *Store) {
		var ready []string
		for _, s := range stuck {
			var attempts int
			if err := db.QueryRow(db.Rebind("SELECT attempts FROM acemq_outbox WHERE id = ?"), s).Scan(&attempts); err == nil && attempts >= 4 {
				ready = append(ready, s)
			}
		}
		if len(ready) == 0 {
			return
		}
		for _, s := range ready {
			dest.setPoison(s, false)
		}
		n, err := via.Retry(context.Background(), ready...)
		if err != nil || n != int64(len(ready)) {
			t.Errorf("Retry %v: %d, %v", ready, n, err)
		}
		at := time.Now()
		for _, s := range ready {
			w.madePending(s, at)
		}
		stuck = slices.DeleteFunc(stuck, func(s string) bool { return slices.Contains(ready, s) })
	}
	start := time.Now()
	anyOn := false
	for i := 0; time.Since(start) < o.run; i++ {
		if i == o.endAt {
			endSnapshot()
			t.Log("snapshot ended")
		}
		if i%50 == 0 {
			for _, f := range relays {
				anyOn = anyOn || FloorOn(f)
			}
		}
		id := fmt.Sprintf("r%05d", i)
		var created any = time.Now()
		kind := "fresh"
		switch rng.IntN(8) {
		case 0, 1:
			created, kind = time.Now().Add(-time.Duration(1+rng.IntN(120))*time.Minute), "late"
		case 2:
			if o.nulls {
				created, kind = nil, "null"
			}
		}
		if kind == "null" {
			// Unreadable (malformed) by design: failed at once, stuck,
			// visible; it must be claimed for that, below no floor.
			nulls = append(nulls, id)
			if _, err := db.Exec(db.Rebind("INSERT INTO acemq_outbox (id, exchange_name, routing_key, body, headers, created_at) VALUES (?, 'x', 'k', 'b', '{}', NULL)"), id); err != nil {
				t.Fatal(err)
			}
			time.Sleep(time.Duration(5+rng.IntN(30)) * time.Millisecond)
			continue
		}
		key := ""
		if rng.IntN(2) == 0 {
			key = keys[rng.IntN(len(keys))]
			id = w.nextKeyedID(key)
			kind += "-keyed"
		}
		switch rng.IntN(20) {
		case 0:
			dest.setPoison(id, true)
			stuck = append(stuck, id)
			kind += "-poison"
		case 1:
			if key == "" {
				// An unkeyed record's transient failure sends what was
				// behind it in its batch again (documented): keyed only.
				break
			}
			dest.mu.Lock()
			dest.flaky[id] = 1
			dest.mu.Unlock()
			kind += "-flaky"
		}
		w.insert(id, kind, created, key)
		if i%25 == 24 && len(stuck) > 0 {
			via := ops
			if rng.IntN(2) == 0 {
				via = local
			}
			retryReady(via)
		}
		time.Sleep(time.Duration(5+rng.IntN(30)) * time.Millisecond)
	}
	period := o.period
	if period == 0 {
		period = floorEveryMax
	}
	// A poisoned keyed record takes four attempts, and a row below a
	// relay's floor may wait a period for its measure (documented): four
	// periods at worst. 10 s was not enough in one loaded CI run (its
	// writer made 495 rows in 25 s, not 1,100), where two such records
	// reached their fourth attempt late; why they were that slow there is
	// not known.
	waitFor := time.Now().Add(4*(period+400*time.Millisecond) + 5*time.Second)
	for len(stuck) > 0 && time.Now().Before(waitFor) {
		retryReady(ops)
		time.Sleep(100 * time.Millisecond)
	}
	if len(stuck) > 0 {
		t.Errorf("never stuck: %v", stuck)
	}
	// period + poll + the backoff after a failure + slack.
	w.check(t, dest, period+250*time.Millisecond+400*time.Millisecond+2*time.Second, 40*time.Second)
	// A row whose created_at is NULL is below every floor: it waits for
	// the next measure, a period, as the rows made pending below the
	// floor do. Those written in the run's last period may not be claimed
	// yet when every other row is published.
	nullsBy := time.Now().Add(period + 250*time.Millisecond + 2*time.Second)
	for _, id := range nulls {
		for {
			var attempts int
			err := db.QueryRow(db.Rebind("SELECT attempts FROM acemq_outbox WHERE id = ?"), id).Scan(&attempts)
			if err == nil && attempts >= 4 {
				break
			}
			if time.Now().After(nullsBy) {
				t.Errorf("row %s, created_at NULL, not claimed within a period of the run's end (attempts %d, %v)", id, attempts, err)
				break
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	for i, f := range relays {
		t.Logf("relay %d floor on at the end: %v", i, FloorOn(f))
	}
	t.Logf("a floor was on during the run: %v", anyOn)
}

func TestForwarder_ThreeRelaysBesideASnapshotThatEnds_FloorOn_NothingLostNothingLate(t *testing.T) {
	eachFloorKind(t, func(t *testing.T, db *testdb.DB, d Dialect) {
		floorStress(t, db, d, stressOpts{relays: 3, period: time.Second, dead: 20000, endAt: 300, run: 12 * time.Second, batch: 20})
	})
}

func TestForwarder_ThreeRelaysBesideASnapshot_NullCreatedAt_NothingLostNothingLate(t *testing.T) {
	eachFloorKind(t, func(t *testing.T, db *testdb.DB, d Dialect) {
		floorStress(t, db, d, stressOpts{relays: 3, period: time.Second, dead: 20000, endAt: -1, nulls: true, run: 10 * time.Second, batch: 20})
	})
}

// The floor as the relays keep it by default (turned on by their own
// measures), behind 100,000 dead entries, two relays.
func TestForwarder_TwoRelaysBehind100kDeadEntries_DefaultFloor_NothingLostNothingLate(t *testing.T) {
	eachFloorKind(t, func(t *testing.T, db *testdb.DB, d Dialect) {
		floorStress(t, db, d, stressOpts{relays: 2, dead: 100000, endAt: -1, run: 25 * time.Second, batch: 100})
	})
}
