package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"
	"github.com/prometheus/client_golang/prometheus"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// pgConflict is an error PostgreSQL's dialect takes for a serialization
// failure (SQLSTATE 40001), as pgx's *pgconn.PgError reports it.
type pgConflict struct{}

func (pgConflict) Error() string {
	return "ERROR: could not serialize access due to concurrent update (SQLSTATE 40001)"
}
func (pgConflict) SQLState() string { return "40001" }

// The gauges of the ordered inbox count every held message. RefreshStats
// read them through Gaps, which stops at 1000 keys, so with more keys
// holding messages outbox_inbox_held and outbox_inbox_gaps stopped at 1000.
// Its log names the 20 longest-held keys and counts the rest.
func TestInbox_RefreshStats_MoreThan1000KeysHeld_TheGaugesCountThemAll(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.SQLite)
	reg := prometheus.NewRegistry()
	m, err := outbox.NewMetrics(reg)
	if err != nil {
		t.Fatal(err)
	}
	logs := watermill.NewCaptureLogger()
	in := orderedInbox(t, db, outbox.InboxConfig{ConsumerName: "ledger", Metrics: m, GapAfter: 1, Logger: logs})
	h := in.Middleware(func(msg *message.Message) ([]*message.Message, error) { return nil, nil })
	const keys = 1005
	for i := range keys {
		deliver(t, h, fmt.Sprintf("k%04d", i), 2) // each held: 1 has not come
	}
	if n := countHeld(t, db); n != keys {
		t.Fatalf("%d held rows, want %d", n, keys)
	}
	if err := in.RefreshStats(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got := metricValue(t, reg, "outbox_inbox_held", ""); got != keys {
		t.Errorf("outbox_inbox_held = %v with %d messages held, want %d", got, keys, keys)
	}
	if got := metricValue(t, reg, "outbox_inbox_gaps", ""); got != keys {
		t.Errorf("outbox_inbox_gaps = %v with %d keys held past GapAfter, want %d", got, keys, keys)
	}
	named, more := 0, ""
	for _, l := range logs.Captured()[watermill.ErrorLogLevel] {
		switch {
		case l.Fields["aggregate_id"] != nil:
			named++
		case strings.HasPrefix(l.Msg, "Ordered inbox: more keys"):
			more = l.Err.Error()
		}
	}
	if named != 20 || more != fmt.Sprintf("%d keys, 20 logged", keys) {
		t.Errorf("RefreshStats logged %d keys by name and %q of the rest, want 20 and \"%d keys, 20 logged\"", named, more, keys)
	}
}

// A delivery whose transaction the database refused for a concurrent one
// runs again and counts once, by its outcome; so does a held message's
// apply. It counted a failure for the refused try, and then a processed
// for the same message: one message, applied once, showed in
// outbox_inbox_failed_total.
func TestInbox_HeldApplyRefusedAndRunAgain_CountsOnce(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.Postgres)
	reg := prometheus.NewRegistry()
	m, err := outbox.NewMetrics(reg)
	if err != nil {
		t.Fatal(err)
	}
	refused := map[string]bool{}
	h := orderedInbox(t, db, outbox.InboxConfig{ConsumerName: "ledger", Metrics: m}).Middleware(func(msg *message.Message) ([]*message.Message, error) {
		if !refused[msg.UUID] {
			refused[msg.UUID] = true
			return nil, pgConflict{}
		}
		return nil, nil
	})
	// The delivery path: seq 1 refused once, run again, applied.
	deliver(t, h, "acct", 1)
	if got := metricValue(t, reg, "outbox_inbox_failed_total", "ledger"); got != 0 {
		t.Fatalf("delivery path: outbox_inbox_failed_total = %v after a conflict rerun, want 0", got)
	}
	// The held path: 3 held, 2 applies and drains 3, whose first try is
	// refused and run again.
	deliver(t, h, "acct", 3)
	deliver(t, h, "acct", 2)
	if n := countHeld(t, db); n != 0 {
		t.Fatalf("%d held after 2 was applied, want 0", n)
	}
	for name, want := range map[string]float64{
		"outbox_inbox_processed_total": 3,
		"outbox_inbox_held_total":      1,
		"outbox_inbox_failed_total":    0,
	} {
		if got := metricValue(t, reg, name, "ledger"); got != want {
			t.Errorf("%s{consumer=ledger} = %v, want %v", name, got, want)
		}
	}
}

// lostDest is a broker whose connection goes before it confirms anything:
// every record of a batch gets ErrConnectionLost, as AMQPDestination gives
// each unconfirmed record when the connection closes or the confirm wait
// times out.
type lostDest struct{}

func (lostDest) Publish(_ context.Context, records []outbox.Record) []error {
	res := make([]error, len(records))
	for i := range res {
		res[i] = fmt.Errorf("%w: channel closed before the broker confirmed", outbox.ErrConnectionLost)
	}
	return res
}

// outbox_forwarder_failed_total counts the failures the relay records on
// rows (last_error), and only those: five records out when the connection
// went, none confirmed, charge the first and release the rest. The metric
// and the rows tell the same story.
func TestForwarder_ConnectionLost_FailedCountsTheFailuresRecorded(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.SQLite)
	reg := prometheus.NewRegistry()
	m, err := outbox.NewMetrics(reg)
	if err != nil {
		t.Fatal(err)
	}
	publishN(t, db, "ex", "rk", 5)
	f, err := outbox.NewForwarder(db.DB, lostDest{}, outbox.ForwarderConfig{Dialect: outbox.SQLite, Metrics: m})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.Sweep(context.Background()); err == nil {
		t.Fatal("sweep of a lost connection returned no error")
	}
	var recorded int
	if err := db.QueryRow("SELECT COUNT(*) FROM acemq_outbox WHERE last_error IS NOT NULL").Scan(&recorded); err != nil {
		t.Fatal(err)
	}
	if recorded != 1 {
		t.Errorf("%d rows with a failure recorded, want the first of the batch", recorded)
	}
	if got := metricValue(t, reg, "outbox_forwarder_failed_total", "ex"); got != float64(recorded) {
		t.Errorf("outbox_forwarder_failed_total{exchange=ex} = %v, want the %d failures recorded on rows", got, recorded)
	}
}

// A NewMetrics that fails to register (one name taken on the registry)
// takes back the collectors it did register: they were left behind, in a
// registry the caller may go on using.
func TestNewMetrics_FailedRegistration_LeavesTheRegistryAsItWas(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	taken := prometheus.NewGauge(prometheus.GaugeOpts{Name: "outbox_stuck", Help: "someone else's"})
	reg.MustRegister(taken)
	if _, err := outbox.NewMetrics(reg); err == nil {
		t.Fatal("NewMetrics succeeded over a taken name")
	}
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() != "outbox_stuck" {
			t.Errorf("the failed NewMetrics left %s registered", f.GetName())
		}
	}
}

// Sweep is the relay's too ("publishes one batch now"), and it sends its
// claim, marks, BEGIN and COMMIT; outbox_forwarder_statements_total
// counted only what Run's loop reported, so a relay driven by Sweep
// showed none.
func TestForwarder_Sweep_StatementsCounted(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.SQLite)
	reg := prometheus.NewRegistry()
	m, err := outbox.NewMetrics(reg)
	if err != nil {
		t.Fatal(err)
	}
	publishN(t, db, "ex", "rk", 1)
	f, err := outbox.NewForwarder(db.DB, okDest{}, outbox.ForwarderConfig{Dialect: outbox.SQLite, Metrics: m})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if n, err := f.Sweep(context.Background()); n != 1 || err != nil {
		t.Fatalf("sweep: %d, %v; want 1, nil", n, err)
	}
	sent := outbox.StatementsSent(f.Store())
	if got := metricValue(t, reg, "outbox_forwarder_statements_total", ""); got != float64(sent) {
		t.Errorf("outbox_forwarder_statements_total = %v after a Sweep that sent %d statements", got, sent)
	}
}

// okDest confirms every record.
type okDest struct{}

func (okDest) Publish(_ context.Context, records []outbox.Record) []error {
	return make([]error, len(records))
}

// An operator's skip reads the held messages into the gauges again (SkipHeld too): an
// alert on outbox_inbox_gaps ends with the skip, not at the next
// RefreshStats (ApplyHeld's, every few minutes).
func TestInbox_SkipGap_RefreshesTheGauges(t *testing.T) {
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		reg := prometheus.NewRegistry()
		m, err := outbox.NewMetrics(reg)
		if err != nil {
			t.Fatal(err)
		}
		in := orderedInbox(t, db, outbox.InboxConfig{ConsumerName: "ledger", Metrics: m, GapAfter: time.Nanosecond})
		h := in.Middleware(func(msg *message.Message) ([]*message.Message, error) { return nil, nil })
		deliver(t, h, "a", 2) // held: 1 is missing
		if err := in.RefreshStats(context.Background()); err != nil {
			t.Fatal(err)
		}
		if got := metricValue(t, reg, "outbox_inbox_gaps", ""); got != 1 {
			t.Fatalf("outbox_inbox_gaps = %v before the skip, want 1", got)
		}
		if err := in.SkipGap(context.Background(), "ledger", "a", 1, 1); err != nil {
			t.Fatal(err)
		}
		for _, name := range []string{"outbox_inbox_held", "outbox_inbox_gaps", "outbox_inbox_oldest_gap_age_seconds"} {
			if got := metricValue(t, reg, name, ""); got != 0 {
				t.Errorf("%s = %v after SkipGap applied the only held message, want 0", name, got)
			}
		}
	})
}

// SQLite: a timestamp another library stored as a number (Java's
// sqlite-jdbc writes Unix milliseconds) is a time like any other. A number
// sorts below every text there, so MIN(created_at) took a row 5 s old for
// the oldest beside one 3 h old, and Republish's grace took a record
// published a second ago for one published long before.
func TestStore_SQLiteNumericTimestamps_ComparedAsTimes(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	ids := publishN(t, db, "ex", "rk", 3)
	threeHours := time.Now().Add(-3 * time.Hour).UTC().Format("2006-01-02 15:04:05.000000")
	if _, err := db.Exec("UPDATE acemq_outbox SET created_at = ? WHERE id = ?", threeHours, ids[0]); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec("UPDATE acemq_outbox SET created_at = ? WHERE id = ?", time.Now().Add(-5*time.Second).UnixMilli(), ids[1]); err != nil {
		t.Fatal(err)
	}
	store, err := outbox.NewStore(db.DB, outbox.StoreConfig{Dialect: outbox.SQLite})
	if err != nil {
		t.Fatal(err)
	}
	st, err := store.Stats(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if age := time.Since(st.OldestPending); age < 2*time.Hour {
		t.Errorf("oldest pending %s old, want the row created 3 h ago", age.Round(time.Second))
	}

	// ids[2] published a second ago, stamped as a number; Republish with a
	// grace of a minute must leave it.
	if _, err := db.Exec("UPDATE acemq_outbox SET published_at = ? WHERE id = ?", time.Now().Add(-time.Second).UnixMilli(), ids[2]); err != nil {
		t.Fatal(err)
	}
	rp, err := outbox.NewRepublisher(db.DB, outbox.RepublisherConfig{Dialect: outbox.SQLite, TrackedTopics: outbox.NewTrackedTopics("rk"), Grace: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	if n, err := rp.Republish(context.Background()); err != nil || n != 0 {
		t.Errorf("Republish: %d, %v; want 0: the record was published a second ago, within the grace", n, err)
	}
}

// SQLite: a lease another library's relay wrote as ISO 8601 text (Rust's
// sqlx writes RFC 3339, "…T…+00:00"; JavaScript's toISOString "…T….123Z")
// is compared as the time it says. Compared as text with this library's
// "YYYY-MM-DD HH:MM:SS", the "T" sorts above the space: a lease expired a
// minute ago looked live until the next midnight (its row waited for
// hours), and a live one written with a negative offset looked expired (a
// second relay published the row the first had in flight).
func TestStore_SQLiteISOTextLease_HeldUntilItExpires(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	s, err := outbox.NewStore(db.DB, outbox.StoreConfig{Dialect: outbox.SQLite})
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	leases := map[string]string{
		"rust-expired":        now.Add(-time.Minute).UTC().Format("2006-01-02T15:04:05.000Z"),
		"rust-expired-offset": now.Add(-time.Minute).In(time.FixedZone("", 2*3600)).Format(time.RFC3339Nano),
		"rust-live":           now.Add(time.Hour).UTC().Format("2006-01-02T15:04:05.000Z"),
		"rust-live-offset":    now.Add(time.Hour).In(time.FixedZone("", -5*3600)).Format(time.RFC3339Nano),
	}
	for id, until := range leases {
		insertRaw(t, db, id, "ex", "k", "{}", "utf-8")
		if _, err := db.Exec("UPDATE acemq_outbox SET locked_by = 'rust-relay-1', locked_until = ? WHERE id = ?", until, id); err != nil {
			t.Fatal(err)
		}
	}
	ids, held, err := outbox.Claim(s, 10, "relay-a")
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = held.Abandon() }()
	sort.Strings(ids)
	if want := []string{"rust-expired", "rust-expired-offset"}; !reflect.DeepEqual(ids, want) {
		t.Fatalf("claimed %v, want %v: the others are under the Rust relay's lease for another hour (leases %v)", ids, want, leases)
	}
}

// SQLite: a lease another library's relay wrote as a number (Unix
// milliseconds) is a lease like any other. A number sorts below every text
// there, so the claim took a live one for one long expired, and a second
// relay published the row the first had in flight; an operator's retry
// cleared it too.
func TestStore_SQLiteNumericLease_HeldUntilItExpires(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.SQLite)
	s, err := outbox.NewStore(db.DB, outbox.StoreConfig{Dialect: outbox.SQLite, MaxAttempts: 3})
	if err != nil {
		t.Fatal(err)
	}
	for id, until := range map[string]time.Time{"java-live": time.Now().Add(time.Hour), "java-expired": time.Now().Add(-time.Hour)} {
		insertRaw(t, db, id, "ex", "k", "{}", "utf-8")
		if _, err := db.Exec("UPDATE acemq_outbox SET locked_by = 'java-relay-1', locked_until = ? WHERE id = ?", until.UnixMilli(), id); err != nil {
			t.Fatal(err)
		}
	}
	ids, held, err := outbox.Claim(s, 10, "relay-a")
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = held.Abandon() }()
	if len(ids) != 1 || ids[0] != "java-expired" {
		t.Fatalf("claimed %v, want only java-expired: java-live is under the Java relay's lease for another hour", ids)
	}
	if _, err := db.Exec("UPDATE acemq_outbox SET attempts = 3 WHERE id = 'java-live'"); err != nil {
		t.Fatal(err)
	}
	if n, err := s.Retry(context.Background(), "java-live"); n != 0 || err != nil {
		t.Errorf("retry of the row under the Java relay's live lease: %d, %v; want 0, nil", n, err)
	}
	stuck, err := s.Stuck(context.Background(), 10)
	if err != nil {
		t.Fatal(err)
	}
	if len(stuck) != 1 || !stuck[0].Leased {
		t.Errorf("stuck: %+v, want java-live, leased", stuck)
	}
}

// A nil registerer is a configuration error, as a nil input is elsewhere;
// it panicked.
func TestNewMetrics_NilRegisterer_ConfigError(t *testing.T) {
	m, err := outbox.NewMetrics(nil)
	var cfgErr *outbox.ConfigError
	if m != nil || !errors.As(err, &cfgErr) {
		t.Errorf("NewMetrics(nil): %v, %v; want a *ConfigError", m, err)
	}
}

// The relay cut off from its database: the readings fail, and the oldest
// pending age, set as an age at each reading, froze at the last one, so an
// alert on it never fired through the outage. It is taken at the scrape
// from the last reading's record, which nothing publishes meanwhile, and
// grows.
func TestMetrics_DatabaseGone_OldestPendingAgeKeepsGrowing(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.SQLite)
	id := publishN(t, db, "x", "rk", 1)[0]
	relayDB, err := sqlx.Open("sqlite3", db.DSN)
	if err != nil {
		t.Fatal(err)
	}
	reg, stop := runRefusingRelay(t, relayDB, id)
	defer stop()
	age := func() float64 { return metricValue(t, reg, "outbox_oldest_pending_age_seconds", "") }
	_ = relayDB.Close() // every statement of the relay fails from here on
	before := age()
	time.Sleep(500 * time.Millisecond)
	if after := age(); after-before < 0.4 {
		t.Errorf("oldest pending age %.2f s, then %.2f s half a second into the outage: want it growing", before, after)
	}
}

// runRefusingRelay runs a relay with Metrics over h until stop, reading
// its gauges every 20 ms, its destination refusing record id every time
// (pending, never stuck), and returns once a reading found it.
func runRefusingRelay(t *testing.T, h *sqlx.DB, id string) (reg *prometheus.Registry, stop func()) {
	t.Helper()
	reg = prometheus.NewRegistry()
	m, err := outbox.NewMetrics(reg)
	if err != nil {
		t.Fatal(err)
	}
	f, err := outbox.NewForwarder(h.DB, &failingOne{id: id}, outbox.ForwarderConfig{Dialect: outbox.SQLite, Metrics: m, Logger: &recordingLogger{},
		StatsInterval: 20 * time.Millisecond, MaxAttempts: 1000, RetryMin: 20 * time.Millisecond, RetryMax: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	ran := make(chan error, 1)
	go func() { ran <- f.Run(ctx) }()
	waitFor(t, 20*time.Second, "a reading of the pending record", func() bool {
		return metricValue(t, reg, "outbox_oldest_pending_age_seconds", "") > 0
	})
	return reg, func() { cancel(); <-ran; _ = f.Close() }
}

// Records the broker confirmed whose mark failed go out again, and the
// consumers count the copies as duplicates, which nothing on the relay's
// side explained: outbox_forwarder_unmarked_total counts them.
func TestMetrics_MarkFails_UnmarkedCounted(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.SQLite)
	publishN(t, db, "orders-ex", "rk", 2)
	reg := prometheus.NewRegistry()
	m, err := outbox.NewMetrics(reg)
	if err != nil {
		t.Fatal(err)
	}
	f, err := outbox.NewForwarder(db.DB, &failingOne{}, outbox.ForwarderConfig{Metrics: m})
	if err != nil {
		t.Fatal(err)
	}
	outbox.SetAfterPublishHook(f, func([]string) error { return errors.New("mark failed (test)") })
	if _, err := f.Sweep(context.Background()); err == nil {
		t.Fatal("Sweep: nil error, want the mark's failure")
	}
	if got := metricValue(t, reg, "outbox_forwarder_unmarked_total", "orders-ex"); got != 2 {
		t.Errorf("outbox_forwarder_unmarked_total{exchange=orders-ex} = %v, want 2", got)
	}
	if got := metricValue(t, reg, "outbox_forwarder_published_total", "orders-ex"); got != 0 {
		t.Errorf("outbox_forwarder_published_total = %v, want 0: nothing was marked", got)
	}
}
