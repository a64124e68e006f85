package outboxctl

import (
	"fmt"
)

// resendReport is resend --json; its names do not change.
type resendReport struct {
	Resent    int64       `json:"resent"`
	LeftAlone []retryLeft `json:"left_alone"`
}

func (c *cli) resend(args []string) error {
	const synopsis = "outboxctl resend ID... | outboxctl resend --key K --seq N"
	fs := c.flagSet("resend")
	key := fs.String("key", "", "the ordering key (aggregateId) of the record to resend, with --seq: the number an ordered inbox waits for (outboxctl held: LAST APPLIED+1)")
	seq := fs.Int64("seq", 0, "with --key: the record's sequence number")
	asJSON := fs.Bool("json", false, `print {"resent": N, "left_alone": [{"id", "state", "why"}...]}, for scripts`)
	ids, err := c.parse(fs, args, synopsis)
	if err != nil {
		return err
	}
	byKey, ids, err := idsOrKey("resend", synopsis, "give the ids of the published records to send again (a poison copy's x-acemq-poisoned-id)", ids, key, *seq)
	if err != nil {
		return err
	}
	d, s, err := c.openStore()
	if err != nil {
		return err
	}
	defer d.Close()
	if byKey {
		if ids, err = c.keySeqID(d, s, "resend", *key, *seq); err != nil {
			return err
		}
	}
	before, err := c.lookupHeld(d, s, ids)
	if err != nil {
		return err
	}
	// A message an ordered inbox of this database holds is applied from
	// the hold, again at each delivery of its key and ApplyHeld: resent
	// while its handler fails, it was set aside a second time, still held
	// (an on-call review). Left alone, as is one an ordered inbox gave up
	// on (skip-held, skip-gap: its key moved past it, and a resend is
	// dropped as a duplicate), and a poison copy (see below).
	var send []string
	for i, row := range before {
		if len(row.Held) == 0 && !row.Skipped && row.PoisonCopyOf == "" {
			send = append(send, ids[i])
		}
	}
	n, err := s.Resend(c.ctx, send...)
	if err != nil {
		return d.explain(err, c.g.table)
	}
	var leftAlone []retryLeft
	for _, row := range before {
		if len(row.Held) > 0 {
			h := row.Held[0]
			leftAlone = append(leftAlone, retryLeft{ID: row.ID, State: "held", Why: fmt.Sprintf("held by %s, key %s seq %d: the ordered inbox applies it from the hold, "+
				"at each delivery of its key and ApplyHeld (outboxctl held shows its handler's error; skip-held gives it up)", printable(h.Consumer), h.Key, h.Seq)})
			continue
		}
		if row.Skipped {
			// Its key moved past it at the skip: resent, it was dropped as
			// a duplicate, and the resend took the note that says so.
			leftAlone = append(leftAlone, retryLeft{ID: row.ID, State: "skipped", Why: printable(row.LastError) + " (an ordered inbox gave it up at skip-held or skip-gap)"})
			continue
		}
		if row.PoisonCopyOf != "" && row.State == "published" {
			// Sent again, a copy goes back to the poison topic, not to the
			// consumer: the set-aside note shows its id beside the
			// message's, easily taken for it.
			leftAlone = append(leftAlone, retryLeft{ID: row.ID, State: "poison_copy", Why: fmt.Sprintf("a poison copy of %s (x-acemq-poisoned-id), which a resend sends to the poison topic again: outboxctl resend %s sends the message to its consumer", row.PoisonCopyOf, row.PoisonCopyOf)})
			continue
		}
		if row.State != "published" {
			state := row.State
			if !row.Found {
				state = "not_found"
			}
			leftAlone = append(leftAlone, retryLeft{ID: row.ID, State: state, Why: c.why(row) + resendHint(state)})
		}
	}
	if *asJSON {
		if err := writeJSON(c.stdout, resendReport{Resent: n, LeftAlone: append([]retryLeft{}, leftAlone...)}); err != nil {
			return err
		}
		return notFound("resend", leftAlone, len(ids), c.g.table)
	}
	fmt.Fprintf(c.stdout, "%s made pending again (published before; processed mark cleared): the relay sends them again, and a consumer with the inbox runs each only if it never processed it\n", rows(n))
	c.printLeftAlone("resend", leftAlone, int64(len(ids))-n, len(ids))
	return notFound("resend", leftAlone, len(ids), c.g.table)
}

// printLeftAlone prints that left of the given ids were left as they were,
// and why for the first retryExplained of leftAlone.
func (c *cli) printLeftAlone(cmd string, leftAlone []retryLeft, left int64, given int) {
	if left <= 0 {
		return
	}
	fmt.Fprintf(c.stdout, "%d of the %d ids given left as they were:\n", left, given)
	for i, l := range leftAlone {
		if i == retryExplained {
			fmt.Fprintf(c.stdout, "  %d more as above (%s --json lists each)\n", len(leftAlone)-i, cmd)
			break
		}
		fmt.Fprintf(c.stdout, "  %s: %s\n", l.ID, l.Why)
	}
}

// resendHint is what to do instead with a record resend left alone.
func resendHint(state string) string {
	switch state {
	case "pending", "in_flight":
		return " (not published yet: the relay sends it)"
	case "stuck":
		return " (not published: outboxctl retry ID)"
	}
	return ""
}
