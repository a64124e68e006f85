package outboxctl

import (
	"database/sql"
	"errors"
	"flag"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jmoiron/sqlx"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/sqldialect"
)

// heldReport is held --json; its names do not change.
type heldReport struct {
	Keys []heldKey `json:"keys"`
	// Total counts the keys held (longer than --older-than), listed or
	// not; Truncated says --limit left some out.
	Total     int  `json:"total"`
	Truncated bool `json:"truncated"`
}

// heldLimit is held's default --limit: a screen's worth many times over,
// and a database that holds more says how many more.
const heldLimit = 1000

type heldKey struct {
	// Consumer is the consumer as --consumer takes it: quoted where its
	// name would not say which consumer it is (see keyText), as Key is. A
	// consumer named with a leading quote, given raw, was taken for the
	// quoted name of another, whose gap a script then skipped.
	Consumer    string `json:"consumer"`
	AggregateID string `json:"aggregate_id"`
	// Key is the key as skip-gap's --key takes it (see keyText):
	// aggregate_id itself, or quoted where that text would not say which
	// key it is, as for a key that is not UTF-8, which aggregate_id, a
	// JSON string, holds with U+FFFD in place of its bytes.
	Key          string    `json:"key"`
	LastApplied  int64     `json:"last_applied"`
	Held         int64     `json:"held"`
	LowestHeld   int64     `json:"lowest_held"`
	Missing      int64     `json:"missing"`
	OldestHeldAt time.Time `json:"oldest_held_at"`
	// From and Through are the numbers the key waits for, as skip-gap's
	// --from and --through take them; null for a key that waits for
	// nothing (its next message is held: its handler failed).
	From    *int64 `json:"from"`
	Through *int64 `json:"through"`
	// NextError, for a key whose next message is held, is its handler's
	// last failure (its time and the error), as the inbox wrote it; absent
	// when none was written.
	NextError string `json:"next_error,omitempty"`
	// Waiting is, for a key that waits for numbers, the record of the
	// first of them in this database's outbox, as show tells it: set
	// aside, stuck at the sender, published and not applied. Absent when
	// the database has no outbox table or held did not look (see
	// heldLookups).
	Waiting *waitingRecord `json:"waiting,omitempty"`

	consumer string // as the table holds it
}

// waitingRecord is the outbox record of the number a key waits for.
type waitingRecord struct {
	Seq   int64  `json:"seq"`
	Found bool   `json:"found"`
	ID    string `json:"id,omitempty"`
	State string `json:"state"` // show's state, not_found, set_aside, or elsewhere
	Why   string `json:"why"`
}

// heldLookups is how many keys' first missing number held looks up in
// the outbox, the longest-held first: one statement or two each.
const heldLookups = 100

func (c *cli) held(args []string) error {
	fs := c.flagSet("held")
	asJSON := fs.Bool("json", false, "print one JSON object, for scripts")
	var olderFlag ageFlag
	fs.Var(&olderFlag, "older-than", "only keys with a message held longer than this (e.g. 5m, 7d; the inbox's GapAfter, 5m by default, lists the gaps it reports)")
	older := &olderFlag.d
	limit := fs.Int("limit", heldLimit, "list at most this many keys, the longest-held first (0: every key); the rest are counted")
	rest, err := c.parse(fs, args, "outboxctl held [--older-than D] [--limit N] [--json]")
	if err != nil {
		return err
	}
	if err := noArgs(fs, rest); err != nil {
		return err
	}
	if *older < 0 {
		return usagef("--older-than: %s; want 0 or more", *older)
	}
	if *limit < 0 {
		return usagef("--limit: %d; want 0 (every key) or more", *limit)
	}
	d, err := c.openChecked(false)
	if err != nil {
		return err
	}
	defer d.Close()
	in, err := c.inbox(d, 0)
	if err != nil {
		return err
	}
	gaps, total, err := in.ListGaps(c.ctx, *older, *limit)
	if err != nil {
		return d.explain(err, sqldialect.InboxHeldTable)
	}
	r := heldReport{Keys: make([]heldKey, len(gaps)), Total: total, Truncated: total > len(gaps)}
	for i, g := range gaps {
		r.Keys[i] = heldKey{consumer: g.Consumer, Consumer: keyText(g.Consumer), AggregateID: g.AggregateID, Key: keyText(g.AggregateID), LastApplied: g.LastApplied, Held: g.Held,
			LowestHeld: g.LowestHeld, Missing: g.Missing(), OldestHeldAt: g.OldestHeldAt.UTC(), NextError: g.NextError}
		if g.Missing() > 0 {
			from, through := g.LastApplied+1, g.LowestHeld-1
			r.Keys[i].From, r.Keys[i].Through = &from, &through
		}
	}
	if err := c.lookUpWaiting(d, r.Keys); err != nil {
		return err
	}
	if *asJSON {
		return writeJSON(c.stdout, r)
	}
	if len(r.Keys) == 0 && *older > 0 {
		// Not "no held messages": an operator filtering by GapAfter would
		// read that the inbox holds nothing.
		_, all, err := in.ListGaps(c.ctx, 0, 1)
		if err != nil {
			return d.explain(err, sqldialect.InboxHeldTable)
		}
		if all > 0 {
			fmt.Fprintf(c.stdout, "no key has a message held longer than %s (keys holding messages for less: %d; outboxctl held lists them)\n", *older, all)
			return nil
		}
	}
	if len(r.Keys) == 0 {
		fmt.Fprintln(c.stdout, "no held messages")
		return nil
	}
	now := time.Now()
	tw := tabwriter.NewWriter(c.stdout, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "CONSUMER\tKEY\tLAST APPLIED\tHELD\tWAITING FOR\tHELD FOR")
	nextHeld, missing := false, false
	for _, k := range r.Keys {
		waiting := fmt.Sprintf("%d..%d", k.LastApplied+1, k.LowestHeld-1)
		missing = missing || k.Missing > 0
		if k.Missing == 1 {
			waiting = fmt.Sprint(k.LastApplied + 1)
		} else if k.Missing <= 0 {
			waiting, nextHeld = "nothing: next held (*)", true
		}
		fmt.Fprintf(tw, "%s\t%s\t%d\t%d\t%s\t%s\n", k.Consumer, k.Key, k.LastApplied, k.Held,
			waiting, now.Sub(k.OldestHeldAt).Round(time.Second))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if r.Truncated {
		fmt.Fprintf(c.stdout, "and %d more keys, not listed: the %d above are the longest-held of %d (--limit 0 lists every key)\n", total-len(r.Keys), len(r.Keys), total)
	}
	for _, k := range r.Keys {
		if k.NextError != "" {
			fmt.Fprintf(c.stdout, "%s %s seq %d: its handler failed %s\n", k.Consumer, k.Key, k.LastApplied+1, printable(k.NextError))
		}
		if w := k.Waiting; w != nil {
			fmt.Fprintf(c.stdout, "%s %s waits for seq %d: %s\n", k.Consumer, k.Key, w.Seq, w.Why)
		}
	}
	if missing {
		// A message set aside (a poison queue) is missing too: it arrived,
		// and "has not arrived" sent a user review's on-call looking for a
		// message the consumer had (its copy on the poison topic).
		fmt.Fprintln(c.stdout, "WAITING FOR: numbers this consumer has not applied: not arrived yet (purged, stuck at the sender), or set aside by a poison queue (PoisonOutbox's copy carries x-acemq-poisoned-id); once the cause is fixed, outboxctl resend --key K --seq N on the database of the outbox they came from sends one again, or outboxctl skip-gap gives them up (after which a resend is dropped as a duplicate)")
	}
	if nextHeld {
		fmt.Fprintln(c.stdout, "(*) the key's next message is held: its handler failed (the service logs \"Held message could not be applied\" with its error, message_uuid and seq, once a minute while it fails), or the router handler it was delivered to has not run since the service started, or is gone (renamed?), or a skip just moved the key on and the service's ApplyHeld (the inbox's Plugin: every 10 s by default) has not run since; the key's next delivery or ApplyHeld applies it, outboxctl skip-held --consumer C --key K --seq LAST+1 gives up on it")
	}
	fmt.Fprintln(c.stdout, "outboxctl skip-gap --consumer C --key K --from A --through B gives up on a key's WAITING FOR A..B (for a single number N: --from N --through N)")
	return nil
}

// lookUpWaiting notes in keys, up to heldLookups of them, the record in
// d's outbox of the first number each waits for: held said "not arrived
// yet, or set aside" of every gap, and an on-call went looking in the
// poison topic for a message stuck at the sender. Nothing is looked up
// where d has no outbox table (the events come from another database).
func (c *cli) lookUpWaiting(d *database, keys []heldKey) error {
	if ok, err := d.hasTable(c.ctx, c.g.table); err != nil || !ok {
		return err
	}
	s, err := c.store(d, 0)
	if err != nil {
		return err
	}
	looked := 0
	for i := range keys {
		k := &keys[i]
		if k.From == nil || looked == heldLookups {
			continue
		}
		looked++
		w := &waitingRecord{Seq: *k.From, State: "not_found",
			Why: fmt.Sprintf("no record of it in %s (purged?)", c.g.table)}
		k.Waiting = w
		// Keys are not unique across services: the key's numbers are this
		// outbox's only if its lowest held message is this outbox's record
		// of that number.
		own, still, err := c.heldHere(d, s, k)
		if err != nil {
			return err
		}
		if !still {
			k.Waiting = nil // applied since the list was read
			continue
		}
		if !own {
			w.State = "elsewhere"
			w.Why = fmt.Sprintf("its held seq %d is no record of %s: the key's messages come from another database's outbox (or were purged here); look there (outboxctl show, resend --key %s --seq %d)", k.LowestHeld, c.g.table, k.Key, *k.From)
			continue
		}
		id, found, err := s.KeySeqID(c.ctx, k.AggregateID, *k.From)
		if err != nil {
			return d.explain(err, c.g.table)
		}
		if found {
			rows, err := c.lookupRows(s, []string{id})
			if err != nil {
				return d.explain(err, c.g.table)
			}
			row := rows[0]
			w.Found, w.ID, w.State, w.Why = row.Found, row.ID, row.State, row.ID+": "+c.why(row)
			switch {
			case row.SetAside:
				w.State = "set_aside"
				w.Why += fmt.Sprintf(" (outboxctl resend --key %s --seq %d)", k.Key, *k.From)
			case row.State == "published":
				w.Why += fmt.Sprintf("; not applied by %s: in a queue still, or lost, or set aside by a consumer that notes nothing (outboxctl resend --key %s --seq %d sends it again)", k.Consumer, k.Key, *k.From)
			case row.State == "stuck" && strings.HasPrefix(strings.TrimPrefix(row.ID, `"`), "-"):
				w.Why += fmt.Sprintf(" (outboxctl retry -- %s)", row.ID) // not read as a flag
			case row.State == "stuck":
				w.Why += fmt.Sprintf(" (outboxctl retry %s)", row.ID)
			}
		}
	}
	return nil
}

// heldHere reports whether k's lowest held message is the record of its
// number in s's outbox, by id; still is false when it is held no more.
func (c *cli) heldHere(d *database, s *outbox.Store, k *heldKey) (own, still bool, err error) {
	q := sqldialect.NewOrderedInbox(d.sqlDialect()).HeldID(k.consumer, k.AggregateID, k.LowestHeld)
	var held string
	switch err := d.db.QueryRowContext(c.ctx, q.SQL, q.Args...).Scan(&held); {
	case errors.Is(err, sql.ErrNoRows):
		return false, false, nil
	case err != nil:
		return false, false, d.explain(err, sqldialect.InboxHeldTable)
	}
	id, found, err := s.KeySeqID(c.ctx, k.AggregateID, k.LowestHeld)
	if err != nil {
		return false, false, d.explain(err, c.g.table)
	}
	return found && sqldialect.InboxKey(id) == held, true, nil
}

func (c *cli) skipGap(args []string) error {
	const synopsis = "outboxctl skip-gap --consumer C --key K --from A --through B"
	fs := c.flagSet("skip-gap")
	consumer := fs.String("consumer", "", "the consumer (inbox ConsumerName or router handler name), as outboxctl held shows it")
	key := fs.String("key", "", "the ordering key (aggregateId), as outboxctl held shows it")
	from := fs.Int64("from", 0, "the first sequence number to give up on: the start of WAITING FOR in outboxctl held")
	through := fs.Int64("through", 0, "the last sequence number to give up on: the end of WAITING FOR in outboxctl held")
	rest, err := c.parse(fs, args, synopsis)
	if err != nil {
		return err
	}
	if err := noArgs(fs, rest); err != nil {
		return err
	}
	given := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { given[f.Name] = true })
	for _, name := range []string{"consumer", "key", "from", "through"} {
		if !given[name] {
			// Both ends, always: a skip that named one would skip, from a
			// screen gone stale, numbers nobody saw missing.
			return usagef("skip-gap: give --%s (%s; see outboxctl held)", name, synopsis)
		}
	}
	if *consumer, err = keyFlag("--consumer", *consumer); err != nil {
		return err
	}
	if *key, err = keyFlag("--key", *key); err != nil {
		return err
	}
	if *consumer == "" || *key == "" {
		return usagef("skip-gap: --consumer and --key must not be empty")
	}
	if *from < 1 {
		return usagef("--from: %d; want a sequence number, 1 or more", *from)
	}
	if *through < *from {
		return usagef("--through: %d, below --from %d; want the end of WAITING FOR, --from itself for a single number", *through, *from)
	}
	d, err := c.openChecked(false)
	if err != nil {
		return err
	}
	defer d.Close()
	in, err := c.inbox(d, 0)
	if err != nil {
		return err
	}
	err = in.SkipGap(c.ctx, *consumer, *key, *from, *through)
	switch {
	case errors.Is(err, outbox.ErrNoHeld):
		return fmt.Errorf("skip-gap: %s holds nothing for key %s: no gap to skip", keyText(*consumer), keyText(*key))
	case errors.Is(err, outbox.ErrGapChanged):
		return fmt.Errorf("skip-gap: nothing skipped: %w (see outboxctl held)", err)
	case err != nil:
		return d.explain(err, sqldialect.InboxSequencesTable)
	}
	skipped := fmt.Sprint(*from)
	if *from < *through {
		skipped = fmt.Sprintf("%d..%d", *from, *through)
	}
	fmt.Fprintf(c.stdout, "%s, key %s: skipped %s; last applied is now %d; the service applies the held messages at its next ApplyHeld or delivery of the key\n",
		keyText(*consumer), keyText(*key), skipped, *through)
	return nil
}

// keyFlag is the key or consumer a --key or --consumer (flag) names, or an
// id retry is given. One held or stuck shows quoted (see keyText), which
// it does for every one that starts with a quote: pasted as shown, it is
// unquoted.
func keyFlag(flag, key string) (string, error) {
	if !strings.HasPrefix(key, `"`) {
		return key, nil
	}
	k, err := strconv.Unquote(key)
	if err != nil {
		return "", usagef("%s %s: starts with a quote but is not quoted as outboxctl shows it (held, stuck): %v", flag, key, err)
	}
	return k, nil
}

// skippedReport is skip-held --json; its names do not change.
type skippedReport struct {
	Consumer  string `json:"consumer"` // as outboxctl held shows it
	Key       string `json:"key"`      // as outboxctl held shows it
	Seq       int64  `json:"seq"`
	MessageID string `json:"message_id"` // quoted where it is not plain text, as Key is
	Payload   []byte `json:"payload"`    // base64
	// PayloadText is the payload as text where it is UTF-8 (a JSON event
	// read as base64 only, a user review), null otherwise.
	PayloadText *string `json:"payload_text"`
	// LastError is its handler's last failure when its turn came, as the
	// inbox wrote it; absent when none was written.
	LastError string `json:"last_error,omitempty"`
	// Metadata is the message's metadata when every key and value of it is
	// UTF-8. Otherwise it is null and MetadataBase64 holds it, as [key,
	// value] pairs, each base64, the form the held row kept it in: a JSON
	// string would hold U+FFFD in place of the other bytes, and this is
	// the message's only copy.
	Metadata       map[string]string `json:"metadata"`
	MetadataBase64 [][2][]byte       `json:"metadata_base64,omitempty"`
	// A part of the held row that could not be decoded is null above and
	// given here as the row held it, in base64 as payload is (it may not be
	// UTF-8), with the reason: payload and payload_encoding, or metadata.
	PayloadError          string `json:"payload_error,omitempty"`
	StoredPayload         []byte `json:"stored_payload,omitempty"`
	StoredPayloadEncoding []byte `json:"stored_payload_encoding,omitempty"`
	MetadataError         string `json:"metadata_error,omitempty"`
	StoredMetadata        []byte `json:"stored_metadata,omitempty"`
}

func newSkippedReport(consumer, key string, seq int64, m outbox.SkippedMessage) skippedReport {
	r := skippedReport{Consumer: keyText(consumer), Key: keyText(key), Seq: seq, MessageID: keyText(m.ID), Payload: m.Payload, Metadata: m.Metadata, LastError: m.LastError}
	if m.PayloadErr == nil && utf8.Valid(m.Payload) {
		text := string(m.Payload)
		r.PayloadText = &text
	}
	text := true
	for k, v := range m.Metadata {
		text = text && utf8.ValidString(k) && utf8.ValidString(v)
	}
	if !text {
		r.Metadata = nil
		// In key order: a map's would print the same message differently
		// each time.
		for _, k := range slices.Sorted(maps.Keys(m.Metadata)) {
			r.MetadataBase64 = append(r.MetadataBase64, [2][]byte{[]byte(k), []byte(m.Metadata[k])})
		}
	}
	if m.PayloadErr != nil {
		r.PayloadError = m.PayloadErr.Error()
		r.StoredPayload, r.StoredPayloadEncoding = []byte(m.StoredPayload), []byte(m.StoredEncoding)
	}
	if m.MetadataErr != nil {
		r.MetadataError, r.StoredMetadata = m.MetadataErr.Error(), []byte(m.StoredMetadata)
	}
	return r
}

func (c *cli) skipHeld(args []string) error {
	const synopsis = "outboxctl skip-held --consumer C --key K --seq N [--park TOPIC [--exchange E]] [--json]"
	fs := c.flagSet("skip-held")
	consumer := fs.String("consumer", "", "the consumer (inbox ConsumerName or router handler name), as outboxctl held shows it")
	key := fs.String("key", "", "the ordering key (aggregateId), as outboxctl held shows it")
	seq := fs.Int64("seq", 0, "the held message to give up on: the key's next, LAST APPLIED+1 in outboxctl held")
	asJSON := fs.Bool("json", false, "print the skipped message, payload (base64) and metadata, for scripts and to resend it by hand")
	park := fs.String("park", "", "also write the message into this database's outbox, to this routing key (a poison topic), before the skip: the relay publishes it there, its key and seq as x-acemq-poisoned-aggregate-id and -seq")
	exchange := fs.String("exchange", "", "with --park: the exchange (default: RabbitMQ's default exchange)")
	rest, err := c.parse(fs, args, synopsis)
	if err != nil {
		return err
	}
	if err := noArgs(fs, rest); err != nil {
		return err
	}
	if *consumer, err = keyFlag("--consumer", *consumer); err != nil {
		return err
	}
	if *key, err = keyFlag("--key", *key); err != nil {
		return err
	}
	if *consumer == "" || *key == "" || *seq == 0 {
		return usagef("skip-held: give --consumer, --key and --seq (%s; see outboxctl held)", synopsis)
	}
	if *seq < 1 {
		return usagef("--seq: %d; want a sequence number, 1 or more", *seq)
	}
	if *exchange != "" && *park == "" {
		return usagef("skip-held: --exchange goes with --park")
	}
	d, err := c.openChecked(*park != "")
	if err != nil {
		return err
	}
	defer d.Close()
	in, err := c.inbox(d, 0)
	if err != nil {
		return err
	}
	// The message is printed before the skip: the held row is its only
	// copy, and a print that failed once the row was deleted (a closed
	// pipe, a full disk) lost it. A print that fails skips nothing; nor
	// does a skip that finds the key moved on meanwhile.
	printed := false
	parked := ""
	_, err = in.SkipHeldKeeping(c.ctx, *consumer, *key, *seq, func(m outbox.SkippedMessage) error {
		if *park != "" {
			// Before the print: a message the outbox refuses is not
			// skipped, and the operator still has --json.
			id, err := c.parkSkipped(d, *consumer, m, *exchange, *park)
			if err != nil {
				return &keepError{fmt.Errorf("--park %s: %w (skip-held --json prints it to keep by hand)", *park, err)}
			}
			parked = id
		}
		if err := c.printSkipped(newSkippedReport(*consumer, *key, *seq, m), *asJSON); err != nil {
			if parked != "" {
				// The parked copy is the one kept: the skip goes on (a
				// code review: it said "nothing skipped", and the relay
				// published the copy of a message still held).
				fmt.Fprintf(c.stderr, "outboxctl: skip-held: the message could not be printed (%v); its copy is kept in %s as %s\n", oneLine(err.Error()), c.g.table, parked)
				return nil
			}
			return &keepError{err}
		}
		printed = true
		return nil
	})
	if err == nil && parked != "" && !*asJSON {
		fmt.Fprintf(c.stdout, "written into %s as %s, to %s: the relay publishes it there\n", c.g.table, parked, printable(*park))
	}
	var kerr *keepError
	switch {
	case err == nil:
		return nil
	case errors.As(err, &kerr) && *park != "" && parked == "":
		return fmt.Errorf("skip-held: nothing skipped: the message could not be parked: %w", kerr.err)
	case errors.As(err, &kerr):
		return fmt.Errorf("skip-held: nothing skipped: the message could not be printed: %w", kerr.err)
	case (errors.Is(err, outbox.ErrNoHeld) || errors.Is(err, outbox.ErrGapChanged)) && parked != "":
		// Applied or moved on between the park and the skip: the copy
		// must not go out as one of a message given up on.
		return fmt.Errorf("skip-held: nothing skipped: %w (see outboxctl held); %s", err, c.unpark(d, parked, *park))
	case errors.Is(err, outbox.ErrNoHeld), errors.Is(err, outbox.ErrGapChanged):
		return fmt.Errorf("skip-held: nothing skipped: %w (see outboxctl held)", err)
	case parked != "":
		return fmt.Errorf("skip-held: the message was parked in %s as %s, and its skip may not have committed (see outboxctl held): %w", c.g.table, parked, err)
	case printed:
		// Failed after the print (the skip's statements, or a commit
		// whose outcome is unknown): the printed copy is the one to keep,
		// skipped or not.
		return fmt.Errorf("skip-held: the message above was printed, and its skip may not have committed (see outboxctl held): %w", err)
	default:
		return d.explain(err, sqldialect.InboxSequencesTable)
	}
}

// keepError is a print of the skipped message that failed.
type keepError struct{ err error }

func (e *keepError) Error() string { return e.err.Error() }

// printSkipped prints the message skip-held skips, which the broker was
// told was handled when it was held: its only copy.
func (c *cli) printSkipped(r skippedReport, asJSON bool) error {
	if asJSON {
		return writeJSON(c.stdout, r)
	}
	encoded := "payload in base64"
	if r.MetadataBase64 != nil {
		encoded = "payload in base64; metadata too, in metadata_base64 as [key, value] pairs: a key or value of it is not UTF-8"
	}
	if r.PayloadError != "" {
		encoded += "; the payload could not be decoded (payload_error): stored_payload and stored_payload_encoding are the row's, in base64"
	}
	if r.MetadataError != "" {
		encoded += "; the metadata could not be decoded (metadata_error): stored_metadata is the row's, in base64"
	}
	if _, err := fmt.Fprintf(c.stdout, "%s, key %s: skipping held message %s (seq %d, %d bytes); once skipped (a failure says so, and exits 1), last applied is %d, and the service applies the messages held behind it at its next ApplyHeld or delivery of the key\n"+
		"The message, its only copy once skipped (%s), to resend it by hand:\n",
		r.Consumer, r.Key, printable(r.MessageID), r.Seq, len(r.Payload), r.Seq, encoded); err != nil {
		return err
	}
	return writeJSON(c.stdout, r)
}

// seqOf is a row's seq as the JSON reports carry it: absent when the
// column is NULL (an unkeyed row's, or a keyed row written without a
// number), so that a NULL is not read as 0.
func seqOf(seq int64, null bool) *int64 {
	if null {
		return nil
	}
	return &seq
}

// seqText is a seq from seqOf as the text reports show it.
func seqText(seq *int64) string {
	if seq == nil {
		return "NULL"
	}
	return strconv.FormatInt(*seq, 10)
}

// keyText is a key (or a consumer, or a stuck row's id) as the table
// shows it: as it is when that says which key it is, else quoted as Go
// quotes it ("k ", "k\xff"). Keys that differ in trailing spaces or in
// bytes a terminal does not show are different keys, and --key must name
// the right one; so are consumers, for --consumer, and ids, for retry.
func keyText(k string) string {
	// A leading "-" is quoted too: given as it is, retry and the others
	// parsed it as a flag (a Java library's negative snowflake id).
	plain := k != "" && utf8.ValidString(k) && strings.TrimSpace(k) == k && !strings.HasPrefix(k, `"`) && !strings.HasPrefix(k, "-")
	for _, r := range k {
		if !unicode.IsPrint(r) || unicode.IsSpace(r) && r != ' ' {
			plain = false
		}
	}
	if plain {
		return k
	}
	return strconv.Quote(k)
}

// parkNamespace is the namespace of parked copies' ids: skip-held --park
// run again after a skip that did not commit writes the same row.
var parkNamespace = uuid.MustParse("0b4f7d1e-5f39-4c2a-8c57-70617263686b")

// parkSkipped writes m, held by consumer, into d's outbox to routing key
// topic on exchange, in a transaction of its own, and returns the copy's
// id: a version 5 UUID of consumer, m's id and topic. Its key and seq go
// as PoisonOutbox's copies carry them, so that the copy is not itself
// ordered (nor held behind the gap it left), with its id as
// x-acemq-poisoned-id.
func (c *cli) parkSkipped(d *database, consumer string, m outbox.SkippedMessage, exchange, topic string) (string, error) {
	if m.PayloadErr != nil || m.MetadataErr != nil {
		return "", errors.New("the held row could not be decoded whole")
	}
	id := uuid.NewSHA1(parkNamespace, []byte(consumer+"\x00"+m.ID+"\x00"+topic)).String()
	msg := message.NewMessage(id, m.Payload)
	for k, v := range m.Metadata {
		switch k {
		case outbox.HeaderMessageID:
		case outbox.HeaderAggregateID:
			msg.Metadata.Set(outbox.PoisonedKeyMetadataKey, v)
		case outbox.HeaderSeq:
			msg.Metadata.Set(outbox.PoisonedSeqMetadataKey, v)
		default:
			msg.Metadata.Set(k, v)
		}
	}
	msg.Metadata.Set(outbox.PoisonedIDMetadataKey, m.ID)
	msg.Metadata.Set("x-acemq-skipped-by", "outboxctl skip-held, consumer "+consumer)
	tx, err := d.db.BeginTx(c.ctx, nil)
	if err != nil {
		return "", err
	}
	defer func() { _ = tx.Rollback() }()
	pub, err := outbox.NewTxPublisher(tx, outbox.TxPublisherConfig{Dialect: d.dialect, Table: c.g.table, Exchange: exchange})
	if err != nil {
		return "", err
	}
	if err := pub.Publish(topic, msg); err != nil {
		return "", err
	}
	return id, tx.Commit()
}

// unpark deletes the parked copy id, unless the relay published it
// already, and says which.
func (c *cli) unpark(d *database, id, topic string) string {
	// Quoted as the park's publisher quotes it: a name that needs it
	// ("OutboxMessages", a reserved word) named another table, and the
	// copy of a message applied stayed pending (a review).
	table, err := sqldialect.QuoteTable(d.sqlDialect(), c.g.table)
	var (
		res sql.Result
		n   int64
	)
	if err == nil {
		q := "DELETE FROM " + table + " WHERE id = ? AND published_at IS NULL"
		if d.kind == kindPostgres {
			q = sqlx.Rebind(sqlx.DOLLAR, q)
		}
		res, err = d.db.ExecContext(c.ctx, q, id)
	}
	if err == nil {
		n, err = res.RowsAffected()
	}
	switch {
	case err != nil:
		return fmt.Sprintf("its parked copy %s in %s could not be deleted (%v): delete it, or drop it from %s once published", id, c.g.table, err, printable(topic))
	case n == 0:
		return fmt.Sprintf("its parked copy %s was published to %s already: drop it there", id, printable(topic))
	}
	return fmt.Sprintf("its parked copy %s is deleted", id)
}
