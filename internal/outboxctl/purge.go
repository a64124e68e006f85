package outboxctl

import (
	"context"
	"fmt"
	"io"
	"os"
	"time"
)

// purgeReport is purge --json: how many rows each purge deleted, null for
// a purge not asked for.
type purgeReport struct {
	Published *int64 `json:"published_deleted"`
	Processed *int64 `json:"processed_deleted"`
}

func (c *cli) purge(args []string) error {
	fs := c.flagSet("purge")
	published := fs.String("published-older-than", "", "delete outbox rows published longer ago than this (7d, 36h, 90m)")
	processed := fs.String("processed-older-than", "", "delete inbox keys processed longer ago than this; keep them longer than any redelivery can take")
	batch := fs.Int("batch-size", 1000, "rows one DELETE removes, so a purge of millions never holds long locks")
	asJSON := fs.Bool("json", false, "print the counts as one JSON object")
	rest, err := c.parse(fs, args, "outboxctl purge [--published-older-than AGE] [--processed-older-than AGE]")
	if err != nil {
		return err
	}
	if err := noArgs(fs, rest); err != nil {
		return err
	}
	if *published == "" && *processed == "" {
		return usagef("purge: give --published-older-than, --processed-older-than, or both (ages like 7d, 36h or 90m)")
	}
	var pubAge, procAge time.Duration
	for _, f := range []struct {
		name, value string
		age         *time.Duration
	}{{"published-older-than", *published, &pubAge}, {"processed-older-than", *processed, &procAge}} {
		if f.value == "" {
			continue
		}
		age, ok := readAge(f.value)
		if !ok {
			return usagef("--%s: %q is not a duration like 7d, 36h, 90m or 1.5h", f.name, f.value)
		}
		if age < 0 {
			// published_at < now + 5m: every published row.
			return usagef("--%s: %s; want 0 or more", f.name, f.value)
		}
		*f.age = age
	}
	if *batch < 1 {
		return usagef("--batch-size: %d; want at least 1", *batch)
	}
	// Legal, and what a test or a drained staging table wants, but not what
	// a production purge should do by a slip of the unit (a user review:
	// --published-older-than 0s deleted rows no consumer had yet, silently).
	if *published != "" && pubAge < shortAge {
		fmt.Fprintf(c.stderr, "outboxctl: note: --published-older-than %s deletes rows published so lately that a consumer may not have them yet; Republish cannot send a deleted row again\n", *published)
	}
	if *processed != "" && procAge < shortAge {
		fmt.Fprintf(c.stderr, "outboxctl: note: --processed-older-than %s forgets keys so young that a redelivery may still bring their message, which then runs again\n", *processed)
	}

	// A consumer's database may hold the inbox and no outbox.
	d, err := c.openChecked(*published != "")
	if err != nil {
		return err
	}
	defer d.Close()
	// Both tables before either purge: the inbox's missing after the
	// outbox's rows were deleted failed the command with their count
	// unsaid (a producer's database, whose inbox is the consumers').
	if *processed != "" {
		if err := d.requireTable(c.ctx, c.g.inboxTable); err != nil {
			return err
		}
	}
	var r purgeReport
	if *published != "" {
		s, err := c.store(d, *batch)
		if err != nil {
			return err
		}
		what := "published more than " + *published + " ago"
		n, err := c.withProgress(c.g.table+" rows "+what,
			func(ctx context.Context) (int64, error) {
				return s.PublishedBefore(ctx, time.Now().Add(-pubAge))
			},
			func() (int64, error) { return s.PurgePublished(c.ctx, pubAge) })
		if err != nil {
			return fmt.Errorf("purge of %s rows %s stopped after %s: %w", c.g.table, what, rows(n), d.explain(err, c.g.table))
		}
		r.Published = &n
		if !*asJSON {
			fmt.Fprintf(c.stdout, "%s: deleted %s %s\n", c.g.table, rows(n), what)
		}
	}
	if *processed != "" {
		in, err := c.inbox(d, *batch)
		if err != nil {
			return err
		}
		what := "processed more than " + *processed + " ago"
		n, err := c.withProgress(c.g.inboxTable+" rows "+what,
			func(ctx context.Context) (int64, error) {
				return in.ProcessedBefore(ctx, time.Now().Add(-procAge))
			},
			func() (int64, error) { return in.PurgeProcessed(c.ctx, procAge) })
		if err != nil {
			return fmt.Errorf("purge of %s rows %s stopped after %s: %w", c.g.inboxTable, what, rows(n), d.explain(err, c.g.inboxTable))
		}
		r.Processed = &n
		if !*asJSON {
			fmt.Fprintf(c.stdout, "%s: deleted %s %s\n", c.g.inboxTable, rows(n), what)
		}
	}
	if *asJSON {
		return writeJSON(c.stdout, r)
	}
	return nil
}

// shortAge is the purge age below which purge says what it risks.
const shortAge = time.Hour

// progressEvery is how often a purge on a terminal shows how far it got.
const progressEvery = 500 * time.Millisecond

// withProgress runs purge and, when stderr is a terminal, shows how far it
// got: the library's purges delete batch after batch in one call and report
// only the total, so the rows still to delete are counted beside it (one
// COUNT over the published_at or processed_at index each time). Without a
// terminal nothing is counted and nothing shown.
func (c *cli) withProgress(what string, remaining func(context.Context) (int64, error), purge func() (int64, error)) (int64, error) {
	if !isTerminal(c.stderr) {
		return purge()
	}
	total, err := remaining(c.ctx)
	if err != nil || total == 0 {
		return purge()
	}
	type result struct {
		n   int64
		err error
	}
	done := make(chan result, 1)
	go func() {
		n, err := purge()
		done <- result{n, err}
	}()
	tick := time.NewTicker(progressEvery)
	defer tick.Stop()
	show := func(deleted int64) {
		fmt.Fprintf(c.stderr, "\rpurging %s: %d of %d deleted", what, min(max(deleted, 0), total), total)
	}
	show(0)
	for {
		select {
		case r := <-done:
			fmt.Fprint(c.stderr, "\r\033[K") // the final count goes to stdout
			return r.n, r.err
		case <-tick.C:
			if left, err := remaining(c.ctx); err == nil {
				show(total - left)
			}
		}
	}
}

// isTerminal says whether w is a terminal, by the standard library alone: a
// character device that is not /dev/null.
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	fi, err := f.Stat()
	if err != nil || fi.Mode()&os.ModeCharDevice == 0 {
		return false
	}
	if null, err := os.Stat(os.DevNull); err == nil && os.SameFile(fi, null) {
		return false
	}
	return true
}
