package outbox_test

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"fmt"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jmoiron/sqlx"
	"github.com/mattn/go-sqlite3"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testamqp"
	"github.com/acemq/watermill-outbox/internal/testdb"
	"github.com/acemq/watermill-outbox/internal/testrelay"
)

// attachDrivers numbers the drivers attachingDriver registers: a name is
// registered once per process.
var attachDrivers atomic.Int64

// attachingDriver registers an SQLite driver whose every connection
// attaches file as schema, as a service keeps its outbox in a database of
// its own beside its main one, and returns its name.
func attachingDriver(file, schema string) string {
	name := fmt.Sprintf("sqlite3-attach-%d", attachDrivers.Add(1))
	sql.Register(name, &sqlite3.SQLiteDriver{ConnectHook: func(c *sqlite3.SQLiteConn) error {
		if _, err := c.Exec("ATTACH DATABASE ? AS "+schema, []driver.Value{file}); err != nil {
			return err
		}
		_, err := c.Exec("PRAGMA "+schema+".journal_mode = WAL", nil)
		return err
	}})
	return name
}

// An outbox in an attached SQLite database ("aux.acemq_outbox"): a commit
// to it writes the attached file's log, not main's, and the relay watches
// that one. It watched main's, so a commit on another pool waited for the
// poll (an hour here).
func TestForwarder_SQLite_OutboxInAttachedDatabase_CommitElsewhereWakesRelay(t *testing.T) {
	dir := t.TempDir()
	outboxFile := filepath.Join(dir, "outbox.db")
	dsn := "file:%s?_journal_mode=WAL&_busy_timeout=10000&_txlock=immediate"

	// The service's other process writes the outbox file directly.
	other, err := sqlx.Open("sqlite3", fmt.Sprintf(dsn, outboxFile))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = other.Close() })
	ctx := context.Background()
	if err := outbox.Migrate(ctx, other, outbox.SQLite); err != nil {
		t.Fatal(err)
	}
	writer := &testdb.DB{DB: other, Kind: testdb.SQLite, DSN: fmt.Sprintf(dsn, outboxFile), Name: outboxFile}

	relayDB, err := sql.Open(attachingDriver(outboxFile, "aux"), fmt.Sprintf(dsn, filepath.Join(dir, "main.db")))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = relayDB.Close() })

	b := testamqp.New(t)
	queue := b.Queue("t")
	f := testrelay.New(t, relayDB, outbox.ForwarderConfig{Dialect: outbox.SQLite, Table: "aux.acemq_outbox",
		PollInterval: time.Hour, MinPollInterval: time.Hour})
	runCtx, cancel := context.WithCancel(ctx)
	t.Cleanup(cancel)
	go func() { _ = f.Run(runCtx) }()
	<-f.Running()
	for i := 0; i < 20; i++ {
		publishN(t, writer, b.Exchange, "t", 1)
		if got := b.Drain(queue, 1, 10*time.Second); len(got) != 1 {
			t.Fatalf("message %d did not arrive within 10 s: a commit to the attached database did not wake the relay", i)
		}
	}
}
