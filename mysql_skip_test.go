package outbox_test

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	mysqldrv "github.com/go-sql-driver/mysql"
	"github.com/jmoiron/sqlx"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// The publisher and the inbox skip an id that is there already on MySQL
// without INSERT IGNORE, which also turned a value its column cannot hold
// into a warning and stored what the column made of it. These tests hold
// the two sides of that: what is skipped is still told apart whatever the
// DSN says (clientFoundRows=true counts a row left as it is as affected),
// and what does not fit a table another library created is refused, not
// changed.

func TestTxPublisher_MySQL_ClientFoundRows_RetriedIDSkippedConflictRefused(t *testing.T) {
	db := migrated(t, testdb.MySQL)
	fr := withClientFoundRows(t, db)
	ctx := context.Background()
	if _, err := db.Exec("CREATE TABLE orders (id bigint AUTO_INCREMENT PRIMARY KEY, note varchar(16))"); err != nil {
		t.Fatal(err)
	}
	plain := message.NewMessage(watermill.NewUUID(), []byte("plain"))
	key := keyed("order-a")
	publishInTx(t, db, "orders", []*message.Message{plain, key})

	// The caller's transaction retried: both messages again, and a new one.
	tx, err := fr.BeginTxx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback() }()
	if _, err := tx.Exec("INSERT INTO orders (note) VALUES ('retried')"); err != nil {
		t.Fatal(err)
	}
	pub, err := outbox.NewTxPublisher(tx)
	if err != nil {
		t.Fatal(err)
	}
	next := keyed("order-a")
	if err := pub.Publish("orders", plain.Copy(), key.Copy(), next); err != nil {
		t.Fatalf("publishing a retried call again: %v", err)
	}
	// The same id to another place is still refused, and writes nothing.
	elsewhere := plain.Copy()
	elsewhere.Metadata.Set(outbox.MetadataRoutingKey, "elsewhere")
	fresh := message.NewMessage(watermill.NewUUID(), nil)
	if err := pub.Publish("orders", fresh, elsewhere); !errors.Is(err, outbox.ErrDuplicateID) {
		t.Fatalf("the same id to another routing key: err = %v, want ErrDuplicateID", err)
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	if n := countRows(t, db); n != 3 {
		t.Errorf("%d rows, want 3: the two first messages once each and the new one", n)
	}
	wantSeq(t, db, key, "order-a", 1)
	wantSeq(t, db, next, "order-a", 2) // the skipped copy took no number
	var counter int64
	if err := db.Get(&counter, "SELECT last_seq FROM acemq_outbox_sequences WHERE aggregate_id = 'order-a'"); err != nil {
		t.Fatal(err)
	}
	if counter != 2 {
		t.Errorf("order-a's counter is %d, want 2", counter)
	}
}

func TestInbox_MySQL_ClientFoundRows_DuplicateAckedHandlerNotRun(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.MySQL)
	createEffects(t, db)
	fr := withClientFoundRows(t, db)
	in, err := outbox.NewInbox(fr.DB, outbox.InboxConfig{ConsumerName: "fulfilment"})
	if err != nil {
		t.Fatal(err)
	}
	var ran atomic.Int32
	h := in.Middleware(writeEffect(t, db, &ran))
	msg := message.NewMessage(watermill.NewUUID(), []byte("order 1"))
	for i := 0; i < 3; i++ {
		if _, err := h(msg.Copy()); err != nil {
			t.Fatalf("delivery %d: %v, want nil (ack)", i+1, err)
		}
	}
	if ran.Load() != 1 || countEffects(t, db, msg.UUID) != 1 {
		t.Fatalf("handler ran %d times, %d effects; want 1 each", ran.Load(), countEffects(t, db, msg.UUID))
	}
}

// An acemq_outbox another library created with narrower columns: utf8mb3
// (MySQL's old "utf8") and a routing_key of 32 characters. An emoji, or a
// routing key the column would cut, fails the Publish with MySQL's error
// (strict mode, the default) and writes nothing, keyed or not; INSERT
// IGNORE stored "?" and a cut key.
func TestTxPublisher_MySQL_NarrowerColumnsOfAnotherLibrary_RefusedNotChanged(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.MySQL)
	if _, err := db.Exec("ALTER TABLE acemq_outbox MODIFY body text CHARACTER SET utf8mb3 NOT NULL," +
		" MODIFY routing_key varchar(32) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL"); err != nil {
		t.Fatal(err)
	}
	long := strings.Repeat("r", 40)
	emoji := func() *message.Message { return message.NewMessage(watermill.NewUUID(), []byte("paid 😀")) }
	for _, c := range []struct {
		name, topic string
		msg         *message.Message
		want        string
	}{
		{"emoji", "orders", emoji(), "Incorrect string value"},
		{"keyed emoji", "orders", func() *message.Message { m := emoji(); m.Metadata.Set(outbox.MetadataAggregateID, "order-a"); return m }(), "Incorrect string value"},
		{"long routing key", long, message.NewMessage(watermill.NewUUID(), []byte("x")), "Data too long"},
	} {
		t.Run(c.name, func(t *testing.T) {
			tx, err := db.Beginx()
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = tx.Rollback() }()
			pub, err := outbox.NewTxPublisher(tx)
			if err != nil {
				t.Fatal(err)
			}
			err = pub.Publish(c.topic, c.msg)
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("err = %v, want MySQL's %q", err, c.want)
			}
			// A caller who commits anyway finds nothing of the message.
			if err := tx.Commit(); err != nil {
				t.Fatal(err)
			}
			if n := countRows(t, db); n != 0 {
				t.Fatalf("%d rows after the refused publish, want 0", n)
			}
		})
	}
	var counter int64
	if err := db.Get(&counter, "SELECT COALESCE(MAX(last_seq), 0) FROM acemq_outbox_sequences"); err != nil {
		t.Fatal(err)
	}
	if counter != 0 {
		t.Errorf("order-a's counter is %d after the refused keyed publish, want 0", counter)
	}
	// What fits goes in as before.
	publishInTx(t, db, "orders", []*message.Message{message.NewMessage(watermill.NewUUID(), []byte("paid"))})
	if n := countRows(t, db); n != 1 {
		t.Fatalf("%d rows, want 1", n)
	}
}

// A processed_messages another library created with a message_id of 36
// characters (a UUID's) in utf8mb3: two ids that share their first 36
// characters, or differ by an emoji, were one key under INSERT IGNORE, and
// the second message was acked as a duplicate without running. Now its
// delivery fails (to be retried, or sent to a poison queue) and the first
// message's key stays the only one.
func TestInbox_MySQL_NarrowerKeyColumnOfAnotherLibrary_DeliveryFailsNotAckedAsDuplicate(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.MySQL)
	createEffects(t, db)
	if _, err := db.Exec("ALTER TABLE processed_messages MODIFY message_id varchar(36) CHARACTER SET utf8mb3 COLLATE utf8mb3_bin NOT NULL"); err != nil {
		t.Fatal(err)
	}
	var ran atomic.Int32
	h := newInbox(t, db, outbox.InboxConfig{}).Middleware(writeEffect(t, db, &ran))
	first := message.NewMessage("00000000-0000-0000-0000-000000000001", []byte("1"))
	if _, err := h(first); err != nil {
		t.Fatalf("first delivery: %v", err)
	}
	for _, id := range []string{first.UUID + "-retry", "order-😀"} {
		if _, err := h(message.NewMessage(id, []byte("2"))); err == nil {
			t.Errorf("message %q: acked, want the delivery to fail", id)
		}
		if n := countEffects(t, db, id); n != 0 {
			t.Errorf("message %q: %d effects of a failed delivery, want 0", id, n)
		}
	}
	if ran.Load() != 1 {
		t.Errorf("the handler ran %d times, want once: the key is written before it runs", ran.Load())
	}
	var keys int
	if err := db.Get(&keys, "SELECT COUNT(*) FROM processed_messages"); err != nil {
		t.Fatal(err)
	}
	if keys != 1 {
		t.Errorf("%d keys, want the first message's only", keys)
	}
}

// Tables another library created with an AUTO_INCREMENT surrogate key
// (Rails' create_table adds one): an insert reports the id it generated,
// which is no skip, and a skip is still told, under clientFoundRows too.
func TestMySQL_TablesWithAnAutoIncrementKey_InsertsAndSkipsToldApart(t *testing.T) {
	for _, found := range []bool{false, true} {
		t.Run(map[bool]string{false: "default", true: "clientFoundRows"}[found], func(t *testing.T) {
			db := migrated(t, testdb.MySQL)
			createEffects(t, db)
			if _, err := db.Exec("ALTER TABLE processed_messages DROP PRIMARY KEY, ADD COLUMN id bigint NOT NULL AUTO_INCREMENT PRIMARY KEY FIRST," +
				" ADD UNIQUE KEY processed_messages_key (consumer_name, message_id)"); err != nil {
				t.Fatal(err)
			}
			if _, err := db.Exec("ALTER TABLE acemq_outbox DROP PRIMARY KEY, ADD COLUMN pk bigint NOT NULL AUTO_INCREMENT PRIMARY KEY FIRST," +
				" ADD UNIQUE KEY acemq_outbox_id (id)"); err != nil {
				t.Fatal(err)
			}
			use := db
			if found {
				use = withClientFoundRows(t, db)
			}
			var ran atomic.Int32
			in, err := outbox.NewInbox(use.DB, outbox.InboxConfig{ConsumerName: "fulfilment"})
			if err != nil {
				t.Fatal(err)
			}
			h := in.Middleware(writeEffect(t, db, &ran))
			first, second := message.NewMessage(watermill.NewUUID(), []byte("1")), message.NewMessage(watermill.NewUUID(), []byte("2"))
			for _, m := range []*message.Message{first, first, second, second} {
				if _, err := h(m.Copy()); err != nil {
					t.Fatal(err)
				}
			}
			if ran.Load() != 2 || countEffects(t, db, first.UUID) != 1 || countEffects(t, db, second.UUID) != 1 {
				t.Fatalf("handler ran %d times (effects %d, %d); want once per message", ran.Load(), countEffects(t, db, first.UUID), countEffects(t, db, second.UUID))
			}

			plain, key1, key2 := message.NewMessage(watermill.NewUUID(), []byte("p")), keyed("order-a"), keyed("order-a")
			done := make(chan error, 1)
			go func() {
				for _, call := range [][]*message.Message{{plain, key1}, {plain.Copy(), key1.Copy(), key2}} {
					tx, err := use.Beginx()
					if err != nil {
						done <- err
						return
					}
					pub, err := outbox.NewTxPublisher(tx)
					if err == nil {
						err = pub.Publish("orders", call...)
					}
					if err == nil {
						err = tx.Commit()
					} else {
						_ = tx.Rollback()
					}
					if err != nil {
						done <- err
						return
					}
				}
				done <- nil
			}()
			select {
			case err := <-done:
				if err != nil {
					t.Fatalf("publishing: %v", err)
				}
			case <-time.After(30 * time.Second):
				t.Fatal("Publish did not return in 30 s")
			}
			if n := countRows(t, db); n != 3 {
				t.Errorf("%d rows, want 3", n)
			}
			wantSeq(t, db, key1, "order-a", 1)
			wantSeq(t, db, key2, "order-a", 2)
		})
	}
}

// MariaDB with innodb_snapshot_isolation (on by default from 11.6.2): a
// write to a row another transaction changed after this one's snapshot
// fails with 1020 ("Record has changed since last read") and rolls the whole
// transaction back, as a deadlock does. The inbox runs such a delivery
// again, as it does a deadlock's, rather than nack it (a nack per conflict
// took a hot key's delivery past a quorum queue's delivery limit).
func TestInbox_MariaDBSnapshotIsolation_ChangedSinceReadRunsAgain(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.MySQL)
	var on int
	if err := db.Get(&on, "SELECT @@innodb_snapshot_isolation"); err != nil {
		t.Skipf("the server has no innodb_snapshot_isolation (MySQL, or MariaDB before 10.6.18): %v", err)
	}
	cfg, err := mysqldrv.ParseDSN(db.DSN)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Params == nil {
		cfg.Params = map[string]string{}
	}
	cfg.Params["innodb_snapshot_isolation"] = "1"
	si, err := sqlx.Open("mysql", cfg.FormatDSN())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = si.Close() })
	if _, err := db.Exec("CREATE TABLE si_counter (id int PRIMARY KEY, v int NOT NULL)"); err != nil {
		t.Fatal(err)
	}
	for _, ordered := range []bool{false, true} {
		t.Run(map[bool]string{false: "plain", true: "ordered"}[ordered], func(t *testing.T) {
			if _, err := db.Exec("REPLACE INTO si_counter VALUES (1, 0)"); err != nil {
				t.Fatal(err)
			}
			in, err := outbox.NewInbox(si, outbox.InboxConfig{ConsumerName: "counter", Ordered: ordered})
			if err != nil {
				t.Fatal(err)
			}
			var tries atomic.Int32
			h := in.Middleware(func(msg *message.Message) ([]*message.Message, error) {
				tx, _ := outbox.TxFromContext(msg.Context())
				var v int
				if err := tx.Get(&v, "SELECT v FROM si_counter WHERE id = 1"); err != nil {
					return nil, err
				}
				if tries.Add(1) == 1 {
					// Another transaction changes the row after this one read it.
					if _, err := db.Exec("UPDATE si_counter SET v = v + 10 WHERE id = 1"); err != nil {
						return nil, err
					}
				}
				_, err := tx.Exec("UPDATE si_counter SET v = v + 1 WHERE id = 1")
				return nil, err
			})
			msg := message.NewMessage(watermill.NewUUID(), []byte("x"))
			if ordered {
				msg = keyedMsg("counter-1", 1)
			}
			if _, err := h(msg); err != nil {
				t.Fatalf("delivery: %v, want it run again and acked", err)
			}
			var v int
			if err := db.Get(&v, "SELECT v FROM si_counter WHERE id = 1"); err != nil {
				t.Fatal(err)
			}
			if tries.Load() != 2 || v != 11 {
				t.Errorf("handler ran %d times, counter %d; want 2 (the first rolled back) and 11", tries.Load(), v)
			}
		})
	}
}
