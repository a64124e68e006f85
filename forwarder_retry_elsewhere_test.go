package outbox_test

import (
	"testing"

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
	retryDuringADrain(t, db, func(*outbox.Forwarder) *outbox.Store {
		ops, err := outbox.NewStore(otherPool(t, db).DB, outbox.StoreConfig{Dialect: outbox.Postgres})
		if err != nil {
			t.Fatal(err)
		}
		return ops
	})
}
