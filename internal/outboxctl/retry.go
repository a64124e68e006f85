package outboxctl

import (
	"fmt"
	"strings"
)

func (c *cli) retry(args []string) error {
	fs := c.flagSet("retry")
	all := fs.Bool("all-stuck", false, "retry every stuck row instead of the ids given")
	asJSON := fs.Bool("json", false, `print {"retried": N, "left_alone": [{"id", "state", "why"}...], "last_failed_unroutable": N}, for scripts`)
	ids, err := c.parse(fs, args, "outboxctl retry ID... | outboxctl retry --all-stuck")
	if err != nil {
		return err
	}
	switch {
	case *all && len(ids) > 0:
		return usagef("retry: give ids or --all-stuck, not both")
	case !*all && len(ids) == 0:
		return usagef("retry: give the ids to retry (see outboxctl stuck), or --all-stuck")
	}
	// An id stuck shows quoted (keyText), pasted as shown.
	if ids, err = uniqueIDs("retry", ids); err != nil {
		return err
	}
	d, s, err := c.openStore()
	if err != nil {
		return err
	}
	defer d.Close()
	var (
		n      int64
		before []showRow // the ids' rows before the retry, to say why one was left alone
	)
	if *all {
		if stuck, err := s.Stuck(c.ctx, retryExplained*10); err == nil { // nil: it says less
			for _, r := range stuck {
				before = append(before, showRow{State: "stuck", LastError: r.LastError})
			}
		}
		n, err = s.RetryAllStuck(c.ctx)
	} else {
		before, _ = c.lookupHeld(d, s, ids) // nil: it says less
		n, err = s.Retry(c.ctx, ids...)     // in statements of a bounded number of ids
	}
	if err != nil {
		return d.explain(err, c.g.table)
	}
	// The ids looked up first that the retry left as they were, and why.
	// Retried rows that last failed on routing fail again until the
	// broker is mended, each holding the unkeyed records behind it: a
	// user review's retry --all-stuck of 12 rows, 2 unroutable, stalled
	// the shared table 70 s without a word.
	unroutable := 0
	for _, row := range before {
		if (row.State == "stuck" || row.State == "pending" && row.Attempts > 0) && routingFailure(row.LastError) {
			unroutable++
		}
	}
	var leftAlone []retryLeft
	if !*all && n < int64(len(ids)) {
		for _, row := range before {
			if row.State == "" || row.State == "published" || row.State == "in_flight" || (row.State == "pending" && row.Attempts == 0 && !row.locked) {
				state := row.State
				if !row.Found {
					state = "not_found"
				}
				leftAlone = append(leftAlone, retryLeft{ID: row.ID, State: state, Why: c.why(row)})
			}
		}
	}
	if *asJSON {
		// left_alone: the reasons the text gives (a user review: --json
		// dropped them); [] where no ids were given (--all-stuck).
		if err := writeJSON(c.stdout, retryReport{Retried: n, LeftAlone: append([]retryLeft{}, leftAlone...), Unroutable: unroutable}); err != nil {
			return err
		}
		return notFound("retry", leftAlone, len(ids), c.g.table)
	}
	fmt.Fprintf(c.stdout, "%s made pending again (attempts reset to 0)\n", rows(n))
	if unroutable > 0 && n > 0 {
		fmt.Fprintf(c.stdout, "note: %d of them last failed as unroutable or to a missing exchange (outboxctl show ID): unless a queue is bound or the exchange exists now, "+
			"each fails again up to %d attempts, and an unkeyed one holds the records behind it meanwhile (about 33 s each at the relay's defaults)\n", unroutable, c.g.maxAttempts)
	}
	if *all {
		// What is still stuck was left alone: a relay holds it under a
		// live lease (another library's, or ours in flight on SQLite).
		if st, err := s.Stats(c.ctx); err == nil && st.Stuck > 0 {
			fmt.Fprintf(c.stdout, "%s still stuck: a relay holds them under a live lease (locked_until in the future); retry once it runs out\n", rows(st.Stuck))
		}
	}
	if !*all && n < int64(len(ids)) {
		if before == nil {
			// MySQL counts changed rows only, so a row pending at 0 attempts
			// already is among these too.
			fmt.Fprintf(c.stdout, "%d of the %d ids given: published already, pending already, in flight (a relay's live lease), or not in %s (outboxctl show ID says which)\n",
				int64(len(ids))-n, len(ids), c.g.table)
			return nil
		}
		left := int64(len(ids)) - n
		fmt.Fprintf(c.stdout, "%d of the %d ids given left as they were:\n", left, len(ids))
		for i, l := range leftAlone {
			if i == retryExplained {
				fmt.Fprintf(c.stdout, "  %d more as above (retry --json lists each)\n", len(leftAlone)-i)
				left -= int64(len(leftAlone) - i)
				break
			}
			fmt.Fprintf(c.stdout, "  %s: %s\n", l.ID, l.Why)
			left--
		}
		if left > 0 {
			// Looked up as retry-able, then not changed: a relay took or
			// published them between the look and the retry.
			fmt.Fprintf(c.stdout, "  %d more, changed by a relay between the look and the retry (outboxctl show ID says how)\n", left)
		}
	}
	return notFound("retry", leftAlone, len(ids), c.g.table)
}

// notFound is the exit of a retry that was given ids not in the table: 1,
// so that a script's typo or an id of another database does not pass for
// done (a user review: retry and show exited 0). What is published, pending
// or in flight already is no failure: the retry's aim is met or underway.
func notFound(cmd string, left []retryLeft, given int, table string) error {
	missing := 0
	for _, l := range left {
		if l.State == "not_found" {
			missing++
		}
	}
	return missingIDs(cmd, missing, given, table)
}

// missingIDs is the error of a command given ids of which missing are not
// in table; nil when none.
func missingIDs(cmd string, missing, given int, table string) error {
	switch {
	case missing == 0:
		return nil
	case missing == 1:
		return fmt.Errorf("%s: 1 of the %d ids given is not in %s", cmd, given, table)
	}
	return fmt.Errorf("%s: %d of the %d ids given are not in %s", cmd, missing, given, table)
}

// retryReport is retry --json.
type retryReport struct {
	Retried   int64       `json:"retried"`
	LeftAlone []retryLeft `json:"left_alone"`
	// Unroutable: of the rows retried, those whose last failure was the
	// broker's routing (no queue bound, no such exchange).
	Unroutable int `json:"last_failed_unroutable"`
}

// routingFailure reports whether lastError is a relay's failure to route:
// this library's (UnroutableError, MissingExchangeError) or the broker's
// own words, which another AceMQ library's relay may keep.
func routingFailure(lastError string) bool {
	for _, s := range []string{"unroutable", "NO_ROUTE", "does not exist on the broker", "NOT_FOUND - no exchange"} {
		if strings.Contains(lastError, s) {
			return true
		}
	}
	return false
}

// retryLeft is an id retry left as it was: its state as show --json says
// it ("not_found" for an id not in the table), and why, as the text says.
type retryLeft struct {
	ID    string `json:"id"`
	State string `json:"state"`
	Why   string `json:"why"`
}

// retryExplained is the most ids left alone whose why retry's text prints
// one by one.
const retryExplained = 100

// rows is "1 row" or "n rows".
func rows(n int64) string {
	if n == 1 {
		return "1 row"
	}
	return fmt.Sprintf("%d rows", n)
}
