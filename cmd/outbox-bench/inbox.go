package main

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// inbox: what the Inbox middleware costs a handler that writes one row.
//
//	baseline: the handler alone: BEGIN; INSERT one effect; COMMIT
//	inbox:    Inbox.Middleware(handler): BEGIN; INSERT the dedupe key into
//	          processed_messages; the handler's INSERT in that transaction
//	          (TxFromContext); COMMIT
//	floor:    BEGIN; INSERT one 36-character key into a table of one column;
//	          INSERT one effect; COMMIT
//	ordered:  an Inbox with Ordered, given keyed messages in their order
//	          (aggregateId over inboxKeys keys, seq 1, 2, … per key): the
//	          inbox's work and the move of the key's last applied, which
//	          locks the key's row: on PostgreSQL folded into the dedupe
//	          key's insert (one statement, as the inbox's), elsewhere one
//	          statement more
//
// The floor is the least any transactional inbox can cost: one more
// statement, so one more round trip. (On MySQL the floor's insert goes with
// its arguments, which go-sql-driver prepares, executes and closes: two
// round trips, where the inbox sends its statements in one; a ratio under
// 1 there is that round trip.) Its key goes in before the effect, as
// the Inbox's does. What the inbox costs over the floor is the library's
// own: its checks, its key of two columns and its processed_at index, the
// timestamp argument, ON CONFLICT DO NOTHING / INSERT IGNORE, RowsAffected.
//
// Every variant is a message.HandlerFunc called directly with a fresh
// message; the time is that of the call alone, not of making the message.
// The three run interleaved on one connection, in rotating order, so that
// noise on this machine, the growth of the tables and any position effect
// fall on all alike. Warm-up iterations are run and discarded.
//
// The default n keeps the scenario under a minute on a 2-core machine whose
// databases commit in about 0.5 ms; pass a smaller -n to a server that
// really syncs to disk on commit.
const (
	inboxDefaultN      = 10000
	inboxDefaultWarmup = 500
	inboxPayloadSize   = 128
	inboxConsumer      = "bench"
	inboxOrderedName   = "bench-ordered"
	inboxKeys          = 1000
)

const (
	inboxVariantBaseline = iota
	inboxVariantMiddleware
	inboxVariantFloor
	inboxVariantOrdered
	inboxVariants
)

var inboxVariantNames = [inboxVariants]string{"baseline", "inbox", "floor", "ordered"}

func runInbox(ctx context.Context, cfg config, out *reporter) error {
	n, warmup := cfg.n, cfg.warmup
	if n == 0 {
		n = inboxDefaultN
	}
	if warmup < 0 {
		warmup = inboxDefaultWarmup
	}
	for _, kind := range cfg.kinds {
		err := withDatabase(ctx, kind, cfg.dir, func(db *testdb.DB, d outbox.Dialect) error {
			return inboxOn(ctx, db, n, warmup, out)
		})
		if err != nil {
			return err
		}
	}
	return nil
}

func inboxOn(ctx context.Context, db *testdb.DB, n, warmup int, out *reporter) error {
	// One connection: every variant pays for the same session, and the
	// numbers are those of a single consumer, not of pool contention.
	db.SetMaxOpenConns(1)
	db.SetMaxIdleConns(1)

	// The handler's business table. A key on message_id: a second effect of
	// one message would fail rather than pass unnoticed.
	if _, err := db.ExecContext(ctx, "CREATE TABLE effects (message_id varchar(64) PRIMARY KEY, note varchar(255) NOT NULL)"); err != nil {
		return fmt.Errorf("creating effects: %w", err)
	}
	if _, err := db.ExecContext(ctx, "CREATE TABLE floor_keys (id varchar(64) PRIMARY KEY)"); err != nil {
		return fmt.Errorf("creating floor_keys: %w", err)
	}
	insertEffect := db.Rebind("INSERT INTO effects (message_id, note) VALUES (?, ?)")
	insertFloor := db.Rebind("INSERT INTO floor_keys (id) VALUES (?)")

	in, err := outbox.NewInbox(db.DB, outbox.InboxConfig{ConsumerName: inboxConsumer})
	if err != nil {
		return fmt.Errorf("new inbox: %w", err)
	}
	ordered, err := outbox.NewInbox(db.DB, outbox.InboxConfig{ConsumerName: inboxOrderedName, Ordered: true})
	if err != nil {
		return fmt.Errorf("new ordered inbox: %w", err)
	}

	// The handler proper, the same for all three: it writes its effect in
	// the transaction it is given.
	effect := func(tx *sqlx.Tx, msg *message.Message) error {
		_, err := tx.ExecContext(msg.Context(), insertEffect, msg.UUID, string(msg.Payload))
		return err
	}
	// ownTx runs effect in a transaction of its own, with extra first.
	ownTx := func(msg *message.Message, extra func(*sqlx.Tx) error) error {
		tx, err := db.BeginTxx(msg.Context(), nil)
		if err != nil {
			return fmt.Errorf("begin: %w", err)
		}
		if extra != nil {
			if err := extra(tx); err != nil {
				_ = tx.Rollback()
				return err
			}
		}
		if err := effect(tx, msg); err != nil {
			_ = tx.Rollback()
			return fmt.Errorf("insert effect: %w", err)
		}
		if err := tx.Commit(); err != nil {
			return fmt.Errorf("commit: %w", err)
		}
		return nil
	}
	handledInInbox := 0
	var handlers [inboxVariants]message.HandlerFunc
	handlers[inboxVariantBaseline] = func(msg *message.Message) ([]*message.Message, error) {
		return nil, ownTx(msg, nil)
	}
	handlers[inboxVariantMiddleware] = in.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		tx, ok := outbox.TxFromContext(msg.Context())
		if !ok {
			return nil, errors.New("no transaction in the message context")
		}
		handledInInbox++
		if err := effect(tx, msg); err != nil {
			return nil, fmt.Errorf("insert effect: %w", err)
		}
		return nil, nil
	})
	handledOrdered := 0
	handlers[inboxVariantOrdered] = ordered.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		tx, ok := outbox.TxFromContext(msg.Context())
		if !ok {
			return nil, errors.New("no transaction in the message context")
		}
		handledOrdered++
		if err := effect(tx, msg); err != nil {
			return nil, fmt.Errorf("insert effect: %w", err)
		}
		return nil, nil
	})
	handlers[inboxVariantFloor] = func(msg *message.Message) ([]*message.Message, error) {
		return nil, ownTx(msg, func(tx *sqlx.Tx) error {
			_, err := tx.ExecContext(msg.Context(), insertFloor, msg.UUID)
			return err
		})
	}

	note("inbox %s: %d warm-up + %d measured iterations per variant", db.Kind, warmup, n)
	var (
		samples  [inboxVariants][]time.Duration
		inboxIDs = make(map[string]bool, warmup+n)
		payload  = inboxPayload()
		start    = time.Now()
		seqs     = make(map[string]int, inboxKeys)
	)
	for v := range samples {
		samples[v] = make([]time.Duration, 0, n)
	}
	for i := 0; i < warmup+n; i++ {
		if err := ctx.Err(); err != nil {
			return err
		}
		// Rotate the order so that each variant takes each position
		// equally often.
		for j := 0; j < inboxVariants; j++ {
			v := (i + j) % inboxVariants
			msg := message.NewMessage(watermill.NewUUID(), payload)
			msg.SetContext(ctx)
			if v == inboxVariantOrdered {
				key := fmt.Sprintf("payment-%d", i%inboxKeys)
				seqs[key]++
				msg.Metadata.Set(outbox.HeaderAggregateID, key)
				msg.Metadata.Set(outbox.HeaderSeq, fmt.Sprint(seqs[key]))
			}
			t0 := time.Now()
			outMsgs, err := handlers[v](msg)
			took := time.Since(t0)
			if err != nil {
				return fmt.Errorf("iteration %d (%s): %w", i, inboxVariantNames[v], err)
			}
			if len(outMsgs) != 0 {
				return fmt.Errorf("iteration %d (%s): %d messages out, want none", i, inboxVariantNames[v], len(outMsgs))
			}
			if v == inboxVariantMiddleware {
				inboxIDs[msg.UUID] = true
			}
			if i >= warmup {
				samples[v] = append(samples[v], took)
			}
		}
	}
	elapsed := time.Since(start)

	if handledOrdered != warmup+n {
		return fmt.Errorf("VERIFY FAILED: the handler ran %d times under the ordered inbox, want %d: messages in order were held or taken for duplicates", handledOrdered, warmup+n)
	}
	if handledInInbox != warmup+n {
		return fmt.Errorf("VERIFY FAILED: the handler ran %d times under the inbox, want %d: fresh messages were taken for duplicates", handledInInbox, warmup+n)
	}
	if err := verifyInbox(ctx, db, warmup+n, inboxIDs); err != nil {
		return err
	}
	note("inbox %s: %d handler calls in %s, processed_messages and effects verified", db.Kind, inboxVariants*(warmup+n), elapsed.Round(time.Millisecond))

	base, mw, floor := samples[inboxVariantBaseline], samples[inboxVariantMiddleware], samples[inboxVariantFloor]
	deltas := make([]time.Duration, len(base))
	deltasFloor := make([]time.Duration, len(base))
	for i := range base {
		deltas[i] = mw[i] - base[i]
		deltasFloor[i] = mw[i] - floor[i]
	}
	baseMed, mwMed, floorMed := quantile(base, 0.5), quantile(mw, 0.5), quantile(floor, 0.5)
	k := db.Kind
	out.metric("inbox_baseline_"+k+"_us", micros(baseMed), "us")
	out.metric("inbox_middleware_"+k+"_us", micros(mwMed), "us")
	out.metric("inbox_overhead_"+k, float64(mwMed)/float64(baseMed), "ratio")
	out.metric("inbox_floor_"+k+"_us", micros(floorMed), "us")
	// A second trivial statement over the baseline: the least any inbox
	// that writes in the handler's transaction can cost here.
	out.metric("inbox_floor_overhead_"+k, float64(floorMed)/float64(baseMed), "ratio")
	out.metric("inbox_overhead_vs_floor_"+k, float64(mwMed)/float64(floorMed), "ratio")
	// Medians of the per-iteration differences: what the middleware adds to
	// the handler, and what it adds over a second statement.
	out.metric("inbox_delta_"+k+"_us", micros(quantile(deltas, 0.5)), "us")
	out.metric("inbox_delta_vs_floor_"+k+"_us", micros(quantile(deltasFloor, 0.5)), "us")
	out.metric("inbox_baseline_"+k+"_p99_us", micros(quantile(base, 0.99)), "us")
	out.metric("inbox_middleware_"+k+"_p99_us", micros(quantile(mw, 0.99)), "us")
	out.metric("inbox_floor_"+k+"_p99_us", micros(quantile(floor, 0.99)), "us")
	orderedMed := quantile(samples[inboxVariantOrdered], 0.5)
	out.metric("inbox_ordered_"+k+"_us", micros(orderedMed), "us")
	out.metric("inbox_ordered_vs_inbox_"+k, float64(orderedMed)/float64(mwMed), "ratio")
	return nil
}

// inboxPayload is the message body, which the handler stores as the
// effect's note: JSON padded to exactly inboxPayloadSize bytes.
func inboxPayload() []byte {
	const head = `{"event":"payment.captured","amount":4999,"currency":"EUR","note":"`
	const tail = `"}`
	return []byte(head + strings.Repeat("x", inboxPayloadSize-len(head)-len(tail)) + tail)
}

// verifyInbox checks that every middleware call left exactly its key, and
// every call of every variant exactly its effect: an inbox that recorded
// nothing would show no overhead at all.
func verifyInbox(ctx context.Context, db *testdb.DB, perVariant int, inboxIDs map[string]bool) error {
	if len(inboxIDs) != perVariant {
		return fmt.Errorf("VERIFY FAILED: %d distinct message ids went through the inbox, want %d", len(inboxIDs), perVariant)
	}
	var effects, floorKeys, processed, joined int
	counts := []struct {
		dst  *int
		what string
		q    string
	}{
		{&effects, "effects", "SELECT COUNT(*) FROM effects"},
		{&floorKeys, "floor_keys", "SELECT COUNT(*) FROM floor_keys"},
		{&processed, "processed_messages", "SELECT COUNT(*) FROM processed_messages WHERE consumer_name = '" + inboxConsumer + "'"},
		{&joined, "processed_messages joined to effects", "SELECT COUNT(*) FROM processed_messages p JOIN effects e ON e.message_id = p.message_id WHERE p.consumer_name = '" + inboxConsumer + "'"},
	}
	for _, c := range counts {
		if err := db.GetContext(ctx, c.dst, c.q); err != nil {
			return fmt.Errorf("counting %s: %w", c.what, err)
		}
	}
	switch {
	case processed != perVariant:
		return fmt.Errorf("VERIFY FAILED: processed_messages has %d rows, want %d (one per middleware call)", processed, perVariant)
	case effects != inboxVariants*perVariant:
		return fmt.Errorf("VERIFY FAILED: effects has %d rows, want %d (one per handler call)", effects, inboxVariants*perVariant)
	case floorKeys != perVariant:
		return fmt.Errorf("VERIFY FAILED: floor_keys has %d rows, want %d", floorKeys, perVariant)
	case joined != perVariant:
		return fmt.Errorf("VERIFY FAILED: %d of %d processed_messages rows have their effect", joined, processed)
	}
	var keys []struct {
		Consumer  string `db:"consumer_name"`
		MessageID string `db:"message_id"`
	}
	if err := db.SelectContext(ctx, &keys, "SELECT consumer_name, message_id FROM processed_messages WHERE consumer_name = '"+inboxConsumer+"'"); err != nil {
		return fmt.Errorf("reading processed_messages: %w", err)
	}
	for _, key := range keys {
		if key.Consumer != inboxConsumer || !inboxIDs[key.MessageID] {
			return fmt.Errorf("VERIFY FAILED: processed_messages holds (%q, %q), which no middleware call recorded", key.Consumer, key.MessageID)
		}
	}
	return nil
}
