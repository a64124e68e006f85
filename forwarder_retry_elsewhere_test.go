package outbox_test

import (
	"context"
	"fmt"
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
	retryDuringADrain(t, db, func(*outbox.Forwarder) *outbox.Store {
		ops, err := outbox.NewStore(otherPool(t, db).DB, outbox.StoreConfig{Dialect: outbox.Postgres})
		if err != nil {
			t.Fatal(err)
		}
		return ops
	})
}

// The same on MySQL and SQLite, which have no NOTIFY to say so: the drain
// goes back to the head every second at most, for rows made
// pending again that this process was not told of. Before, the record
// waited for the drain's end: 3,000 rows on.
func TestForwarder_RetryFromAnotherProcessDuringADrain_NoNotify_DrainGoesBackForIt(t *testing.T) {
	for _, kind := range []string{testdb.MySQL, testdb.SQLite} {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			db := migrated(t, kind)
			retryDuringADrainBy(t, db, backlogOf/2, lookBackPace, func(*outbox.Forwarder) func(string) error {
				ops, err := outbox.NewStore(otherPool(t, db).DB, outbox.StoreConfig{Dialect: dialectOf(t, db)})
				if err != nil {
					t.Fatal(err)
				}
				return func(id string) error {
					if m, err := ops.Retry(context.Background(), id); m != 1 || err != nil {
						return fmt.Errorf("retry: %d %v", m, err)
					}
					return nil
				}
			})
		})
	}
}

// Another library's tool sets a stuck record's attempts back by an
// UPDATE, on any database: nothing tells the relay (no NOTIFY on
// PostgreSQL either), and its drain goes back for the record all the same.
func TestForwarder_RecordSetBackByAnUpdateElsewhereDuringADrain_DrainGoesBackForIt(t *testing.T) {
	for _, kind := range testdb.Kinds {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			db := migrated(t, kind)
			retryDuringADrainBy(t, db, backlogOf/2, lookBackPace, func(*outbox.Forwarder) func(string) error {
				other := otherPool(t, db)
				return func(id string) error {
					_, err := other.Exec(other.Rebind("UPDATE acemq_outbox SET attempts = 0, last_error = NULL WHERE id = ?"), id)
					return err
				}
			})
		})
	}
}

// lookBackPace is what the destination of the tests of a drain's look back
// takes over each send of ten records: at most 1,000 a second where it
// sends one batch at a time, however fast the machine, so that the second
// the drain goes on before it goes back stays well within half the
// backlog (3,000 rows, 3 s or more).
const lookBackPace = 10 * time.Millisecond
