package outboxctl

// outboxctl as an operator uses it, at its edges: DSNs of the wrong form,
// flags out of range, stops while the broker or the database does not
// answer, rows another library wrote, commands beside running services.

import (
	"encoding/json"
	"net"
	"net/http"
	"net/url"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testamqp"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// A libpq keyword/value DSN ("host=… user=… dbname=…", which pgx and psql
// take) is not recognised as PostgreSQL and is read as an SQLite path:
// status answers "the sqlite database … does not exist (outboxctl migrate
// creates it)", and migrate, following that hint, creates an SQLite file
// named "host=… dbname=…" in the working directory and exits 0. From then
// on status, stuck and relay run happily against that empty file: the relay
// publishes nothing and status reports an empty outbox, while the real
// PostgreSQL outbox fills up. A --db with '=' and spaces and no path
// separator should be a usage error (or be taken as PostgreSQL).
func TestDB_KeywordDSN_RefusedNotTakenForAnSQLiteFile(t *testing.T) {
	dir := t.TempDir()
	t.Chdir(dir)
	dsn := "host=127.0.0.1 port=5432 user=postgres dbname=test sslmode=disable"

	r := ctl(t, nil, "migrate", "--db", dsn)
	if r.code == 0 {
		t.Errorf("migrate --db %q: exit 0, want a usage error; it said:\n%s%s", dsn, r.stdout, r.stderr)
	}
	if _, err := os.Stat(dsn); err == nil {
		t.Errorf("migrate --db %q created an SQLite file of that name in the working directory", dsn)
	}
	r = ctl(t, nil, "status", "--db", dsn)
	if r.code == 0 || strings.Contains(r.stderr, "sqlite") {
		t.Errorf("status --db %q: exit %d, treated as SQLite:\n%s%s", dsn, r.code, r.stdout, r.stderr)
	}
}

// --poll-interval under a millisecond passes the command's own checks, and
// the relay then connects to the database and the broker before
// NewForwarder refuses it, naming a field the operator has no flag for
// (MinPollInterval); with the broker down the operator is told about the
// broker instead. A flag out of range should be refused up front, naming
// the flag, before anything is dialled.
func TestRelay_PollIntervalUnderAMillisecond_UsageErrorNamingTheFlag(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	for _, amqpURL := range []string{testdb.AMQPURL(), "amqp://guest:guest@127.0.0.1:1/"} {
		r := ctl(t, nil, "relay", "--db", db.DSN, "--amqp", amqpURL, "--poll-interval", "500us", "--listen", "")
		if r.code != exitUsage || !strings.Contains(r.stderr, "--poll-interval") {
			t.Errorf("--poll-interval 500us with --amqp %s: exit %d, want 2 naming --poll-interval:\n%s", amqpURL, r.code, r.stderr)
		}
		if strings.Contains(r.stderr, "Connected to RabbitMQ") {
			t.Errorf("the relay connected to the broker before refusing its flags:\n%s", r.stderr)
		}
	}
}

// stallNode is a TCP listener in front of a server (the test broker, or a
// database) whose traffic can be stopped: Stall stops the client-to-server
// direction (the relay's publishes sit in the socket buffers, the broker's
// heartbeats still come, no confirm comes back: a wedged node or one under
// a memory alarm); Blackhole stops both (a partition the kernel does not
// see: connections stay open and nothing answers).
type stallNode struct {
	ln        net.Listener
	URL       string // for the broker: its URL with this node's address
	Addr      string
	stalled   atomic.Bool
	blackhole atomic.Bool
	mu        sync.Mutex
	conns     []net.Conn
}

func newStallNode(t *testing.T) *stallNode {
	t.Helper()
	u, err := url.Parse(testdb.AMQPURL())
	if err != nil {
		t.Fatal(err)
	}
	n := newStallProxy(t, u.Host)
	u.Host = n.Addr
	n.URL = u.String()
	return n
}

func newStallProxy(t *testing.T, server string) *stallNode {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	n := &stallNode{ln: ln, Addr: ln.Addr().String()}
	pipe := func(dst, src net.Conn, gate func() bool) {
		buf := make([]byte, 32<<10)
		for {
			k, err := src.Read(buf)
			for gate() {
				time.Sleep(5 * time.Millisecond)
			}
			if k > 0 {
				if _, werr := dst.Write(buf[:k]); werr != nil {
					_ = src.Close()
					return
				}
			}
			if err != nil {
				_ = dst.Close()
				return
			}
		}
	}
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			up, err := net.Dial("tcp", server)
			if err != nil {
				_ = c.Close()
				continue
			}
			n.mu.Lock()
			n.conns = append(n.conns, c, up)
			n.mu.Unlock()
			go pipe(c, up, n.blackhole.Load)
			go pipe(up, c, func() bool { return n.stalled.Load() || n.blackhole.Load() })
		}
	}()
	t.Cleanup(func() {
		n.stalled.Store(false)
		n.blackhole.Store(false)
		_ = ln.Close()
		n.mu.Lock()
		defer n.mu.Unlock()
		for _, c := range n.conns {
			_ = c.Close()
		}
	})
	return n
}

// SIGTERM while the broker has stopped answering, batches in flight: the
// relay must exit 0 within its publish timeout (15 s) plus the close's
// (5 s), mark nothing it has no confirm for, leave nothing leased or
// locked, and a relay started afterwards must send every row.
func TestRelay_SIGTERMWhileBrokerStalled_ExitsZeroLosesNothing(t *testing.T) {
	testdb.Require(t, "amqp")
	eachKind(t, func(t *testing.T, kind string) {
		const rows = 3000
		db := migrated(t, kind)
		broker := testamqp.New(t)
		queue := broker.Queue()
		node := newStallNode(t)
		published := func() int { return count(t, db, "SELECT COUNT(*) FROM acemq_outbox WHERE published_at IS NOT NULL") }

		relay := startRelay(t, db.DSN, "--amqp", node.URL, "--batch-size", "10", "--max-batch-size", "10")
		ids := publish(t, db, rows, queue)
		eventually(t, 30*time.Second, "the relay to publish some", func() bool { return published() >= 20 })
		node.stalled.Store(true)
		time.Sleep(300 * time.Millisecond) // batches go out and sit unconfirmed
		before := published()
		start := time.Now()
		code := relay.stop()
		took := time.Since(start)
		t.Logf("%s: exit %d %s after SIGTERM; %d of %d published", kind, code, took, before, rows)
		if code != 0 {
			t.Errorf("exit %d after SIGTERM with the broker stalled, want 0:\n%s", code, relay.stderr.String())
		}
		if took > 25*time.Second {
			t.Errorf("took %s to exit after SIGTERM", took)
		}
		if n := count(t, db, "SELECT COUNT(*) FROM acemq_outbox WHERE published_at IS NULL AND (locked_until IS NOT NULL OR attempts > 0)"); n != 0 {
			t.Logf("%d unpublished rows leased or with attempts after the stop", n)
		}
		if n := count(t, db, "SELECT COUNT(*) FROM acemq_outbox WHERE locked_until IS NOT NULL AND locked_by <> 'retry-after'"); n != 0 {
			t.Errorf("%d rows still leased after the relay stopped", n)
		}
		node.stalled.Store(false)
		var marked []string
		if err := db.Select(&marked, "SELECT id FROM acemq_outbox WHERE published_at IS NOT NULL"); err != nil {
			t.Fatal(err)
		}
		// A fresh relay on the real broker sends the rest.
		relay2 := startRelay(t, db.DSN)
		eventually(t, 60*time.Second, "the second relay to drain", func() bool { return published() == rows })
		if code := relay2.stop(); code != 0 {
			t.Errorf("second relay exit %d", code)
		}
		arrived := messageIDs(t, broker, queue, rows)
		for _, id := range ids {
			if arrived[id] == 0 {
				t.Errorf("message %s never arrived", id)
			}
		}
		_ = marked
	})
}

// On SQLite, status reads the oldest pending created_at as MIN(CASE … END),
// an expression without the column's declared type, so the driver hands
// back the stored value raw. A created_at another library stored as an
// integer (Java's sqlite-jdbc writes a Timestamp as Unix milliseconds by
// default; the relay itself reads such a row through the column and
// publishes it) comes back as an int64 the time reader refuses, and status
// shows "oldest pending age -" and oldest_pending_at null, age 0, with rows
// pending, two days old: the one number that says the relay is behind is
// blanked, and the relay's outbox_oldest_pending_age_seconds gauge (the
// same Stats) with it. stuck, which selects the column itself, reads the
// same value fine.
func TestStatus_SQLiteIntegerCreatedAt_OldestPendingStillShown(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	ids := publish(t, db, 2, "orders") // ids[1] stays as the library wrote it
	twoDays := time.Now().Add(-48 * time.Hour)
	execSQL(t, db, "UPDATE acemq_outbox SET created_at = ? WHERE id = ?", twoDays.UnixMilli(), ids[0])

	got := decodeJSON(t, mustCtl(t, "status", "--db", db.DSN, "--json"))
	if got["pending"] != 2.0 {
		t.Fatalf("pending = %v, want 2", got["pending"])
	}
	age, _ := got["oldest_pending_age_seconds"].(float64)
	if got["oldest_pending_at"] == nil || age < (47*time.Hour).Seconds() {
		t.Errorf("oldest_pending_at = %v, oldest_pending_age_seconds = %v with a row pending for two days, want about %v",
			got["oldest_pending_at"], age, (48 * time.Hour).Seconds())
	}
	if human := mustCtl(t, "status", "--db", db.DSN); strings.Contains(human, "oldest pending age          -") {
		t.Errorf("status shows no oldest pending age with two rows pending:\n%s", human)
	}
	// stuck reads the same kind of value fine: the column has its type.
	execSQL(t, db, "UPDATE acemq_outbox SET attempts = 10 WHERE id = ?", ids[0])
	var sr stuckReport
	if err := json.Unmarshal([]byte(mustCtl(t, "stuck", "--db", db.DSN, "--json")), &sr); err != nil {
		t.Fatal(err)
	}
	if len(sr.Rows) != 1 || sr.Rows[0].CreatedAt.Before(twoDays.Add(-time.Minute)) {
		t.Errorf("stuck rows %+v, want the row created two days ago", sr.Rows)
	}
}

// The same on purge: on SQLite the cutoff is compared as text, and an
// integer published_at (Unix milliseconds, as sqlite-jdbc writes it) sorts
// below every text value, so purge --published-older-than 7d deletes a row
// published a minute ago, and status's "published in the last hour" never
// counts it.
func TestPurge_SQLiteIntegerPublishedAt_NotDeletedBeforeItsAge(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	ids := publish(t, db, 1, "orders")
	execSQL(t, db, "UPDATE acemq_outbox SET published_at = ? WHERE id = ?", time.Now().Add(-time.Minute).UnixMilli(), ids[0])
	if got := decodeJSON(t, mustCtl(t, "status", "--db", db.DSN, "--json")); got["published_last_hour"] != 1.0 {
		t.Errorf("published_last_hour = %v with a row published a minute ago, want 1", got["published_last_hour"])
	}
	mustCtl(t, "purge", "--db", db.DSN, "--published-older-than", "7d")
	if n := count(t, db, "SELECT COUNT(*) FROM acemq_outbox"); n != 1 {
		t.Errorf("purge --published-older-than 7d deleted a row published a minute ago")
	}
}

// The inbox's keys as another library stamps them on SQLite: sqlite-jdbc
// writes processed_at as Unix milliseconds, a number, which sorts below
// every text. A key processed a minute ago was purged as older than any
// age, and its message, delivered again, ran again; a key a week old is
// still purged.
func TestPurge_SQLiteIntegerProcessedAt_NotDeletedBeforeItsAge(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	execSQL(t, db, "INSERT INTO processed_messages (consumer_name, message_id, processed_at) VALUES ('java', 'fresh', ?), ('java', 'old', ?)",
		time.Now().Add(-time.Minute).UnixMilli(), time.Now().Add(-8*24*time.Hour).UnixMilli())
	mustCtl(t, "purge", "--db", db.DSN, "--processed-older-than", "7d")
	if n := count(t, db, "SELECT COUNT(*) FROM processed_messages WHERE message_id = 'fresh'"); n != 1 {
		t.Errorf("purge --processed-older-than 7d deleted a key processed a minute ago")
	}
	if n := count(t, db, "SELECT COUNT(*) FROM processed_messages WHERE message_id = 'old'"); n != 0 {
		t.Errorf("purge --processed-older-than 7d kept a key processed 8 days ago")
	}
}

// SIGTERM while the database has stopped answering (a partition: the
// connections stay open, nothing comes back). The relay's statements run
// under context.WithoutCancel (relay_pipeline.go sweep: work) and the
// database/sql pool has no deadline of its own, so the statement in flight
// (an idle relay's probe, a claim, a mark) waits for the kernel to give up
// on the TCP connection, minutes, and SIGTERM does nothing meanwhile: the
// process outlives any grace period and is SIGKILLed. Nothing is lost (no
// mark, no confirm), but "relay runs until SIGINT or SIGTERM … and exits 0"
// does not hold. The stop should bound the database work too (a deadline on
// the stopping sweep's statements), and exit non-zero if it could not
// release its claim.
func TestRelay_SIGTERMWhileDatabasePartitioned_ExitsWithinABound(t *testing.T) {
	eachBehindProxy(t, func(t *testing.T, db *testdb.DB, proxy *stallNode, dsn string) {
		runPartitioned(t, db, dsn, func() { proxy.blackhole.Store(true) })
	})
}

// eachBehindProxy runs fn as a parallel subtest on PostgreSQL and MySQL,
// each with a migrated database, a stall proxy in front of its server and
// the database's DSN through it.
func eachBehindProxy(t *testing.T, fn func(t *testing.T, db *testdb.DB, proxy *stallNode, dsn string)) {
	testdb.Require(t, "amqp")
	for _, kind := range []string{testdb.Postgres, testdb.MySQL} {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			db := migrated(t, kind)
			proxy, dsn := databaseProxy(t, db)
			fn(t, db, proxy, dsn)
		})
	}
}

// databaseProxy puts a stall proxy between a relay and db's server, and
// returns it with db's DSN through it.
func databaseProxy(t *testing.T, db *testdb.DB) (*stallNode, string) {
	t.Helper()
	var server string
	i, j := 0, 0
	if db.Kind == testdb.Postgres {
		u, err := url.Parse(db.DSN)
		if err != nil {
			t.Fatal(err)
		}
		server = u.Host
		i = strings.Index(db.DSN, server)
		j = i + len(server)
	} else {
		i, j = strings.Index(db.DSN, "tcp(")+4, strings.Index(db.DSN, ")/")
		server = db.DSN[i:j]
	}
	proxy := newStallProxy(t, server)
	return proxy, db.DSN[:i] + proxy.Addr + db.DSN[j:]
}

// The database partitioned in the middle of a drain, with batches claimed
// and in flight, then SIGTERM: their marks cannot be made, so the stop ends
// at its bound (stopTimeout, 30 s; exit 1 in every run so far) rather than
// wait for the kernel to give the connections up. An exit 0 is accepted
// only with a clean stop in the log: a partition between two batches, with
// nothing in flight. Nothing is lost to it: once the
// partition ends and the dead relay's transactions with it, another relay
// sends every row that was not marked, and every message reaches the
// broker.
func TestRelay_SIGTERMWhileDatabasePartitionedMidDrain_BoundedNothingLost(t *testing.T) {
	eachBehindProxy(t, func(t *testing.T, db *testdb.DB, proxy *stallNode, dsn string) {
		broker := testamqp.New(t)
		queue := broker.Queue()
		relay := startRelay(t, dsn)
		const n = 20000
		ids := publish(t, db, n, queue)
		eventually(t, 30*time.Second, "the relay to start the drain", func() bool {
			return count(t, db, "SELECT COUNT(*) FROM acemq_outbox WHERE published_at IS NOT NULL") > 0
		})
		proxy.blackhole.Store(true)
		left := count(t, db, "SELECT COUNT(*) FROM acemq_outbox WHERE published_at IS NULL")
		if left == 0 {
			t.Fatal("the relay drained every row before the partition: the test proved nothing")
		}
		time.Sleep(500 * time.Millisecond)
		start := time.Now()
		if err := relay.cmd.Process.Signal(syscall.SIGTERM); err != nil {
			t.Fatal(err)
		}
		select {
		case <-relay.exited:
			t.Logf("exit %d %s after SIGTERM, %d of %d rows unmarked at the partition", relay.code, time.Since(start).Round(time.Millisecond), left, n)
		case <-time.After(45 * time.Second):
			t.Fatalf("relay still running 45s after SIGTERM with the database partitioned mid-drain; its log:\n%s", relay.stderr.String())
		}
		if relay.code == 0 && !strings.Contains(relay.stderr.String(), "Relay stopped") {
			t.Errorf("exit 0 without a clean stop; its log:\n%s", relay.stderr.String())
		}

		// The partition ends: what the dead relay held is released.
		proxy.blackhole.Store(false)
		startRelay(t, db.DSN)
		eventually(t, 60*time.Second, "every row to be published", func() bool {
			return count(t, db, "SELECT COUNT(*) FROM acemq_outbox WHERE published_at IS NULL") == 0
		})
		seen := map[string]bool{}
		for deadline := time.Now().Add(60 * time.Second); len(seen) < n && time.Now().Before(deadline); {
			for _, d := range broker.Drain(queue, 1, time.Until(deadline)) {
				seen[d.MessageId] = true
			}
		}
		lost := 0
		for _, id := range ids {
			if !seen[id] {
				lost++
			}
		}
		if lost > 0 {
			t.Fatalf("%d of %d messages never reached the broker", lost, n)
		}
	})
}

func runPartitioned(t *testing.T, db *testdb.DB, dsn string, partition func()) {
	t.Helper()
	broker := testamqp.New(t)
	queue := broker.Queue()
	relay := startRelay(t, dsn, "--stall-after", "3s")
	publish(t, db, 50, queue)
	eventually(t, 30*time.Second, "the relay to publish", func() bool {
		return count(t, db, "SELECT COUNT(*) FROM acemq_outbox WHERE published_at IS NULL") == 0
	})
	if code, body := relay.get("/healthz"); code != http.StatusOK {
		t.Fatalf("/healthz of a relay that sweeps: %d %s", code, body)
	}
	partition()
	// The idle relay's next probe goes out and hangs: no sweep ends, and
	// /healthz says so (a liveness probe restarts it).
	eventually(t, 15*time.Second, "/healthz to call the relay stalled", func() bool {
		code, body := relay.get("/healthz")
		return code == http.StatusServiceUnavailable && strings.Contains(body, "stalled")
	})
	start := time.Now()
	if err := relay.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case <-relay.exited:
		// 0 when the statement in flight ended with the stop (an idle
		// relay's probe: nothing was claimed), 1 when the bound cut it.
		t.Logf("exit %d %s after SIGTERM", relay.code, time.Since(start))
	case <-time.After(45 * time.Second):
		t.Errorf("relay still running 45s after SIGTERM with the database partitioned; its log:\n%s", relay.stderr.String())
	}
}

// A row whose attempts is NULL (a hand-made or another library's table
// where the column is nullable, and a writer that leaves it out) is neither
// pending nor stuck: Stats counts attempts < ? and attempts >= ?, Stuck
// lists attempts >= ?, and the relay's claim wants attempts < ? (all NULL
// for it). So status shows an empty outbox, stuck lists nothing, and the
// relay never sends it: a committed message silently never published,
// where the README promises a row with a NULL in a hand-made table "fails
// by itself: it is stuck at once with a last_error naming the column".
// Fix: treat a NULL attempts as 0 (COALESCE) in the claim and the counts,
// or show such rows as stuck.
func TestRelayAndStatus_NullAttempts_RowPendingAndSent(t *testing.T) {
	testdb.Require(t, "amqp")
	for _, kind := range []string{testdb.Postgres, testdb.MySQL} {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			db := migrated(t, kind)
			if kind == testdb.Postgres {
				execSQL(t, db, "ALTER TABLE acemq_outbox ALTER COLUMN attempts DROP NOT NULL")
			} else {
				execSQL(t, db, "ALTER TABLE acemq_outbox MODIFY attempts INT NULL")
			}
			broker := testamqp.New(t)
			queue := broker.Queue()
			ids := publish(t, db, 1, queue)
			execSQL(t, db, "UPDATE acemq_outbox SET attempts = NULL WHERE id = ?", ids[0])

			got := decodeJSON(t, mustCtl(t, "status", "--db", db.DSN, "--json"))
			if got["pending"] == 0.0 && got["stuck"] == 0.0 {
				t.Errorf("status: pending 0, stuck 0 with one unpublished row (attempts NULL)")
			}
			relay := startRelay(t, db.DSN)
			const within = 30 * time.Second
			unpublished := func() int { return count(t, db, "SELECT COUNT(*) FROM acemq_outbox WHERE published_at IS NULL") }
			for deadline := time.Now().Add(within); unpublished() != 0 && time.Now().Before(deadline); {
				time.Sleep(50 * time.Millisecond) // polling the database
			}
			relay.stop()
			if n := unpublished(); n != 0 {
				r := ctl(t, nil, "stuck", "--db", db.DSN)
				t.Errorf("the relay left the row with attempts NULL unpublished after %s, and stuck says:\n%s", within, r.stdout)
			}
		})
	}
}

// serviceWrites commits one outbox message per transaction, as a service
// does, until stop closes, and returns the errors its transactions met.
func serviceWrites(t *testing.T, db *testdb.DB, queue string, perTx int, stop <-chan struct{}) (wait func() (ok int, errs []error)) {
	t.Helper()
	var (
		wg   sync.WaitGroup
		mu   sync.Mutex
		n    int
		errs []error
	)
	for w := 0; w < 4; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				err := func() error {
					tx, err := db.Beginx()
					if err != nil {
						return err
					}
					defer func() { _ = tx.Rollback() }()
					pub, err := outbox.NewTxPublisher(tx)
					if err != nil {
						return err
					}
					msgs := make([]*message.Message, perTx)
					for i := range msgs {
						msgs[i] = message.NewMessage(watermill.NewUUID(), []byte(`{}`))
					}
					if err := pub.Publish(queue, msgs...); err != nil {
						return err
					}
					return tx.Commit()
				}()
				mu.Lock()
				if err != nil {
					errs = append(errs, err)
				} else {
					n++
				}
				mu.Unlock()
			}
		}()
	}
	return func() (int, []error) {
		wg.Wait()
		return n, errs
	}
}

// On MySQL, retry --all-stuck (and purge) run their UPDATE and DELETE as
// plain autocommit statements under the server's default REPEATABLE READ,
// whose next-key and gap locks over the range of the pending index they
// walk cover the gap where the services' new pending rows go. With a relay
// running and the services committing (10 messages a transaction), retry
// --all-stuck of 40,000 rows made 9-13 of ~2,300 service transactions fail
// with "Error 1213: Deadlock found when trying to get lock" (the baseline,
// relay and services alone, 0 of ~2,600). purge --published-older-than 7d
// of 40,000 rows caused no deadlock in this run but held the services'
// inserts back while it ran (577 transactions committed in 3 s against
// 2,623 without it); an earlier run of purge in a loop beside the relay
// deadlocked a service's insert too. The relay avoids exactly this for its
// claims by running them in READ COMMITTED (store.go claimBatch). Fix: run
// Retry, RetryAllStuck and PurgePublished in a READ COMMITTED transaction
// (no gap locks) on MySQL.
func TestPurgeAndRetry_MySQLBesideTheServices_NoDeadlockInTheirTransactions(t *testing.T) {
	const rows = 40000
	for _, tc := range []struct {
		name  string
		setup string // what the rows written before become
		args  []string
	}{
		{"baseline: the relay and the services alone", "", nil},
		{"purge --published-older-than 7d", "UPDATE acemq_outbox SET published_at = ?", []string{"purge", "--published-older-than", "7d"}},
		{"retry --all-stuck", "UPDATE acemq_outbox SET attempts = 10, last_error = 'x', created_at = ?", []string{"retry", "--all-stuck"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			testdb.Require(t, "amqp")
			db := migrated(t, testdb.MySQL)
			broker := testamqp.New(t)
			queue := broker.Queue()
			if tc.setup != "" {
				for i := 0; i < rows/5000; i++ {
					publish(t, db, 5000, queue)
				}
				execSQL(t, db, tc.setup, ts(testdb.MySQL, time.Now().Add(-10*24*time.Hour)))
			}
			startRelay(t, db.DSN)
			stop := make(chan struct{})
			wait := serviceWrites(t, db, queue, 10, stop)
			start := time.Now()
			if tc.args != nil {
				r := ctl(t, nil, append(tc.args, "--db", db.DSN)...)
				if r.code != 0 {
					t.Errorf("exit %d: %s", r.code, r.stderr)
				}
				t.Logf("outboxctl %s: %s in %s", strings.Join(tc.args, " "), strings.TrimSpace(r.stdout), time.Since(start))
			}
			time.Sleep(max(0, 3*time.Second-time.Since(start)))
			close(stop)
			ok, errs := wait()
			t.Logf("the services committed %d transactions, %d failed", ok, len(errs))
			for i, err := range errs {
				if i < 3 {
					t.Errorf("a service's transaction failed: %v", err)
				}
			}
		})
	}
}
