package outbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/jmoiron/sqlx"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testamqp"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// otherPool opens a pool of its own on db's database, as another process
// would: the relay learns nothing of its commits but through the database.
func otherPool(t testing.TB, db *testdb.DB) *testdb.DB {
	t.Helper()
	other, err := sqlx.Open(db.DriverName(), db.DSN)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = other.Close() })
	return &testdb.DB{DB: other, Kind: db.Kind, DSN: db.DSN, Name: db.Name}
}

// On SQLite the relay watches the database's write-ahead log: a commit on
// another pool (another process, as outboxctl relay runs) wakes it with no
// poll for an hour, also after a checkpoint truncated the log, and with the
// relay's own writes in between.
func TestForwarder_SQLite_CommitElsewhere_WakesRelayWithoutPoll(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	b := testamqp.New(t)
	queue := b.Queue("t")
	// No poll for an hour, adaptive or not: only the watch can wake it.
	f := newForwarder(t, db, outbox.ForwarderConfig{PollInterval: time.Hour, MinPollInterval: time.Hour})
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	go func() { _ = f.Run(ctx) }()
	<-f.Running()
	other := otherPool(t, db)
	for i := 0; i < 4; i++ {
		if i == 2 {
			if _, err := other.Exec("PRAGMA wal_checkpoint(TRUNCATE)"); err != nil {
				t.Fatal(err)
			}
		}
		publishN(t, other, b.Exchange, "t", 1)
		if got := b.Drain(queue, 1, 10*time.Second); len(got) != 1 {
			t.Fatalf("message %d did not arrive within 10 s: the commit on another pool did not wake the relay", i)
		}
	}
}
