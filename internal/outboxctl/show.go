package outboxctl

import (
	"fmt"
	"io"
	"time"

	outbox "github.com/acemq/watermill-outbox"
)

// showRow is show --json's row; like status, its names do not change.
type showRow struct {
	ID          string     `json:"id"` // as stuck shows it (keyText)
	Found       bool       `json:"found"`
	State       string     `json:"state,omitempty"` // published, pending, stuck or in_flight
	Exchange    string     `json:"exchange,omitempty"`
	RoutingKey  string     `json:"routing_key,omitempty"`
	AggregateID string     `json:"aggregate_id,omitempty"`
	Seq         int64      `json:"seq,omitempty"`
	Attempts    int        `json:"attempts"`
	LastError   string     `json:"last_error,omitempty"`
	CreatedAt   *time.Time `json:"created_at,omitempty"`
	PublishedAt *time.Time `json:"published_at,omitempty"`
	ProcessedAt *time.Time `json:"processed_at,omitempty"`
	LeasedBy    *string    `json:"leased_by,omitempty"`
	LeasedUntil *time.Time `json:"leased_until,omitempty"`
	locked      bool       // a lease, live or not, which a retry clears
}

func (c *cli) show(args []string) error {
	fs := c.flagSet("show")
	asJSON := fs.Bool("json", false, "print a JSON array, one object per id, for scripts")
	ids, err := c.parse(fs, args, "outboxctl show ID...")
	if err != nil {
		return err
	}
	if len(ids) == 0 {
		return usagef("show: give the ids of the records to show (a message's x-acemq-id)")
	}
	if ids, err = uniqueIDs("show", ids); err != nil {
		return err
	}
	d, s, err := c.openStore()
	if err != nil {
		return err
	}
	defer d.Close()
	out, err := c.lookupRows(s, ids)
	if err != nil {
		return d.explain(err, c.g.table)
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
	for _, row := range out {
		c.printShow(c.stdout, row)
	}
	return missingIDs("show", missing, len(ids), c.g.table)
}

// lookupRows is show's rows of ids.
func (c *cli) lookupRows(s *outbox.Store, ids []string) ([]showRow, error) {
	recs, err := s.Lookup(c.ctx, ids...)
	if err != nil {
		return nil, err
	}
	byID := make(map[string]outbox.RecordState, len(recs))
	for _, r := range recs {
		byID[r.ID] = r
	}
	rows := make([]showRow, len(ids))
	for i, id := range ids {
		r, ok := byID[id]
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
	row.Exchange, row.RoutingKey, row.AggregateID, row.Seq = r.Exchange, r.RoutingKey, r.AggregateID, r.Seq
	row.Attempts, row.LastError, row.locked = r.Attempts, r.LastError, r.Locked
	row.CreatedAt, row.PublishedAt, row.ProcessedAt = at(r.CreatedAt), at(r.PublishedAt), at(r.ProcessedAt)
	switch {
	case r.Published:
		row.State = "published"
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
		if row.ProcessedAt != nil {
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

func (c *cli) printShow(w io.Writer, row showRow) {
	fmt.Fprintf(w, "%s: %s\n", row.ID, c.why(row))
	if !row.Found {
		return
	}
	exchange := row.Exchange
	if exchange == "" {
		exchange = "(default)"
	}
	fmt.Fprintf(w, "  to %s / %s", printable(exchange), printable(row.RoutingKey))
	if row.AggregateID != "" {
		fmt.Fprintf(w, ", key %s seq %d", keyText(row.AggregateID), row.Seq)
	}
	if row.CreatedAt != nil {
		fmt.Fprintf(w, ", created %s", row.CreatedAt.Format("2006-01-02 15:04:05Z"))
	}
	fmt.Fprintln(w)
}
