package outbox

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/acemq/watermill-outbox/internal/testdb"
)

// A full claim whose last row has a NULL created_at (another library's
// row; PostgreSQL sorts them last) leaves the drain no cursor, and a keyed
// record published in it makes the relay look for its key's next record
// behind that cursor: it compared the next record with the cursor it did
// not have, and the relay panicked (Run's goroutine: the process). It goes
// on from the head.
func TestForwarder_FullClaimEndingInANullCreatedAt_KeyedRecordPublished_RelayGoesOn(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, testdb.Postgres)
	ctx := context.Background()
	if err := Migrate(ctx, db.DB, Postgres); err != nil {
		t.Fatal(err)
	}
	allowNullCreatedAt(db)
	base := time.Now().Add(-time.Hour).UTC()
	ins := "INSERT INTO acemq_outbox (id, exchange_name, routing_key, body, headers, created_at, aggregate_id, seq) VALUES ($1, '', 'k', '{}', '{}', $2, $3, $4)"
	db.MustExec(ins, "K#1", base, "K", 1)
	db.MustExec(ins, "K#2", base.Add(time.Millisecond), "K", 2)
	const nulls = 9 // with K#1, a full claim of 10: K#2 waits for K#1
	for i := range nulls {
		db.MustExec("INSERT INTO acemq_outbox (id, exchange_name, routing_key, body, headers, created_at) VALUES ($1, '', 'k', '{}', '{}', NULL)", fmt.Sprintf("null-%d", i))
	}
	dest := newStressDest()
	f, err := NewForwarder(db.DB, dest, ForwarderConfig{Dialect: Postgres, BatchSize: 10, MaxBatchSize: 10})
	if err != nil {
		t.Fatal(err)
	}
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- f.Run(runCtx) }()
	defer func() { cancel(); <-done; _ = f.Close() }()
	deadline := time.Now().Add(30 * time.Second)
	for _, id := range []string{"K#1", "K#2"} { // the rows without a created_at fail as malformed
		for {
			if _, ok := dest.firstAt(id); ok {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s not published within 30 s", id)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
}
