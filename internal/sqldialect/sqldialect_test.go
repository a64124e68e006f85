package sqldialect

import (
	"regexp"
	"strings"
	"testing"
	"time"
)

// placeholderRE finds "?" and "$n" placeholders outside quoted text (the
// statements quote only identifiers and a few literals without either).
var placeholderRE = regexp.MustCompile(`\?|\$[0-9]+`)

// Every statement of every dialect carries exactly as many arguments as it
// has placeholders: the point of returning text and arguments together.
func TestQueries_ArgumentsMatchPlaceholders_EveryDialect(t *testing.T) {
	now := time.Date(2026, 11, 30, 12, 0, 0, 123456000, time.UTC)
	ids := []string{"a", "b", "c"}
	for _, d := range []Dialect{Postgres, MySQL, SQLite} {
		o, err := NewOutbox(d, "app.acemq_outbox")
		if err != nil {
			t.Fatal(err)
		}
		in, err := NewInbox(d, "processed_messages")
		if err != nil {
			t.Fatal(err)
		}
		claims := map[string]ClaimParams{
			"claim":              {Limit: 10, MaxAttempts: 5, Now: now, RelayID: "r", LeaseUntil: now},
			"claim after cursor": {Limit: 10, MaxAttempts: 5, Now: now, After: &Cursor{CreatedAt: now, ID: "x"}, RelayID: "r", LeaseUntil: now},
			"claim on index":     {Limit: 10, MaxAttempts: 5, Now: now, Index: "acemq_outbox_pending"},
		}
		queries := map[string]Query{
			"insert":           o.Insert([]Row{{ID: "a", CreatedAt: now}, {ID: "b", CreatedAt: now}}),
			"destinations":     o.Destinations(ids),
			"delete":           o.Delete(ids),
			"mark published":   o.MarkPublished(now, ids),
			"mark failed":      o.MarkFailed("a", 3, "nack"),
			"release lease":    o.ReleaseLease("r", ids),
			"stats":            o.Stats(10),
			"stuck":            o.Stuck(10, 50),
			"retry":            o.Retry(ids),
			"retry stuck":      o.RetryStuck(10),
			"purge published":  o.PurgePublished(now, 1000),
			"published since":  o.PublishedSince(now),
			"published before": o.PublishedBefore(now),
			"republish":        o.Republish(now, ids),
			"mark processed":   o.MarkProcessed("a", now),
			"inbox insert":     in.Insert("c", "a", now),
			"inbox purge":      in.Purge(now, 1000),
			"inbox before":     in.ProcessedBefore(now),
			"insert migration": InsertMigration(d, 1, "x"),
		}
		for name, p := range claims {
			queries[name] = o.Claim(p)
		}
		if q, ok := o.PendingIndex(); ok {
			queries["pending index"] = q
		}
		for name, q := range queries {
			if got := len(placeholderRE.FindAllString(q.SQL, -1)); got != len(q.Args) {
				t.Errorf("%s %s: %d placeholders, %d arguments: %s", d.Name(), name, got, len(q.Args), q.SQL)
			}
			if d == Postgres && strings.Contains(q.SQL, "?") {
				t.Errorf("postgres %s: a ? placeholder was not rebound: %s", name, q.SQL)
			}
		}
	}
}

// The relay prepares exactly the text its claims and marks run, so a
// prepared statement is found by that text.
func TestRelayStatements_AreTheTextTheRelayRuns(t *testing.T) {
	o, err := NewOutbox(MySQL, "acemq_outbox")
	if err != nil {
		t.Fatal(err)
	}
	got := o.RelayStatements("acemq_outbox_pending", 100)
	now := time.Now()
	want := []string{
		o.Claim(ClaimParams{Limit: 100, MaxAttempts: 10, Now: now, Index: "acemq_outbox_pending"}).SQL,
		o.Claim(ClaimParams{Limit: 100, MaxAttempts: 10, Now: now, Index: "acemq_outbox_pending", After: &Cursor{CreatedAt: now, ID: "x"}}).SQL,
		o.MarkPublished(now, make([]string, 100)).SQL,
	}
	for i := range want {
		if got[i] != want[i] {
			t.Errorf("statement %d:\n got %s\nwant %s", i, got[i], want[i])
		}
	}
	if !strings.Contains(got[0], "FORCE INDEX (`acemq_outbox_pending`)") {
		t.Errorf("the claim does not name the index: %s", got[0])
	}
}

func TestQuoteTable_RefusesAnythingButIdentifiers(t *testing.T) {
	for in, want := range map[string]string{"acemq_outbox": `"acemq_outbox"`, "app.outbox_2": `"app"."outbox_2"`} {
		if got, err := QuoteTable(Postgres, in); err != nil || got != want {
			t.Errorf("QuoteTable(%q) = %q, %v; want %q", in, got, err, want)
		}
	}
	if got, _ := QuoteTable(MySQL, "app.t"); got != "`app`.`t`" {
		t.Errorf("MySQL quoting: %s", got)
	}
	for _, in := range []string{"", "a.b.c", `x"; DROP TABLE y; --`, "1abc", "a-b", strings.Repeat("a", 64), "a..b"} {
		if _, err := QuoteTable(Postgres, in); err == nil {
			t.Errorf("QuoteTable(%q) accepted", in)
		}
	}
}

// MySQL and SQLite get fixed-width UTC text whatever the time's zone, so
// that text order is time order; Time reads every form back as UTC.
func TestTime_FixedWidthUTCTextRoundTrips(t *testing.T) {
	local := time.FixedZone("UTC+5", 5*3600)
	at := time.Date(2026, 1, 2, 8, 4, 5, 7000, local) // 03:04:05.000007 UTC
	for _, d := range []Dialect{MySQL, SQLite} {
		if got := d.TimeArg(at); got != "2026-01-02 03:04:05.000007" {
			t.Errorf("%s TimeArg = %v", d.Name(), got)
		}
	}
	for _, v := range []any{"2026-01-02 03:04:05.000007", []byte("2026-01-02 03:04:05.000007"), at, "2026-01-02T03:04:05.000007Z"} {
		var ts Time
		if err := ts.Scan(v); err != nil || !ts.T.Equal(at) || ts.T.Location() != time.UTC {
			t.Errorf("Scan(%v) = %v, %v; want %v in UTC", v, ts.T, err, at)
		}
	}
	var ts Time
	if err := ts.Scan("yesterday"); err == nil {
		t.Error("Scan accepted text that is no time")
	}
}
