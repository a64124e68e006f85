package outbox

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"runtime"
	"slices"
	"strings"
	"sync"
	"time"
	"weak"

	"github.com/acemq/watermill-outbox/internal/sqldialect"
)

// headFloor is where the relay's claims and probes start when a walk from
// the head of the pending index is slow.
//
// On PostgreSQL and MySQL, the pending index keeps the entry of every row
// published since the oldest snapshot another session holds (a pg_dump,
// a mysqldump --single-transaction, a long report): neither vacuum nor
// purge may remove it while that snapshot could still read the row as
// pending, and a walk from the head visits each such row to learn that it
// is not (BenchmarkClaim_BesideAHeldSnapshot: behind 100,000 of them a
// claim took 13 ms on PostgreSQL and 65–86 ms on MariaDB, against 1.1–1.4
// ms once PostgreSQL's snapshot ended; MariaDB's stayed slow until its
// purge caught up). That is the database's CPU, at every claim and every
// idle poll, and as much added to every record's way to the broker.
//
// A claim or a probe from the head that takes checkAbove or longer makes
// the next one measure (at most every checkEvery): it reads where the
// pending rows start (the first pending row under MaxAttempts that no
// stuck record of its key holds; pendingStart) from the head, and again
// from the floor that gives, the created_at of that row or lag before now
// when that is earlier. When the second read is gainAbove quicker, three
// rounds in a row (measureFloor), the floor is on. (On MySQL, where they
// show no gain, the next claim times locking reads, as its own walk is,
// and decides: see lockMeasure; a floor it keeps is timed so less and
// less often, up to floorLockMax apart.) From then on, claims and probes that
// would start at the head start at the floor; each claim reads the floor
// again from where it stood, which walks only the entries of rows
// published since (one statement more; a probe takes it as it stands).
// A keyed record waiting out its retry backoff is passed, as a stuck
// key's are, until its backoff ends (see endBackoffs). Where the first
// pending rows are older than lag, few (maxStragglers), and the walk from
// the first of them to lag before now slow, the floor stands at lag
// before now, above them, and each claim from it offers them first, as
// points, by their place in the index or their ids, and takes those it
// can, until a mark of this Store settles them (see stragglers); a probe
// asks after them, and a drain at or below the floor claims from it (see
// belowPoints).
// Every period, floorEvery times the last read from the head's time
// (everyMin to everyMax), one claim or probe (a drain's claim too, which
// would go on from its cursor) measures again, and starts at the floor its read from
// the head gives, below every pending row, those below the last floor
// too; at the head when the measure turns the floor off, or finds first a
// row whose created_at is NULL (which no floor is below). Rows that
// became pending below the floor wait for that measure: a transaction
// that committed more than lag after its Publish, a publisher whose clock
// is more than lag behind the relay's, a Retry or Republish of old
// records from another process or over another pool (those through a
// Store over the relay's pool make its next claim measure), the records
// a stuck record held once it is retried, published or deleted that way
// or claimed by a relay with a higher MaxAttempts, a row whose created_at
// is NULL. None waits longer, but for an idle relay's next
// poll where PollInterval is under everyMin. A Sweep starts at the head.
//
// SQLite removes an entry from its indexes as its row is published: a walk
// from the head there reads only pending rows, and no floor is kept.
type headFloor struct {
	mu sync.Mutex
	// check: a claim or probe from the head took checkAbove or longer;
	// the next one measures (see headBound). checked: the last measure.
	// missed: the measures in a row that found a floor off and left it
	// off; each doubles the wait for the next (see headWalked).
	check   bool
	checked time.Time
	missed  int
	// on: claims and probes start at at, until next; then one measures
	// again, and next is set again.
	on   bool
	at   time.Time
	next time.Time
	// skip holds the records stuck at MaxAttempts that the last measure
	// passed (see pendingStart), and those this Store's marks took there
	// since (see passStuck): each claim's read of the floor passes the
	// records they hold in their keys too. backoffs: the keyed records
	// waiting out a retry backoff that the last measure or a claim's read
	// of the floor passed, with their key's later records (each one's skip
	// entry is the record before it, seq − 1): once a backoff ends, the
	// next claim's read drops its entry and starts no higher than the
	// record (see endBackoffs).
	skip     []sqldialect.KeySeq
	backoffs []backoff
	// points: the pending rows below the floor that the last measure
	// found, where it set the floor at lag before now above them (see
	// stragglers): each claim from the floor takes them as points, and a
	// probe from it asks after them. A mark of this Store that publishes
	// one, or takes it to MaxAttempts, drops it (see settled).
	points []sqldialect.Cursor
	// lowered is when lowerFloors last made next due: a walk from the head
	// under way then did not see what it made pending.
	lowered time.Time
	// heard is when lowerFloorsHeard last lowered it, or will: at most
	// once per rewindGap for what other processes say.
	heard time.Time
	// locking: MySQL, whose claim's locking read walks the entries of
	// published rows some 20 times slower than a plain read: where a
	// measure's plain reads show no gain, lockDue makes the next claim
	// measure with locking reads (see lockMeasure).
	locking bool
	lockDue bool
	// lockNext: a floor on that a locking measure kept is kept until then
	// whatever the plain reads show (see measureFloor); lockKept is how
	// many locking measures in a row kept it, each doubling the wait.
	lockNext time.Time
	lockKept int
	// rewind: rows were made pending again (lowerFloors), perhaps behind
	// a drain's cursor; retries: when the retry backoffs of the keyed
	// records this Store's relay failed end. Either sends a drain's next
	// claim back (see drainRewinds), once rewindGap has passed since
	// rewound, the last claim that went back.
	rewind    bool
	retries   []time.Time
	rewound   time.Time
	rewindGap time.Duration
	// fromHead is when the last claim that started at the floor or the
	// head did: a drain goes back once lookBack (drainLookBack) has passed
	// since, whatever it was told (see drainRewinds).
	fromHead time.Time
	lookBack time.Duration

	// Defaults from NewStore (the floor… constants); a test's.
	checkAbove, checkEvery, gainAbove, lag, everyMin, everyMax time.Duration
	// pointsAbove: how slow the walk from the first pending row older
	// than lag to lag before now must be for the floor to stand there,
	// those rows taken as points (see stragglers); gainAbove's default.
	pointsAbove time.Duration
}

const (
	// floorCheckAbove is the time of a claim (its statements after BEGIN
	// and the claim's setup, to its rows) or a probe (from taking a
	// connection) from the head over which the relay measures
	// whether a floor would save it (see headBound): a walk of 10,000 to
	// 25,000 entries of published rows on PostgreSQL, a fifth of that in a
	// MariaDB claim. A busy machine makes claims that slow too: at most
	// one measure, two statements where it finds no gain (six where it
	// turns the floor on; one more where the first pending row is keyed,
	// and past stuck keys two more each, past records in a retry backoff
	// one more each, and one more read from the head; two more where the
	// first pending row is older than floorLag, four where the walk to
	// it is slow, see stragglers and walkBelow;
	// on MySQL, where it finds no gain, the next claim's locking measure:
	// BEGIN, where the pending rows start as above, two locking reads,
	// four more where they turn the floor on, ROLLBACK), every
	// floorCheckEvery. (Turned on by
	// such a claim alone, the floor cost an idle relay in CI's test of its
	// statements a statement per probe: 30 and 35 where it counts 20.)
	floorCheckAbove = 5 * time.Millisecond
	floorCheckEvery = 2 * time.Second
	// floorGainAbove is how much quicker the read of where the pending
	// rows start must be from the floor than from the head for the floor
	// to be kept, in every round of a measure: 10,000 entries on
	// PostgreSQL, 3,000 in MariaDB's locking read. MariaDB's plain read
	// passes a published row's entry about 20 times quicker than its
	// claim's locking read does: at 2 ms the plain read kept the floor
	// from about 60,000 entries, at floorGainAboveMySQL, half that, from
	// about 45,000, and only by chance at 20,000 (a claim from the head
	// 16 ms, its plain read 0.75). Where the plain reads show no gain on
	// MySQL, the next claim times locking reads against floorGainAbove
	// (see lockMeasure).
	floorGainAbove      = 2 * time.Millisecond
	floorGainAboveMySQL = time.Millisecond
	// floorRounds is how many rounds of the two reads must each show
	// floorGainAbove for the floor to be turned on (see measureFloor): six
	// statements a measure where it is, two where the first round shows
	// no gain, and two for a floor already on (four on MySQL where the
	// first round shows no gain, none where a locking measure kept it
	// lately), and those pendingStart adds.
	floorRounds = 3
	// floorMissedMax: the wait for the next measure after measures that
	// found no gain is floorCheckEvery doubled this many times at most.
	floorMissedMax = 5
	// floorLag is how far before now the floor stays at the most: rows
	// committed within it of their Publish (created_at), on a clock at
	// most it behind the relay's, are never below the floor. Each claim
	// walks the entries of the rows published within it: 1,000 at 500
	// msg/s.
	floorLag = 2 * time.Second
	// floorEvery times the last read from the head's time is the time to
	// the next measure, floorEveryMin to floorEveryMax: reads from the
	// head then take about a fiftieth of the relay's time, and a row below
	// the floor waits at most floorEveryMax. An idle relay measures once a
	// period, two statements more, so at least floorEveryMin apart. When
	// each period's claim still started at the head, at a twentieth the
	// records that came during those walks made a p99 of their own: 14–15
	// ms on PostgreSQL and 72–147 ms on MariaDB at 500 msg/s beside
	// 100,000 entries (outbox-bench -scenario latency -held-snapshot
	// 100000), and 7–13 and 37–47 ms at a fiftieth.
	floorEvery    = 50
	floorEveryMin = 2 * time.Second
	floorEveryMax = 10 * time.Second
	// floorLockMax is the longest a floor that a locking measure kept on
	// MySQL goes without another (see lockMeasure): its periods' plain
	// reads still find where the pending rows start. Behind 20,000 dead
	// entries, where a locking read from the head takes 15 ms and the
	// plain reads show no gain, a locking measure every period (2 s) held
	// up a claim and the records that came meanwhile each time. A floor
	// kept a minute after its snapshot ended costs each claim one
	// statement, a quick one.
	floorLockMax = time.Minute
)

// newHeadFloor is the floor of a Store, on MySQL where mysql is set.
func newHeadFloor(mysql bool) *headFloor {
	f := &headFloor{checkAbove: floorCheckAbove, checkEvery: floorCheckEvery, gainAbove: floorGainAbove, lag: floorLag, everyMin: floorEveryMin, everyMax: floorEveryMax, lookBack: drainLookBack}
	if mysql {
		f.gainAbove, f.locking = floorGainAboveMySQL, true
	}
	f.pointsAbove = f.gainAbove
	return f
}

// atHead, as a claim's cursor, starts it at the head of the pending index
// whatever the floor says: Sweep's, whose caller wants every record it
// committed on the broker before it answers.
var atHead = new(sqldialect.Cursor)

// rowQuerier runs a statement: a connection of the pool, or a claim's or
// probe's transaction.
type rowQuerier interface {
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
	QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error)
}

// headBound is where a claim or probe that would start at the head of the
// pending index starts (see headFloor): nil for the head. The floor's
// reads run on q, through index and keyIndex when they are set (MySQL's
// pending index and its index of a key's pending rows).
// A claim or probe that starts at the head tells headWalked how long it
// took, from before this call. A probe (probing) starts at the floor as it
// stands: an idle relay, which probes every PollInterval, would pay a
// statement more a poll, and publishes nothing to move the floor past.
//
// points are the rows below the floor that the claim takes as well, and the
// probe asks after (see headFloor.points): none where it starts at the head.
func (s *Store) headBound(ctx context.Context, q rowQuerier, index, keyIndex string, probing bool) (after *sqldialect.Cursor, points []sqldialect.Cursor, err error) {
	if s.leases() {
		return nil, nil, nil // SQLite
	}
	f := s.floor
	f.mu.Lock()
	defer f.mu.Unlock()
	now := time.Now()
	switch {
	case f.on && now.Before(f.next) && probing:
		f.endBackoffs(now)
		return &sqldialect.Cursor{CreatedAt: f.at}, f.pointsBelow(), nil
	case f.on && now.Before(f.next):
		f.endBackoffs(now)
		r, err := s.pendingFirst(ctx, q, index, keyIndex, &sqldialect.Cursor{CreatedAt: f.at}, f.skip)
		for err == nil && r.inBackoff() && len(f.skip) < maxStuckKeys {
			// A keyed record waiting out its retry backoff, failed since
			// the last measure (by this relay's batch, most often): passed
			// until its backoff ends.
			b := r.backoff()
			f.skip, f.backoffs = append(slices.Clip(f.skip), b.skip), append(slices.Clip(f.backoffs), b)
			r, err = s.pendingFirst(ctx, q, index, keyIndex, r.first, f.skip)
		}
		first := r.first
		if err != nil {
			// The next claim or probe starts at the head, as one without
			// a floor does: a read that keeps failing (MySQL's pending
			// index renamed, which it names) would fail every claim.
			f.off()
			return nil, nil, err
		}
		if first != nil && first.CreatedAt.IsZero() {
			return nil, nil, nil // from the head, this once
		}
		f.at = f.below(first, now)
		return &sqldialect.Cursor{CreatedAt: f.at}, f.pointsBelow(), nil
	case !f.on && !f.check:
		return nil, nil, nil
	}
	// A walk from the head was slow, or the period is over: measure, which
	// reads where the pending rows start from the head. Once on, this
	// claim or probe starts at the floor that read gives, below every
	// pending row it saw, those below the last floor too: a claim from the
	// head (MariaDB's locking read passes an entry some 20 times slower
	// than its plain read) held up, once a period, what came meanwhile.
	f.check, f.checked = false, now
	m, err := s.measureFloor(ctx, q, index, keyIndex, now)
	switch {
	case err != nil:
		f.off()
		return nil, nil, err
	case m.headOnly && !f.on:
		// A row whose created_at is NULL, claimable: this claim starts at
		// the head, as without a measure. Counted as a measure without
		// gain, so that one this claim leaves (its lease running, say)
		// does not bring a measure every checkEvery.
		f.missed++
		return nil, nil, nil
	case m.headOnly:
		return nil, nil, nil // from the head, this once: headWalked sets the period
	case !m.on && f.locking && !f.lockDue:
		// MySQL: the plain reads may gain little where the claim's
		// locking walk pays much; the next claim measures with locking
		// reads before its transaction (lockMeasure), and decides. A
		// floor on stays on until then; one off, this claim or probe
		// starts at the head, and the measure is not counted as missed.
		// Once: a second miss before a claim has measured (an idle
		// relay's probes, which never claim) is a miss, as elsewhere.
		f.lockDue = true
		if !f.on {
			return nil, nil, nil
		}
		m.on = true
		f.missed = 0
	case m.on || f.on:
		f.missed = 0
	default:
		f.missed++
	}
	if !m.on {
		f.off()
		return nil, nil, nil
	}
	f.on, f.at, f.skip, f.backoffs, f.points = true, m.at, m.skip, m.backoffs, m.points
	f.next = now.Add(f.period(m.head))
	return &sqldialect.Cursor{CreatedAt: f.at}, f.pointsBelow(), nil
}

// pointsBelow are the floor's points below where it stands: one at or
// above it (the floor lowered to a keyed record whose backoff ended, see
// endBackoffs) the claim from the floor takes, and its points statement
// would have taken it too, twice in one batch.
func (f *headFloor) pointsBelow() []sqldialect.Cursor {
	if !slices.ContainsFunc(f.points, func(c sqldialect.Cursor) bool { return !c.CreatedAt.Before(f.at) }) {
		return f.points
	}
	return slices.DeleteFunc(slices.Clone(f.points), func(c sqldialect.Cursor) bool { return !c.CreatedAt.Before(f.at) })
}

// off turns the floor off: claims and probes start at the head, and a
// locking measure that turns it on again starts its waits anew.
func (f *headFloor) off() {
	f.on, f.lockNext, f.lockKept, f.backoffs, f.points = false, time.Time{}, 0, nil, nil
}

// period is the time to the next measure of a floor that is on, after a
// walk from the head that took took.
func (f *headFloor) period(took time.Duration) time.Duration {
	return min(max(floorEvery*took, f.everyMin), f.everyMax)
}

// floorMeasure is what measureFloor found.
type floorMeasure struct {
	// on: the floor saves gainAbove; at: where it stands, below the first
	// pending row; head: the first read from the head took that long.
	on   bool
	at   time.Time
	head time.Duration
	// headOnly: the first pending row's created_at is NULL or not a time
	// this relay can compare; no floor is below it.
	headOnly bool
	// points: the pending rows below at, where the floor stands lag
	// before now above them (see stragglers).
	points []sqldialect.Cursor
	// skip: the stuck records the read from the head passed, and the
	// records before those waiting out a retry backoff that it passed,
	// backoffs.
	skip     []sqldialect.KeySeq
	backoffs []backoff
}

// measureFloor reads where the pending rows start from the head, and
// again from the floor that gives, on q, floorRounds times, each round's
// two reads side by side and in the other order than the round before, so
// a busy machine slows both and neither warms the cache for the other
// alone. The floor is kept (on) only if every round's read from the floor
// was gainAbove quicker; the first round that was not ends the measure.
// One read that a busy machine delays (CI's load delayed a read from the
// head of a table with no dead entry by 2 ms) then does not turn the
// floor on: every claim would pay a statement more, for nothing. A floor
// already on is measured again in one round: a delayed read keeps it a
// period longer at most, and each read from the head of a long walk is
// one more wait for the records that come meanwhile.
func (s *Store) measureFloor(ctx context.Context, q rowQuerier, index, keyIndex string, now time.Time) (floorMeasure, error) {
	f := s.floor
	start, err := s.pendingStart(ctx, q, index, keyIndex)
	first := start.first
	m := floorMeasure{head: start.head, skip: start.skip, backoffs: start.backoffs}
	switch {
	case err != nil:
		return m, err
	case first != nil && first.CreatedAt.IsZero():
		m.headOnly = true
		return m, nil
	}
	m.at = f.below(first, now)
	var fromHead func() (time.Duration, error)
	found, full := 0, false // the walk below lag before now: rows found, more than maxStragglers or not a time
	if low := now.Add(-f.lag); m.at.Before(low) {
		// Rows older than lag: where the walk from the first of them to
		// lag before now is slow, the floor stays there, above them, and
		// the claims take them as points, where they are few. The walk
		// below the floor passes every entry there, as a walk from the
		// head past them would: it is the measure's read from the head.
		below := s.walkBelow(ctx, q, index, keyIndex, nil, low, m.skip, false, &found)
		took, err := below()
		if err != nil {
			return m, err
		}
		if found <= maxStragglers {
			between, err := f.confirmedWalk(s.walkBelow(ctx, q, index, keyIndex, &sqldialect.Cursor{CreatedAt: m.at}, low, m.skip, false, new(int)))
			if err == nil && between >= f.pointsAbove {
				m.points, full, err = s.stragglers(ctx, q, index, keyIndex, low, m.skip)
				if !full && len(m.points) > 0 {
					m.at, m.head, fromHead = low, took, below
				}
			}
			if err != nil {
				return m, err
			}
		}
	}
	if f.on && now.Before(f.lockNext) {
		// A floor a locking measure kept (see lockMeasure): where the
		// plain reads show a gain, it stays on; where they show none, it
		// stays on too, until lockNext, when a locking measure decides
		// again. The read from the head is all this measure needs: where
		// the floor now stands.
		m.on = true
		return m, nil
	}
	read := func(after *sqldialect.Cursor) func() (time.Duration, error) {
		return s.timedFirst(ctx, q, s.pendingParams(index, keyIndex, after, m.skip, false))
	}
	if fromHead == nil {
		if len(m.skip) > 0 {
			// The read from the head is timed as one statement, as the
			// one from the floor is, and past the stuck keys' records:
			// each statement more, a round trip, would count as a gain,
			// and keep a floor on for good where a key is stuck.
			if m.head, err = read(nil)(); err != nil {
				return m, err
			}
		}
		fromHead = read(nil)
	}
	fromFloor := read(&sqldialect.Cursor{CreatedAt: m.at})
	m.on, _, err = f.rounds(fromHead, fromFloor, m.head, f.gainAbove)
	if !m.on && err == nil && f.on && f.locking {
		// A floor kept on MySQL: a round that missed sends the next
		// claim to a locking measure (see lockMeasure), which walks from
		// the head as the claim does, 60 ms or more behind 100,000
		// entries. Behind that many, where the plain reads gain 2 ms, a
		// round a busy machine delayed missed; one more round first.
		m.on, _, err = f.rounds(fromHead, fromFloor, -1, f.gainAbove)
	}
	if full || found > maxStragglers {
		// The rows below lag before now more than maxStragglers (a later
		// round's walk found more), or one whose created_at is not a time
		// this relay can bind: the floor stands below them all, as
		// without points.
		m.at, m.points = f.below(first, now), nil
	}
	return m, err
}

// maxStragglers is how many pending rows below the floor a measure takes
// as points at most (see stragglers): two arguments each on MySQL, one on
// PostgreSQL, in every claim (which offers them all, and takes the first
// it can) until a mark of this Store settles them.
const maxStragglers = 128

// stragglers is a read on q, through index, of the pending rows below at
// but for those skip holds, maxStragglers and one at most: those a measure
// takes as points, full where it found more (none then: the floor stands
// below them all). A floor kept at the
// first pending row stands below all that was published since: a record
// committed late, a publisher's clock behind, a Retry of old records. On
// MySQL, behind 100,000 entries of rows published beside a held snapshot
// and one such row, every claim of two relays walked them with locking
// reads (4 s a claim on a loaded machine), and a locking measure, from a
// head no lower than that floor, found no gain and turned the floor off.
// Kept at lag before now, it passes the entries below it, and the claims
// take those rows by their place in the index (ClaimParams.Points).
//
// A floor at the first of them is kept where the walk from it to lag
// before now (walkBelow, after it) takes less than pointsAbove: there a
// row made pending since between the two is claimed at once, not at the
// next measure.
func (s *Store) stragglers(ctx context.Context, q rowQuerier, index, keyIndex string, at time.Time, skip []sqldialect.KeySeq) (pts []sqldialect.Cursor, full bool, err error) {
	query := s.inline(s.q.PendingBelow(s.pendingParams(index, keyIndex, nil, skip, false), at, maxStragglers+1))
	s.sent.Add(1)
	rows, err := q.QueryContext(ctx, query.SQL, query.Args...)
	if err != nil {
		return nil, false, fmt.Errorf("outbox: the rows below the floor: %w", err)
	}
	defer func() { _ = rows.Close() }()
	for rows.Next() {
		var (
			id   string
			text any
		)
		if err := rows.Scan(&text, &id); err != nil {
			return nil, false, fmt.Errorf("outbox: the rows below the floor: %w", err)
		}
		created := sqldialect.NewTime(s.dialect.sql())
		_ = created.Scan(text) // its error is created.Err
		if created.Err != nil || created.T.IsZero() {
			// Not a time this relay can bind back: the floor stands
			// below it, as without points.
			return nil, true, rows.Err()
		}
		c := sqldialect.Cursor{CreatedAt: created.T, ID: id}
		switch t := text.(type) {
		case []byte:
			c.CreatedText = string(t)
		case string:
			c.CreatedText = t
		}
		pts = append(pts, c)
	}
	if err := rows.Err(); err != nil {
		return nil, false, fmt.Errorf("outbox: the rows below the floor: %w", err)
	}
	if len(pts) > maxStragglers {
		return nil, true, nil
	}
	return pts, false, nil
}

// walkBelow is a read on q, through index, that walks the entries of the
// pending index stragglers would, from after where it is set, to at, a
// locking one where lock is set, and returns how long it took: a
// measure's read from the head, or from the first pending row, where that
// row is older than lag. It counts the rows it finds where it stands, and
// sets *found to how many (maxStragglers and one at most). Timed,
// stragglers' own read counted the transfer of the rows it found: under
// CI's load, rows with no dead entry among them took pointsAbove, and the
// floor stood above them as if a held snapshot's entries were there.
func (s *Store) walkBelow(ctx context.Context, q rowQuerier, index, keyIndex string, after *sqldialect.Cursor, at time.Time, skip []sqldialect.KeySeq, lock bool, found *int) func() (time.Duration, error) {
	p := s.pendingParams(index, keyIndex, after, skip, lock)
	return func() (time.Duration, error) {
		started := time.Now()
		query := s.inline(s.q.PendingBelowWalk(p, at, maxStragglers+1))
		s.sent.Add(1)
		if err := q.QueryRowContext(ctx, query.SQL, query.Args...).Scan(found); err != nil {
			return 0, fmt.Errorf("outbox: the walk below the floor: %w", err)
		}
		return time.Since(started), nil
	}
}

// confirmedWalk times read, the walk from the first pending row older
// than lag to lag before now (see walkBelow), and once more where it
// took pointsAbove or longer: the quicker of the two. One read a busy
// machine delayed took a row as a point where the walk was quick (CI's
// load did, at 2 ms), and rows made pending after it between the two
// waited for the next measure.
func (f *headFloor) confirmedWalk(read func() (time.Duration, error)) (time.Duration, error) {
	took, err := read()
	if err != nil || took < f.pointsAbove {
		return took, err
	}
	again, err := read()
	return min(took, again), err
}

// settled drops from the floor's points (see headFloor.points) the rows a
// mark of this Store published or took to MaxAttempts: no claim takes
// them again. Others' marks are not seen: their points stay, a read of an
// index entry each in every claim, until the next measure.
func (s *Store) settled(published []string, failures []failure) {
	f := s.floor
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.points) == 0 {
		return
	}
	done := make(map[string]bool, len(published)+len(failures))
	for _, id := range published {
		done[id] = true
	}
	for _, x := range failures {
		if x.attempts >= s.cfg.MaxAttempts {
			done[x.id] = true
		}
	}
	// A copy: claims read the slice headBound gave them.
	f.points = slices.DeleteFunc(slices.Clone(f.points), func(c sqldialect.Cursor) bool { return done[c.ID] })
}

// rounds times the reads fromHead and fromFloor, floorRounds times (once
// for a floor already on), each round's two side by side and in the other
// order than the round before (see measureFloor), the first round's read
// from the head taken as head (read first where it is negative): on where
// every round's read from the floor was gain quicker; the first round that
// was not ends them. first is the first round's read from the head.
func (f *headFloor) rounds(fromHead, fromFloor func() (time.Duration, error), head, gain time.Duration) (on bool, first time.Duration, err error) {
	rounds := floorRounds
	if f.on {
		rounds = 1
	}
	for round := 0; ; round++ {
		var floor time.Duration
		if round%2 == 0 {
			if round > 0 || head < 0 {
				if head, err = fromHead(); err != nil {
					return false, first, err
				}
			}
			floor, err = fromFloor()
		} else {
			if floor, err = fromFloor(); err == nil {
				head, err = fromHead()
			}
		}
		if round == 0 {
			first = head
		}
		switch {
		case err != nil:
			return false, first, err
		case head-floor < gain:
			return false, first, nil
		case round+1 == rounds:
			return true, first, nil
		}
	}
}

// below is the floor under the first pending row first (nil: none) at now:
// that row's created_at, or lag before now if that is earlier.
func (f *headFloor) below(first *sqldialect.Cursor, now time.Time) time.Time {
	at := now.Add(-f.lag)
	if first != nil && first.CreatedAt.Before(at) {
		at = first.CreatedAt
	}
	return at
}

// headWalked records the time took of a claim or probe that started at the
// head of the pending index. While the floor is on, it sets the next walk
// from the head a period on. While it is off, one of checkAbove or longer
// makes the next claim or probe measure whether the walk is worth skipping,
// at most every checkEvery, doubled for each measure in a row that found
// no gain, up to 32 times (a minute by default): a database 5 ms away,
// whose every probe takes checkAbove, or records large enough that every
// claim does, measured every 2 s for good, two statements each time. A
// snapshot taken after such a spell is found that much later.
func (s *Store) headWalked(took time.Duration) {
	if s.leases() {
		return // SQLite
	}
	f := s.floor
	f.mu.Lock()
	defer f.mu.Unlock()
	now := time.Now()
	switch {
	case f.on && f.lowered.After(now.Add(-took)):
		f.next = time.Time{} // lowered during this walk: the next starts at the head too
	case f.on:
		f.next = now.Add(f.period(took))
	case took >= f.checkAbove && now.Sub(f.checked) >= f.checkEvery<<min(f.missed, floorMissedMax):
		f.check = true
	}
}

// floorDue is how long until the next claim or probe from the head while
// the floor is on (0 when it is due), and an hour while it is off.
func (s *Store) floorDue() time.Duration {
	f := s.floor
	f.mu.Lock()
	defer f.mu.Unlock()
	if !f.on {
		return time.Hour
	}
	return max(time.Until(f.next), 0)
}

// belowPoints reports whether a drain's cursor c stands at or below the
// floor while the floor has points (see headFloor.points): the drain went
// back for a key's next record (behindNextOfKeys), an old one, and its
// claim from c would walk every dead entry between it and the floor; or
// the claim before took points alone, more than one claim's worth, and
// resumes at the floor (batch.last), where it would pass the others
// over until the drain's end. Its claim starts at the floor instead,
// whose points statement offers them all.
func (s *Store) belowPoints(c *sqldialect.Cursor) bool {
	f := s.floor
	f.mu.Lock()
	defer f.mu.Unlock()
	if !f.on || len(f.points) == 0 {
		return false
	}
	// At the floor: the cursor batch.last gives a batch of points alone
	// (no id), not a row's of that created_at, which would send every
	// claim of a drain whose rows share it back to the floor.
	return c.CreatedAt.Before(f.at) || c.ID == "" && c.IDArg == nil && c.CreatedAt.Equal(f.at)
}

// floorKey names the Stores of one table over one pool: by the table's
// name without its schema, in lower case, so that "acemq_outbox" and
// "public.acemq_outbox" (and MySQL's names that differ in case only) are
// one. Two tables of one name in two schemas share a key: a Retry through
// one costs the other's relay a walk from the head, no more.
type floorKey struct {
	db    weak.Pointer[sql.DB]
	table string
}

// floorKeyOf is the floorKey of s.
func (s *Store) floorKeyOf() floorKey {
	return floorKey{weak.Make(s.db), strings.ToLower(s.q.Name())}
}

// floors are the floors of this process's Stores, by pool and table: a
// Republisher, and a Store an operator's code made, has one of its own,
// and what it makes pending again must reach the relay's.
var floors struct {
	mu sync.Mutex
	m  map[floorKey]map[*headFloor]struct{}
}

// joinFloors enters the floor of s among floors, until s is collected.
func (s *Store) joinFloors() {
	k := s.floorKeyOf()
	floors.mu.Lock()
	defer floors.mu.Unlock()
	if floors.m == nil {
		floors.m = make(map[floorKey]map[*headFloor]struct{})
	}
	if floors.m[k] == nil {
		floors.m[k] = make(map[*headFloor]struct{})
	}
	floors.m[k][s.floor] = struct{}{}
	runtime.AddCleanup(s, func(f *headFloor) {
		floors.mu.Lock()
		defer floors.mu.Unlock()
		delete(floors.m[k], f)
		if len(floors.m[k]) == 0 {
			delete(floors.m, k)
		}
	}, s.floor)
}

// lowerFloors makes the next claim or probe of every Store of the table
// over the same pool start at the head: rows made pending again (Retry,
// Republish) may lie below their floors. Their skip lists are emptied: a
// stuck record in one may be pending again, and a measure that leaves the
// floor as it was (a row whose created_at is NULL found first) would keep
// passing the records it held, claimable once it is published.
func (s *Store) lowerFloors() {
	now := time.Now()
	for _, f := range s.floorsOfTable() {
		f.mu.Lock()
		f.next, f.lowered, f.skip, f.backoffs, f.lockDue, f.rewind = time.Time{}, now, nil, nil, false, true
		f.mu.Unlock()
	}
}

// lowerFloorsHeard is lowerFloors for a retry that another process
// announced (see Forwarder.listen), at most once per rewindGap
// (rewindGapMin at the least) of each floor: any session can send the
// notification, and a stream of them (retries in a loop, relays that stop
// after a quiet flow wake the table) had every claim of a drain measure
// its floor from the head (20 claims of 20 in half a second), the walk
// that the floor and the throttle keep rare. One heard within the gap is
// lowered for once the gap is over: not at the floor's next measure, a
// period away, which a claim in between may have moved above its rows.
func (s *Store) lowerFloorsHeard() {
	now := time.Now()
	for _, f := range s.floorsOfTable() {
		f.mu.Lock()
		gap, last := max(f.rewindGap, rewindGapMin), f.heard
		if f.lowered.After(last) {
			last = f.lowered // a Retry in this process, heard too
		}
		switch {
		case now.Sub(last) >= gap:
			f.next, f.lowered, f.heard, f.rewind = time.Time{}, now, now, true
		default:
			if !last.After(now) { // none coming yet
				f.heard = last.Add(gap)
			}
			// Also where one is coming: a measure since may have put the
			// next a period away.
			if !f.next.IsZero() && f.next.After(f.heard) {
				f.next = f.heard // the drain goes back then, to measure
			}
		}
		if !f.on {
			f.rewind = true // to the head, throttled by drainRewinds
		}
		f.skip, f.backoffs, f.lockDue = nil, nil, false
		f.mu.Unlock()
	}
}

// floorsOfTable are the floors of every Store of s's table over its pool.
func (s *Store) floorsOfTable() []*headFloor {
	floors.mu.Lock()
	defer floors.mu.Unlock()
	group := floors.m[s.floorKeyOf()]
	fs := make([]*headFloor, 0, len(group))
	for f := range group {
		fs = append(fs, f)
	}
	return fs
}

// retryAt notes that a keyed record this Store's relay failed waits out
// its retry backoff until t. A failed keyed record does not send the drain
// back to the head, as a failed unkeyed one does: it holds back only its
// key, and the records behind it go on. By t the drain's cursor is past
// it, and it waited for the end of the drain (a backlog of 3,000 rows,
// 1.1 to 1.5 s for a backoff of 5 ms), and for as long as a flow the relay
// could not keep up with lasted, its key with it. At most maxRetries
// are kept; a record past them waits for the drain's next look back
// (drainLookBack).
//
// On SQLite the backoff ends leaseRounding after t: a claim compares the
// lease through julianday(), which rounds both times to the millisecond
// (the lease's text is the microsecond's), so to a claim less than a
// millisecond past t the lease could still be live. The claim that went
// back then passed the record over and used the entry up, and the record
// waited for the drain's end after all (20 runs in 120 of
// TestForwarder_KeyedRecordsBackoffEnds_DrainGoesBackForIt under load).
func (s *Store) retryAt(t time.Time) {
	if s.leases() {
		t = t.Add(leaseRounding)
	}
	f := s.floor
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.retries) < maxRetries {
		f.retries = append(f.retries, t)
	}
}

// leaseRounding is how long after its end a lease may still look live to
// a claim on SQLite (see retryAt): now's text at least a millisecond and a
// half past the lease's rounds to a later millisecond.
const leaseRounding = 2 * time.Millisecond

// maxRetries bounds headFloor.retries: a drain goes back once however many
// backoffs ended by then, and each entry is a few bytes.
const maxRetries = 1024

// drainRewinds reports whether a claim at now from a drain's cursor (drain)
// starts from the floor (or the head) instead: a backoff retryAt noted has
// ended, or lowerFloors made rows pending again since, or drainLookBack
// has passed since a claim last started there. Any claim but a Sweep's
// asks, so that one from the floor, which reaches those rows, uses up
// what it would have said.
//
// The last is for rows made pending again that this process was not told
// of: a Retry or Republish of another process on MySQL and SQLite, which
// have no NOTIFY to say so, and on every database another library's tool
// that sets a row's attempts back by an UPDATE. Behind the cursor, they
// waited for the drain's end: for as long as a flow the relay could not
// keep up with lasted.
//
// A drain goes back once rewindGap has passed since it last did: keys
// whose records a broker refuses for ever, at backoffs of a few
// milliseconds (a queue that nacks, which counts no attempt to
// MaxAttempts), sent every claim back to those records, each refused
// again, and the drain published nothing else (0 of 20,000 rows in 60 s
// beside 200 such keys, a review found). The gap is ten times what the
// last claim that went back took, from rewindGapMin to rewindGapMax: the
// walk from the head costs at most a tenth of the relay's time, where
// dead index entries make it slow.
func (s *Store) drainRewinds(now time.Time, drain bool) bool {
	f := s.floor
	f.mu.Lock()
	defer f.mu.Unlock()
	if drain && now.Sub(f.rewound) < f.rewindGap {
		return false // kept for the claim that may go back
	}
	due := f.rewind || drain && now.Sub(f.fromHead) >= f.lookBack
	f.rewind = false
	kept := f.retries[:0]
	for _, t := range f.retries {
		if t.After(now) {
			kept = append(kept, t)
		} else {
			due = true
		}
	}
	f.retries = kept
	if drain && due {
		f.rewound = now
	}
	return drain && due
}

// drainLookBack is how long a drain goes on from its cursor at most
// before a claim goes back to the floor or the head (see drainRewinds), if
// rewindGap allows: one claim a second at most, of the tens or hundreds a
// drain makes, each walking the entries of the rows in flight (at half a
// second, a drain of 20,000 rows on PostgreSQL lost some 4 % of its rate).
const drainLookBack = time.Second

// claimsFromHead notes that a claim starts at the floor or the head now
// (see drainRewinds).
func (s *Store) claimsFromHead(now time.Time) {
	f := s.floor
	f.mu.Lock()
	defer f.mu.Unlock()
	f.fromHead = now
}

// rewindTook notes how long a claim that went back (drainRewinds) took.
func (s *Store) rewindTook(took time.Duration) {
	f := s.floor
	f.mu.Lock()
	defer f.mu.Unlock()
	f.rewindGap = min(max(10*took, rewindGapMin), rewindGapMax)
}

// rewindGapMin and rewindGapMax bound the time between two claims of a
// drain that go back (see drainRewinds): at the least, a drain of a few
// thousand rows a second gains some hundreds between them; at the most, a
// keyed record whose backoff ended waits that long past it, beside a walk
// from the head of half a second.
const (
	rewindGapMin = 250 * time.Millisecond
	rewindGapMax = 5 * time.Second
)

// pendingStart reads where the pending rows start from the head on q, as
// pendingFirst does, passing the records that keyed records stuck at
// MaxAttempts hold in their keys: no claim takes them until the stuck one
// is retried, and a floor kept at the first of them (an hour back, say)
// would have every claim walk the dead entries of all that was published
// since. Where the first row is keyed and not its key's first (seq 1), the
// record before it in its key is read (KeyRecord: seqs are gapless, a
// point read); if that is unpublished and stuck, the read goes on after
// the row past the key's later records, up to maxStuckKeys keys, and stops
// at the next held record after that. A row whose predecessor is missing
// (another library's gap) is taken as it is: the floor stays lower. A
// keyed row waiting out its retry backoff (a lease RetryHold, live) is
// passed too, with its key's later records, until its backoff ends (see
// endBackoffs). It
// returns the stuck records it passed, for the reads that follow.
//
// One point read a key, in Go: a first form asked the database, for each
// row it walked, whether its key's first pending record was stuck. That
// read the key again for each held record where PostgreSQL's planner did
// not memoize it (1.6 s past 5,000 held records beside a snapshot), and
// each read walked the entries a held snapshot keeps of the key's
// published records, at every claim.
func (s *Store) pendingStart(ctx context.Context, q rowQuerier, index, keyIndex string) (start pendingStartRead, err error) {
	var after *sqldialect.Cursor
	for {
		started := time.Now()
		r, err := s.pendingFirst(ctx, q, index, keyIndex, after, start.skip)
		if start.sent++; start.sent == 1 {
			start.head = time.Since(started)
		}
		first, key := r.first, r.key
		start.first = first
		if err != nil || len(start.skip) == maxStuckKeys {
			return start, err
		}
		if r.inBackoff() {
			// Waiting out its retry backoff: passed, with its key's later
			// records, until the backoff ends (see endBackoffs).
			b := r.backoff()
			start.skip, start.backoffs = append(start.skip, b.skip), append(start.backoffs, b)
			after = first
			continue
		}
		if first == nil || first.CreatedAt.IsZero() || key == nil || key.Seq <= 1 {
			return start, nil
		}
		before := sqldialect.KeySeq{Key: key.Key, Seq: key.Seq - 1}
		read := s.inline(s.q.KeyRecord(keyIndex, before.Key, before.Seq))
		s.sent.Add(1)
		start.sent++
		var attempts int64
		switch err := q.QueryRowContext(ctx, read.SQL, read.Args...).Scan(&attempts); {
		case errors.Is(err, sql.ErrNoRows):
			return start, nil // published, or a gap
		case err != nil:
			return pendingStartRead{sent: start.sent}, fmt.Errorf("outbox: the record before a keyed one: %w", err)
		case attempts < int64(s.cfg.MaxAttempts):
			return start, nil // waiting, not held for good
		}
		start.skip = append(start.skip, before)
		after = first // every row before it is passed or held
	}
}

// passStuck adds to the floor's skip list the keyed records stuck that a
// mark of this Store took to MaxAttempts and committed (marked: before
// it was sent), up to maxStuckKeys in all. Without it, the floor stopped
// at the first record such a key holds until the next measure (up to
// everyMax): each claim's read of the floor found it pending, under
// MaxAttempts, and the floor stood there. A record stuck after a relay
// retried it for minutes holds records as old, and every claim walked the
// dead entries a held snapshot keeps of all that was published since.
//
// Nothing is added where the floors were lowered since marked (a Retry
// through a Store over this pool, which may have made the record pending
// again) or the floor is off: the next measure reads the stuck keys
// itself. A mark that changed no row (a record deleted meanwhile, a lease
// another relay took) passes nothing.
func (s *Store) passStuck(stuck []sqldialect.KeySeq, marked time.Time) {
	if len(stuck) == 0 || s.leases() {
		return
	}
	f := s.floor
	f.mu.Lock()
	defer f.mu.Unlock()
	if !f.on || f.lowered.After(marked) {
		return
	}
	for _, k := range stuck {
		if len(f.skip) == maxStuckKeys {
			return
		}
		if !slices.Contains(f.skip, k) {
			f.skip = append(slices.Clip(f.skip), k)
		}
	}
}

// lockMeasure, where a measure's plain reads found no gain on MySQL
// (headFloor.lockDue), measures again on conn, in a transaction of its
// own that it rolls back at once: where the pending rows start, read
// from the head as a measure does (a row made pending since, below the
// floor that measure found, is below this one), then locking reads from
// the head and from the floor that gives, timed as the claim's walk is
// (FOR UPDATE SKIP LOCKED, under READ COMMITTED). InnoDB keeps the lock
// of every row a locking read passes through the pending index until its
// transaction ends, records stuck below the floor among them: in the
// claim's transaction, an operator's Retry of one waited for the batch.
// The claim that calls it, before its own transaction, then starts where
// it says. MariaDB's plain read passes a published row's entry some 20
// times quicker than its locking read: behind 20,000, 0.75 ms from the
// head against 15, a gain under gainAbove, and the floor stayed off (or
// on by chance) while every claim paid the walk. The locking reads must
// gain floorGainAbove (gainAbove where a test asks more). A floor they
// keep stays on whatever the plain reads show until lockNext: two periods
// after the measure that turned it on, each measure that keeps it
// doubling the wait, up to floorLockMax.
func (s *Store) lockMeasure(ctx context.Context, conn *sql.Conn) error {
	f := s.floor
	f.mu.Lock()
	defer f.mu.Unlock()
	if !f.lockDue {
		return nil
	}
	index, keyIndex := s.indexNames()
	if index == "" {
		return nil // not looked up yet: the claim does, and the next measures
	}
	f.lockDue = false
	s.sent.Add(2) // BEGIN, ROLLBACK
	tx, err := conn.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelReadCommitted})
	if err != nil {
		f.off()
		return fmt.Errorf("outbox: the floor's locking measure: %w", err)
	}
	defer func() { _ = tx.Rollback() }()
	// now before the read, as in headBound: a row committed after it
	// within lag of its created_at is above the floor below.
	now := time.Now()
	start, err := s.pendingStart(ctx, tx, index, keyIndex)
	if err != nil {
		f.off()
		return err
	}
	if start.first != nil && start.first.CreatedAt.IsZero() {
		// A row whose created_at is NULL, which no floor is below: the
		// claim's own measure sends it to the head.
		f.next = time.Time{}
		return nil
	}
	at := f.below(start.first, now)
	// Locking reads (see sqldialect.PendingParams.Lock): their time is what
	// is wanted, not their row, which stays locked, with every row they
	// passed, until tx is rolled back.
	read := func(after *sqldialect.Cursor) func() (time.Duration, error) {
		return s.timedFirst(ctx, tx, s.pendingParams(index, keyIndex, after, start.skip, true))
	}
	fromHead := read(nil)
	var points []sqldialect.Cursor
	if low := now.Add(-f.lag); at.Before(low) {
		// Rows older than lag, taken as points where they are few and the
		// locking walk from the first of them to lag before now is slow
		// (see stragglers): the floor is timed at lag before now, against
		// a locking walk of the rows below it (walkBelow).
		full := false
		var between time.Duration
		points, full, err = s.stragglers(ctx, tx, index, keyIndex, low, start.skip)
		if err == nil && !full {
			between, err = f.confirmedWalk(s.walkBelow(ctx, tx, index, keyIndex, &sqldialect.Cursor{CreatedAt: at}, low, start.skip, true, new(int)))
		}
		switch {
		case err != nil:
			f.off()
			return err
		case !full && between >= f.pointsAbove:
			at, fromHead = low, s.walkBelow(ctx, tx, index, keyIndex, nil, low, start.skip, true, new(int))
		default:
			points = nil
		}
	}
	on, head, err := f.rounds(fromHead, read(&sqldialect.Cursor{CreatedAt: at}), -1, max(f.gainAbove, floorGainAbove))
	if rbErr := tx.Rollback(); err == nil && rbErr != nil {
		err = fmt.Errorf("outbox: the floor's locking measure: %w", rbErr)
	}
	switch {
	case err != nil:
		f.off()
		return err
	case on:
		f.lockedOn(now, head)
		f.on, f.at, f.skip, f.backoffs, f.points, f.missed = true, at, start.skip, start.backoffs, points, 0
		f.next = now.Add(f.period(head))
	case f.on:
		f.off()
		f.missed = 0
	default:
		f.missed++
	}
	return nil
}

// lockedOn sets when the next locking measure is due after one at now
// that turned the floor on or kept it, its read from the head having
// taken head: two periods after one that turned it on, and twice as long
// as the last wait after each that kept it, floorLockMax at most.
func (f *headFloor) lockedOn(now time.Time, head time.Duration) {
	if f.on {
		f.lockKept = min(f.lockKept+1, floorMissedMax)
	}
	f.lockNext = now.Add(min(f.period(head)<<(f.lockKept+1), floorLockMax))
}

// pendingStartRead is what Store.pendingStart read.
type pendingStartRead struct {
	// first: where the pending rows start (see pendingFirst); skip: the
	// stuck records passed (key, seq), each holding its key's later ones,
	// and the records before those waiting out a retry backoff, backoffs.
	first    *sqldialect.Cursor
	skip     []sqldialect.KeySeq
	backoffs []backoff
	// head: the first read's time, from the head with nothing skipped;
	// sent: the statements sent.
	head time.Duration
	sent int
}

// maxStuckKeys is how many stuck keys and records in a retry backoff the
// floor passes at most: two statements each stuck key in a measure, one
// each record in backoff, in a measure or a claim's read of the floor.
const maxStuckKeys = 16

// pendingFirst reads the first pending row under MaxAttempts after after
// (from the head when nil) on q, but for those skip holds (see
// pendingStart), as sqldialect's PendingFirst does: nil when there is
// none, and one without a CreatedAt when its created_at is NULL or cannot
// be read as a time; with its key and seq where it has both.
func (s *Store) pendingFirst(ctx context.Context, q rowQuerier, index, keyIndex string, after *sqldialect.Cursor, skip []sqldialect.KeySeq) (pendingRow, error) {
	return s.readFirst(ctx, q, s.pendingParams(index, keyIndex, after, skip, false))
}

// pendingParams are the PendingParams of a read of where the pending rows
// start (see pendingFirst), a locking one where lock is set.
func (s *Store) pendingParams(index, keyIndex string, after *sqldialect.Cursor, skip []sqldialect.KeySeq, lock bool) sqldialect.PendingParams {
	return sqldialect.PendingParams{Index: index, KeyIndex: keyIndex, MaxAttempts: s.cfg.MaxAttempts, Now: time.Now(), After: after, Skip: skip, Lock: lock}
}

// timedFirst is a read of where the pending rows start on q, as p says,
// that returns how long it took: a measure's.
func (s *Store) timedFirst(ctx context.Context, q rowQuerier, p sqldialect.PendingParams) func() (time.Duration, error) {
	return func() (time.Duration, error) {
		started := time.Now()
		p.Now = started
		_, err := s.readFirst(ctx, q, p)
		return time.Since(started), err
	}
}

// readFirst runs sqldialect's PendingFirst of p on q: see pendingFirst.
func (s *Store) readFirst(ctx context.Context, q rowQuerier, p sqldialect.PendingParams) (pendingRow, error) {
	query := s.inline(s.q.PendingFirst(p))
	s.sent.Add(1)
	var (
		id  string
		key sql.NullString
		seq sql.NullInt64
	)
	at, hold := sqldialect.NewTime(s.dialect.sql()), sqldialect.NewTime(s.dialect.sql())
	err := q.QueryRowContext(ctx, query.SQL, query.Args...).Scan(at, &id, &key, &seq, hold)
	switch {
	case errors.Is(err, sql.ErrNoRows):
		return pendingRow{}, nil
	case err != nil:
		return pendingRow{}, fmt.Errorf("outbox: where the pending rows start: %w", err)
	case at.Err != nil || at.T.IsZero():
		// Not a time this relay can compare: no floor below it is safe.
		return pendingRow{first: &sqldialect.Cursor{ID: id}}, nil
	}
	r := pendingRow{first: &sqldialect.Cursor{CreatedAt: at.T, ID: id}}
	if key.Valid && seq.Valid {
		r.key = &sqldialect.KeySeq{Key: key.String, Seq: seq.Int64}
		if hold.Err == nil {
			r.hold = hold.T
		}
	}
	return r, nil
}

// pendingRow is a read of where the pending rows start (see pendingFirst).
type pendingRow struct {
	// first: the row, nil for none, without a CreatedAt where its
	// created_at is NULL or not a time; key: its key and seq where it has
	// both.
	first *sqldialect.Cursor
	key   *sqldialect.KeySeq
	// hold: for a keyed row waiting out its retry backoff (a lease
	// RetryHold, live at the read), the backoff's end; zero otherwise.
	hold time.Time
}

// backoff is a keyed record waiting out its retry backoff that the floor
// passes: its skip entry (the record before it, seq − 1, so that it and
// its key's later records are passed), its created_at, and when its
// backoff ends.
type backoff struct {
	skip  sqldialect.KeySeq
	at    time.Time
	until time.Time
}

// backoff is r's row as a backoff the floor passes (see inBackoff).
func (r pendingRow) backoff() backoff {
	return backoff{skip: sqldialect.KeySeq{Key: r.key.Key, Seq: r.key.Seq - 1}, at: r.first.CreatedAt, until: r.hold}
}

// endBackoffs, for each record the floor passes whose retry backoff has
// ended at now, drops its skip entry and lowers the floor to its
// created_at: the claim then starts no higher than the record, which is
// claimable again, and takes it. No read from the head: the floor stood
// below every pending row it did not pass, as it does now.
func (f *headFloor) endBackoffs(now time.Time) {
	if len(f.backoffs) == 0 {
		return
	}
	var left []backoff
	for _, b := range f.backoffs {
		if now.Before(b.until) {
			left = append(left, b)
			continue
		}
		if i := slices.Index(f.skip, b.skip); i >= 0 {
			f.skip = slices.Delete(slices.Clone(f.skip), i, i+1)
		}
		if b.at.Before(f.at) {
			f.at = b.at
		}
	}
	f.backoffs = left
}

// inBackoff tells whether the floor may pass r's row and its key's later
// records until r.hold: a keyed record waiting out its retry backoff
// (see pendingStart).
func (r pendingRow) inBackoff() bool {
	return r.first != nil && !r.first.CreatedAt.IsZero() && r.key != nil && !r.hold.IsZero()
}
