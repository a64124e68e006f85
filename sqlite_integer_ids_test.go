package outbox_test

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// SQLite, a foreign table whose id column has no declared type (BLOB
// affinity, the configuration TestForwarder_SQLiteIntegerIDInAColumnWithoutAType
// supports): integer ids are stored as INTEGERs. A drain resumes after its
// last row with the cursor's id bound as TEXT ("id > '2'"), which no
// INTEGER is greater than: the rest of that created_at was passed over and
// the rows after it went out first. The cursor binds the INTEGER now.
func TestForwarder_SQLiteIntegerIDsWithoutAType_DrainInCreatedAtIDOrder(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, testdb.SQLite)
	foreignIDTable(t, db, "")
	at := time.Now().Add(-time.Hour).Truncate(time.Second)
	var want []string
	for i := 1; i <= 6; i++ {
		insertForeignID(t, db, i, "x", at)
		want = append(want, fmt.Sprint(i))
	}
	for i := 7; i <= 10; i++ {
		insertForeignID(t, db, i, "x", at.Add(time.Second))
		want = append(want, fmt.Sprint(i))
	}
	var typ string
	if err := db.Get(&typ, "SELECT typeof(id) FROM acemq_outbox LIMIT 1"); err != nil || typ != "integer" {
		t.Fatalf("id stored as %q (%v)", typ, err)
	}
	dest := newRefuseOnceDest(0)
	f, err := outbox.NewForwarder(db.DB, dest, outbox.ForwarderConfig{
		Dialect: dialectOf(t, db), BatchSize: 2, MaxBatchSize: 2,
		PollInterval: 50 * time.Millisecond, OnError: func(error, outbox.ErrorContext) {},
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- f.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done; _ = f.Close() })
	waitFor(t, 20*time.Second, "all published", func() bool { return len(dest.snapshot()) >= len(want) })
	got := dest.snapshot()
	t.Logf("published order: %v", got)
	if !slices.Equal(got, want) {
		t.Errorf("published in order %v, want created_at, id order %v", got, want)
	}
}

// The same table: a stuck row of integer id 5. Stuck lists it as "5", as
// outboxctl stuck --json does; Retry("5") bound the text, which no INTEGER
// equals, and retried nothing. It looks for the INTEGER too now.
func TestStore_SQLiteIntegerIDWithoutAType_RetryOfTheStuckRowStuckLists(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, testdb.SQLite)
	foreignIDTable(t, db, "")
	insertForeignID(t, db, 5, "x", time.Now().Add(-time.Minute))
	if _, err := db.Exec("UPDATE acemq_outbox SET attempts = 10, last_error = 'x'"); err != nil {
		t.Fatal(err)
	}
	s, err := outbox.NewStore(db.DB, outbox.StoreConfig{Dialect: dialectOf(t, db), MaxAttempts: 10})
	if err != nil {
		t.Fatal(err)
	}
	stuck, err := s.Stuck(context.Background(), 10)
	if err != nil || len(stuck) != 1 {
		t.Fatalf("stuck: %v %v", stuck, err)
	}
	t.Logf("stuck id: %q", stuck[0].ID)
	n, err := s.Retry(context.Background(), stuck[0].ID)
	if err != nil {
		t.Fatal(err)
	}
	if n != 1 {
		t.Errorf("Retry(%q) of the stuck row Stuck listed changed %d rows, want 1", stuck[0].ID, n)
	}
}
