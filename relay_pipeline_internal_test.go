package outbox

import (
	"context"
	"database/sql"
	"path/filepath"
	"testing"

	_ "github.com/go-sql-driver/mysql"
	_ "github.com/jackc/pgx/v5/stdlib"
	_ "github.com/mattn/go-sqlite3"
)

// Only a database that cannot wake the relay at all (MySQL) claims again at
// once while its claims find rows: on PostgreSQL without its trigger that
// measured worse, and SQLite's claims take the services' write lock (see
// claimNow).
func TestNewRelayLoop_ClaimsInAFlowOnMySQLOnly(t *testing.T) {
	for _, c := range []struct {
		dialect Dialect
		driver  string
		want    bool
	}{{MySQL, "mysql", true}, {Postgres, "pgx", false}, {SQLite, "sqlite3", false}} {
		db, err := sql.Open(c.driver, "") // no connection is made
		if err != nil {
			t.Fatal(err)
		}
		store, err := NewStore(db, StoreConfig{Dialect: c.dialect})
		if err != nil {
			t.Fatal(err)
		}
		l := (&Forwarder{store: store}).newRelayLoop(0, false)
		if l.claimInFlow != c.want {
			t.Errorf("%s: claimInFlow %v, want %v", c.driver, l.claimInFlow, c.want)
		}
		_ = db.Close()
	}
}

// With a batch's confirms out and the last claim short of a batch, the
// next sweep claims only if something says rows may be waiting: a wake-up,
// or, where nothing can wake the relay, a last claim that found rows.
func TestClaimNow_BatchesOut_ClaimsOnAWakeUpOrInAFlowWithoutOne(t *testing.T) {
	loop := func(found, inFlow bool) *relayLoop {
		return &relayLoop{f: &Forwarder{wake: make(chan struct{}, 1)}, queue: []*batch{{}}, drained: true, found: found, claimInFlow: inFlow}
	}
	if loop(true, false).claimNow() {
		t.Error("claimed with nothing pending where a commit wakes the relay")
	}
	if loop(false, true).claimNow() {
		t.Error("claimed after a claim that found nothing")
	}
	if !loop(true, true).claimNow() {
		t.Error("did not claim in a flow where nothing wakes the relay")
	}
	woken := loop(false, false)
	woken.f.Notify()
	if !woken.claimNow() {
		t.Error("did not claim on a wake-up")
	}
}

// An idle relay probes before it claims, except on SQLite when a wake-up
// started the sweep: the file watch reports the commit's write before the
// commit is visible, and the probe's snapshot missed it about once in 400
// commits (TestForwarder_SQLite_CommitElsewhere_WakesRelayWithoutPoll).
// The claim waits for the writer's lock instead.
func TestNothingToClaim_SQLiteWokenClaimsWithoutProbing(t *testing.T) {
	db, err := sql.Open("sqlite3", "file:"+filepath.Join(t.TempDir(), "outbox.db")+"?_journal_mode=WAL")
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	if err := Migrate(context.Background(), db, SQLite); err != nil {
		t.Fatal(err)
	}
	store, err := NewStore(db, StoreConfig{Dialect: SQLite})
	if err != nil {
		t.Fatal(err)
	}
	f := &Forwarder{store: store}
	idle := func(woke bool) *relayLoop { return &relayLoop{f: f, idle: true, woke: woke} }
	if !idle(false).nothingToClaim(context.Background()) {
		t.Error("an idle poll of an empty outbox claimed: its probe should have found nothing")
	}
	if idle(true).nothingToClaim(context.Background()) {
		t.Error("a woken idle sweep on SQLite probed: a commit whose log write woke it may not be visible to a probe yet")
	}
}
