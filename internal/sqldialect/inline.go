package sqldialect

import (
	"strconv"
	"strings"
	"unicode/utf8"
)

// maxInlineBytes bounds the statement Inline writes: past it the arguments
// go as they are. Hex takes two characters a byte, and a server with a
// small max_allowed_packet could refuse a statement whose arguments alone
// would fit; and a round trip saved is worth nothing beside a statement of
// that size.
const maxInlineBytes = 64 << 10

// Inline writes q's arguments into its text as literals, where the dialect
// sends a statement with arguments in more round trips than one without
// (MySQL: go-sql-driver prepares, executes and closes a statement with
// arguments unless the DSN sets interpolateParams, and the DSN is the
// caller's). ok is false, and q is to be sent as it is, elsewhere, or when an
// argument is of a type it does not write, or the literals would be large.
//
// A string is written as a hex literal with a utf8mb4 introducer
// (_utf8mb4 X'…'): it reads the same under every sql_mode (backslash
// escapes or not, ANSI quotes or not) and in every connection character
// set. A string that is not UTF-8 cannot be so written, and its statement
// goes as it is.
func (d mysql) inline(q Query) (Query, bool) {
	if len(q.Args) == 0 {
		return q, true
	}
	if strings.Contains(q.SQL, "--") || strings.Contains(q.SQL, "/*") || strings.IndexByte(q.SQL, '#') >= 0 {
		return q, false // a comment could hold a quote or a question mark
	}
	size := len(q.SQL)
	for _, a := range q.Args {
		switch v := a.(type) {
		case string:
			if !utf8.ValidString(v) {
				// _utf8mb4 X'…' must hold UTF-8 (MySQL refuses it, error
				// 1300, where an argument's bytes go into a varbinary
				// column as they are): a key from another language's
				// producer may not be.
				return q, false
			}
			size += 12 + 2*len(v)
		case []byte:
			size += 3 + 2*len(v)
		case int, int64, nil:
			size += 20
		default:
			return q, false
		}
	}
	if size > maxInlineBytes {
		return q, false
	}
	var b strings.Builder
	b.Grow(size)
	next := 0
	for i := 0; i < len(q.SQL); i++ {
		c := q.SQL[i]
		switch c {
		case '\'', '`', '"':
			// A quoted literal or identifier of the statement's own text:
			// copied whole, its question marks are not placeholders.
			j := strings.IndexByte(q.SQL[i+1:], c)
			if j < 0 {
				return q, false
			}
			b.WriteString(q.SQL[i : i+j+2])
			i += j + 1
			continue
		case '?':
			if next == len(q.Args) {
				return q, false
			}
			writeLiteral(&b, q.Args[next])
			next++
			continue
		}
		b.WriteByte(c)
	}
	if next != len(q.Args) {
		return q, false
	}
	return Query{SQL: b.String()}, true
}

func writeLiteral(b *strings.Builder, a any) {
	switch v := a.(type) {
	case string:
		if v == "" {
			b.WriteString("''")
			return
		}
		b.WriteString("_utf8mb4 X'")
		writeHex(b, v)
		b.WriteByte('\'')
	case []byte:
		b.WriteString("X'")
		writeHex(b, string(v))
		b.WriteByte('\'')
	case int:
		b.WriteString(strconv.Itoa(v))
	case int64:
		b.WriteString(strconv.FormatInt(v, 10))
	case nil:
		b.WriteString("NULL")
	}
}

func writeHex(b *strings.Builder, s string) {
	const digits = "0123456789ABCDEF"
	for i := 0; i < len(s); i++ {
		b.WriteByte(digits[s[i]>>4])
		b.WriteByte(digits[s[i]&0x0f])
	}
}

// Inline is q with its arguments written into its text where the dialect
// saves round trips that way (see mysql's inline), else q as it is.
func Inline(d Dialect, q Query) Query {
	if in, ok := d.inline(q); ok {
		return in
	}
	return q
}

// MySQLSessionCharsets reads the character set MySQL reads a statement's
// arguments in (character_set_client) and the one it sends text results in
// (character_set_results; binary for NULL, as stored). Text outside them
// is refused or replaced with '?': a DSN's charset=utf8 (3-byte) or latin1
// drops an emoji, latin1 also every character it has not.
const MySQLSessionCharsets = "SELECT @@character_set_client, COALESCE(@@character_set_results, 'binary')"

// FullCharset reports whether a MySQL session character set (as
// MySQLSessionCharsets reads it) carries any UTF-8 text as it is.
func FullCharset(cs string) bool { return cs == "utf8mb4" || cs == "binary" }

// CharsetHolds reports whether MySQL, reading arguments in the session
// character set cs, reads each string of args as it is: utf8mb4 any,
// utf8 (utf8mb3, 3-byte) all but the characters beyond U+FFFF (an emoji),
// another only ASCII.
func CharsetHolds(cs string, args []any) bool {
	if FullCharset(cs) {
		return true
	}
	limit := byte(utf8.RuneSelf) // a byte from it on starts or goes on a character beyond ASCII
	if cs == "utf8mb3" || cs == "utf8" {
		limit = 0xF0 // starts a 4-byte character
	}
	return !byteFrom(args, limit)
}

// InlineOK is Inline, and whether it wrote q's arguments in.
func InlineOK(d Dialect, q Query) (Query, bool) {
	if in, ok := d.inline(q); ok {
		return in, true
	}
	return q, false
}

// NonASCIIText reports whether one of args is a string with a byte outside
// ASCII: sent as an argument, MySQL reads it in the connection's
// character_set_client.
func NonASCIIText(args []any) bool { return byteFrom(args, utf8.RuneSelf) }

// byteFrom reports whether one of args is a string with a byte of limit
// or above.
func byteFrom(args []any, limit byte) bool {
	for _, a := range args {
		if s, ok := a.(string); ok {
			for i := 0; i < len(s); i++ {
				if s[i] >= limit {
					return true
				}
			}
		}
	}
	return false
}
