package outboxctl

import (
	"database/sql"
	"encoding/json"
	"fmt"
	"strings"
	"unicode/utf8"

	"github.com/acemq/watermill-outbox/internal/rowcodec"
	"github.com/acemq/watermill-outbox/internal/sqldialect"
)

// discardReport is discard --json, printed before the delete; its names
// do not change.
type discardReport struct {
	// Records are the stuck records discard deletes, as they were: their
	// only copy.
	Records   []discardedRecord `json:"records"`
	LeftAlone []retryLeft       `json:"left_alone"`
}

// discardedRecord is a stuck record as discard prints it before the delete.
type discardedRecord struct {
	ID          string `json:"id"` // as stuck shows it (keyText)
	Exchange    string `json:"exchange"`
	RoutingKey  string `json:"routing_key"`
	AggregateID string `json:"aggregate_id,omitempty"`
	Seq         *int64 `json:"seq,omitempty"` // absent when NULL (seqOf)
	Attempts    int    `json:"attempts"`
	LastError   string `json:"last_error"`
	ContentType string `json:"content_type"`
	// Headers is the row's headers column as it holds it: JSON where it
	// is, else a string.
	Headers any `json:"headers"`
	// Body is the message's body, base64; BodyText the same as text where
	// it is UTF-8, null otherwise. A body the row's body_encoding does not
	// decode is given as the row holds it, in StoredBody, with the reason.
	Body       []byte  `json:"body"`
	BodyText   *string `json:"body_text"`
	BodyError  string  `json:"body_error,omitempty"`
	StoredBody string  `json:"stored_body,omitempty"`
}

// discard deletes stuck records an operator gives up on, after printing
// each: a foreign row to an exchange that will never be, which kept
// outbox_stuck above 0 and an alert on it firing for good, with no
// command but SQL to end it (a user review).
func (c *cli) discard(args []string) error {
	const synopsis = "outboxctl discard ID... [--json]"
	fs := c.flagSet("discard")
	asJSON := fs.Bool("json", false, `print {"records": [...], "left_alone": [...]} before the delete, for scripts`)
	ids, err := c.parse(fs, args, synopsis)
	if err != nil {
		return err
	}
	if len(ids) == 0 {
		return usagef("discard: give the ids of the stuck records to delete (%s; see outboxctl stuck)", synopsis)
	}
	if ids, err = uniqueIDs("discard", ids); err != nil {
		return err
	}
	d, s, err := c.openStore()
	if err != nil {
		return err
	}
	defer d.Close()
	before, err := c.lookupRows(s, ids)
	if err != nil {
		return d.explain(err, c.g.table)
	}
	var stuck []string
	var leftAlone []retryLeft
	byID := map[string]showRow{}
	for i, row := range before {
		if row.State == "stuck" {
			stuck = append(stuck, ids[i])
			byID[ids[i]] = row
			continue
		}
		state := row.State
		if !row.Found {
			state = "not_found"
		}
		why := c.why(row)
		if row.Found {
			why += " (discard deletes stuck records only)"
		}
		leftAlone = append(leftAlone, retryLeft{ID: row.ID, State: state, Why: why})
	}
	records, err := c.contents(d, stuck, byID)
	if err != nil {
		return err
	}
	// Printed before the delete: the row is the message's only copy, and
	// a print that fails deletes nothing.
	if !*asJSON && len(records) > 0 {
		fmt.Fprintf(c.stdout, "discarding %d stuck records, as they were (keep this: it is their only copy):\n", len(records))
		if err := writeJSON(c.stdout, records); err != nil {
			return err
		}
	}
	if *asJSON {
		if err := writeJSON(c.stdout, discardReport{Records: append([]discardedRecord{}, records...), LeftAlone: append([]retryLeft{}, leftAlone...)}); err != nil {
			return err
		}
	}
	n, err := s.Discard(c.ctx, stuck...)
	if err != nil {
		return d.explain(err, c.g.table)
	}
	if m := int64(len(stuck)) - n; m > 0 {
		fmt.Fprintf(c.stderr, "outboxctl: discard: %d of the stuck records printed were not discarded: retried or claimed meanwhile (outboxctl show)\n", m)
	}
	if *asJSON {
		return notFound("discard", leftAlone, len(ids), c.g.table)
	}
	fmt.Fprintf(c.stdout, "%s discarded\n", rows(n))
	for _, r := range records {
		if r.AggregateID != "" && r.Seq == nil {
			fmt.Fprintf(c.stdout, "key %s seq NULL discarded: a row without a number, which no consumer's ordered inbox waits for\n", keyText(r.AggregateID))
		} else if r.AggregateID != "" {
			fmt.Fprintf(c.stdout, "key %s seq %d discarded: its key's later records go out, and a consumer's ordered inbox waits for the number (outboxctl held on its database; skip-gap gives it up)\n", keyText(r.AggregateID), *r.Seq)
		}
	}
	c.printLeftAlone("discard", leftAlone, int64(len(leftAlone)), len(ids))
	return notFound("discard", leftAlone, len(ids), c.g.table)
}

// contents reads the rows of ids, stuck rows whose show rows are byID.
func (c *cli) contents(d *database, ids []string, byID map[string]showRow) ([]discardedRecord, error) {
	if len(ids) == 0 {
		return nil, nil
	}
	o, err := sqldialect.NewOutbox(d.sqlDialect(), c.g.table)
	if err != nil {
		return nil, err
	}
	var out []discardedRecord
	for start := 0; start < len(ids); start += idsPerStatement {
		q := o.Contents(ids[start:min(start+idsPerStatement, len(ids))])
		rs, err := d.db.QueryContext(c.ctx, q.SQL, q.Args...)
		if err != nil {
			return nil, d.explain(err, c.g.table)
		}
		for rs.Next() {
			var id, exchange, routingKey, body, encoding, contentType, headers sql.NullString // a foreign row's may be NULL
			if err := rs.Scan(&id, &exchange, &routingKey, &body, &encoding, &contentType, &headers); err != nil {
				_ = rs.Close()
				return nil, err
			}
			row := byID[id.String]
			if !row.Found { // the table's form of the id: see lookupRows
				for k, r := range byID {
					if strings.EqualFold(k, id.String) {
						row = r
					}
				}
			}
			r := discardedRecord{ID: keyText(id.String), Exchange: exchange.String, RoutingKey: routingKey.String, AggregateID: row.AggregateID, Seq: row.Seq,
				Attempts: row.Attempts, LastError: row.LastError, ContentType: contentType.String, Headers: headers.String}
			if json.Valid([]byte(headers.String)) {
				r.Headers = json.RawMessage(headers.String)
			}
			if b, err := rowcodec.DecodeBody(body.String, encoding.String); err != nil {
				r.BodyError, r.StoredBody = err.Error(), body.String
			} else {
				r.Body = b
				if utf8.Valid(b) {
					text := string(b)
					r.BodyText = &text
				}
			}
			out = append(out, r)
		}
		if err := rs.Close(); err != nil {
			return nil, err
		}
	}
	return out, nil
}
