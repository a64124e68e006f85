package outbox

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/acemq/watermill-outbox/internal/testdb"
)

type countingDest struct {
	mu sync.Mutex
	n  int
}

func (d *countingDest) Publish(_ context.Context, recs []Record) []error {
	d.mu.Lock()
	d.n += len(recs)
	d.mu.Unlock()
	return make([]error, len(recs))
}

// ForwarderConfig.Table names an updatable view over the outbox (a rename
// in progress, say). Behind a backlog of a window's worth or more, every
// claim is windowed; PostgreSQL views have no ctid, and a windowed claim
// that locked its candidates by ctid failed every time: nothing was
// relayed until the backlog fell below a window, which it never did (a
// review's catch). Over a view, they are locked by id alone.
func TestForwarder_Postgres_TableIsAView_BacklogDrains(t *testing.T) {
	db := testdb.New(t, testdb.Postgres)
	ctx := context.Background()
	if err := Migrate(ctx, db.DB, Postgres); err != nil {
		t.Fatal(err)
	}
	const n = 2000
	at := time.Now().Add(-time.Minute).UTC()
	insertRows(t, db, n, func(i int) (string, time.Time, any, any, any) {
		return fmt.Sprintf("r%05d", i), at.Add(time.Duration(i) * time.Microsecond), nil, nil, nil
	})
	db.MustExec("CREATE VIEW outbox_v AS SELECT * FROM acemq_outbox")
	dest := &countingDest{}
	f, err := NewForwarder(db.DB, dest, ForwarderConfig{Dialect: Postgres, Table: "outbox_v", BatchSize: 100})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = f.Close() }()
	total := 0
	for range 40 {
		got, err := f.Sweep(ctx)
		if err != nil {
			t.Fatalf("sweep through the view after %d of %d rows: %v", total, n, err)
		}
		if total += got; got == 0 {
			break
		}
	}
	if total != n {
		t.Errorf("%d of %d rows swept through the view", total, n)
	}
}
