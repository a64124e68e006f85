package outbox_test

import (
	"context"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// A processed_messages another AceMQ library created (Rails' create_table:
// a surrogate id key, the dedupe columns under a plain, non-unique index).
// Migrate adopts it (0002's CREATE TABLE IF NOT EXISTS leaves it as it is),
// and the inbox then must still run a message's handler once, however
// often the broker delivers it. It ran at every delivery on all three
// databases: the inbox's insert finds a duplicate through a unique key
// only, and 0014 now adds one where the table has none. One that holds a
// message twice already fails the migration, naming the key, and migrates
// once the copy is gone.
func TestMigrate_ForeignInboxTableWithoutUniqueKey_RedeliveryRunsHandlerOnce(t *testing.T) {
	t.Parallel()
	create := map[string][]string{
		testdb.Postgres: {
			"CREATE TABLE processed_messages (id bigserial PRIMARY KEY, consumer_name varchar(255) NOT NULL, message_id varchar(64) NOT NULL, processed_at timestamp(6) NOT NULL)",
			"CREATE INDEX index_processed_messages_on_consumer_and_message ON processed_messages (consumer_name, message_id)",
		},
		testdb.MySQL: {
			"CREATE TABLE processed_messages (id bigint NOT NULL AUTO_INCREMENT PRIMARY KEY, consumer_name varchar(255) NOT NULL, message_id varchar(64) NOT NULL, processed_at datetime(6) NOT NULL," +
				" KEY index_processed_messages_on_consumer_and_message (consumer_name, message_id)) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin",
		},
		testdb.SQLite: {
			"CREATE TABLE processed_messages (id INTEGER PRIMARY KEY AUTOINCREMENT, consumer_name varchar NOT NULL, message_id varchar NOT NULL, processed_at datetime(6) NOT NULL)",
			"CREATE INDEX index_processed_messages_on_consumer_and_message ON processed_messages (consumer_name, message_id)",
		},
	}
	testdb.Each(t, func(t *testing.T, db *testdb.DB) {
		for _, stmt := range create[db.Kind] {
			if _, err := db.Exec(stmt); err != nil {
				t.Fatal(err)
			}
		}
		twice := "INSERT INTO processed_messages (consumer_name, message_id, processed_at) VALUES ('billing', 'm-1', '2026-01-01 00:00:00')"
		for i := 0; i < 2; i++ {
			if _, err := db.Exec(twice); err != nil {
				t.Fatal(err)
			}
		}
		err := outbox.Migrate(context.Background(), db.DB.DB, dialectOf(t, db))
		if err == nil || !strings.Contains(err.Error(), "processed_messages") {
			t.Fatalf("migrate over a processed_messages holding a message twice: %v, want an error naming the table", err)
		}
		t.Logf("migrate over a message held twice: %v", err)
		if _, err := db.Exec("DELETE FROM processed_messages WHERE id = (SELECT MAX(id) FROM (SELECT id FROM processed_messages) m)"); err != nil {
			t.Fatal(err)
		}
		if err := outbox.Migrate(context.Background(), db.DB.DB, dialectOf(t, db)); err != nil {
			t.Fatalf("migrate once the copy is gone: %v", err)
		}
		createEffects(t, db)
		var ran atomic.Int32
		h := newInbox(t, db, outbox.InboxConfig{}).Middleware(writeEffect(t, db, &ran))
		msg := message.NewMessage(watermill.NewUUID(), []byte("charge 42.50"))
		for i := 0; i < 3; i++ {
			if _, err := h(msg.Copy()); err != nil {
				t.Logf("delivery %d: %v", i+1, err)
			}
		}
		if got := countEffects(t, db, msg.UUID); got != 1 || ran.Load() != 1 {
			t.Fatalf("3 deliveries of one message: handler ran %d times, %d effects committed, %d keys; want 1 (Migrate adopted a processed_messages without a unique key on (consumer_name, message_id))",
				ran.Load(), got, countProcessed(t, db, msg.UUID))
		}
	})
}
