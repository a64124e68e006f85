package outboxctl

import (
	"context"
	"fmt"
	"strings"
	"text/tabwriter"
	"time"
	"unicode"
)

// stuckReport is stuck --json; like status, its names do not change.
type stuckReport struct {
	MaxAttempts int        `json:"max_attempts"`
	Total       int64      `json:"total"` // all stuck rows, of which rows holds up to --limit
	Rows        []stuckRow `json:"rows"`
}

type stuckRow struct {
	// ID is the id as retry takes it: as it is, or quoted as Go quotes it
	// where that would not say which id it is (see keyText): spaces at its
	// ends, characters a terminal does not show, bytes that are not UTF-8
	// (which JSON would carry as U+FFFD), a leading quote (which retry
	// would take for a quoted id: another row's).
	ID         string `json:"id"`
	Exchange   string `json:"exchange"`
	RoutingKey string `json:"routing_key"`
	// AggregateID and Seq: a keyed record's key (as keyText shows it) and
	// number, which hold the key's later records back; absent for an
	// unkeyed record, and Seq for a keyed row whose seq is NULL.
	AggregateID string `json:"aggregate_id,omitempty"`
	Seq         *int64 `json:"seq,omitempty"`
	Attempts    int    `json:"attempts"`
	LastError   string `json:"last_error"`
	// CreatedAt is null for a time no parser of the dialect reads (a row
	// the relay stuck for it), not year 1, which a script's age check
	// read as 2025 years old.
	CreatedAt *time.Time `json:"created_at"`
	// LeasedBy and LeasedUntil: the relay that holds the row under a live
	// lease (one with a higher ceiling, another library's say), which retry
	// leaves alone until LeasedUntil; null when none holds it. LeasedUntil
	// is null too for a lease whose end cannot be read.
	LeasedBy    *string    `json:"leased_by"`
	LeasedUntil *time.Time `json:"leased_until"`
}

func (c *cli) stuck(args []string) error {
	fs := c.flagSet("stuck")
	asJSON := fs.Bool("json", false, "print one JSON object, for scripts")
	limit := fs.Int("limit", 100, "list at most this many rows, oldest first")
	failing := fs.Bool("failing", false, "list the rows that failed and are not stuck yet (the relay tries them again; an unkeyed one holds back the rows behind it)")
	setAside := fs.Bool("set-aside", false, "list the published records a consumer's poison queue set aside, never applied (an inbox with MarkOutboxProcessed on this database noted them); resend sends them again. Reads the whole table")
	rest, err := c.parse(fs, args, "outboxctl stuck [--failing | --set-aside] [--limit N] [--json]")
	if err != nil {
		return err
	}
	if err := noArgs(fs, rest); err != nil {
		return err
	}
	if *limit < 1 {
		return usagef("--limit: %d; want at least 1", *limit)
	}
	if *failing && *setAside {
		return usagef("stuck: give --failing or --set-aside, not both")
	}
	d, s, err := c.openStore()
	if err != nil {
		return err
	}
	defer d.Close()
	list, count, what := s.Stuck, func(ctx context.Context) (int64, error) {
		st, err := s.Stats(ctx)
		return st.Stuck, err
	}, "stuck"
	if *failing {
		list, count, what = s.Failing, s.FailingCount, "failing"
	}
	if *setAside {
		list, count, what = s.SetAside, s.SetAsideCount, "set-aside"
	}
	recs, err := list(c.ctx, *limit)
	if err != nil {
		return d.explain(err, c.g.table)
	}
	total, err := count(c.ctx)
	if err != nil {
		return d.explain(err, c.g.table)
	}
	r := stuckReport{MaxAttempts: c.g.maxAttempts, Total: max(total, int64(len(recs))), Rows: make([]stuckRow, len(recs))}
	leased, keyed := false, false
	for i, rec := range recs {
		r.Rows[i] = stuckRow{ID: keyText(rec.ID), Exchange: rec.Exchange, RoutingKey: rec.RoutingKey,
			Attempts: rec.Attempts, LastError: rec.LastError}
		if !rec.CreatedAt.IsZero() {
			created := rec.CreatedAt.UTC()
			r.Rows[i].CreatedAt = &created
		}
		if rec.AggregateID != "" {
			r.Rows[i].AggregateID, r.Rows[i].Seq, keyed = keyText(rec.AggregateID), seqOf(rec.Seq, rec.SeqNull), true
		}
		if rec.Leased {
			by := rec.LeasedBy
			r.Rows[i].LeasedBy, leased = &by, true
			if !rec.LeasedUntil.IsZero() {
				until := rec.LeasedUntil.UTC()
				r.Rows[i].LeasedUntil = &until
			}
		}
	}
	if *asJSON {
		return writeJSON(c.stdout, r)
	}
	if len(r.Rows) == 0 {
		if *setAside {
			fmt.Fprintln(c.stdout, "no records set aside (none published that a consumer's poison queue set aside, as an inbox with MarkOutboxProcessed on this database notes them)")
			return nil
		}
		if *failing {
			fmt.Fprintf(c.stdout, "no failing rows (none unpublished after failed attempts fewer than %d)\n", r.MaxAttempts)
			return nil
		}
		fmt.Fprintf(c.stdout, "no stuck rows (none unpublished at %d attempts)\n", r.MaxAttempts)
		return nil
	}
	tw := tabwriter.NewWriter(c.stdout, 0, 0, 2, ' ', 0)
	// A lease column only when a relay holds one of them: retry leaves
	// those alone, and this says why and until when.
	lease := func(stuckRow) string { return "" }
	header := "ID\tDESTINATION (EXCHANGE / ROUTING KEY)\tATTEMPTS\tCREATED\tLAST ERROR"
	if leased {
		header = "ID\tDESTINATION (EXCHANGE / ROUTING KEY)\tATTEMPTS\tCREATED\tLEASED BY (UNTIL)\tLAST ERROR"
		lease = func(row stuckRow) string {
			if row.LeasedBy == nil {
				return "-\t"
			}
			by, until := printable(*row.LeasedBy), "?"
			if by == "" {
				by = "(no locked_by)"
			}
			if row.LeasedUntil != nil {
				until = row.LeasedUntil.Format("2006-01-02 15:04:05Z")
			}
			return fmt.Sprintf("%s (%s)\t", by, until)
		}
	}
	// A key column only when one of them is keyed: a stuck keyed record
	// holds its key's later records, which outboxctl held shows waiting.
	key := func(stuckRow) string { return "" }
	if keyed {
		header = strings.Replace(header, "\tATTEMPTS", "\tKEY (SEQ)\tATTEMPTS", 1)
		key = func(row stuckRow) string {
			if row.AggregateID == "" {
				return "-\t"
			}
			return fmt.Sprintf("%s (%s)\t", printable(row.AggregateID), seqText(row.Seq))
		}
	}
	fmt.Fprintln(tw, header)
	for _, row := range r.Rows {
		exchange := exchangeText(row.Exchange)
		// The id as retry takes it: two ids that differ in a trailing
		// space, or in a tab shown as a space, were shown alike, and
		// retry of the id as shown found no row.
		created := "-" // NULL, or no time the driver reads (another library's row)
		if row.CreatedAt != nil {
			created = row.CreatedAt.Format("2006-01-02 15:04:05Z")
		}
		fmt.Fprintf(tw, "%s\t%s / %s\t%s%d\t%s\t%s%s\n", row.ID, printable(exchange), printable(row.RoutingKey),
			key(row), row.Attempts, created, lease(row), printable(row.LastError))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if r.Total > int64(len(r.Rows)) {
		fmt.Fprintf(c.stdout, "%d of %d %s rows shown (--limit %d)\n", len(r.Rows), r.Total, what, *limit)
	}
	if *failing {
		fmt.Fprintf(c.stdout, "the relay tries them again itself, up to %d attempts; outboxctl show ID says more\n", r.MaxAttempts)
		return nil
	}
	if *setAside {
		fmt.Fprintln(c.stdout, "published and never applied: once the cause is fixed, outboxctl resend ID... sends them again (a keyed one's key waits for it: outboxctl held)")
		return nil
	}
	fmt.Fprintln(c.stdout, "outboxctl retry ID... or outboxctl retry --all-stuck makes them pending again (in a shell, an id shown quoted goes in single quotes: retry '\"ord-1 \"')")
	return nil
}

// printable keeps a value written by any library, or a broker's error
// text, on its line of the table and out of the terminal's control: tabs,
// newlines and escapes become spaces.
func printable(s string) string {
	return strings.Map(func(r rune) rune {
		if unicode.IsControl(r) {
			return ' '
		}
		return r
	}, s)
}
