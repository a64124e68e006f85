package main

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/rowcodec"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// txpublish: what adding one outbox message costs a business transaction.
//
//	baseline:  BEGIN; INSERT one order; COMMIT
//	candidate: BEGIN; INSERT one order; NewTxPublisher(tx).Publish(one 256-byte message); COMMIT
//	floor:     BEGIN; INSERT one order; INSERT one 36-character key into a table of one column; COMMIT
//	keyed:     the candidate with the message keyed (MetadataAggregateID), 1,000 keys in turn
//	message floor: the floor with the message's bytes: its id, its 256-byte
//	           body and its headers' JSON in a table of those three columns
//	row floor: the candidate's row written by one plain INSERT into
//	           acemq_outbox, without the library: what any writer of the
//	           estate's table pays for its columns, its indexes and (on
//	           PostgreSQL) its NOTIFY trigger
//	keyed row floor: the keyed candidate's row written without the
//	           library, numbered as it numbers it: the key's counter raised
//	           and the row inserted with it, in one statement on PostgreSQL
//	           (a data-modifying CTE), two elsewhere (MySQL has no such CTE
//	           and no RETURNING; SQLite no such CTE)
//
// The floor is what any second statement costs: one more round trip to the
// server (on MySQL two: go-sql-driver prepares, executes and closes a
// statement with arguments, where the publisher sends its statement in
// one, so a ratio under 1 there is that round trip). It separates what the
// outbox costs from what a second statement costs, which on a server whose
// commit is cheap is most of the overhead.
// The message floor is what writing the message itself costs, which any
// outbox pays: over it (txpublish_overhead_vs_message_floor), the outbox row
// is left, its other columns and its pending index, and the library's own
// code. On SQLite, whose commit writes every page a transaction changed,
// bytes and B-trees are the whole cost, and the two floors tell them apart.
//
// keyed against the candidate is what per-aggregate order costs a
// transaction: the key's sequence number, one more statement.
//
// The candidate over the row floor (txpublish_overhead_vs_row_floor) is what
// the library itself adds to writing its row: building it, its statement,
// its checks. The row floor over the floor (txpublish_row_floor_vs_floor) is
// what the table's shape costs, which the library does not choose alone.
// The keyed row floor over the row floor
// (txpublish_keyed_row_floor_vs_row_floor) is what a gapless number per key
// costs any writer of the table, beside txpublish_keyed_vs_unkeyed. On
// MySQL both row floors send their statements with the arguments written
// in, one round trip each, as the publisher does.
//
// The seven run interleaved on one connection, in rotating order, so that
// noise on this machine, the growth of the tables and any position effect
// fall on all alike. Warm-up iterations
// (connection set-up, statement caches, the first pages of each table) are
// run and discarded.
//
// The default n keeps the scenario near half a minute on a 2-core machine
// whose databases commit in about 0.5 ms, and gives the p99 some 100
// samples above it. A server that really syncs to disk on commit is slower:
// pass a smaller -n there.
const (
	txPublishDefaultN      = 10000
	txPublishDefaultWarmup = 500
	txPublishPayloadSize   = 256
	txPublishTopic         = "orders.created"
	txPublishKeys          = 1000
)

func runTxPublish(ctx context.Context, cfg config, out *reporter) error {
	n, warmup := cfg.n, cfg.warmup
	if n == 0 {
		n = txPublishDefaultN
	}
	if warmup < 0 {
		warmup = txPublishDefaultWarmup
	}
	for _, kind := range cfg.kinds {
		err := withDatabase(ctx, kind, cfg.dir, func(db *testdb.DB, d outbox.Dialect) error {
			if err := txPublishOn(ctx, db, n, warmup, out); err != nil || kind != testdb.Postgres {
				return err
			}
			if err := txPublishConcurrent(ctx, db, out); err != nil {
				return err
			}
			return triggerCost(ctx, db, out)
		})
		if err != nil {
			return err
		}
	}
	return nil
}

func txPublishOn(ctx context.Context, db *testdb.DB, n, warmup int, out *reporter) error {
	// One connection: both variants pay for the same session, and the
	// numbers are those of a single request path, not of pool contention.
	db.SetMaxOpenConns(1)
	db.SetMaxIdleConns(1)

	if _, err := db.ExecContext(ctx, ordersDDL(db.Kind)); err != nil {
		return fmt.Errorf("creating orders: %w", err)
	}
	if _, err := db.ExecContext(ctx, "CREATE TABLE floor_keys (id varchar(64) PRIMARY KEY)"); err != nil {
		return fmt.Errorf("creating floor_keys: %w", err)
	}
	if _, err := db.ExecContext(ctx, "CREATE TABLE floor_messages (id varchar(64) PRIMARY KEY, body text NOT NULL, headers text NOT NULL)"); err != nil {
		return fmt.Errorf("creating floor_messages: %w", err)
	}
	insertOrder := db.Rebind("INSERT INTO orders (id, customer, total, created_at) VALUES (?, ?, ?, ?)")
	insertFloor := db.Rebind("INSERT INTO floor_keys (id) VALUES (?)")
	insertMessageFloor := db.Rebind("INSERT INTO floor_messages (id, body, headers) VALUES (?, ?, ?)")
	insertRowFloor := "INSERT INTO acemq_outbox (id, exchange_name, routing_key, body, body_encoding, content_type, headers, created_at)" +
		" VALUES (?, '', ?, ?, 'utf-8', 'application/json', ?, ?)"
	keyedRowFloor := keyedRowFloorSQL(db.Kind)

	note("txpublish %s: %d warm-up + %d measured iterations per variant", db.Kind, warmup, n)
	start := time.Now()
	var (
		baseline  = make([]time.Duration, 0, n)
		candidate = make([]time.Duration, 0, n)
		floor     = make([]time.Duration, 0, n)
		keyedOut  = make([]time.Duration, 0, n)
		msgFloor  = make([]time.Duration, 0, n)
		rowFloor  = make([]time.Duration, 0, n)
		keyedRow  = make([]time.Duration, 0, n)
		published = 0
		lastMsgID string
		lastBody  []byte
	)
	for i := 0; i < warmup+n; i++ {
		if err := ctx.Err(); err != nil {
			return err
		}
		var a, b, c, k, m, r, kr time.Duration
		for _, variant := range rotation(i) {
			o := newOrder(i)
			var (
				took time.Duration
				err  error
			)
			switch variant {
			case variantFloor:
				took, err = orderTx(ctx, db.DB, insertOrder, o, func(tx *sqlx.Tx) error {
					_, err := tx.ExecContext(ctx, insertFloor, o.id)
					return err
				})
				c = took
			case variantMessageFloor:
				msg, headers, herr := floorMessage(o)
				if herr != nil {
					return herr
				}
				took, err = orderTx(ctx, db.DB, insertOrder, o, func(tx *sqlx.Tx) error {
					_, err := tx.ExecContext(ctx, insertMessageFloor, msg.UUID, string(msg.Payload), headers)
					return err
				})
				m = took
			case variantRowFloor:
				msg, headers, herr := floorMessage(o)
				if herr != nil {
					return herr
				}
				took, err = orderTx(ctx, db.DB, insertOrder, o, func(tx *sqlx.Tx) error {
					return execFloor(ctx, tx, db.Kind, insertRowFloor, msg.UUID, txPublishTopic, string(msg.Payload), headers, time.Now().UTC())
				})
				if err == nil {
					published++
				}
				r = took
			case variantKeyedRowFloor:
				msg, headers, herr := floorMessage(o)
				if herr != nil {
					return herr
				}
				key := fmt.Sprintf("customer-%04d", i%txPublishKeys)
				took, err = orderTx(ctx, db.DB, insertOrder, o, func(tx *sqlx.Tx) error {
					if keyedRowFloor.raise != "" {
						if err := execFloor(ctx, tx, db.Kind, keyedRowFloor.raise, key); err != nil {
							return err
						}
					}
					return execFloor(ctx, tx, db.Kind, keyedRowFloor.insert, msg.UUID, txPublishTopic, string(msg.Payload), headers, time.Now().UTC(), key)
				})
				if err == nil {
					published++
				}
				kr = took
			case variantOutbox, variantKeyed:
				msgID := watermill.NewUUID()
				payload := orderPayload(o)
				key := ""
				if variant == variantKeyed {
					key = fmt.Sprintf("customer-%04d", i%txPublishKeys)
				}
				took, err = orderTx(ctx, db.DB, insertOrder, o, func(tx *sqlx.Tx) error {
					return publishOrderCreated(ctx, tx, msgID, payload, o, key)
				})
				if err == nil {
					published++
					lastMsgID, lastBody = msgID, payload
				}
				if variant == variantKeyed {
					k = took
				} else {
					b = took
				}
			default:
				took, err = orderTx(ctx, db.DB, insertOrder, o, nil)
				a = took
			}
			if err != nil {
				return fmt.Errorf("iteration %d (variant %d): %w", i, variant, err)
			}
		}
		if i >= warmup {
			baseline = append(baseline, a)
			candidate = append(candidate, b)
			floor = append(floor, c)
			keyedOut = append(keyedOut, k)
			msgFloor = append(msgFloor, m)
			rowFloor = append(rowFloor, r)
			keyedRow = append(keyedRow, kr)
		}
	}
	elapsed := time.Since(start)

	if err := verifyTxPublish(ctx, db, len(rotation(0))*(warmup+n), published, lastMsgID, lastBody); err != nil {
		return err
	}
	note("txpublish %s: %d transactions in %s, outbox rows verified", db.Kind, len(rotation(0))*(warmup+n), elapsed.Round(time.Millisecond))

	deltas := make([]time.Duration, len(baseline))
	for i := range baseline {
		deltas[i] = candidate[i] - baseline[i]
	}
	baseMed, candMed, floorMed := quantile(baseline, 0.5), quantile(candidate, 0.5), quantile(floor, 0.5)
	k := db.Kind
	out.metric("txpublish_baseline_"+k+"_us", micros(baseMed), "us")
	out.metric("txpublish_outbox_"+k+"_us", micros(candMed), "us")
	out.metric("txpublish_overhead_"+k, float64(candMed)/float64(baseMed), "ratio")
	out.metric("txpublish_floor_"+k+"_us", micros(floorMed), "us")
	// A second trivial statement over the baseline: the least any outbox
	// that writes in the caller's transaction can cost here.
	out.metric("txpublish_floor_overhead_"+k, float64(floorMed)/float64(baseMed), "ratio")
	out.metric("txpublish_overhead_vs_floor_"+k, float64(candMed)/float64(floorMed), "ratio")
	// The median of the per-pair differences: what one message adds to a
	// transaction, robust to noise that hits a pair as a whole.
	out.metric("txpublish_delta_"+k+"_us", micros(quantile(deltas, 0.5)), "us")
	out.metric("txpublish_baseline_"+k+"_p99_us", micros(quantile(baseline, 0.99)), "us")
	out.metric("txpublish_outbox_"+k+"_p99_us", micros(quantile(candidate, 0.99)), "us")
	keyedMed := quantile(keyedOut, 0.5)
	out.metric("txpublish_keyed_"+k+"_us", micros(keyedMed), "us")
	// What the key's sequence number adds to an outbox message.
	out.metric("txpublish_keyed_vs_unkeyed_"+k, float64(keyedMed)/float64(candMed), "ratio")
	// What the outbox costs beyond the message's own bytes: its row's other
	// columns, its pending index, the library's code.
	msgFloorMed := quantile(msgFloor, 0.5)
	out.metric("txpublish_message_floor_"+k+"_us", micros(msgFloorMed), "us")
	out.metric("txpublish_message_floor_vs_floor_"+k, float64(msgFloorMed)/float64(floorMed), "ratio")
	out.metric("txpublish_overhead_vs_message_floor_"+k, float64(candMed)/float64(msgFloorMed), "ratio")
	rowFloorMed := quantile(rowFloor, 0.5)
	out.metric("txpublish_row_floor_"+k+"_us", micros(rowFloorMed), "us")
	out.metric("txpublish_row_floor_vs_floor_"+k, float64(rowFloorMed)/float64(floorMed), "ratio")
	out.metric("txpublish_overhead_vs_row_floor_"+k, float64(candMed)/float64(rowFloorMed), "ratio")
	keyedRowMed := quantile(keyedRow, 0.5)
	out.metric("txpublish_keyed_row_floor_"+k+"_us", micros(keyedRowMed), "us")
	out.metric("txpublish_keyed_row_floor_vs_row_floor_"+k, float64(keyedRowMed)/float64(rowFloorMed), "ratio")
	out.metric("txpublish_keyed_vs_keyed_row_floor_"+k, float64(keyedMed)/float64(keyedRowMed), "ratio")
	return nil
}

const (
	variantBaseline = iota
	variantOutbox
	variantFloor
	variantKeyed
	variantMessageFloor
	variantRowFloor
	variantKeyedRowFloor
)

// rotation gives the order of the seven variants in iteration i, rotating
// so that each takes each position equally often.
func rotation(i int) [7]int {
	var v [7]int
	for j := range v {
		v[j] = (i + j) % len(v)
	}
	return v
}

// ordersDDL is the business table of the bench. MySQL gets datetime(6):
// its timestamp converts through the session time zone and ends in 2038.
func ordersDDL(kind string) string {
	createdAt := "timestamp"
	if kind == testdb.MySQL {
		createdAt = "datetime(6)"
	}
	return `CREATE TABLE orders (
    id         varchar(64)  PRIMARY KEY,
    customer   varchar(255) NOT NULL,
    total      bigint       NOT NULL,
    created_at ` + createdAt + ` NOT NULL
)`
}

type order struct {
	id       string
	customer string
	total    int64
}

func newOrder(i int) order {
	return order{
		id:       watermill.NewUUID(),
		customer: fmt.Sprintf("customer-%05d", i%10000),
		total:    int64(1000 + (i*7919)%100000),
	}
}

// orderPayload is the order-created event, JSON padded to exactly
// txPublishPayloadSize bytes.
func orderPayload(o order) []byte {
	head := fmt.Sprintf(`{"event":"order.created","order_id":%q,"customer":%q,"total":%d,"currency":"EUR","note":"`, o.id, o.customer, o.total)
	const tail = `"}`
	pad := txPublishPayloadSize - len(head) - len(tail)
	if pad < 0 {
		panic("outbox-bench: payload head longer than the payload size")
	}
	return []byte(head + strings.Repeat("x", pad) + tail)
}

// orderTx times one business transaction: BEGIN, INSERT the order, then
// extra (if any) inside the same transaction, COMMIT. It rolls back on error.
func orderTx(ctx context.Context, db *sqlx.DB, insertOrder string, o order, extra func(*sqlx.Tx) error) (time.Duration, error) {
	start := time.Now()
	tx, err := db.BeginTxx(ctx, nil)
	if err != nil {
		return 0, fmt.Errorf("begin: %w", err)
	}
	if _, err := tx.ExecContext(ctx, insertOrder, o.id, o.customer, o.total, time.Now().UTC()); err != nil {
		_ = tx.Rollback()
		return 0, fmt.Errorf("insert order: %w", err)
	}
	if extra != nil {
		if err := extra(tx); err != nil {
			_ = tx.Rollback()
			return 0, err
		}
	}
	if err := tx.Commit(); err != nil {
		return 0, fmt.Errorf("commit: %w", err)
	}
	return time.Since(start), nil
}

// publishOrderCreated is what a service adds to its transaction to announce
// the order: a publisher on the tx, one message, Publish.
// A key other than "" makes it a keyed message.
func publishOrderCreated(ctx context.Context, tx *sqlx.Tx, msgID string, payload []byte, o order, key string) error {
	pub, err := outbox.NewTxPublisher(tx)
	if err != nil {
		return fmt.Errorf("new publisher: %w", err)
	}
	msg := orderMessage(msgID, payload, o, key)
	msg.SetContext(ctx)
	if err := pub.Publish(txPublishTopic, msg); err != nil {
		return fmt.Errorf("publish: %w", err)
	}
	return pub.Close()
}

// orderMessage is the order-created message the bench publishes, keyed by
// key if not empty.
func orderMessage(msgID string, payload []byte, o order, key string) *message.Message {
	msg := message.NewMessage(msgID, payload)
	msg.Metadata.Set(outbox.MetadataContentType, "application/json")
	msg.Metadata.Set("order_id", o.id)
	msg.Metadata.Set("source", "outbox-bench")
	if key != "" {
		msg.Metadata.Set(outbox.MetadataAggregateID, key)
	}
	return msg
}

// verifyTxPublish checks that every committed transaction left its rows:
// a bench of a publisher that writes nothing would show no overhead at all.
func verifyTxPublish(ctx context.Context, db *testdb.DB, wantOrders, wantMessages int, lastID string, lastBody []byte) error {
	var orders, messages int
	if err := db.GetContext(ctx, &orders, "SELECT COUNT(*) FROM orders"); err != nil {
		return fmt.Errorf("counting orders: %w", err)
	}
	if err := db.GetContext(ctx, &messages, "SELECT COUNT(*) FROM acemq_outbox"); err != nil {
		return fmt.Errorf("counting outbox rows: %w", err)
	}
	if orders != wantOrders {
		return fmt.Errorf("VERIFY FAILED: orders has %d rows, want %d", orders, wantOrders)
	}
	if messages != wantMessages {
		return fmt.Errorf("VERIFY FAILED: acemq_outbox has %d rows, want %d (one per committed outbox transaction)", messages, wantMessages)
	}
	// Every key numbered 1..n: a keyed variant that skipped its numbering
	// would look free.
	var keys, gapless int
	if err := db.GetContext(ctx, &keys, "SELECT COUNT(DISTINCT aggregate_id) FROM acemq_outbox"); err != nil {
		return fmt.Errorf("counting keys: %w", err)
	}
	if err := db.GetContext(ctx, &gapless, "SELECT COUNT(*) FROM (SELECT aggregate_id FROM acemq_outbox WHERE aggregate_id IS NOT NULL"+
		" GROUP BY aggregate_id HAVING MIN(seq) = 1 AND MAX(seq) = COUNT(*)) g"); err != nil {
		return fmt.Errorf("checking the keys' numbers: %w", err)
	}
	if keys == 0 || gapless != keys {
		return fmt.Errorf("VERIFY FAILED: %d of %d keys numbered 1..n", gapless, keys)
	}
	var row struct {
		Body         string     `db:"body"`
		BodyEncoding string     `db:"body_encoding"`
		RoutingKey   string     `db:"routing_key"`
		ContentType  string     `db:"content_type"`
		PublishedAt  *time.Time `db:"published_at"`
	}
	q := db.Rebind("SELECT body, body_encoding, routing_key, content_type, published_at FROM acemq_outbox WHERE id = ?")
	if err := db.GetContext(ctx, &row, q, lastID); err != nil {
		return fmt.Errorf("VERIFY FAILED: reading back message %s: %w", lastID, err)
	}
	body, err := rowcodec.DecodeBody(row.Body, row.BodyEncoding)
	switch {
	case err != nil:
		return fmt.Errorf("VERIFY FAILED: message %s: %w", lastID, err)
	case string(body) != string(lastBody):
		return fmt.Errorf("VERIFY FAILED: message %s: body %q, want %q", lastID, body, lastBody)
	case row.RoutingKey != txPublishTopic || row.ContentType != "application/json":
		return fmt.Errorf("VERIFY FAILED: message %s: routing key %q, content type %q", lastID, row.RoutingKey, row.ContentType)
	case row.PublishedAt != nil:
		return fmt.Errorf("VERIFY FAILED: message %s is marked published with no relay running", lastID)
	}
	return nil
}

// floorMessage is the message the floors write without the library: the
// candidate's, and its headers' JSON as the row holds them.
func floorMessage(o order) (*message.Message, string, error) {
	msg := orderMessage(watermill.NewUUID(), orderPayload(o), o, "")
	headers, err := rowcodec.EncodeHeaders(msg.Metadata)
	return msg, headers, err
}

// keyedRowFloorSQL is the keyed row floor's statements on kind: raise (none
// on PostgreSQL) takes the key; insert takes the row's id, routing key,
// body, headers and created_at, then the key.
func keyedRowFloorSQL(kind string) (q struct{ raise, insert string }) {
	const cols = "INSERT INTO acemq_outbox (aggregate_id, id, exchange_name, routing_key, body, body_encoding, content_type, headers, created_at, seq)"
	switch kind {
	case testdb.Postgres:
		q.insert = "WITH s AS (INSERT INTO acemq_outbox_sequences AS s (aggregate_id, last_seq) VALUES ($6, 1)" +
			" ON CONFLICT (aggregate_id) DO UPDATE SET last_seq = s.last_seq + 1 RETURNING aggregate_id, last_seq) " +
			cols + " SELECT aggregate_id, $1, '', $2, $3, 'utf-8', 'application/json', $4, $5, last_seq FROM s"
	case testdb.MySQL:
		q.raise = "INSERT INTO acemq_outbox_sequences (aggregate_id, last_seq) VALUES (?, 1) ON DUPLICATE KEY UPDATE last_seq = last_seq + 1"
		q.insert = cols + " SELECT aggregate_id, ?, '', ?, ?, 'utf-8', 'application/json', ?, ?, last_seq FROM acemq_outbox_sequences WHERE aggregate_id = ?"
	default:
		q.raise = "INSERT INTO acemq_outbox_sequences AS s (aggregate_id, last_seq) VALUES (?, 1) ON CONFLICT (aggregate_id) DO UPDATE SET last_seq = s.last_seq + 1"
		q.insert = cols + " SELECT aggregate_id, ?, '', ?, ?, 'utf-8', 'application/json', ?, ?, last_seq FROM acemq_outbox_sequences WHERE aggregate_id = ?"
	}
	return q
}

// execFloor runs one of the row floors' statements. On MySQL the
// arguments are written into the text, so that it goes in one round trip
// as the publisher's do, not prepared, executed and closed; on PostgreSQL
// "?" becomes "$n".
func execFloor(ctx context.Context, tx *sqlx.Tx, kind, query string, args ...any) error {
	switch kind {
	case testdb.MySQL:
		var b strings.Builder
		for _, a := range args {
			head, tail, ok := strings.Cut(query, "?")
			if !ok {
				return fmt.Errorf("execFloor: more arguments than placeholders in %q", query)
			}
			b.WriteString(head)
			switch v := a.(type) {
			case string:
				fmt.Fprintf(&b, "_utf8mb4 X'%x'", v)
			case time.Time:
				b.WriteString(v.Format("'2006-01-02 15:04:05.000000'"))
			default:
				return fmt.Errorf("execFloor: an argument of type %T", a)
			}
			query = tail
		}
		b.WriteString(query)
		query, args = b.String(), nil
	case testdb.Postgres:
		if !strings.Contains(query, "$1") {
			query = tx.Rebind(query)
		}
	}
	_, err := tx.ExecContext(ctx, query, args...)
	return err
}
