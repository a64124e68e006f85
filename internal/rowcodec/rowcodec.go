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
func DecodeBody(body, encoding string) ([]byte, error) {
	switch encoding {
	case BodyUTF8, "":
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
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false) // the table is read by people during incidents
	if err := enc.Encode(headers); err != nil {
		return "", err
	}
	return string(bytes.TrimSuffix(buf.Bytes(), []byte{'\n'})), nil
}

// DecodeHeaders reads a row's headers, a JSON object of strings ("" reads
// as none).
func DecodeHeaders(text string) (map[string]string, error) {
	if text == "" {
		return map[string]string{}, nil
	}
	var raw map[string]any
	if err := json.Unmarshal([]byte(text), &raw); err != nil {
		return nil, fmt.Errorf("headers are not a JSON object: %w", err)
	}
	if raw == nil { // the JSON text "null"
		return nil, errors.New("headers are null; want a JSON object of strings")
	}
	headers := make(map[string]string, len(raw))
	for k, v := range raw {
		s, ok := v.(string)
		if !ok {
			return nil, fmt.Errorf("header %q is %T, not a string; want a JSON object of strings", k, v)
		}
		headers[k] = s
	}
	return headers, nil
}
