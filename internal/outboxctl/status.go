package outboxctl

import (
	"encoding/json"
	"fmt"
	"io"
	"math"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/acemq/watermill-outbox/internal/sqldialect"
)

// statusReport is status --json. The field names are a contract with the
// scripts and dashboards that read them: add fields, never rename one.
type statusReport struct {
	Database         string     `json:"database"` // postgres, mysql, sqlite
	Table            string     `json:"table"`
	Pending          int64      `json:"pending"`
	OldestPendingAt  *time.Time `json:"oldest_pending_at"` // null when nothing is pending
	OldestPendingAge float64    `json:"oldest_pending_age_seconds"`
	Stuck            int64      `json:"stuck"`
	MaxAttempts      int        `json:"max_attempts"`
	// Failing: the rows that failed and are not stuck yet, which the relay
	// tries again itself (an unkeyed one holds back the records behind it
	// meanwhile); OldestFailing the oldest of them, null when none.
	Failing           int64       `json:"failing"`
	OldestFailing     *failingRow `json:"oldest_failing"`
	PublishedLastHour int64       `json:"published_last_hour"`
	InboxTable        string      `json:"inbox_table"`
	Processed         *int64      `json:"processed_messages"` // null when the inbox table is not in this database
	// HeldMessages and HeldKeys: the ordered inbox's held messages and the
	// keys holding them, OldestHeldAt the longest-held's; null when this
	// database has no held messages' table (oldest: when none is held).
	HeldMessages *int64     `json:"held_messages"`
	HeldKeys     *int64     `json:"held_keys"`
	OldestHeldAt *time.Time `json:"oldest_held_at"`
	// NotifyTrigger: on PostgreSQL, whether the table's NOTIFY trigger
	// fires, so that a commit wakes a listening relay; null elsewhere.
	NotifyTrigger *bool `json:"notify_trigger"`
	// NotifyQuietMs: on PostgreSQL, how many more milliseconds the trigger
	// stays quiet because a relay is in a flow and polls (0: it notifies);
	// null elsewhere, before migration 0010, and for a role that may not
	// read the sequence.
	NotifyQuietMs *int64 `json:"notify_quiet_ms"`
	// AlsoOnSearchPath: on PostgreSQL, the tables of the outbox's name in
	// the search path's other schemas (schema.table, path order), which a
	// process with another search_path reads and writes under the same
	// name; [] when none, null elsewhere.
	AlsoOnSearchPath []string `json:"also_on_search_path"`
	// NarrowColumns: on MySQL, the outbox's text columns whose character
	// set cannot hold every character, "column (charset)"; [] when none,
	// null elsewhere.
	NarrowColumns []string `json:"narrow_columns"`
}

// failingRow is status's oldest failing row.
type failingRow struct {
	ID        string `json:"id"` // as stuck shows it (keyText)
	Attempts  int    `json:"attempts"`
	LastError string `json:"last_error"`
	// AggregateID is its key, "" for an unkeyed record, which holds the
	// records behind it while it fails, keyed ones too; a keyed one holds
	// only its key's.
	AggregateID string `json:"aggregate_id,omitempty"`
}

func (c *cli) status(args []string) error {
	fs := c.flagSet("status")
	asJSON := fs.Bool("json", false, "print one JSON object, for scripts")
	rest, err := c.parse(fs, args, "outboxctl status [--json]")
	if err != nil {
		return err
	}
	if err := noArgs(fs, rest); err != nil {
		return err
	}
	d, s, err := c.openStore()
	if err != nil {
		return err
	}
	defer d.Close()
	now := time.Now()
	st, err := s.Stats(c.ctx)
	if err != nil {
		return d.explain(err, c.g.table)
	}
	r := statusReport{
		Database: d.kind, Table: c.g.table, Pending: st.Pending, Stuck: st.Stuck,
		MaxAttempts: c.g.maxAttempts, InboxTable: c.g.inboxTable,
	}
	if !st.OldestPending.IsZero() {
		at := st.OldestPending
		r.OldestPendingAt = &at
		r.OldestPendingAge = math.Round(max(0, now.Sub(at).Seconds())*1000) / 1000
	}
	if r.PublishedLastHour, err = s.PublishedSince(c.ctx, now.Add(-time.Hour)); err != nil {
		return d.explain(err, c.g.table)
	}
	// While a record fails, before it is stuck, the rows behind it wait:
	// pending grew and stuck said 0 (a user review found the record only
	// by show of the oldest pending id).
	if r.Failing, err = s.FailingCount(c.ctx); err != nil {
		return d.explain(err, c.g.table)
	}
	if r.Failing > 0 {
		head, err := s.Failing(c.ctx, 1)
		if err != nil {
			return d.explain(err, c.g.table)
		}
		if len(head) > 0 {
			r.OldestFailing = &failingRow{ID: keyText(head[0].ID), Attempts: head[0].Attempts, LastError: head[0].LastError}
			if rec, err := s.Lookup(c.ctx, head[0].ID); err == nil && len(rec) == 1 { // not found: it says less
				r.OldestFailing.AggregateID = rec[0].AggregateID
			}
		}
	}
	if d.kind == kindPostgres {
		fires, err := d.notifyTrigger(c.ctx, c.g.table)
		if err != nil {
			return d.explain(err, c.g.table)
		}
		r.NotifyTrigger = &fires
		if r.NotifyQuietMs, err = d.quietLeft(c.ctx, c.g.table); err != nil {
			return d.explain(err, c.g.table)
		}
		if r.AlsoOnSearchPath, err = d.alsoOnSearchPath(c.ctx, c.g.table); err != nil {
			return d.explain(err, c.g.table)
		}
	}
	if d.kind == kindMySQL {
		if r.NarrowColumns, err = d.narrowColumns(c.ctx, c.g.table); err != nil {
			return d.explain(err, c.g.table)
		}
	}
	// The inbox may live in the consumers' database rather than this one.
	if ok, err := d.hasTable(c.ctx, c.g.inboxTable); err != nil {
		return err
	} else if ok {
		in, err := c.inbox(d, 0)
		if err != nil {
			return err
		}
		n, err := in.Count(c.ctx)
		if err != nil {
			return d.explain(err, c.g.inboxTable)
		}
		r.Processed = &n
	}
	// Keys an ordered inbox holds: status looked healthy with 42 payment
	// keys stopped behind poison messages (a user review).
	if ok, err := d.hasTable(c.ctx, sqldialect.InboxHeldTable); err != nil {
		return err
	} else if ok {
		if err := c.heldStatus(d, &r); err != nil {
			return d.explain(err, sqldialect.InboxHeldTable)
		}
	}
	if *asJSON {
		return writeJSON(c.stdout, r)
	}
	tw := tabwriter.NewWriter(c.stdout, 0, 0, 2, ' ', 0)
	fmt.Fprintf(tw, "table\t%s (%s)\n", r.Table, r.Database)
	fmt.Fprintf(tw, "pending\t%d\n", r.Pending)
	if r.OldestPendingAt == nil {
		fmt.Fprintf(tw, "oldest pending age\t-\n")
	} else {
		fmt.Fprintf(tw, "oldest pending age\t%s (created %s)\n",
			formatAge(time.Duration(r.OldestPendingAge*float64(time.Second))), r.OldestPendingAt.UTC().Format(time.RFC3339))
	}
	if r.OldestFailing == nil {
		fmt.Fprintf(tw, "failing\t%d\n", r.Failing)
	} else {
		// What waits behind it: a user review's status read "failing 1"
		// while 343 records, keyed ones too, waited behind an unroutable
		// unkeyed one.
		holds := "unkeyed: the records behind it wait, keyed ones too, until it goes out or is stuck"
		if f := r.OldestFailing; f.AggregateID != "" {
			holds = "key " + keyText(f.AggregateID) + ": that key's later records wait"
		}
		fmt.Fprintf(tw, "failing\t%d (tried again by the relay; the oldest, %s, at %d of %d attempts: %s; %s; see outboxctl stuck --failing)\n",
			r.Failing, r.OldestFailing.ID, r.OldestFailing.Attempts, r.MaxAttempts, printable(r.OldestFailing.LastError), holds)
	}
	fmt.Fprintf(tw, "stuck\t%d (at %d attempts; see outboxctl stuck)\n", r.Stuck, r.MaxAttempts)
	fmt.Fprintf(tw, "published in the last hour\t%d\n", r.PublishedLastHour)
	if r.NotifyTrigger != nil {
		switch {
		case *r.NotifyTrigger && r.NotifyQuietMs != nil && *r.NotifyQuietMs > 0:
			fmt.Fprintf(tw, "wake-up\tnone for another %d ms: a relay in a flow keeps trigger %s quiet and polls\n", *r.NotifyQuietMs, sqldialect.NotifyTriggerName)
		case *r.NotifyTrigger:
			fmt.Fprintf(tw, "wake-up\tNOTIFY at commit (trigger %s)\n", sqldialect.NotifyTriggerName)
		default:
			fmt.Fprintf(tw, "wake-up\tnone: trigger %s missing or disabled, relays poll adaptively\n", sqldialect.NotifyTriggerName)
		}
	}
	if len(r.NarrowColumns) > 0 {
		fmt.Fprintf(tw, "narrow columns\t%s: a message with a character outside their set (an emoji in utf8mb3) fails to publish; "+
			"convert them to utf8mb4 (README, MySQL)\n", strings.Join(r.NarrowColumns, ", "))
	}
	if len(r.AlsoOnSearchPath) > 0 {
		fmt.Fprintf(tw, "also on the search path\t%s: a service with another search_path uses it under the same name "+
			"(a database split by an earlier migrate? see the CHANGELOG)\n", strings.Join(r.AlsoOnSearchPath, ", "))
	}
	if r.Processed == nil {
		fmt.Fprintf(tw, "%s\t- (no such table in this database)\n", r.InboxTable)
	} else {
		fmt.Fprintf(tw, "%s\t%s\n", r.InboxTable, rows(*r.Processed))
	}
	switch {
	case r.HeldMessages == nil:
	case r.OldestHeldAt == nil:
		fmt.Fprintf(tw, "held (ordered inbox)\t0\n")
	default:
		keys := "keys"
		if *r.HeldKeys == 1 {
			keys = "key"
		}
		fmt.Fprintf(tw, "held (ordered inbox)\t%d on %d %s, the longest for %s: their keys wait (see outboxctl held)\n",
			*r.HeldMessages, *r.HeldKeys, keys, formatAge(now.Sub(*r.OldestHeldAt)))
	}
	return tw.Flush()
}

// heldStatus reads into r the ordered inbox's held messages.
func (c *cli) heldStatus(d *database, r *statusReport) error {
	// The gauges' one statement: with a cutoff no held_at reaches, every
	// key that holds a message counts.
	dialect := d.sqlDialect()
	q := sqldialect.NewOrderedInbox(dialect).HeldStats(time.Now().AddDate(100, 0, 0))
	var held, keys int64
	oldest := sqldialect.NewTime(dialect)
	if err := d.db.QueryRowContext(c.ctx, q.SQL, q.Args...).Scan(&held, &keys, oldest); err != nil {
		return err
	}
	if oldest.Err != nil {
		return fmt.Errorf("the oldest held_at: %w", oldest.Err)
	}
	r.HeldMessages, r.HeldKeys = &held, &keys
	if !oldest.T.IsZero() {
		at := oldest.T.UTC()
		r.OldestHeldAt = &at
	}
	return nil
}

func writeJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}
