package outbox_test

import (
	"context"
	"database/sql"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/go-sql-driver/mysql"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testamqp"
	"github.com/acemq/watermill-outbox/internal/testdb"
	"github.com/acemq/watermill-outbox/sqlschema"
)

// On MySQL the pipelined relay claims a batch while the one before is in
// flight. Claims that reached rows by different paths once made a mark wait
// for the relay's own next claim (50 s, innodb_lock_wait_timeout); with the
// timeout at 1 s any such wait fails a mark, which OnError reports. Tables
// made with CREATE TABLE … LIKE and from sqlschema's SQL under another name
// pipeline alike; a table without an index on published_at still drains,
// without overlapping claims.
func TestForwarder_MySQL_PipelinedClaims_NeverWaitOnEachOther(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.MySQL)
	migs, err := sqlschema.Migrations("mysql")
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		table   string
		create  []string
		overlap bool
	}{
		{"acemq_outbox", nil, true},
		{"like_outbox", []string{"CREATE TABLE like_outbox LIKE acemq_outbox"}, true},
		// 0001 and 0005's columns (claims read aggregate_id and seq).
		{"renamed_outbox", append([]string{strings.ReplaceAll(migs[0].Up, "acemq_outbox", "renamed_outbox")},
			sqlschema.Statements(strings.ReplaceAll(migs[4].Up, "acemq_outbox", "renamed_outbox"))...), true},
		{"bare_outbox", []string{"CREATE TABLE bare_outbox LIKE acemq_outbox", "ALTER TABLE bare_outbox DROP INDEX acemq_outbox_pending"}, false},
	} {
		t.Run(tc.table, func(t *testing.T) {
			for _, stmt := range tc.create {
				if _, err := db.Exec(stmt); err != nil {
					t.Fatalf("%s: %v", stmt, err)
				}
			}
			cfg, err := mysql.ParseDSN(db.DSN)
			if err != nil {
				t.Fatal(err)
			}
			if cfg.Params == nil {
				cfg.Params = map[string]string{}
			}
			cfg.Params["innodb_lock_wait_timeout"] = "1"
			pool, err := sql.Open("mysql", cfg.FormatDSN())
			if err != nil {
				t.Fatal(err)
			}
			defer pool.Close()
			b := testamqp.New(t)
			queue := b.Queue("pipelined")
			// Rows trickle in one per transaction while the relay runs on a
			// new table: claims meet a few pending rows, where the
			// optimizer's choice of path varies.
			var msgs []*message.Message
			for i := 0; i < 400; i++ {
				msgs = append(msgs, message.NewMessage(watermill.NewUUID(), []byte("x")))
			}

			var errs atomic.Int64
			var firstErr atomic.Value
			dest, err := outbox.NewAMQPDestination(outbox.AMQPConfig{URLs: []string{testdb.AMQPURL()}})
			if err != nil {
				t.Fatal(err)
			}
			f, err := outbox.NewForwarder(pool, dest, outbox.ForwarderConfig{
				Dialect: outbox.MySQL, Table: tc.table, PollInterval: 5 * time.Millisecond,
				OnError: func(err error, _ outbox.ErrorContext) {
					errs.Add(1)
					firstErr.CompareAndSwap(nil, err.Error())
				},
			})
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan error, 1)
			go func() { done <- f.Run(ctx) }()
			for _, m := range msgs {
				publishInTx(t, db, "pipelined", []*message.Message{m}, outbox.TxPublisherConfig{Exchange: b.Exchange, Table: tc.table})
			}
			got := countIDs(b.Drain(queue, len(msgs), 60*time.Second))
			waitFor(t, 30*time.Second, "every row to be marked", func() bool { return pendingCount(t, f) == 0 })
			cancel()
			if err := <-done; err != nil {
				t.Fatal(err)
			}
			if n := errs.Load(); n > 0 {
				t.Fatalf("the relay reported %d errors; the first: %v", n, firstErr.Load())
			}
			if len(got) != len(msgs) {
				t.Fatalf("%d of %d messages arrived", len(got), len(msgs))
			}
			if overlap := outbox.ClaimsOverlap(f.Store()); overlap != tc.overlap {
				t.Errorf("claims overlap: %v, want %v", overlap, tc.overlap)
			}
		})
	}
}

// On MySQL the relay's claims and marks are prepared once per connection,
// not prepared, run and closed for every batch (go-sql-driver's way with a
// query that has arguments): a round trip and a parse fewer per statement.
// What it does not prepare (an idle relay's probes, the mark of a batch of
// another size) goes with its arguments in its text, one round trip too,
// and prepares nothing either.
func TestForwarder_MySQL_Run_PreparesItsStatementsOnce(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.MySQL)
	b := testamqp.New(t)
	queue := b.Queue("t")
	publishN(t, db, b.Exchange, "t", 100)
	db.DB.SetMaxOpenConns(1) // one session, whose counters the test reads
	before := sessionPrepares(t, db)
	f := newForwarder(t, db, outbox.ForwarderConfig{BatchSize: 10, PollInterval: 20 * time.Millisecond})
	ran := make(chan error, 1)
	go func() { ran <- f.Run(context.Background()) }()
	if got := countIDs(b.Drain(queue, 100, 30*time.Second)); len(got) != 100 {
		t.Fatalf("%d distinct messages arrived, want 100", len(got))
	}
	// Idle, probing every 20 ms (five probes at least); then 7 rows in one
	// commit, claimed as a batch of 7, whose mark is of a size not
	// prepared.
	sent := outbox.StatementsSent(f.Store())
	waitFor(t, 10*time.Second, "five idle probes", func() bool { return outbox.StatementsSent(f.Store()) >= sent+5 })
	idle := sessionPrepares(t, db)
	publishBatch(t, db, b.Exchange, "t", 7)
	if got := countIDs(b.Drain(queue, 7, 30*time.Second)); len(got) != 7 {
		t.Fatalf("%d distinct messages arrived, want 7", len(got))
	}
	if err := f.Close(); err != nil { // settles every batch
		t.Fatal(err)
	}
	if err := <-ran; err != nil {
		t.Fatal(err)
	}
	// Ten batches and an empty claim: unprepared, 21 prepares or more;
	// prepared, the claims (from the head, a drain's cursor and a floor;
	// with keyed records in flight and without; on the index and without)
	// and the marks of each size a drain grows to.
	if n := idle - before; n > 16 {
		t.Errorf("the relay prepared %d statements for 10 batches and its idle probes, want each of its few once", n)
	}
	if n := sessionPrepares(t, db) - idle; n != 0 {
		t.Errorf("the relay prepared %d statements for a batch of 7, want 0: its mark goes in its text", n)
	}
	t.Logf("prepared %d for the drain and the idle probes, %d for the batch of 7", idle-before, sessionPrepares(t, db)-idle)
	var pending int
	if err := db.QueryRowx("SELECT COUNT(*) FROM acemq_outbox WHERE published_at IS NULL").Scan(&pending); err != nil {
		t.Fatal(err)
	}
	if pending != 0 {
		t.Errorf("%d rows left pending", pending)
	}
}

// Run's start looks the pending index up and prepares the relay's
// statements with a connection from the pool. A Sweep (or any claim) that
// holds the pool's last connection meanwhile goes on, rather than wait on
// Run for the lookup while Run waits on it for the connection.
func TestForwarder_MySQL_RunStartsWhileAClaimHoldsTheLastConnection(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.MySQL)
	db.DB.SetMaxOpenConns(1)
	f := newForwarder(t, db, outbox.ForwarderConfig{})
	tx, err := db.DB.BeginTx(context.Background(), &sql.TxOptions{Isolation: sql.LevelReadCommitted})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback() }()
	waits := db.DB.Stats().WaitCount
	go func() { _ = f.Run(context.Background()) }()
	waitFor(t, 10*time.Second, "Run to wait for the pool's connection", func() bool { return db.DB.Stats().WaitCount > waits })

	claimed := make(chan error, 1)
	go func() {
		_, err := outbox.PendingIndex(f.Store(), tx) // the claim's next step: the index lookup
		claimed <- err
	}()
	select {
	case err := <-claimed:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		_ = tx.Rollback() // frees Run, and the test
		t.Fatal("the claim waited on Run's start, which waited on the claim's connection")
	}
	_ = tx.Rollback()
	select {
	case <-f.Running():
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not start once the connection was free")
	}
}

// Prepared statements that stop working (a proxy that does not keep a
// connection's statements, a server out of them) fail one claim; the relay
// then runs its statements unprepared, as it would have without them, and
// every row arrives.
func TestForwarder_MySQL_PreparedStatementsFail_RelayGoesOnUnprepared(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.MySQL)
	other := migrated(t, testdb.MySQL)
	b := testamqp.New(t)
	queue := b.Queue("t")
	f := newForwarder(t, db, outbox.ForwarderConfig{BatchSize: 10, RetryMin: 10 * time.Millisecond, RetryMax: 50 * time.Millisecond,
		OnError: func(error, outbox.ErrorContext) {}})
	ids := publishN(t, db, b.Exchange, "t", 5)
	go func() { _ = f.Run(context.Background()) }()
	<-f.Running()
	waitFor(t, 10*time.Second, "the first rows to be published", func() bool { return pendingCount(t, f) == 0 })
	if n, err := outbox.SwapPrepared(f, other.DB.DB); err != nil || n == 0 {
		t.Fatalf("swapped %d prepared statements: %v", n, err)
	}

	ids = append(ids, publishN(t, db, b.Exchange, "t", 30)...)
	f.Notify()
	waitFor(t, 20*time.Second, "the outbox to drain", func() bool { return pendingCount(t, f) == 0 })
	if seen := countIDs(b.Drain(queue, len(ids), 10*time.Second)); len(seen) != len(ids) {
		t.Errorf("%d of %d messages arrived", len(seen), len(ids))
	}
	if n := outbox.Prepared(f); n != 0 {
		t.Errorf("the relay still runs %d statements prepared after they failed", n)
	}
}

// InnoDB reads a claim's rows as they are now (a locking read) and its
// key-head probe as they were when the probe first ran (the statement's
// consistent view). A key's seq 1 and seq 2 committed while a long claim
// scans (here past 300,000 stuck rows) were seen as seq 2 alone: seq 2
// was claimed and published while seq 1 was pending. The claim now takes a
// keyed row only if its snapshot holds it. Without that this failed in
// every one of three runs; a run whose sweep ends before the commits
// proves nothing, and says so.
func TestForwarder_MySQL_KeyCommittedDuringALongClaim_StaysInOrder(t *testing.T) {
	db := migrated(t, testdb.MySQL)
	b := testamqp.New(t)
	b.Queue("k")
	at := func(tm time.Time) string { return tm.UTC().Format("2006-01-02 15:04:05.000000") }
	t0 := time.Now().Add(-time.Hour).UTC().Truncate(time.Second)
	ctx := context.Background()
	conn, err := db.Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := conn.ExecContext(ctx, "SET SESSION max_recursive_iterations = 10000000"); err != nil {
		t.Fatal(err)
	}
	// Stuck rows (at MaxAttempts) between seq 1 and seq 2: a long scan.
	if _, err := conn.ExecContext(ctx, `INSERT INTO acemq_outbox (id, exchange_name, routing_key, body, body_encoding, content_type, headers, created_at, attempts)
		WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i+1 FROM n WHERE i < 300000)
		SELECT CONCAT('stuck-', i), ?, 'k', 'x', 'utf-8', 'text/plain', '{}', DATE_ADD(?, INTERVAL i MICROSECOND), 100 FROM n`,
		b.Exchange, at(t0.Add(time.Second))); err != nil {
		t.Fatal(err)
	}
	_ = conn.Close()
	// Another key's row at the head: its probe runs first and fixes the
	// probe's view before seq 1 commits.
	insertKeyed(t, db, []keyedRow{{id: "x#1", exchange: b.Exchange, routingKey: "k", aggregate: "x", seq: 1, createdAt: t0}})
	f := newForwarder(t, db, outbox.ForwarderConfig{BatchSize: 100, OnError: func(error, outbox.ErrorContext) {}})

	ins := db.Rebind("INSERT INTO acemq_outbox (id, exchange_name, routing_key, body, body_encoding, content_type, headers, created_at, aggregate_id, seq)" +
		" VALUES (?, ?, 'k', 'b', 'utf-8', 'text/plain', '{}', ?, 'K', ?)")
	tx1, err := db.Beginx()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx1.Exec(ins, "K#1", b.Exchange, at(t0.Add(500*time.Millisecond)), 1); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	start := time.Now()
	go func() { _, err := f.Sweep(ctx); done <- err }()
	time.Sleep(30 * time.Millisecond) // into the sweep's scan, which takes some 300 ms
	if err := tx1.Commit(); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec(ins, "K#2", b.Exchange, at(t0.Add(3*time.Second)), 2); err != nil {
		t.Fatal(err)
	}
	committed := time.Since(start)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if took := time.Since(start); took < committed {
		t.Logf("the sweep (%s) ended before seq 1 and 2 were committed (%s): this run proves nothing", took, committed)
	}
	if s1, s2 := stateOf(t, db, "K#1"), stateOf(t, db, "K#2"); s2.Published && !s1.Published {
		t.Errorf("K seq 2 was published while seq 1 is pending (seq 1 %+v, seq 2 %+v)", s1, s2)
	}
}
