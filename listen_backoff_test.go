package outbox_test

import (
	"testing"
	"time"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// listenPid is the pid of the relay pool's LISTEN backend, 0 when none.
func listenPid(t testing.TB, db *testdb.DB, app string) int {
	t.Helper()
	var pid int
	err := db.Get(&pid, "SELECT COALESCE(max(pid), 0) FROM pg_stat_activity WHERE application_name = $1 AND query = 'LISTEN acemq_outbox'", app)
	if err != nil {
		t.Fatal(err)
	}
	return pid
}

// The LISTEN connection of a relay over a quiet outbox is ended again and
// again after it has listened a while (idle_session_timeout, a pooler, a
// DBA). The reconnect's backoff went back to its shortest only once a
// notification had been heard: each loss left the relay longer without
// LISTEN than the one before (100, 200, 400, 800, 1600 ms…, up to
// RetryMax), polling meanwhile. A LISTEN that lasted listenLived now
// resets it. Not parallel: it sets listenLived.
func TestForwarder_Postgres_ListenEndedAfterLiving_ReconnectsAtTheShortestBackoff(t *testing.T) {
	t.Cleanup(outbox.SetListenLived(200 * time.Millisecond))
	db := migrated(t, testdb.Postgres)
	relayDB, app := ownRelayPool(t, db)
	logs := &recordingLogger{}
	f := newForwarder(t, &testdb.DB{DB: relayDB, Kind: db.Kind, DSN: db.DSN, Name: db.Name}, outbox.ForwarderConfig{RetryMax: 5 * time.Second, Logger: logs})
	runInBackground(t, f)
	waitFor(t, 10*time.Second, "LISTEN", func() bool { return listenPid(t, db, app) != 0 })
	var gaps []time.Duration
	for range 6 {
		time.Sleep(400 * time.Millisecond) // it listens
		pid := listenPid(t, db, app)
		if _, err := db.Exec("SELECT pg_terminate_backend($1)", pid); err != nil {
			t.Fatal(err)
		}
		killed := time.Now()
		waitFor(t, 30*time.Second, "LISTEN again", func() bool {
			p := listenPid(t, db, app)
			return p != 0 && p != pid
		})
		gaps = append(gaps, time.Since(killed).Round(time.Millisecond))
	}
	t.Logf("without LISTEN after each loss: %v", gaps)
	if last := gaps[len(gaps)-1]; last > time.Second {
		t.Errorf("after LISTEN connections that had each listened 400 ms, the relay went %s without LISTEN after the last loss (%v): the backoff grew", last, gaps)
	}
	// Each loss is logged, and so is each return (a user review: the loss
	// at ERROR, and nothing after it).
	waitFor(t, 5*time.Second, "LISTEN's returns logged, one after each loss", func() bool {
		lost := len(logs.find("Outbox LISTEN connection lost; the relay polls until it is back"))
		return lost >= 6 && len(logs.find("Outbox LISTEN connection back: commits wake the relay again")) == lost
	})
}
