package outbox_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testamqp"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// keyedRow is an outbox row as a keyed publish leaves it: its key and
// sequence number set, its created_at chosen by the test (aggregate "" is an
// unkeyed row).
type keyedRow struct {
	id, exchange, routingKey string
	aggregate                string
	seq                      int64
	createdAt                time.Time
}

// insertKeyed writes rows in one transaction, by SQL: the sequence numbers
// are the test's, whatever allocates them at publish.
func insertKeyed(t testing.TB, db *testdb.DB, rows []keyedRow) {
	t.Helper()
	if err := writeKeyed(db, rows); err != nil {
		t.Fatal(err)
	}
}

// writeKeyed is insertKeyed for a goroutine that may not call t.Fatal.
func writeKeyed(db *testdb.DB, rows []keyedRow) error {
	tx, err := db.Beginx()
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback() }()
	q := db.Rebind("INSERT INTO acemq_outbox (id, exchange_name, routing_key, body, body_encoding, content_type, headers, created_at, aggregate_id, seq)" +
		" VALUES (?, ?, ?, ?, 'utf-8', 'text/plain', '{}', ?, ?, ?)")
	for _, r := range rows {
		var created any = r.createdAt.UTC()
		if db.Kind != testdb.Postgres {
			created = r.createdAt.UTC().Format("2006-01-02 15:04:05.000000")
		}
		var aggregate, seq any // NULL: unkeyed
		if r.aggregate != "" {
			aggregate, seq = r.aggregate, r.seq
		}
		if _, err := tx.Exec(q, r.id, r.exchange, r.routingKey, r.id, created, aggregate, seq); err != nil {
			return err
		}
	}
	return tx.Commit()
}

// keyedID is the message id of a key's seq-th record: the consumer reads
// the key and the sequence back from it.
func keyedID(key string, seq int64) string { return fmt.Sprintf("%s#%d", key, seq) }

// runForwarders runs n forwarders over db until the test ends.
func runForwarders(t *testing.T, db *testdb.DB, n int, cfg outbox.ForwarderConfig) []*outbox.Forwarder {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	fs := make([]*outbox.Forwarder, n)
	for i := range fs {
		c := cfg
		c.RelayID = fmt.Sprintf("relay-%d", i)
		fs[i] = newForwarder(t, db, c)
	}
	for _, f := range fs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := f.Run(ctx); err != nil {
				t.Errorf("run: %v", err)
			}
		}()
	}
	t.Cleanup(func() { cancel(); wg.Wait() }) // before the forwarders' Close (cleanups run last first)
	return fs
}

// perKey splits deliveries by key, in arrival order: the sequence numbers
// of each key as they arrived, and the unkeyed ids.
func perKey(t *testing.T, ds []amqp.Delivery) (map[string][]int64, map[string]int) {
	t.Helper()
	keys, unkeyed := map[string][]int64{}, map[string]int{}
	for _, d := range ds {
		key, seq, ok := strings.Cut(d.MessageId, "#")
		if !ok {
			unkeyed[d.MessageId]++
			continue
		}
		var n int64
		if _, err := fmt.Sscan(seq, &n); err != nil {
			t.Fatalf("message id %q: %v", d.MessageId, err)
		}
		keys[key] = append(keys[key], n)
	}
	return keys, unkeyed
}

// inOrderOnce reports what is wrong with a key's arrivals, "" if they are
// 1..n, each once, in order.
func inOrderOnce(seqs []int64, n int) string {
	want := make([]int64, n)
	for i := range want {
		want[i] = int64(i + 1)
	}
	if fmt.Sprint(seqs) != fmt.Sprint(want) {
		return fmt.Sprintf("arrived %v, want %v", seqs, want)
	}
	return ""
}

// Three relays at once, in small pipelined batches, over 200 keys of 10
// records each written in a shuffled created_at order (so most keys' rows
// contradict their sequence, one of them entirely) and unkeyed rows among
// them: a plain consumer sees every key's records once each, in sequence
// order, and every unkeyed record once.
func TestForwarder_ThreeRelays_EachKeyArrivesInSeqOrderExactlyOnce(t *testing.T) {
	t.Parallel()
	const keys, perKeyN, unkeyedN = 200, 10, 100
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		b := testamqp.New(t)
		queue := b.Queue("k")
		var rows []keyedRow
		for k := 0; k < keys; k++ {
			for s := int64(1); s <= perKeyN; s++ {
				key := fmt.Sprintf("key-%03d", k)
				rows = append(rows, keyedRow{id: keyedID(key, s), exchange: b.Exchange, routingKey: "k", aggregate: key, seq: s})
			}
		}
		for i := 0; i < unkeyedN; i++ {
			rows = append(rows, keyedRow{id: fmt.Sprintf("unkeyed-%03d", i), exchange: b.Exchange, routingKey: "k"})
		}
		rng := rand.New(rand.NewPCG(1, 2))
		rng.Shuffle(len(rows), func(i, j int) { rows[i], rows[j] = rows[j], rows[i] })
		base := time.Now().Add(-time.Hour).UTC().Truncate(time.Second)
		for i := range rows {
			rows[i].createdAt = base.Add(time.Duration(i) * time.Millisecond)
		}
		// key-000's created_at runs against its sequence: seq 10 is oldest.
		var reversed []int
		for i := range rows {
			if rows[i].aggregate == "key-000" {
				reversed = append(reversed, i)
			}
		}
		for _, i := range reversed {
			rows[i].createdAt = base.Add(-time.Duration(rows[i].seq) * time.Second)
		}
		insertKeyed(t, db, rows)

		fs := runForwarders(t, db, 3, outbox.ForwarderConfig{BatchSize: 7, PollInterval: 50 * time.Millisecond})
		waitFor(t, 120*time.Second, "every row published", func() bool { return pendingCount(t, fs[0]) == 0 })

		got, unkeyed := perKey(t, b.Drain(queue, len(rows), 10*time.Second))
		for k := 0; k < keys; k++ {
			key := fmt.Sprintf("key-%03d", k)
			if what := inOrderOnce(got[key], perKeyN); what != "" {
				t.Errorf("%s: %s", key, what)
			}
		}
		for i := 0; i < unkeyedN; i++ {
			if id := fmt.Sprintf("unkeyed-%03d", i); unkeyed[id] != 1 {
				t.Errorf("%s arrived %d times, want once", id, unkeyed[id])
			}
		}
	})
}

// A keyed record the broker refuses (unroutable) holds back only the later
// records of its key: the other keys' records and the unkeyed ones all
// arrive although the relay's backoff is an hour (a failure that backed
// the relay off, or stopped its pipeline, would hold them for that hour),
// the refused record is not tried again before its own retry-after (an
// hour too), and its key's later records stay pending. Once it can be
// routed and an operator retries it, its key drains in order.
func TestForwarder_KeyedRecordRefused_HoldsOnlyItsKey_OthersFlowWithoutBackoff(t *testing.T) {
	t.Parallel()
	const keys, perKeyN, unkeyedPerRound = 40, 3, 7
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		b := testamqp.New(t)
		queue := b.Queue("k")
		base := time.Now().Add(-time.Hour).UTC().Truncate(time.Second)
		var (
			rows     []keyedRow
			nUnkeyed int
		)
		add := func(r keyedRow) {
			if r.aggregate == "" {
				nUnkeyed++
			}
			r.createdAt = base.Add(time.Duration(len(rows)) * time.Millisecond)
			rows = append(rows, r)
		}
		// The refused record comes first, its key's next ones right after
		// it, and the other keys interleaved behind them.
		add(keyedRow{id: keyedID("refused", 1), exchange: b.Exchange, routingKey: "nobody.listens", aggregate: "refused", seq: 1})
		for s := int64(1); s <= perKeyN; s++ {
			if s > 1 {
				add(keyedRow{id: keyedID("refused", s), exchange: b.Exchange, routingKey: "k", aggregate: "refused", seq: s})
			}
			for k := 0; k < keys; k++ {
				key := fmt.Sprintf("key-%02d", k)
				add(keyedRow{id: keyedID(key, s), exchange: b.Exchange, routingKey: "k", aggregate: key, seq: s})
			}
			for i := 0; i < unkeyedPerRound; i++ {
				add(keyedRow{id: fmt.Sprintf("unkeyed-%d-%d", s, i), exchange: b.Exchange, routingKey: "k"})
			}
		}
		insertKeyed(t, db, rows)

		fs := runForwarders(t, db, 2, outbox.ForwarderConfig{
			BatchSize: 10, PollInterval: 50 * time.Millisecond, RetryMin: time.Hour, RetryMax: time.Hour,
			OnError: func(error, outbox.ErrorContext) {},
		})
		// Everything but the refused key's three records goes.
		waitFor(t, 60*time.Second, "every other record published", func() bool { return pendingCount(t, fs[0]) == perKeyN })
		ds := b.Drain(queue, len(rows)-perKeyN, 10*time.Second)
		got, unkeyed := perKey(t, ds)
		for k := 0; k < keys; k++ {
			key := fmt.Sprintf("key-%02d", k)
			if what := inOrderOnce(got[key], perKeyN); what != "" {
				t.Errorf("%s: %s", key, what)
			}
		}
		if len(got["refused"]) != 0 {
			t.Errorf("the refused key's records %v arrived before the refused one", got["refused"])
		}
		if len(unkeyed) != nUnkeyed {
			t.Errorf("%d unkeyed records arrived, want %d", len(unkeyed), nUnkeyed)
		}
		if s := stateOf(t, db, keyedID("refused", 1)); s.Published || s.Attempts != 1 || !strings.Contains(s.LastError, "unroutable") {
			t.Errorf("refused record: %+v; want pending after one attempt (its retry is an hour away), last_error unroutable", s)
		}
		for s := int64(2); s <= perKeyN; s++ {
			if st := stateOf(t, db, keyedID("refused", s)); st.Published || st.Attempts != 0 {
				t.Errorf("refused key's record %d: %+v; want pending, never tried", s, st)
			}
		}

		// Routable now, and retried by an operator: the key drains in order.
		b.Bind(queue, "nobody.listens")
		if n, err := fs[0].Store().Retry(context.Background(), keyedID("refused", 1)); n != 1 || err != nil {
			t.Fatalf("retry: %d, %v", n, err)
		}
		waitFor(t, 60*time.Second, "the refused key published", func() bool { return pendingCount(t, fs[0]) == 0 })
		got, _ = perKey(t, b.Drain(queue, perKeyN, 10*time.Second))
		if what := inOrderOnce(got["refused"], perKeyN); what != "" {
			t.Errorf("refused key after the retry: %s", what)
		}
	})
}

// A record whose publish makes the broker close the confirm channel fails
// alone: one to an internal exchange (403, the broker names the exchange).
// (One whose CC header is not an array, as another library may write, was
// the broker's 406, naming nothing; the relay now refuses it unsent, and
// it must fail alone all the same.) Every record unconfirmed on that channel gets a
// nack with the close; charging each an attempt made the poison record
// take the records of other keys down with it, try after try, until all
// were stuck. Keyed, the others flow while the poison record waits out its
// backoff; unkeyed, they wait behind it, as unkeyed records do, and go out
// once it is stuck. Either way none of them is charged an attempt.
func TestForwarder_RecordThatClosesTheChannel_FailsAlone(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name      string
		keyed     bool
		internal  bool   // the poison record goes to an internal exchange
		headers   string // else it carries these headers
		lastError string
	}{
		{"internal exchange, keyed", true, true, "", "internal exchange"},
		{"internal exchange, unkeyed", false, true, "", "internal exchange"},
		{"refused header, keyed", true, false, `{"CC":"not-an-array"}`, `header "CC" of type string`},
		{"refused header, unkeyed", false, false, `{"CC":"not-an-array"}`, `header "CC" of type string`},
	} {
		t.Run(c.name, func(t *testing.T) {
			eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
				b := testamqp.New(t)
				queue := b.Queue("k")
				poisonExchange := b.Exchange
				if c.internal {
					poisonExchange = b.Exchange + "-internal"
					b.With(func(ch *amqp.Channel) error {
						return ch.ExchangeDeclare(poisonExchange, amqp.ExchangeDirect, false, true, true, false, nil)
					})
					t.Cleanup(func() {
						b.With(func(ch *amqp.Channel) error { return ch.ExchangeDelete(poisonExchange, false, false) })
					})
				}
				key := func(k string) string {
					if c.keyed {
						return k
					}
					return ""
				}
				base := time.Now().Add(-time.Hour).UTC().Truncate(time.Second)
				poison := keyedID("poison", 1)
				const n = 20
				var rows []keyedRow
				for i := range n {
					k := fmt.Sprintf("other-%02d", i)
					rows = append(rows, keyedRow{id: keyedID(k, 1), exchange: b.Exchange, routingKey: "k", aggregate: key(k), seq: 1,
						createdAt: base.Add(time.Duration(i+1) * time.Millisecond)})
				}
				// First, or among the others: both ways round the window.
				at := base
				if !c.internal {
					at = base.Add(10*time.Millisecond + 500*time.Microsecond)
				}
				rows = append(rows, keyedRow{id: poison, exchange: poisonExchange, routingKey: "k", aggregate: key("poison"), seq: 1, createdAt: at})
				insertKeyed(t, db, rows)
				if c.headers != "" {
					if _, err := db.Exec(db.Rebind("UPDATE acemq_outbox SET headers = ? WHERE id = ?"), c.headers, poison); err != nil {
						t.Fatal(err)
					}
				}
				relays := runForwarders(t, db, 1, outbox.ForwarderConfig{
					MaxAttempts: 3, RetryMin: 10 * time.Millisecond, RetryMax: 50 * time.Millisecond, PollInterval: 20 * time.Millisecond,
					OnError: func(error, outbox.ErrorContext) {},
				})
				waitFor(t, 30*time.Second, "the poison record stuck", func() bool { return stateOf(t, db, poison).Attempts >= 3 })
				waitFor(t, 30*time.Second, "the others published", func() bool {
					for _, r := range rows[:n] {
						if !stateOf(t, db, r.id).Published {
							return false
						}
					}
					return true
				})
				if s := stateOf(t, db, poison); s.Published || !strings.Contains(s.LastError, c.lastError) {
					t.Errorf("poison record %+v, want unpublished, its last error the refusal (%s)", s, c.lastError)
				}
				for _, r := range rows[:n] {
					if s := stateOf(t, db, r.id); s.Attempts != 0 {
						t.Errorf("record %s: %+v, want no attempt charged", r.id, s)
					}
				}
				// Closed, the relay sends nothing more: the queue holds all
				// that will ever arrive, a late copy of the poison record too.
				if err := relays[0].Close(); err != nil {
					t.Errorf("close the relay: %v", err)
				}
				if got := countIDs(b.Drain(queue, n, 10*time.Second)); len(got) != n {
					t.Errorf("%d distinct records arrived, want %d", len(got), n)
				}
			})
		})
	}
}

// The records a destination did not send behind a keyed failure (here a
// missing exchange) are released with the claim, before the cursor of the
// drain: the next claim goes back to the head for them, rather than leave
// them for the end of the backlog.
func TestForwarder_Run_RecordsReleasedBehindAKeyedFailure_GoOutAtOnce(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		b := testamqp.New(t)
		queue := b.Queue("k")
		const n, batch, failAt = 1500, 20, 104
		t0 := time.Now().Add(-time.Hour)
		var rows []keyedRow
		for i := range n {
			rows = append(rows, keyedRow{id: fmt.Sprintf("row-%04d", i), exchange: b.Exchange, routingKey: "k", createdAt: t0.Add(time.Duration(2*i) * time.Millisecond)})
		}
		rows = append(rows, keyedRow{id: keyedID("k", 1), exchange: b.Exchange + "-missing", routingKey: "k", aggregate: "k", seq: 1,
			createdAt: t0.Add(time.Duration(2*failAt+1) * time.Millisecond)})
		insertKeyed(t, db, rows)
		runForwarders(t, db, 1, outbox.ForwarderConfig{BatchSize: batch, MaxAttempts: 1000, OnError: func(error, outbox.ErrorContext) {}})
		got := b.Drain(queue, n, 30*time.Second)
		if len(got) < n {
			t.Fatalf("%d of %d arrived", len(got), n)
		}
		at := map[string]int{}
		for i, d := range got {
			if _, ok := at[d.MessageId]; !ok {
				at[d.MessageId] = i
			}
		}
		// Released: the records after the failed one in its batch.
		for i := failAt + 1; i < (failAt/batch+1)*batch; i++ {
			if id := rows[i].id; at[id] > 10*batch {
				t.Errorf("%s, released behind the failed record, arrived %dth of %d: left for the end of the drain", id, at[id]+1, n)
			}
		}
	})
}

// A keyed record that makes the broker close the channel, among unkeyed
// records, under the pipelined Run: the records released with the close
// (those after it, and those in flight behind it) go out before any
// claimed later, so the unkeyed records first arrive in created_at order.
// The batch claimed in the same sweep used to overtake them.
func TestForwarder_Run_ChannelClosedOverAKeyedRecord_UnkeyedOrderKept(t *testing.T) {
	t.Parallel()
	// Within a batch, and first in one: a batch whose first record failed
	// and the rest were released counted as clean, and the next batch went
	// down the pipeline ahead of them.
	for _, first := range []bool{false, true} {
		t.Run(map[bool]string{false: "within a batch", true: "first in a batch"}[first], func(t *testing.T) {
			releasedRecordsKeepOrder(t, "closes the channel", "poison", first)
		})
	}
}

// A record the relay cannot send at all (its exchange is missing: the
// confirm channel stays open, and the send stops at it), keyed or not:
// the records of its batch after it are released, and the batches sent
// down the pipeline behind it (claimed after them) used to go out and be
// marked, so the released records first arrived after records created
// after them.
func TestForwarder_Run_SendStoppedAtARecord_ReleasedRecordsNotOvertaken(t *testing.T) {
	t.Parallel()
	for _, key := range []string{"poison", ""} {
		t.Run(map[string]string{"poison": "keyed", "": "unkeyed"}[key], func(t *testing.T) {
			releasedRecordsKeepOrder(t, "missing exchange", key, false)
		})
	}
}

// releasedRecordsKeepOrder drains 600 unkeyed rows with one poison record
// among them, keyed under key unless key is "": to an exchange whose
// publish closes the channel, or to a missing exchange.
func releasedRecordsKeepOrder(t *testing.T, poison, key string, first bool) {
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		b := testamqp.New(t)
		queue := b.Queue("k")
		internal := b.Exchange + "-internal"
		b.With(func(ch *amqp.Channel) error {
			return ch.ExchangeDeclare(internal, amqp.ExchangeDirect, false, true, true, false, nil)
		})
		t.Cleanup(func() { b.With(func(ch *amqp.Channel) error { return ch.ExchangeDelete(internal, false, false) }) })
		const n, poisonAt = 600, 45
		t0 := time.Now().Add(-time.Hour).UTC().Truncate(time.Second)
		var rows []keyedRow
		for i := range n {
			rows = append(rows, keyedRow{id: fmt.Sprintf("row-%04d", i), exchange: b.Exchange, routingKey: "k", createdAt: t0.Add(time.Duration(2*i) * time.Millisecond)})
		}
		at := t0.Add(time.Duration(2*poisonAt+1) * time.Millisecond) // after row 45, within the third batch
		if first {
			at = t0.Add(time.Duration(2*40-1) * time.Millisecond) // before row 40: first in the third batch
		}
		bad := keyedRow{id: keyedID("poison", 1), exchange: internal, routingKey: "k", createdAt: at}
		if poison == "missing exchange" {
			bad.exchange = b.Exchange + "-missing"
		}
		if key != "" {
			bad.aggregate, bad.seq = key, 1
		}
		rows = append(rows, bad)
		insertKeyed(t, db, rows)
		runForwarders(t, db, 1, outbox.ForwarderConfig{BatchSize: 20, MaxAttempts: 3, RetryMin: 10 * time.Millisecond, RetryMax: 50 * time.Millisecond,
			OnError: func(error, outbox.ErrorContext) {}})
		got := b.Drain(queue, n, 30*time.Second)
		seen := map[string]bool{}
		var order []string
		for _, d := range got {
			if !seen[d.MessageId] {
				seen[d.MessageId] = true
				order = append(order, d.MessageId)
			}
		}
		if len(order) < n {
			t.Fatalf("%d of %d arrived", len(order), n)
		}
		inversions := 0
		for i := 1; i < len(order); i++ {
			if order[i] < order[i-1] {
				if inversions < 5 {
					t.Errorf("%s first arrived after %s", order[i], order[i-1])
				}
				inversions++
			}
		}
		if inversions > 0 {
			t.Errorf("%d records first arrived out of created_at order (%d deliveries of %d records)", inversions, len(got), n)
		}
	})
}

// A key's three records at the head of a backlog (an aggregate's events of
// one transaction, drained after an outage): the claims skip its second
// and third while the first is in flight, and the drain, resuming after
// its last claim, left them for the end of the backlog (3,002nd and
// 3,003rd of 3,003). It now goes back for them once the first is
// published.
func TestForwarder_Run_KeysNextRecordsBehindTheCursor_SentSoon(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		b := testamqp.New(t)
		queue := b.Queue("k")
		const n, batch = 3000, 20
		t0 := time.Now().Add(-time.Hour).UTC().Truncate(time.Second)
		var rows []keyedRow
		for s := int64(1); s <= 3; s++ {
			rows = append(rows, keyedRow{id: keyedID("k", s), exchange: b.Exchange, routingKey: "k", aggregate: "k", seq: s, createdAt: t0.Add(time.Duration(s) * time.Microsecond)})
		}
		for i := range n {
			rows = append(rows, keyedRow{id: fmt.Sprintf("row-%04d", i), exchange: b.Exchange, routingKey: "k", createdAt: t0.Add(time.Millisecond + time.Duration(i)*time.Millisecond)})
		}
		insertKeyed(t, db, rows)
		runForwarders(t, db, 1, outbox.ForwarderConfig{BatchSize: batch, MaxBatchSize: batch}) // claims of 20: a pipeline of three in flight
		got := b.Drain(queue, len(rows), 30*time.Second)
		at := map[string]int{}
		for i, d := range got {
			if _, ok := at[d.MessageId]; !ok {
				at[d.MessageId] = i
			}
		}
		if len(at) != len(rows) {
			t.Fatalf("%d of %d arrived", len(at), len(rows))
		}
		if at[keyedID("k", 1)] > at[keyedID("k", 2)] || at[keyedID("k", 2)] > at[keyedID("k", 3)] {
			t.Fatalf("k arrived out of order: %d, %d, %d", at[keyedID("k", 1)], at[keyedID("k", 2)], at[keyedID("k", 3)])
		}
		for s := int64(2); s <= 3; s++ {
			if i := at[keyedID("k", s)]; i > 10*batch {
				t.Errorf("k#%d arrived %dth of %d: left behind the cursor", s, i+1, len(rows))
			}
		}
	})
}
