package sqldialect

import (
	"errors"
	"fmt"
	"regexp"
	"strconv"
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
			"claim":                       {Limit: 10, MaxAttempts: 5, Now: now, RelayID: "r", LeaseUntil: now},
			"claim after cursor":          {Limit: 10, MaxAttempts: 5, Now: now, After: &Cursor{CreatedAt: now, ID: "x"}, RelayID: "r", LeaseUntil: now},
			"claim on index":              {Limit: 10, MaxAttempts: 5, Now: now, Index: "acemq_outbox_pending"},
			"claim on indexes":            {Limit: 10, MaxAttempts: 5, Now: now, Index: "acemq_outbox_pending", KeyIndex: "acemq_outbox_pending_key"},
			"claim, in flight":            {Limit: 10, MaxAttempts: 5, Now: now, After: &Cursor{CreatedAt: now, ID: "x"}, InFlight: ids, RelayID: "r", LeaseUntil: now},
			"claim on indexes, in flight": {Limit: 10, MaxAttempts: 5, Now: now, Index: "acemq_outbox_pending", KeyIndex: "acemq_outbox_pending_key", InFlight: ids},
			"windowed claim":              {Limit: 10, MaxAttempts: 5, Now: now, RelayID: "r", LeaseUntil: now, Window: 20},
			"windowed, after, in flight":  {Limit: 10, MaxAttempts: 5, Now: now, After: &Cursor{CreatedAt: now, ID: "x"}, InFlight: ids, RelayID: "r", LeaseUntil: now, Window: 20},
			"windowed, a slice of keys":   {Limit: 10, MaxAttempts: 5, Now: now, InFlight: ids, RelayID: "r", LeaseUntil: now, Window: 20, KeysRead: 30, KeysFrom: "k1"},
			"windowed, the first keys":    {Limit: 10, MaxAttempts: 5, Now: now, InFlight: ids, RelayID: "r", LeaseUntil: now, Window: 20, KeysRead: 30},
		}
		queries := map[string]Query{
			"insert":            o.Insert([]Row{{ID: "a", CreatedAt: now}, {ID: "b", CreatedAt: now}}),
			"give back seq":     o.GiveBackSeq("k", 2),
			"destinations":      o.Destinations(ids, true),
			"delete":            o.Delete(ids),
			"mark published":    o.MarkPublished(now, anys(ids)),
			"mark failed":       o.MarkFailed("a", 3, "nack", "", time.Time{}, ""),
			"mark failed, held": o.MarkFailed("a", 3, "nack", "r", now, "relay"),
			"release lease":     o.ReleaseLease("r", []any{"a", []byte("b"), "c"}),
			"stats":             o.Stats(10),
			"stuck":             o.Stuck(10, 50, now),
			"retry":             o.Retry(ids, now),
			"retry stuck":       o.RetryStuck(10, now),
			"purge published":   o.PurgePublishedRange(now, 1000, nil, nil),
			"purge, from, to":   o.PurgePublishedRange(now, 1000, now, now),
			"purge bound":       o.PurgePublishedBound(now, now, 999),
			"published since":   o.PublishedSince(now),
			"published before":  o.PublishedBefore(now),
			"republish pick":    o.RepublishPick(now, time.Time{}, ids, nil, nil, 1000, true),
			"republish, exch.":  o.RepublishPick(now, time.Time{}, ids, []string{"shop"}, &RepublishCursor{PublishedAt: now, ID: "a"}, 1000, false),
			"republish ids":     o.RepublishIDs(ids, now),
			"mark processed":    o.MarkProcessed("a", now),
			"inbox insert":      in.Insert("c", "a", now),
			"inbox delete":      in.Delete("c", "a"),
			"inbox purge":       in.PurgeRange(now, 1000, nil, nil),
			"inbox purge bound": in.PurgeBound(now, now, 999),
			"inbox before":      in.ProcessedBefore(now),
			"insert migration":  InsertMigration(d, 1, "x"),
		}
		for name, p := range claims {
			queries[name] = o.Claim(p)
		}
		keys := []KeyCount{{Key: "a", N: 2}, {Key: "b", N: 1}}
		numbered := []Row{{ID: "1", AggregateID: "b"}, {ID: "2"}, {ID: "3", AggregateID: "a"}, {ID: "4", AggregateID: "a"}}
		for i, q := range o.InsertNumbered(numbered, keys) {
			queries["insert numbered "+strconv.Itoa(i)] = q
		}
		queries["lock keys"] = o.LockKeys(keys)
		queries["inbox key as is"] = in.KeyAsIs("c", strings.Repeat("a", 65))
		queries["claimable"] = o.Claimable(ClaimParams{MaxAttempts: 10, Now: now})
		pts := []Cursor{{CreatedAt: now, ID: "a", CreatedText: "2026-11-30 12:00:00.123456"}, {CreatedAt: now, ID: "b"}}
		queries["claim of points"] = o.Claim(ClaimParams{Limit: 10, MaxAttempts: 5, Now: now, Index: "acemq_outbox_pending", Points: pts})
		queries["claimable points"] = o.Claimable(ClaimParams{MaxAttempts: 10, Now: now, Points: pts})
		queries["pending below"] = o.PendingBelow(PendingParams{MaxAttempts: 10, Skip: []KeySeq{{Key: "k", Seq: 2}}}, now, 128)
		queries["pending below, after, locking"] = o.PendingBelow(PendingParams{Index: "acemq_outbox_pending", MaxAttempts: 10, After: &Cursor{CreatedAt: now}, Lock: true}, now, 128)
		queries["pending below's walk"] = o.PendingBelowWalk(PendingParams{MaxAttempts: 10, Skip: []KeySeq{{Key: "k", Seq: 2}}}, now, 128)
		queries["pending below's walk, after, locking"] = o.PendingBelowWalk(PendingParams{Index: "acemq_outbox_pending", MaxAttempts: 10, After: &Cursor{CreatedAt: now}, Lock: true}, now, 128)
		queries["keys slice end"] = o.KeysSliceEnd(ClaimParams{Window: 20, KeysRead: 30, KeysFrom: "k1"}, nil)
		queries["keys slice end, beyond the window"] = o.KeysSliceEnd(ClaimParams{Window: 20, KeysRead: 30, After: &Cursor{CreatedAt: now, ID: "x"}}, []any{"a", "b"})
		queries["window full"] = o.WindowFull(ClaimParams{After: &Cursor{CreatedAt: now, ID: "x"}}, 20)
		queries["pending between"] = o.PendingBetween("", 10, &Cursor{CreatedAt: now, ID: "x"}, Cursor{CreatedAt: now, ID: "y"})
		queries["pending up to"] = o.PendingBetween("acemq_outbox_pending", 10, nil, Cursor{CreatedAt: now, ID: "y"})
		for _, seq := range []int64{1, 2} {
			for i, step := range NewOrderedInbox(d).Apply(in, InOrder{Consumer: "c", Key: "k", Seq: seq, MessageID: "a", At: now}) {
				queries["apply in order, seq "+strconv.FormatInt(seq, 10)+", step "+strconv.Itoa(i)] = step.Query
			}
		}
		if q, ok := o.PendingIndex(); ok {
			queries["pending index"] = q
		}
		if q, ok := o.KeyIndex(); ok {
			queries["key index"] = q
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
	got := o.RelayStatements("acemq_outbox_pending", "acemq_outbox_pending_key", []int{100, 200})
	now := time.Now()
	p := ClaimParams{Limit: 100, MaxAttempts: 10, Now: now, Index: "acemq_outbox_pending", KeyIndex: "acemq_outbox_pending_key"}
	after := p
	after.After = &Cursor{CreatedAt: now, ID: "x"}
	floor := p
	floor.After = &Cursor{CreatedAt: now}
	inFlight, inFlightAfter, inFlightFloor := p, after, floor
	inFlight.InFlight, inFlightAfter.InFlight, inFlightFloor.InFlight = []string{"a", "b"}, []string{"c"}, []string{"d"}
	want := []string{o.Claim(p).SQL, o.Claim(after).SQL, o.Claim(floor).SQL, o.Claim(inFlight).SQL, o.Claim(inFlightAfter).SQL, o.Claim(inFlightFloor).SQL,
		o.MarkPublished(now, make([]any, 100)).SQL, o.MarkPublished(now, make([]any, 200)).SQL}
	if len(got) != len(want) {
		t.Fatalf("%d statements, want %d", len(got), len(want))
	}
	for i := range want {
		if got[i] != want[i] {
			t.Errorf("statement %d:\n got %s\nwant %s", i, got[i], want[i])
		}
	}
	for _, index := range []string{"FORCE INDEX (`acemq_outbox_pending`)", "FORCE INDEX (`acemq_outbox_pending_key`)"} {
		if !strings.Contains(got[0], index) {
			t.Errorf("the claim does not name %s: %s", index, got[0])
		}
	}
	if strings.Contains(got[0], "JSON_TABLE") || !strings.Contains(got[3], "JSON_TABLE") {
		t.Errorf("only the claims with records in flight read their ids:\n%s\n%s", got[0], got[3])
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
		ts := NewTime(SQLite)
		if err := ts.Scan(v); err != nil || ts.Err != nil || !ts.T.Equal(at) || ts.T.Location() != time.UTC {
			t.Errorf("Scan(%v) = %v, %v, %v; want %v in UTC", v, ts.T, err, ts.Err, at)
		}
	}
	ts := NewTime(SQLite)
	if err := ts.Scan("yesterday"); err != nil || ts.Err == nil || !ts.T.IsZero() {
		t.Errorf("Scan(yesterday) = %v, %v, %v; want the zero time and Err saying why", ts.T, err, ts.Err)
	}
	if err := new(Time).Scan(at); err == nil {
		t.Error("a Time without a dialect read a time")
	}
}

// Every time written is UTC, and reads back as the instant written, under
// any process zone and any column type. PostgreSQL is sent UTC: pgx writes
// a timestamp (without time zone) column from the time's wall clock. A
// MySQL DATETIME comes back as its wall clock in the DSN's loc, which is
// UTC; pgx (timestamptz, or timestamp in UTC) and mattn/go-sqlite3 return
// the instant in any zone.
func TestTime_WrittenAndReadAsUTC_WhateverTheZone(t *testing.T) {
	far := time.FixedZone("+13:45", 13*3600+45*60)
	utc := time.Date(2026, 9, 26, 10, 0, 0, 123456000, time.UTC)
	if got, ok := Postgres.TimeArg(utc.In(far)).(time.Time); !ok || !got.Equal(utc) || got.Location() != time.UTC {
		t.Errorf("postgres TimeArg = %v, want %v in UTC", got, utc)
	}
	// What go-sql-driver/mysql returns for the DATETIME 10:00:00.123456
	// with loc set to the far zone.
	mysqlLocal := time.Date(2026, 9, 26, 10, 0, 0, 123456000, far)
	for _, c := range []struct {
		d    Dialect
		v    time.Time
		want time.Time
	}{
		{MySQL, mysqlLocal, utc},
		{MySQL, utc, utc},
		{Postgres, utc.In(far), utc},
		{Postgres, utc, utc},
		{SQLite, utc.In(far), utc},
	} {
		ts := NewTime(c.d)
		if err := ts.Scan(c.v); err != nil || ts.Err != nil || !ts.T.Equal(c.want) || ts.T.Location() != time.UTC {
			t.Errorf("%s: Scan(%v) = %v (%v, %v), want %v", c.d.Name(), c.v, ts.T, err, ts.Err, c.want)
		}
	}
}

type sqlStateErr string

func (e sqlStateErr) Error() string    { return "ERROR: something (SQLSTATE " + string(e) + ")" }
func (e sqlStateErr) SQLState() string { return string(e) }

func TestConflict_SerializationFailuresAndDeadlocksOnly(t *testing.T) {
	cases := []struct {
		d    Dialect
		err  error
		want bool
	}{
		{Postgres, fmt.Errorf("apply: %w", sqlStateErr("40001")), true},
		{Postgres, sqlStateErr("40P01"), true},
		{Postgres, sqlStateErr("23505"), false},
		{Postgres, errors.New("ERROR: could not serialize access (SQLSTATE 40001)"), false}, // no SQLState(): not guessed from text
		{MySQL, errors.New("Error 1213 (40001): Deadlock found when trying to get lock; try restarting transaction"), true},
		{MySQL, errors.New("Error 1205 (HY000): Lock wait timeout exceeded"), false},
		{SQLite, errors.New("database is locked"), false},
		{Postgres, nil, false},
		{MySQL, nil, false},
	}
	for _, c := range cases {
		if got := c.d.Conflict(c.err); got != c.want {
			t.Errorf("%s Conflict(%v) = %v, want %v", c.d.Name(), c.err, got, c.want)
		}
	}
}

// anys is ids as the arguments MarkPublished takes.
func anys(ids []string) []any {
	out := make([]any, len(ids))
	for i, id := range ids {
		out[i] = id
	}
	return out
}

// On MySQL a claim's points are exact keys of the pending index, each
// created_at bound as the text the database wrote: within a range of
// created_at, however narrow, InnoDB's locking read stepped over every
// entry a held snapshot kept after the point (110 ms a claim beside
// 100,000). On PostgreSQL they are ids, in a claim ordered by an
// expression no index holds (see postgres's claim).
func TestClaimOfPoints_MySQLExactKeys_PostgresIDs(t *testing.T) {
	now := time.Date(2026, 11, 30, 12, 0, 0, 123456000, time.UTC)
	pts := []Cursor{{CreatedAt: now, ID: "a", CreatedText: "2026-11-30 12:00:00.123456"}, {CreatedAt: now, ID: "b"}}
	o, err := NewOutbox(MySQL, "acemq_outbox")
	if err != nil {
		t.Fatal(err)
	}
	q := o.Claim(ClaimParams{Limit: 10, MaxAttempts: 5, Now: now, Index: "acemq_outbox_pending", Points: pts})
	if !strings.Contains(q.SQL, "((created_at = ? AND id = ?) OR (created_at = ? AND id = ?))") || !strings.Contains(q.SQL, "FORCE INDEX") {
		t.Errorf("MySQL's claim of points: %s", q.SQL)
	}
	want := []any{"2026-11-30 12:00:00.123456", "a", MySQL.TimeArg(now), "b", 10}
	if got := q.Args[len(q.Args)-len(want):]; fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("MySQL's claim of points binds %v, want %v at the end", got, want)
	}
	o, err = NewOutbox(Postgres, "acemq_outbox")
	if err != nil {
		t.Fatal(err)
	}
	q = o.Claim(ClaimParams{Limit: 10, MaxAttempts: 5, Now: now, Points: pts})
	if !strings.Contains(q.SQL, "id IN ($") || !strings.Contains(q.SQL, "ORDER BY (created_at + interval '0 seconds'), id LIMIT") {
		t.Errorf("PostgreSQL's claim of points: %s", q.SQL)
	}
}

// InboxKey keeps the ids this library writes as they are, gives every
// other a digest that fits varchar(64) and is no id kept as it is, and
// keeps a digest as it is (a held message's stored key, applied).
func TestInboxKey_KeptOrDigested_DigestKept(t *testing.T) {
	for _, id := range []string{"a", "01J9Z3K4", strings.Repeat("x", 64), "~!{}"} {
		if got := InboxKey(id); got != id {
			t.Errorf("InboxKey(%q) = %q, want it as it is", id, got)
		}
	}
	seen := map[string]string{}
	for _, id := range []string{"", strings.Repeat("x", 65), strings.Repeat("x", 255), "a b", "é", "nul\x00", "\xff", "sha256 x"} {
		got := InboxKey(id)
		if len(got) != 59 || !strings.HasPrefix(got, "sha256 ") || strings.ToLower(got) != got {
			t.Errorf("InboxKey(%q) = %q, want sha256, a space and 52 lower-case base32 digits", id, got)
		}
		if other, ok := seen[got]; ok {
			t.Errorf("InboxKey(%q) = InboxKey(%q)", id, other)
		}
		seen[got] = id
		if again := InboxKey(got); again != got {
			t.Errorf("InboxKey of the digest %q = %q, want it kept", got, again)
		}
	}
}
