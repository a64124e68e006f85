package rowcodec

import (
	"math"
	"reflect"
	"strconv"
	"strings"
	"testing"
)

// nested is n arrays one inside the other around inner: [[…[inner]…]].
func nested(n int, inner string) string {
	return strings.Repeat("[", n) + inner + strings.Repeat("]", n)
}

// Headers are read with the type their JSON text was written with, as the
// relay must send them: every JSON type, integers exact to the edges of
// int64, 1.0 a double.
func TestDecodeHeaders_EveryJSONType_TypedAsWritten(t *testing.T) {
	for _, tc := range []struct {
		name, text string
		want       map[string]any
	}{
		{"empty text", ``, map[string]any{}},
		{"empty object", `{}`, map[string]any{}},
		{"string", `{"a":"pay-1"}`, map[string]any{"a": "pay-1"}},
		{"integer", `{"seq":7}`, map[string]any{"seq": int64(7)}},
		{"negative integer", `{"n":-3}`, map[string]any{"n": int64(-3)}},
		{"2^53+1 exact", `{"n":9007199254740993}`, map[string]any{"n": int64(9007199254740993)}},
		{"max int64", `{"n":9223372036854775807}`, map[string]any{"n": int64(math.MaxInt64)}},
		{"min int64", `{"n":-9223372036854775808}`, map[string]any{"n": int64(math.MinInt64)}},
		{"fraction", `{"ratio":0.5}`, map[string]any{"ratio": 0.5}},
		{"1.0 is a double", `{"x":1.0}`, map[string]any{"x": float64(1)}},
		{"exponent is a double", `{"x":2e3}`, map[string]any{"x": float64(2000)}},
		{"underflow rounds to zero", `{"x":1e-400}`, map[string]any{"x": float64(0)}},
		{"booleans", `{"t":true,"f":false}`, map[string]any{"t": true, "f": false}},
		{"null kept", `{"note":null}`, map[string]any{"note": nil}},
		{"array", `{"tags":["a",1,1.5,true,null,[2],{"k":"v"}]}`, map[string]any{"tags": []any{"a", int64(1), 1.5, true, nil, []any{int64(2)}, map[string]any{"k": "v"}}}},
		{"object", `{"trace":{"id":"t1","n":2,"in":{"deep":[3]}}}`, map[string]any{"trace": map[string]any{"id": "t1", "n": int64(2), "in": map[string]any{"deep": []any{int64(3)}}}}},
		{"Ruby JSON.generate of a hash", `{"attempt":3,"priority":true,"ratio":0.5,"tags":["a","b"],"trace":{"id":"t1"},"note":null}`,
			map[string]any{"attempt": int64(3), "priority": true, "ratio": 0.5, "tags": []any{"a", "b"}, "trace": map[string]any{"id": "t1"}, "note": nil}},
		{"depth 32", `{"d":` + nested(32, "1") + `}`, map[string]any{"d": nestedValue(32, int64(1))}},
		{"8192 elements", `{"a":[` + strings.TrimSuffix(strings.Repeat("0,", 8192), ",") + `]}`, map[string]any{"a": make8192()}},
		{"name of 255 bytes", `{"` + strings.Repeat("k", 255) + `":"v"}`, map[string]any{strings.Repeat("k", 255): "v"}},
		{"whitespace around", " \n{\"a\":\"b\"}\n ", map[string]any{"a": "b"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := DecodeHeaders(tc.text)
			if err != nil {
				t.Fatalf("DecodeHeaders(%.60q): %v", tc.text, err)
			}
			if !reflect.DeepEqual(got, tc.want) {
				t.Fatalf("DecodeHeaders(%.60q) = %#v, want %#v", tc.text, got, tc.want)
			}
		})
	}
}

func nestedValue(n int, inner any) any {
	v := inner
	for range n {
		v = []any{v}
	}
	return v
}

func make8192() []any {
	a := make([]any, 8192)
	for i := range a {
		a[i] = int64(0)
	}
	return a
}

// What is not a JSON object, or holds what AMQP cannot carry as written, is
// refused with an error that says what and, inside the object, names the
// header.
func TestDecodeHeaders_WhatAMQPCannotCarry_RefusedNamingTheHeader(t *testing.T) {
	long := strings.Repeat("k", 256)
	for _, tc := range []struct{ name, text, want string }{
		{"not JSON", `{not json`, "headers are not a JSON object"},
		{"null text", `null`, "headers are null"},
		{"array", `["a"]`, "headers are a JSON array"},
		{"string", `"a"`, "headers are a JSON string"},
		{"number", `7`, "headers are a JSON number"},
		{"two objects", `{}{}`, "more follows the object"},
		{"trailing garbage", `{"a":"b"} x`, "more follows the object"},
		{"2^63", `{"big":9223372036854775808}`, `header "big": integer 9223372036854775808 is outside the signed 64-bit range`},
		{"below min int64", `{"small":-9223372036854775809}`, `header "small": integer -9223372036854775809 is outside`},
		{"2^64 nested", `{"ids":[1,18446744073709551616]}`, `header "ids" at [1]: integer 18446744073709551616 is outside`},
		{"1e400", `{"huge":1e400}`, `header "huge": number 1e400 is outside the range of a double`},
		{"depth 33", `{"deep":` + nested(33, "1") + `}`, `header "deep" at [0]`},
		{"depth 33 in objects", `{"deep":` + strings.Repeat(`{"k":`, 33) + `1` + strings.Repeat(`}`, 33) + `}`, "nested 33 deep; AMQP clients read at most 32"},
		{"8193 elements", `{"a":[` + strings.TrimSuffix(strings.Repeat("0,", 8193), ",") + `]}`, `header "a": array of 8193 elements`},
		{"name of 256 bytes", `{"` + long + `":"v"}`, "header name of 256 bytes"},
		{"nested key of 256 bytes", `{"trace":{"in":{"` + long + `":1}}}`, `header "trace" at ["in"]: key of 256 bytes`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := DecodeHeaders(tc.text)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("DecodeHeaders(%.60q) = %v, %v; want an error containing %q", tc.text, got, err, tc.want)
			}
		})
	}
}

// A header object of more than MaxElements entries is refused too.
func TestDecodeHeaders_MoreHeadersThanAMQPReads_Refused(t *testing.T) {
	var b strings.Builder
	b.WriteString("{")
	for i := range MaxElements + 1 {
		if i > 0 {
			b.WriteString(",")
		}
		b.WriteString(`"h` + strconv.Itoa(i) + `":1`)
	}
	b.WriteString("}")
	if _, err := DecodeHeaders(b.String()); err == nil || !strings.Contains(err.Error(), "8193 headers") {
		t.Fatalf("err = %v, want 8193 headers refused", err)
	}
}

// What TxPublisher writes, strings, reads back as the same strings.
func TestEncodeHeaders_DecodeHeaders_StringsRoundTrip(t *testing.T) {
	in := map[string]string{"tenant": "acme", "html": "<a&b>", "empty": "", "ü": "🦀"}
	text, err := EncodeHeaders(in)
	if err != nil {
		t.Fatal(err)
	}
	out, err := DecodeHeaders(text)
	if err != nil {
		t.Fatal(err)
	}
	if len(out) != len(in) {
		t.Fatalf("%v, want %v", out, in)
	}
	for k, v := range in {
		if out[k] != v {
			t.Errorf("%s = %#v, want %q", k, out[k], v)
		}
	}
}

// A held message's metadata comes back byte for byte: text as a readable
// JSON object, and metadata holding bytes that are not UTF-8 (which JSON
// would turn into U+FFFD) as base64 pairs.
func TestEncodeMetadata_DecodeMetadata_BytesRoundTrip(t *testing.T) {
	for _, c := range []struct {
		name string
		md   map[string]string
		want string // how the column starts
	}{
		{"none", nil, "{}"},
		{"text", map[string]string{"aggregateId": "order-1", "note": "<é & \u00a0>", "nul": "a\x00b"}, "{"},
		{"invalid value", map[string]string{"aggregateId": "order-1", "raw": "\xff\xfe"}, "["},
		{"invalid key", map[string]string{"\xc3(": "v", "seq": "2"}, "["},
	} {
		t.Run(c.name, func(t *testing.T) {
			s, err := EncodeMetadata(c.md)
			if err != nil {
				t.Fatal(err)
			}
			if !strings.HasPrefix(s, c.want) {
				t.Errorf("encoded %q, want it to start with %q", s, c.want)
			}
			got, err := DecodeMetadata(s)
			if err != nil {
				t.Fatal(err)
			}
			if len(got) != len(c.md) {
				t.Fatalf("decoded %q from %q, want %q", got, s, c.md)
			}
			for k, v := range c.md {
				if got[k] != v {
					t.Errorf("decoded %q = %q from %q, want %q", k, got[k], s, v)
				}
			}
		})
	}
	for _, bad := range []string{"[[\"!\",\"\"]]", "{", "[1]"} {
		if _, err := DecodeMetadata(bad); err == nil {
			t.Errorf("DecodeMetadata(%q): no error", bad)
		}
	}
}

// body_encoding as other libraries write it: any case, "utf8", padded by
// a char column. An unknown name is refused, never guessed.
func TestDecodeBody_EncodingNamesOfOtherLibraries(t *testing.T) {
	for _, enc := range []string{"utf-8", "UTF-8", "utf8", "UTF8", "utf-8         ", ""} {
		if got, err := DecodeBody("héllo", enc); err != nil || string(got) != "héllo" {
			t.Errorf("DecodeBody(%q) = %q, %v; want the text", enc, got, err)
		}
	}
	for _, enc := range []string{"base64", "BASE64", " base64 "} {
		if got, err := DecodeBody("aGk=", enc); err != nil || string(got) != "hi" {
			t.Errorf("DecodeBody(%q) = %q, %v; want the decoded bytes", enc, got, err)
		}
	}
	for _, enc := range []string{"latin1", "gzip", "utf-16"} {
		if _, err := DecodeBody("x", enc); err == nil {
			t.Errorf("DecodeBody(%q) accepted an unknown encoding", enc)
		}
	}
}
