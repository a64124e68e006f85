package outbox_test

import (
	"context"
	"slices"
	"testing"
	"time"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// A stuck keyed record retried from another process (outboxctl retry, a
// Store over a pool of its own) while the relay drains a backlog on
// PostgreSQL: the retry's NOTIFY woke the relay, but nothing brought its
// drain back from its cursor, past the record, and the record (and its
// key) waited for the rest of the backlog. The retry now says so on a
// channel of its own, and the drain goes back for it.
func TestForwarder_Postgres_RetryFromAnotherProcessDuringADrain_DrainGoesBackForIt(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.Postgres)
	const n = 3000
	keyBeforeBacklog(t, db, n)
	if _, err := db.Exec("UPDATE acemq_outbox SET attempts = 10, last_error = 'stuck' WHERE id = $1", keyedID("K", 1)); err != nil {
		t.Fatal(err)
	}
	other := otherPool(t, db)
	ops, err := outbox.NewStore(other.DB, outbox.StoreConfig{Dialect: outbox.Postgres})
	if err != nil {
		t.Fatal(err)
	}
	dest := newRefuseOnceDest(time.Millisecond)
	relayInTens(t, db, dest)
	waitFor(t, 60*time.Second, "the drain under way", func() bool { return len(dest.snapshot()) >= 100 })
	retried := time.Now()
	if m, err := ops.Retry(context.Background(), keyedID("K", 1)); m != 1 || err != nil {
		t.Fatalf("retry: %d %v", m, err)
	}
	before := len(dest.snapshot())
	waitFor(t, 120*time.Second, "everything published", func() bool { return len(dest.snapshot()) == n+2 })
	pub := dest.snapshot()
	at := slices.Index(pub, keyedID("K", 1))
	dest.mu.Lock()
	wait := dest.pubAt[keyedID("K", 1)].Sub(retried)
	dest.mu.Unlock()
	t.Logf("retried elsewhere when %d were out; K#1 published as %d of %d, %s after the retry", before, at+1, len(pub), wait)
	if at > before+n/10 {
		t.Errorf("K#1 retried elsewhere when %d records were out went out as %d of %d, %s after the retry: it waited for the drain", before, at+1, len(pub), wait)
	}
}
