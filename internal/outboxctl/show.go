package outboxctl

import (
	"context"
	"fmt"
	"io"
	"strings"
	"time"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/rowcodec"
	"github.com/acemq/watermill-outbox/internal/sqldialect"
	"github.com/jmoiron/sqlx"
)

// showRow is show --json's row; like status, its names do not change.
type showRow struct {
	ID    string `json:"id"` // as stuck shows it (keyText)
	Found bool   `json:"found"`
	State string `json:"state,omitempty"` // published, pending, stuck or in_flight
	// Exchange and RoutingKey: "" for the default exchange, as stuck
	// --json has it, rather than left out (a script read null for one
	// record and a name for another); left out for an id not found.
	Exchange    *string    `json:"exchange,omitempty"`
	RoutingKey  *string    `json:"routing_key,omitempty"`
	AggregateID string     `json:"aggregate_id,omitempty"`
	Seq         *int64     `json:"seq,omitempty"` // absent when NULL (seqOf)
	Attempts    int        `json:"attempts"`
	LastError   string     `json:"last_error,omitempty"`
	CreatedAt   *time.Time `json:"created_at,omitempty"`
	PublishedAt *time.Time `json:"published_at,omitempty"`
	ProcessedAt *time.Time `json:"processed_at,omitempty"`
	LeasedBy    *string    `json:"leased_by,omitempty"`
	LeasedUntil *time.Time `json:"leased_until,omitempty"`
	// SetAside: a consumer set its message aside (a poison queue), which
	// marked it processed; last_error says by whom, where and why.
	SetAside bool `json:"set_aside,omitempty"`
	// Skipped: an ordered inbox gave its message up at an operator's word
	// (skip-held, skip-gap), never applied; last_error says by whom.
	Skipped bool `json:"skipped,omitempty"`
	// PoisonCopyOf: the record is a poison copy of that message
	// (x-acemq-poisoned-id), sent to a poison topic, not to its consumer.
	PoisonCopyOf string `json:"poison_copy_of,omitempty"`
	// PoisonCopies: a published record no consumer marked processed whose
	// message has poison copies in the table (PoisonOutbox's, by a
	// consumer without MarkOutboxProcessed): set aside, not applied.
	PoisonCopies []string `json:"poison_copies,omitempty"`
	// setAsideSince: a poison copy was written after the record's last
	// publish (else it was sent again since, a resend).
	setAsideSince bool
	// Held: the ordered inboxes of this database that hold its message,
	// not applied yet, though its record is marked processed.
	Held   []heldBy `json:"held,omitempty"`
	locked bool     // a lease, live or not, which a retry clears
}

// heldBy is an ordered inbox's hold of a record's message.
type heldBy struct {
	Consumer string    `json:"consumer"`
	Key      string    `json:"key"` // as held shows it (keyText)
	Seq      int64     `json:"seq"`
	HeldAt   time.Time `json:"held_at"`
	// LastApplied is the key's: Seq is its next when Seq is one more (its
	// handler failing), else the key waits for an earlier number.
	LastApplied int64 `json:"last_applied"`
	// NextError is, of the key's next, its handler's last failure as the
	// inbox kept it (outboxctl held's next_error), absent if none.
	NextError string `json:"next_error,omitempty"`
}

func (c *cli) show(args []string) error {
	const synopsis = "outboxctl show ID... | outboxctl show --key K --seq N"
	fs := c.flagSet("show")
	asJSON := fs.Bool("json", false, "print a JSON array, one object per id, for scripts")
	key := fs.String("key", "", "the ordering key (aggregateId) of the record to show, with --seq: as outboxctl held shows a key and the number it waits for")
	seq := fs.Int64("seq", 0, "with --key: the record's sequence number")
	ids, err := c.parse(fs, args, synopsis)
	if err != nil {
		return err
	}
	// held gives a key and a number, and show took ids only: a user
	// review looked the id up in SQL for each gap.
	byKey, ids, err := idsOrKey("show", synopsis, "give the ids of the records to show (a message's x-acemq-id)", ids, key, *seq)
	if err != nil {
		return err
	}
	d, s, err := c.openStore()
	if err != nil {
		return err
	}
	defer d.Close()
	if byKey {
		if ids, err = c.keySeqID(d, s, "show", *key, *seq); err != nil {
			return err
		}
	}
	out, err := c.lookupHeld(d, s, ids)
	if err != nil {
		return err
	}
	if err := c.poisonCopiesOf(d, s, out, ids); err != nil {
		return err
	}
	missing := 0
	for _, row := range out {
		if !row.Found {
			missing++
		}
	}
	if *asJSON {
		if err := writeJSON(c.stdout, out); err != nil {
			return err
		}
		return missingIDs("show", missing, len(ids), c.g.table)
	}
	// A pending row may wait behind a failing one: "publishes it at its
	// next claim" sent a user review's on-call away from the record that
	// held it.
	failing, _ := s.FailingCount(c.ctx) // 0 on an error: it says less
	for _, row := range out {
		c.printShow(c.stdout, row, failing)
	}
	return missingIDs("show", missing, len(ids), c.g.table)
}

// poisonCopiesOf names, for each of rows (of ids) published and marked
// processed by no consumer, the poison copies of its message in the table
// (Store.PoisonCopies): show said "not marked processed by a consumer" of a
// message its consumer had set aside, as of one lost in a queue (an on-call
// drill). Read only where there is such a row and an inbox table in the
// database (PoisonOutbox writes its copies into its inbox's database): it
// reads the whole table. A record published again after its last copy was
// written (a resend) is told apart: whether it was applied since, its
// consumer's inbox knows.
func (c *cli) poisonCopiesOf(d *database, s *outbox.Store, rows []showRow, ids []string) error {
	if ok, err := d.hasTable(c.ctx, c.g.inboxTable); err != nil || !ok {
		return err
	}
	var asked []string
	for i, row := range rows {
		if row.State == "published" && row.ProcessedAt == nil {
			asked = append(asked, ids[i], strings.ToLower(ids[i])) // as a uuid column reads it back
		}
	}
	if len(asked) == 0 {
		return nil
	}
	copies, err := s.PoisonCopies(c.ctx, asked...)
	if err != nil {
		return err
	}
	var copyIDs []string
	for _, of := range copies {
		copyIDs = append(copyIDs, of...)
	}
	made := map[string]time.Time{}
	if len(copyIDs) > 0 {
		recs, err := s.Lookup(c.ctx, copyIDs...)
		if err != nil {
			return err
		}
		for _, r := range recs {
			made[r.ID] = r.CreatedAt
		}
	}
	for i := range rows {
		found := copies[ids[i]]
		if lower := strings.ToLower(ids[i]); lower != ids[i] {
			found = append(found, copies[lower]...)
		}
		for _, id := range found {
			rows[i].PoisonCopies = append(rows[i].PoisonCopies, keyText(id))
			if at := made[id]; rows[i].PublishedAt != nil && !at.Before(*rows[i].PublishedAt) {
				rows[i].setAsideSince = true // the copy is of this publish
			}
		}
	}
	return nil
}

// idsOrKey checks a command's ids, or its --key and --seq (a record by
// its key and number), as show and resend take them: byKey says which,
// and ids are the ids given, each once; key is unquoted in place.
func idsOrKey(cmd, synopsis, giveIDs string, ids []string, key *string, seq int64) (byKey bool, _ []string, err error) {
	byKey = *key != "" || seq != 0
	switch {
	case byKey && len(ids) > 0:
		return false, nil, usagef("%s: give ids or --key and --seq, not both", cmd)
	case byKey && (*key == "" || seq < 1):
		return false, nil, usagef("%s: give --key and --seq (at least 1) together (%s)", cmd, synopsis)
	case !byKey && len(ids) == 0:
		return false, nil, usagef("%s: %s, or --key and --seq", cmd, giveIDs)
	case byKey:
		*key, err = keyFlag("--key", *key)
		return true, nil, err
	}
	ids, err = uniqueIDs(cmd, ids)
	return false, ids, err
}

// keySeqID is the id of key's record seq in s's table, as the one id of
// a command given --key and --seq.
func (c *cli) keySeqID(d *database, s *outbox.Store, cmd, key string, seq int64) ([]string, error) {
	id, found, err := s.KeySeqID(c.ctx, key, seq)
	if err != nil {
		return nil, d.explain(err, c.g.table)
	}
	if !found {
		return nil, fmt.Errorf("%s: %s holds no record of key %s seq %d (purged, or written to another database's outbox)", cmd, c.g.table, keyText(key), seq)
	}
	return []string{id}, nil
}

// lookupHeld is lookupRows with the holds of the ids' messages in the
// ordered inbox's table of d, where it has one: a record marked processed
// may be a message an ordered inbox holds, not applied yet, and show said
// "processed" of a payment never applied (a user review).
func (c *cli) lookupHeld(d *database, s *outbox.Store, ids []string) ([]showRow, error) {
	rows, err := c.lookupRows(s, ids)
	if err != nil {
		return nil, d.explain(err, c.g.table)
	}
	// On a failure of the held messages' look, the rows still: retry
	// counts the ids not in the table from them.
	if ok, err := d.hasTable(c.ctx, sqldialect.InboxHeldTable); err != nil {
		return rows, err
	} else if ok {
		if err := heldOf(c.ctx, d, rows, ids); err != nil {
			return rows, d.explain(err, sqldialect.InboxHeldTable)
		}
	}
	return rows, nil
}

// lookupRows is show's rows of ids.
func (c *cli) lookupRows(s *outbox.Store, ids []string) ([]showRow, error) {
	recs, err := s.Lookup(c.ctx, ids...)
	if err != nil {
		return nil, err
	}
	byID := make(map[string]outbox.RecordState, len(recs))
	folded := make(map[string]outbox.RecordState, len(recs))
	for _, r := range recs {
		byID[r.ID] = r
		folded[strings.ToLower(r.ID)] = r
	}
	rows := make([]showRow, len(ids))
	for i, id := range ids {
		r, ok := byID[id]
		if !ok {
			// The row the table found for the id, read back in another
			// form: a PostgreSQL uuid column's lower case, a MySQL _ci
			// collation's stored case. (A character(n) column's padding
			// the lookup drops.)
			r, ok = folded[strings.ToLower(id)]
		}
		rows[i] = c.showRow(id, r, ok)
	}
	return rows, nil
}

// uniqueIDs reads ids as an operator gives them (quoted as stuck shows
// some: see keyText), each once, in the order given.
func uniqueIDs(cmd string, ids []string) ([]string, error) {
	seen := make(map[string]bool, len(ids))
	unique := make([]string, 0, len(ids))
	for _, id := range ids {
		if id == "" {
			return nil, usagef("%s: an empty id", cmd)
		}
		id, err := keyFlag(cmd+": id", id)
		if err != nil {
			return nil, err
		}
		if !seen[id] {
			seen[id] = true
			unique = append(unique, id)
		}
	}
	return unique, nil
}

// showRow is r, the row of id (ok false: none), as show reports it.
func (c *cli) showRow(id string, r outbox.RecordState, ok bool) showRow {
	row := showRow{ID: keyText(id), Found: ok}
	if !ok {
		return row
	}
	at := func(t time.Time) *time.Time {
		if t.IsZero() {
			return nil
		}
		t = t.UTC()
		return &t
	}
	row.Exchange, row.RoutingKey, row.AggregateID, row.Seq = &r.Exchange, &r.RoutingKey, r.AggregateID, seqOf(r.Seq, r.SeqNull)
	row.Attempts, row.LastError, row.locked = r.Attempts, r.LastError, r.Locked
	if r.PoisonedID != "" {
		row.PoisonCopyOf = keyText(r.PoisonedID)
	}
	row.CreatedAt, row.PublishedAt, row.ProcessedAt = at(r.CreatedAt), at(r.PublishedAt), at(r.ProcessedAt)
	switch {
	case r.Published:
		row.State = "published"
		row.SetAside = row.ProcessedAt != nil && strings.HasPrefix(r.LastError, sqldialect.SetAsideNote)
		row.Skipped = row.ProcessedAt != nil && strings.HasPrefix(r.LastError, sqldialect.SkippedNote)
	case r.Leased:
		row.State = "in_flight"
		by := r.LeasedBy
		row.LeasedBy, row.LeasedUntil = &by, at(r.LeasedUntil)
	case r.Attempts >= c.g.maxAttempts:
		row.State = "stuck"
	default:
		row.State = "pending"
	}
	return row
}

// why says, in a line, what row's state means to an operator.
func (c *cli) why(row showRow) string {
	stamp := func(t *time.Time) string {
		if t == nil {
			return "?"
		}
		return t.Format("2006-01-02 15:04:05Z")
	}
	switch row.State {
	case "":
		return "not in " + c.g.table
	case "published":
		processed := "not marked processed by a consumer of this database"
		switch {
		case row.SetAside:
			processed = fmt.Sprintf("%s (%s), not applied: once its cause is fixed, outboxctl resend ID sends it again", printable(row.LastError), stamp(row.ProcessedAt))
		case row.Skipped:
			processed = printable(row.LastError)
		case row.setAsideSince:
			processed = fmt.Sprintf("set aside by a consumer, not applied: its poison copy %s is in this table (a consumer without MarkOutboxProcessed marks no record); "+
				"once its cause is fixed, outboxctl resend ID sends it again", strings.Join(row.PoisonCopies, ", "))
		case len(row.PoisonCopies) > 0:
			processed = fmt.Sprintf("sent again after a consumer set it aside (poison copy %s); not marked processed by a consumer of this database: its consumer's inbox says whether it was applied",
				strings.Join(row.PoisonCopies, ", "))
		case len(row.Held) > 0:
			processed = "marked processed " + stamp(row.ProcessedAt) + " as an ordered inbox held it, not applied yet"
		case row.ProcessedAt != nil:
			processed = "processed " + stamp(row.ProcessedAt)
		}
		return fmt.Sprintf("published %s; %s", stamp(row.PublishedAt), processed)
	case "in_flight":
		by := printable(*row.LeasedBy)
		if by == "" {
			by = "(no locked_by)"
		}
		return fmt.Sprintf("in flight: relay %s holds it under a lease until %s; retry leaves it alone until then", by, stamp(row.LeasedUntil))
	case "stuck":
		return fmt.Sprintf("stuck at %d attempts (the relay leaves it alone; retry makes it pending): %s", row.Attempts, printable(row.LastError))
	}
	if row.Attempts == 0 {
		return "pending: the relay publishes it at its next claim"
	}
	return fmt.Sprintf("pending after %d failed attempts of %d: %s", row.Attempts, c.g.maxAttempts, printable(row.LastError))
}

func (c *cli) printShow(w io.Writer, row showRow, failing int64) {
	why := c.why(row)
	if row.State == "pending" && row.Attempts == 0 && failing > 0 {
		behind := fmt.Sprintf("one of the %d records failing now", failing)
		if failing == 1 {
			behind = "the record failing now"
		}
		why = "pending: the relay publishes it at its next claim, unless it waits behind " + behind +
			" (an unkeyed one holds the records behind it, a keyed one its key's; outboxctl status names the oldest)"
	}
	fmt.Fprintf(w, "%s: %s\n", row.ID, why)
	defer func() {
		for _, h := range row.Held {
			// A user review: "waits for an earlier number" was said of a
			// key's next, held as its handler failed.
			why := fmt.Sprintf("its key waits for an earlier number, %d (outboxctl held)", h.LastApplied+1)
			if h.Seq == h.LastApplied+1 {
				why = "the key's next, its handler failing (outboxctl held shows its error; skip-held gives it up)"
				if h.NextError != "" {
					why = "the key's next, its handler failing: " + printable(h.NextError) + " (skip-held gives it up)"
				}
			}
			fmt.Fprintf(w, "  held by %s, key %s seq %d, since %s: %s\n", printable(h.Consumer), h.Key, h.Seq, h.HeldAt.Format("2006-01-02 15:04:05Z"), why)
		}
	}()
	if !row.Found {
		return
	}
	fmt.Fprintf(w, "  to %s / %s", printable(exchangeText(*row.Exchange)), printable(*row.RoutingKey))
	if row.AggregateID != "" {
		fmt.Fprintf(w, ", key %s seq %s", keyText(row.AggregateID), seqText(row.Seq))
	}
	if row.CreatedAt != nil {
		fmt.Fprintf(w, ", created %s", row.CreatedAt.Format("2006-01-02 15:04:05Z"))
	}
	fmt.Fprintln(w)
	if row.PoisonCopyOf != "" {
		fmt.Fprintf(w, "  a poison copy of %s (x-acemq-poisoned-id): outboxctl show %s tells where the message is, and resend %s sends it to its consumer again\n", row.PoisonCopyOf, row.PoisonCopyOf, row.PoisonCopyOf)
	}
}

// exchangeText is an exchange as outboxctl shows it: RabbitMQ's default
// exchange, "", by name.
func exchangeText(exchange string) string {
	if exchange == "" {
		return "(default)"
	}
	return exchange
}

// sqlDialect is d's dialect, for the statements outboxctl writes itself.
func (d *database) sqlDialect() sqldialect.Dialect {
	return map[string]sqldialect.Dialect{kindPostgres: sqldialect.Postgres, kindMySQL: sqldialect.MySQL, kindSQLite: sqldialect.SQLite}[d.kind]
}

// idsPerStatement bounds the ids of one statement of outboxctl's own:
// its placeholders are bounded (65,535 on PostgreSQL), and a list of ids
// pasted from stuck may be long.
const idsPerStatement = 1000

// heldOf notes in rows, show's rows of ids, the holds of their messages
// in the ordered inbox's table of d (kept under the inbox's key of each
// id: sqldialect.InboxKey).
func heldOf(ctx context.Context, d *database, rows []showRow, ids []string) error {
	dialect := d.sqlDialect()
	byKey := make(map[string][]int, len(ids))
	for i, id := range ids {
		k := sqldialect.InboxKey(id)
		byKey[k] = append(byKey[k], i)
	}
	for start := 0; start < len(ids); start += idsPerStatement {
		chunk := ids[start:min(start+idsPerStatement, len(ids))]
		args := make([]any, len(chunk))
		for i, id := range chunk {
			args[i] = sqldialect.InboxKey(id)
		}
		q := "SELECT h.consumer_name, h.aggregate_id, h.seq, h.held_at, h.message_id, COALESCE(s.last_seq, 0), h.metadata FROM " + sqldialect.InboxHeldTable + " h" +
			" LEFT JOIN " + sqldialect.InboxSequencesTable + " s ON s.consumer_name = h.consumer_name AND s.aggregate_id = h.aggregate_id" +
			" WHERE h.message_id IN (?" + strings.Repeat(", ?", len(chunk)-1) + ") ORDER BY h.consumer_name, h.aggregate_id, h.seq"
		if d.kind == kindPostgres {
			q = sqlx.Rebind(sqlx.DOLLAR, q)
		}
		rs, err := d.db.QueryContext(ctx, q, args...)
		if err != nil {
			return err
		}
		for rs.Next() {
			var h heldBy
			var key, metadata string
			at := sqldialect.NewTime(dialect)
			if err := rs.Scan(&h.Consumer, &h.Key, &h.Seq, at, &key, &h.LastApplied, &metadata); err != nil {
				_ = rs.Close()
				return err
			}
			if md, err := rowcodec.DecodeMetadata(metadata); err == nil && h.Seq == h.LastApplied+1 { // undecodable: it says less
				h.NextError = md[sqldialect.HeldErrorKey]
			}
			h.Key, h.HeldAt = keyText(h.Key), at.T
			for _, i := range byKey[key] {
				rows[i].Held = append(rows[i].Held, h)
			}
		}
		if err := rs.Close(); err != nil {
			return err
		}
	}
	return nil
}
