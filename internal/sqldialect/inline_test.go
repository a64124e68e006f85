package sqldialect

import (
	"encoding/hex"
	"regexp"
	"strings"
	"testing"
	"time"
)

// literalRE reads back what inline writes for a string argument.
var literalRE = regexp.MustCompile(`_utf8mb4 X'([0-9A-F]*)'`)

// Every statement the publisher and the inbox run in the caller's or the
// handler's transaction is sent with its arguments in its text on MySQL, and
// each string reads back as the bytes it was, whatever they hold.
func TestInline_MySQL_PublisherAndInboxStatements_KeepEveryArgument(t *testing.T) {
	now := time.Date(2026, 12, 1, 12, 0, 0, 123456000, time.UTC)
	awkward := "it's \\ \"q\" ? -- # /* ` \x00 ζ 😀"
	o, err := NewOutbox(MySQL, "app.acemq_outbox")
	if err != nil {
		t.Fatal(err)
	}
	in, err := NewInbox(MySQL, "processed_messages")
	if err != nil {
		t.Fatal(err)
	}
	rows := []Row{
		{ID: "a'?", Exchange: awkward, RoutingKey: "rk", Body: awkward, BodyEncoding: "utf-8", ContentType: "c", Headers: `{"k":"?"}`, CreatedAt: now},
		{ID: "b", Exchange: "", RoutingKey: awkward, Body: "", BodyEncoding: "base64", Headers: "{}", CreatedAt: now, AggregateID: awkward},
	}
	keys := []KeyCount{{Key: awkward, N: 1}}
	queries := map[string]Query{
		"insert":          o.Insert(rows[:1]),
		"give back seq":   o.GiveBackSeq(awkward, 2),
		"destinations":    o.Destinations([]string{"a'?", awkward}, true),
		"delete":          o.Delete([]string{"a'?", awkward}),
		"lock keys":       o.LockKeys(keys),
		"inbox insert":    in.Insert("consumer", awkward, now),
		"mark processed":  o.MarkProcessed(awkward, now),
		"numbered raise":  o.InsertNumbered(rows, keys)[0],
		"numbered insert": o.InsertNumbered(rows, keys)[1],
	}
	for name, q := range queries {
		got, ok := MySQL.inline(q)
		if !ok {
			t.Errorf("%s: not inlined: %s", name, q.SQL)
			continue
		}
		if len(got.Args) != 0 || strings.Count(stripQuoted(got.SQL), "?") != 0 {
			t.Errorf("%s: placeholders or arguments left: %s %v", name, got.SQL, got.Args)
		}
		var want []string
		for _, a := range q.Args {
			if s, ok := a.(string); ok && s != "" {
				want = append(want, s)
			}
		}
		var read []string
		for _, m := range literalRE.FindAllStringSubmatch(got.SQL, -1) {
			b, err := hex.DecodeString(m[1])
			if err != nil {
				t.Fatalf("%s: %v", name, err)
			}
			read = append(read, string(b))
		}
		if strings.Join(read, "\x01") != strings.Join(want, "\x01") {
			t.Errorf("%s: strings read back %q, want %q", name, read, want)
		}
	}
}

// The statement's own quoted text is copied as it is, and only the
// placeholders outside it are filled, in order.
func TestInline_MySQL_FillsPlaceholdersOutsideQuotesInOrder(t *testing.T) {
	q := Query{SQL: "SELECT '?', `a?`, ?, ?, ?, ? FROM t WHERE x = ?", Args: []any{"", 7, int64(-9), nil, []byte{0, 0xff}}}
	got, ok := MySQL.inline(q)
	want := "SELECT '?', `a?`, '', 7, -9, NULL FROM t WHERE x = X'00FF'"
	if !ok || got.SQL != want || got.Args != nil {
		t.Errorf("inline = %q %v (ok %v), want %q", got.SQL, got.Args, ok, want)
	}
}

// Whatever inline cannot write safely goes as it is: with its arguments,
// prepared by the driver as before.
func TestInline_LeavesAsItIs_WhatItCannotWrite(t *testing.T) {
	cases := map[string]Query{
		"a comment":            {SQL: "SELECT ? -- it's", Args: []any{1}},
		"a block comment":      {SQL: "SELECT /* ' */ ?", Args: []any{1}},
		"a hash comment":       {SQL: "SELECT ? # '", Args: []any{1}},
		"a time":               {SQL: "SELECT ?", Args: []any{time.Now()}},
		"a float":              {SQL: "SELECT ?", Args: []any{0.5}},
		"a string not UTF-8":   {SQL: "SELECT ?, ?", Args: []any{"k", "k\xff"}},
		"too few placeholders": {SQL: "SELECT ?", Args: []any{1, 2}},
		"too many":             {SQL: "SELECT ?, ?", Args: []any{1}},
		"an open quote":        {SQL: "SELECT ?, 'x", Args: []any{1}},
		"large":                {SQL: "SELECT ?", Args: []any{strings.Repeat("x", maxInlineBytes/2)}},
	}
	for name, q := range cases {
		if got, ok := MySQL.inline(q); ok || got.SQL != q.SQL || len(got.Args) != len(q.Args) {
			t.Errorf("%s: inlined as %q %v", name, got.SQL, got.Args)
		}
		if got := Inline(MySQL, q); got.SQL != q.SQL || len(got.Args) != len(q.Args) {
			t.Errorf("%s: Inline changed it to %q %v", name, got.SQL, got.Args)
		}
	}
	q := Query{SQL: "SELECT ?", Args: []any{"x"}}
	for _, d := range []Dialect{Postgres, SQLite} {
		if got := Inline(d, q); got.SQL != q.SQL || len(got.Args) != 1 {
			t.Errorf("%s: Inline changed it to %q %v", d.Name(), got.SQL, got.Args)
		}
	}
}

// stripQuoted removes quoted text, as inline skips it.
func stripQuoted(s string) string {
	return regexp.MustCompile("'[^']*'|`[^`]*`").ReplaceAllString(s, "")
}
