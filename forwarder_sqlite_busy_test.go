package outbox_test

import (
	"context"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// On SQLite a service's writers hold the write lock most of the time, in
// transactions of 4 ms with 0.5 ms between them, from a connection of
// their own as another process would. The relay's claims and marks still
// get the lock between two of them within the pool's busy_timeout (100
// ms), every time: the relay tries again every fraction of a millisecond.
// SQLite's own wait for a busy lock tries about nine times in 100 ms
// (after 1, 2, 5, 10, 15, 20, 25 ms …) and, now and then, lands in no gap:
// with it, one of the two hundred claims and marks failed in each of ten
// runs. (At 40 ms and sixty writes it also failed every run, but the
// relay's own wait came too near its limit under a loaded CI.) Each
// connection's busy_timeout is back at 100 ms afterwards.
func TestForwarder_SQLite_ServicesHoldTheWriteLock_ClaimsAndMarksGetItBetween(t *testing.T) {
	db := testdb.New(t, testdb.SQLite)
	migrate(t, db)
	const rows = 100
	msgs := make([]*message.Message, rows)
	for i := range msgs {
		msgs[i] = message.NewMessage(testdb.RandomName(), []byte("x"))
	}
	publishInTx(t, db, "busy", msgs)

	dsn := strings.Replace(db.DSN, "_busy_timeout=10000", "_busy_timeout=100", 1)
	if dsn == db.DSN {
		t.Fatalf("DSN %s sets no _busy_timeout=10000 to replace", db.DSN)
	}
	pool, err := sqlx.Open("sqlite3", dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	pool.SetMaxOpenConns(1) // the connection the relay used is the one asked after
	services, err := sqlx.Open("sqlite3", db.DSN)
	if err != nil {
		t.Fatal(err)
	}
	defer services.Close()

	ctx, stop := context.WithCancel(context.Background())
	var (
		wg    sync.WaitGroup
		held  = make(chan struct{})
		holds atomic.Int64
	)
	wg.Add(1)
	go func() {
		defer wg.Done()
		for ctx.Err() == nil {
			tx, err := services.Begin() // BEGIN IMMEDIATE (_txlock): the write lock
			if err != nil {
				t.Errorf("services: %v", err)
				return
			}
			if holds.Add(1) == 1 {
				close(held)
			}
			time.Sleep(4 * time.Millisecond)
			if err := tx.Commit(); err != nil {
				t.Errorf("services: %v", err)
				return
			}
			time.Sleep(500 * time.Microsecond)
		}
	}()
	defer func() { stop(); wg.Wait() }()

	broker := &capture{}
	f, err := outbox.NewForwarder(pool, outbox.NewPublisherDestination(broker, nil), outbox.ForwarderConfig{BatchSize: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	<-held
	started := holds.Load()
	for i := range rows {
		n, err := f.Sweep(context.Background())
		if err != nil || n != 1 {
			t.Fatalf("sweep %d: published %d, err %v; want 1 and no error", i+1, n, err)
		}
		time.Sleep(5 * time.Millisecond) // the broker's time, as it were: the services' turn
	}
	during := holds.Load() - started
	stop()
	wg.Wait()
	if during < rows {
		t.Fatalf("the services took the lock %d times during the %d sweeps, want at least %d: the test did not contend", during, rows, rows)
	}
	if len(broker.msgs) != rows {
		t.Fatalf("published %d messages, want %d", len(broker.msgs), rows)
	}
	var ms int
	if err := pool.Get(&ms, "PRAGMA busy_timeout"); err != nil || ms != 100 {
		t.Fatalf("busy_timeout after the sweeps %d (%v), want 100", ms, err)
	}
}
