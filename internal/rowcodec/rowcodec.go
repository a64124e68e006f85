// Package rowcodec is the text form of an acemq_outbox row's body and
// headers, as every AceMQ library reads and writes them: body_encoding says
// how body holds the payload, headers is a JSON object.
package rowcodec

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"unicode/utf8"
)

// Body encodings, the values of the body_encoding column.
const (
	BodyUTF8   = "utf-8"
	BodyBase64 = "base64"
)

// EncodeBody stores text as text and anything else base64. NUL is valid
// UTF-8 but PostgreSQL text refuses it, so a body holding one goes base64 on
// every database, and the table means the same thing everywhere.
func EncodeBody(payload []byte) (body, encoding string) {
	if utf8.Valid(payload) && bytes.IndexByte(payload, 0) < 0 {
		return string(payload), BodyUTF8
	}
	return base64.StdEncoding.EncodeToString(payload), BodyBase64
}

// DecodeBody returns the bytes a row's body and body_encoding stand for.
// The encoding's name is read as other libraries write it: in any case
// ("UTF-8" is Java's StandardCharsets.UTF_8.name()), "utf8" for "utf-8",
// and padded with spaces (a char(16) column). A name that is none of these
// is refused: no guess changes a body unseen.
func DecodeBody(body, encoding string) ([]byte, error) {
	switch strings.ToLower(strings.TrimSpace(encoding)) {
	case BodyUTF8, "utf8", "":
		return []byte(body), nil
	case BodyBase64:
		return base64.StdEncoding.DecodeString(body)
	}
	return nil, fmt.Errorf("outbox: unknown body_encoding %q", encoding)
}

// EncodeHeaders renders headers as a JSON object of strings. It refuses what
// JSON would alter: invalid UTF-8 becomes U+FFFD under encoding/json.
func EncodeHeaders(headers map[string]string) (string, error) {
	if len(headers) == 0 {
		return "{}", nil
	}
	for k, v := range headers {
		if !utf8.ValidString(k) {
			return "", fmt.Errorf("key %q is not valid UTF-8", k)
		}
		if !utf8.ValidString(v) {
			return "", fmt.Errorf("value of %q is not valid UTF-8", k)
		}
	}
	return jsonObject(headers)
}

// jsonObject renders m, all of it valid UTF-8, as a JSON object of strings,
// with <, > and & as they are: the tables are read by people during
// incidents.
func jsonObject(m map[string]string) (string, error) {
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(m); err != nil {
		return "", err
	}
	return string(bytes.TrimSuffix(buf.Bytes(), []byte{'\n'})), nil
}

// Limits of a header value, those of the AMQP clients that read it
// (amqp091-go's reader, which closes the connection over a frame beyond
// them, so that a Go consumer could never take such a message off its
// queue).
const (
	// MaxNameBytes is the most bytes of a header name, or of a key of a table
	// nested in a header: an AMQP short string.
	MaxNameBytes = 255
	// MaxDepth is how deep arrays and objects may nest in a header value:
	// the value of {"h":[[1]]} is 2 deep.
	MaxDepth = 32
	// MaxElements is the most elements of an array or entries of an object,
	// the headers object itself included.
	MaxElements = 8192
)

// DecodeHeaders reads a row's headers, a JSON object ("" reads as none),
// into the values the relay sends as AMQP field values, as written:
//
//	JSON                                      Go (AMQP field type)
//	string                                    string (long string)
//	number without fraction or exponent: 7    int64 (signed 64-bit)
//	any other number: 0.5, 1.0, 2e3           float64 (double)
//	true, false                               bool (boolean)
//	null                                      nil (void)
//	array                                     []any (field array)
//	object                                    map[string]any (nested table)
//
// The number's text decides, not its value, so an integer is exact beyond
// 2^53 and 1.0 stays a double, as the writer's language had it. It refuses,
// naming the header, what AMQP cannot carry as written: an integer outside
// the signed 64-bit range (AMQP has no wider integer, and a double would
// change its digits unseen: write such a number as a string), a number
// beyond a double's range, and anything beyond MaxNameBytes, MaxDepth or
// MaxElements. Headers that are not one JSON object are refused too.
func DecodeHeaders(text string) (map[string]any, error) {
	if text == "" {
		return map[string]any{}, nil
	}
	dec := json.NewDecoder(strings.NewReader(text))
	dec.UseNumber()
	var raw any
	if err := dec.Decode(&raw); err != nil {
		return nil, fmt.Errorf("headers are not a JSON object: %w", err)
	}
	if _, err := dec.Token(); err != io.EOF {
		return nil, errors.New("headers are not a JSON object: more follows the object")
	}
	obj, ok := raw.(map[string]any)
	if !ok {
		if raw == nil { // the JSON text "null"
			return nil, errors.New("headers are null; want a JSON object")
		}
		return nil, fmt.Errorf("headers are a JSON %s; want a JSON object", jsonKind(raw))
	}
	if len(obj) > MaxElements {
		return nil, fmt.Errorf("%d headers; AMQP clients read at most %d", len(obj), MaxElements)
	}
	for k, v := range obj {
		if len(k) > MaxNameBytes {
			return nil, fmt.Errorf("header name of %d bytes (%.20q…): AMQP allows %d", len(k), k, MaxNameBytes)
		}
		typed, bad := typedValue(v, 1)
		if bad != nil {
			return nil, bad.of(k)
		}
		obj[k] = typed
	}
	return obj, nil
}

// typedValue turns a value json decoded with UseNumber into the one the
// relay sends, in place for arrays and objects. depth is the nesting of an
// array or object v: 1 for a header's own value.
func typedValue(v any, depth int) (any, *refusal) {
	switch v := v.(type) {
	case json.Number:
		return number(string(v))
	case []any:
		if bad := checkContainer("array", len(v), depth); bad != nil {
			return nil, bad
		}
		for i, e := range v {
			typed, bad := typedValue(e, depth+1)
			if bad != nil {
				return nil, bad.within(fmt.Sprintf("[%d]", i))
			}
			v[i] = typed
		}
		return v, nil
	case map[string]any:
		if bad := checkContainer("object", len(v), depth); bad != nil {
			return nil, bad
		}
		for k, e := range v {
			if len(k) > MaxNameBytes {
				return nil, &refusal{msg: fmt.Sprintf("key of %d bytes (%.20q…); AMQP allows %d", len(k), k, MaxNameBytes)}
			}
			typed, bad := typedValue(e, depth+1)
			if bad != nil {
				return nil, bad.within(fmt.Sprintf("[%q]", k))
			}
			v[k] = typed
		}
		return v, nil
	}
	return v, nil // string, bool, nil
}

func checkContainer(kind string, n, depth int) *refusal {
	if depth > MaxDepth {
		return &refusal{msg: fmt.Sprintf("arrays and objects nested %d deep; AMQP clients read at most %d", depth, MaxDepth)}
	}
	if n > MaxElements {
		return &refusal{msg: fmt.Sprintf("%s of %d elements; AMQP clients read at most %d", kind, n, MaxElements)}
	}
	return nil
}

// number reads a JSON number by its text: an integer literal is an int64,
// any other a float64.
func number(s string) (any, *refusal) {
	if !strings.ContainsAny(s, ".eE") {
		n, err := strconv.ParseInt(s, 10, 64)
		if err != nil {
			return nil, &refusal{msg: fmt.Sprintf("integer %.40s is outside the signed 64-bit range AMQP carries; write it as a string", s)}
		}
		return n, nil
	}
	f, err := strconv.ParseFloat(s, 64)
	if err != nil {
		return nil, &refusal{msg: fmt.Sprintf("number %.40s is outside the range of a double", s)}
	}
	return f, nil
}

// refusal is a value refused inside a header, and where: the path is built
// while the recursion unwinds, so only a failure pays for it.
type refusal struct{ path, msg string }

func (r *refusal) within(step string) *refusal {
	return &refusal{path: step + r.path, msg: r.msg}
}

// of is the error, naming the header.
func (r *refusal) of(header string) error {
	if r.path == "" {
		return fmt.Errorf("header %q: %s", header, r.msg)
	}
	return fmt.Errorf("header %q at %s: %s", header, r.path, r.msg)
}

func jsonKind(v any) string {
	switch v.(type) {
	case []any:
		return "array"
	case string:
		return "string"
	case json.Number:
		return "number"
	case bool:
		return "boolean"
	}
	return fmt.Sprintf("%T", v)
}

// EncodeMetadata renders a held message's metadata (acemq_inbox_held's
// metadata column) so that DecodeMetadata gives back the same bytes. Text
// goes as a JSON object of strings, readable in the table. Metadata with a
// key or value that is not valid UTF-8 (AMQP header strings are bytes, and
// another language's producer may send any), which encoding/json would
// turn into U+FFFD, goes as a JSON array of [key, value] pairs, each
// base64.
func EncodeMetadata(md map[string]string) (string, error) {
	text := true
	for k, v := range md {
		text = text && utf8.ValidString(k) && utf8.ValidString(v)
	}
	if text {
		if len(md) == 0 {
			return "{}", nil
		}
		return jsonObject(md)
	}
	pairs := make([][2]string, 0, len(md))
	for k, v := range md {
		pairs = append(pairs, [2]string{base64.StdEncoding.EncodeToString([]byte(k)), base64.StdEncoding.EncodeToString([]byte(v))})
	}
	out, err := json.Marshal(pairs)
	return string(out), err
}

// DecodeMetadata reads what EncodeMetadata wrote: a JSON object of
// strings, or an array of base64 [key, value] pairs.
func DecodeMetadata(s string) (map[string]string, error) {
	md := map[string]string{}
	if t := strings.TrimSpace(s); !strings.HasPrefix(t, "[") {
		if err := json.Unmarshal([]byte(t), &md); err != nil {
			return nil, fmt.Errorf("metadata: %w", err)
		}
		return md, nil
	}
	var pairs [][2]string
	if err := json.Unmarshal([]byte(s), &pairs); err != nil {
		return nil, fmt.Errorf("metadata: %w", err)
	}
	for _, p := range pairs {
		k, err := base64.StdEncoding.DecodeString(p[0])
		if err != nil {
			return nil, fmt.Errorf("metadata: key: %w", err)
		}
		v, err := base64.StdEncoding.DecodeString(p[1])
		if err != nil {
			return nil, fmt.Errorf("metadata: value of %q: %w", k, err)
		}
		md[string(k)] = string(v)
	}
	return md, nil
}
