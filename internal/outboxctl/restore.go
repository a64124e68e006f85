package outboxctl

import (
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill/message/router/middleware"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/rowcodec"
	"github.com/acemq/watermill-outbox/internal/sqldialect"
)

// restore writes a poison copy back into this database's outbox as the
// message it is a copy of: its id, its topic, and a keyed message's key
// and number as the headers aggregateId and seq, which the relay sends as
// they are. Where the message's own record is in another database, purged
// there (a producer cannot tell a message its consumer set aside from one
// it applied, and purges both), the copy in the consumer's outbox is all
// that is left, and a user review republished it by hand with amqp091 to
// free 3,346 messages held behind it.
func (c *cli) restore(args []string) error {
	const synopsis = "outboxctl restore COPY_ID... [--topic T] [--exchange E]"
	fs := c.flagSet("restore")
	topic := fs.String("topic", "", "the routing key to send the message to (default: the copy's topic_poisoned, the topic it was consumed from)")
	exchange := fs.String("exchange", "", "the exchange to send it to (default: the copy's)")
	ids, err := c.parse(fs, args, synopsis)
	if err != nil {
		return err
	}
	if len(ids) == 0 {
		return usagef("restore: give the ids of the poison copies to write back as their messages (%s)", synopsis)
	}
	if ids, err = uniqueIDs("restore", ids); err != nil {
		return err
	}
	d, s, err := c.openStore()
	if err != nil {
		return err
	}
	defer d.Close()
	copies, err := c.lookupRows(s, ids)
	if err != nil {
		return d.explain(err, c.g.table)
	}
	byID := map[string]showRow{}
	for i, row := range copies {
		switch {
		case !row.Found:
			return fmt.Errorf("restore: %s is not in %s", row.ID, c.g.table)
		case row.PoisonCopyOf == "":
			return fmt.Errorf("restore: %s is no poison copy (its headers carry no %s); resend sends a record again", row.ID, outbox.PoisonedIDMetadataKey)
		}
		byID[ids[i]] = row
	}
	records, err := c.contents(d, ids, byID)
	if err != nil {
		return err
	}
	o, err := sqldialect.NewOutbox(d.sqlDialect(), c.g.table)
	if err != nil {
		return err
	}
	for _, r := range records {
		row, err := c.restoredRow(r, *topic, *exchange)
		if err != nil {
			return fmt.Errorf("restore: %s: %w", r.ID, err)
		}
		if there, err := s.Lookup(c.ctx, row.ID); err != nil {
			return d.explain(err, c.g.table)
		} else if len(there) > 0 {
			return fmt.Errorf("restore: %s: its message %s has its record in %s: outboxctl resend %s sends it again", r.ID, keyText(row.ID), c.g.table, keyText(row.ID))
		}
		q := o.Insert([]sqldialect.Row{row})
		if _, err := d.db.ExecContext(c.ctx, q.SQL, q.Args...); err != nil {
			return d.explain(fmt.Errorf("restore: %s: %w", r.ID, err), c.g.table)
		}
		key := ""
		if k, ok := r.headers()[outbox.PoisonedKeyMetadataKey]; ok {
			key = fmt.Sprintf(", key %v seq %v", k, r.headers()[outbox.PoisonedSeqMetadataKey])
		}
		fmt.Fprintf(c.stdout, "%s: written into %s as its message %s, to %s / %s%s: the relay publishes it\n",
			r.ID, c.g.table, keyText(row.ID), printable(exchangeText(row.Exchange)), printable(row.RoutingKey), key)
	}
	return nil
}

// headers is r's headers as a JSON object, nil where they are not one.
func (r discardedRecord) headers() map[string]any {
	raw, ok := r.Headers.(json.RawMessage)
	if !ok {
		return nil
	}
	h, err := rowcodec.DecodeHeaders(string(raw))
	if err != nil {
		return nil
	}
	return h
}

// restoredRow is the message copy r is of, as a row of the outbox.
func (c *cli) restoredRow(r discardedRecord, topic, exchange string) (sqldialect.Row, error) {
	h := r.headers()
	if h == nil {
		return sqldialect.Row{}, fmt.Errorf("its headers are not a JSON object the relay reads")
	}
	if r.BodyError != "" {
		return sqldialect.Row{}, fmt.Errorf("its body cannot be decoded: %s", r.BodyError)
	}
	if by, ok := h["x-acemq-skipped-by"]; ok {
		return sqldialect.Row{}, fmt.Errorf("a copy skip-held --park wrote (%v): its key moved past the message, which a consumer would drop as a duplicate", by)
	}
	id, _ := h[outbox.PoisonedIDMetadataKey].(string)
	if topic == "" {
		topic, _ = h[middleware.PoisonedTopicKey].(string)
	}
	if topic == "" {
		return sqldialect.Row{}, fmt.Errorf("its headers name no topic (%s): give --topic", middleware.PoisonedTopicKey)
	}
	if exchange == "" {
		exchange = r.Exchange
	}
	out := map[string]any{}
	for k, v := range h {
		switch {
		case k == outbox.PoisonedIDMetadataKey, k == middleware.ReasonForPoisonedKey, k == middleware.PoisonedTopicKey,
			k == middleware.PoisonedHandlerKey, k == middleware.PoisonedSubscriberKey:
		case k == outbox.PoisonedKeyMetadataKey:
			out[outbox.HeaderAggregateID] = v
		case k == outbox.PoisonedSeqMetadataKey:
			seq, err := strconv.ParseInt(fmt.Sprint(v), 10, 64)
			if err != nil || seq < 1 {
				return sqldialect.Row{}, fmt.Errorf("its %s is %v, not a sequence number", k, v)
			}
			out[outbox.HeaderSeq] = seq // a long integer, as the relay sends a keyed row's
		case strings.HasPrefix(k, "x-acemq-poisoned-header-"):
			out[strings.TrimPrefix(k, "x-acemq-poisoned-header-")] = v
		case strings.HasPrefix(k, "x-acemq-poisoned-"):
			// the copy's own (headers-dropped): not the message's
		default:
			out[k] = v
		}
	}
	if _, keyed := out[outbox.HeaderAggregateID]; keyed != (out[outbox.HeaderSeq] != nil) {
		return sqldialect.Row{}, fmt.Errorf("its headers hold one of %s and %s without the other", outbox.PoisonedKeyMetadataKey, outbox.PoisonedSeqMetadataKey)
	}
	headers, err := json.Marshal(out)
	if err != nil {
		return sqldialect.Row{}, err
	}
	body, encoding := rowcodec.EncodeBody(r.Body)
	return sqldialect.Row{ID: id, Exchange: exchange, RoutingKey: topic, Body: body, BodyEncoding: encoding,
		ContentType: r.ContentType, Headers: string(headers), CreatedAt: time.Now()}, nil
}
