package outbox

import (
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/acemq/watermill-outbox/internal/sqldialect"
)

var (
	// ErrPublisherClosed is returned by Publish after Close.
	ErrPublisherClosed = errors.New("outbox: publisher is closed")

	// ErrTxDone is returned by Publish when the publisher's transaction was
	// already committed or rolled back: the message could not join it.
	ErrTxDone = errors.New("outbox: transaction already committed or rolled back")

	// ErrInvalidMessage matches every *InvalidMessageError with errors.Is.
	ErrInvalidMessage = errors.New("outbox: invalid message")

	// ErrInvalidConfig matches every *ConfigError with errors.Is.
	ErrInvalidConfig = errors.New("outbox: invalid configuration")
)

// InvalidMessageError says which message of a Publish call was refused and
// why. Nothing of that call was written.
type InvalidMessageError struct {
	Index     int    // position of the message in the Publish call
	MessageID string // as given, possibly empty or too long
	Field     string // "id", "topic", "exchange", "routing key", "content type", "metadata"
	Reason    string
}

func (e *InvalidMessageError) Error() string {
	return fmt.Sprintf("outbox: message %d (id %.80q): %s %s", e.Index, e.MessageID, e.Field, e.Reason)
}

// Is makes errors.Is(err, ErrInvalidMessage) true.
func (e *InvalidMessageError) Is(target error) bool { return target == ErrInvalidMessage }

// ConfigError names the option or field whose value was refused.
type ConfigError struct {
	Field  string
	Reason string
}

func (e *ConfigError) Error() string { return fmt.Sprintf("outbox: %s: %s", e.Field, e.Reason) }

// Is makes errors.Is(err, ErrInvalidConfig) true.
func (e *ConfigError) Is(target error) bool { return target == ErrInvalidConfig }

// ErrDuplicateID matches every *DuplicateIDError with errors.Is.
var ErrDuplicateID = errors.New("outbox: message id already in the outbox for another destination or ordering key")

// DuplicateIDError is a message whose id is already in the outbox for
// another exchange or routing key, or under another ordering key
// (MetadataAggregateID): a copy of one message published to a second topic
// (Watermill's Copy keeps the UUID), or given another key. The id is the
// row's key and the consumers' dedupe key, so that copy would be lost, or
// sent under the row's key rather than its own; instead the whole Publish
// call is refused and nothing of it written. Give each copy its own UUID.
// The same message to the same place under the same key again (a retried
// transaction) is not an error: it leaves one row, the first written.
//
// Keys are compared in their bytes, as the table holds them, whatever the
// column's collation; a row without one (aggregate_id NULL, or ” as
// another library may write it, which the relay sends unkeyed too) has
// AggregateID "".
type DuplicateIDError struct {
	ID                           string
	Exchange, RoutingKey         string // where the row already in the table goes
	WantExchange, WantRoutingKey string // where this call wanted it to go
	AggregateID                  string // the row's ordering key, "" for none
	WantAggregateID              string // this call's message's, "" for none
}

func (e *DuplicateIDError) Error() string {
	if e.Exchange == e.WantExchange && e.RoutingKey == e.WantRoutingKey {
		return fmt.Sprintf("outbox: message id %q is already in the outbox %s; it cannot be published again %s, as the row keeps its key: give the message its own UUID",
			e.ID, orderingKey(e.AggregateID), orderingKey(e.WantAggregateID))
	}
	msg := fmt.Sprintf("outbox: message id %q is already in the outbox for exchange %q routing key %q; it cannot also go to exchange %q routing key %q",
		e.ID, e.Exchange, e.RoutingKey, e.WantExchange, e.WantRoutingKey)
	if e.AggregateID != e.WantAggregateID {
		msg += fmt.Sprintf(" (the row is %s, this message %s)", orderingKey(e.AggregateID), orderingKey(e.WantAggregateID))
	}
	return msg + ": give each copy its own UUID"
}

// unmigrated adds to err, where the database says one of tables (as
// quoted in the SQL) is missing, what to do about it: a service started
// before its tables were made got the database's error alone ("relation
// \"acemq_outbox\" does not exist"), from the publisher, the relay and the
// inbox alike, and on MySQL a relay's first log lines were about
// statements it could not prepare. A table is named in the error by its
// name without schema or quotes, as a whole word: the inbox's error may be
// its handler's, over a table of the service's own (processed_messages_
// archive is not processed_messages). Migrate makes the library's tables
// of their default names only; for a table of another name it says to
// create that one.
func unmigrated(d Dialect, err error, tables ...string) error {
	if err == nil || d == nil || !d.sql().MissingTable(err) {
		return err
	}
	for _, t := range tables {
		name := strings.Trim(t[strings.LastIndexByte(t, '.')+1:], "\"`")
		if !namesWord(err.Error(), name) {
			continue
		}
		if slices.Contains(migratedTables, name) {
			return fmt.Errorf("%w (%s is missing: run outbox.Migrate, or outboxctl migrate, on this database before the service starts)", err, name)
		}
		return fmt.Errorf("%w (%s is missing: outbox.Migrate makes the tables of the default names only; create %s as sqlschema's migrations make the default one)", err, name, name)
	}
	return err
}

// migratedTables are the tables Migrate makes.
var migratedTables = []string{DefaultTable, DefaultInboxTable, sqldialect.SequencesTable, sqldialect.InboxSequencesTable, sqldialect.InboxHeldTable}

// namesWord reports whether s holds word with no character of an
// identifier (a letter, a digit, an underscore or a dollar sign) right
// before or after it.
func namesWord(s, word string) bool {
	if word == "" {
		return false
	}
	isIdent := func(c byte) bool {
		return c == '_' || c == '$' || '0' <= c && c <= '9' || 'a' <= c|0x20 && c|0x20 <= 'z'
	}
	for from := 0; ; {
		i := strings.Index(s[from:], word)
		if i < 0 {
			return false
		}
		i += from
		end := i + len(word)
		if (i == 0 || !isIdent(s[i-1])) && (end == len(s) || !isIdent(s[end])) {
			return true
		}
		from = i + 1
	}
}

// idText is a message id as errors and logs name it: as it is where it is
// printable ASCII without a space, 80 bytes at most (every id an AceMQ
// library makes); else quoted, cut at 80 characters (runes, or bytes that
// are not UTF-8) with its size. An id
// has no size limit of its own (a header of up to the broker's frame, a
// text column of another library's table), and an error or a log line
// naming it in full for every delivery of a 100 KB id weighed as much.
func idText(id string) string {
	plain := id != "" && len(id) <= maxIDText
	for i := 0; plain && i < len(id); i++ {
		plain = id[i] > ' ' && id[i] < 0x7f
	}
	switch {
	case plain:
		return id
	case utf8.RuneCountInString(id) <= maxIDText: // what %.*q would cut
		return strconv.Quote(id)
	}
	return fmt.Sprintf("%.*q… (%d bytes)", maxIDText, id, len(id))
}

// maxIDText is how much of a message id idText shows.
const maxIDText = 80

// orderingKey names a row's or message's ordering key in an error.
func orderingKey(key string) string {
	if key == "" {
		return "without an ordering key"
	}
	return fmt.Sprintf("under ordering key %q", key)
}

// Is makes errors.Is(err, ErrDuplicateID) and errors.Is(err, ErrInvalidMessage) true.
func (e *DuplicateIDError) Is(target error) bool {
	return target == ErrDuplicateID || target == ErrInvalidMessage
}
