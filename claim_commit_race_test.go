package outbox_test

import (
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// On MySQL a locking claim reads each row as the scan reaches it (FOR
// UPDATE SKIP LOCKED): a transaction that commits while the claim walks its
// rows showed the claim its later rows only, the earlier ones still locked
// by their writer when the claim passed them, and the relay sent the
// transaction tail first. Here a transaction of 20,000 rows commits at a
// different moment of the claim in each try; the claim's rows of it must be
// its first ones, in order. Before the fix the claim took 1,000 rows from
// its row 86 to 6,673 on in 10 of 12 tries (text form); with the snapshot check but
// not the subquery that takes the snapshot before the walk, it still took
// a tail.
//
// The relay runs its claims prepared on MySQL, and MariaDB plans a prepared
// statement at each execution: both forms are tried.
func TestStore_MySQL_ClaimRacingACommit_NeverTakesATransactionsTailWithoutItsHead(t *testing.T) {
	for _, prepared := range []bool{false, true} {
		t.Run(map[bool]string{false: "text", true: "prepared"}[prepared], func(t *testing.T) {
			// Side by side, each on its own database, and beside nothing
			// else: the test stays serial. A claim slowed by the other
			// walks longer, and a commit lands in its walk no less often.
			t.Parallel()
			claimRacingACommit(t, prepared)
		})
	}
}

func claimRacingACommit(t *testing.T, prepared bool) {
	db := migrated(t, testdb.MySQL)
	s, err := outbox.NewStore(db.DB, outbox.StoreConfig{Dialect: outbox.MySQL})
	if err != nil {
		t.Fatal(err)
	}
	if prepared {
		if n, err := outbox.PrepareClaims(s, 1000); err != nil || n == 0 {
			t.Fatalf("prepare the relay's statements: %d, %v", n, err)
		}
	}
	const rows = 20000
	for try := 0; try < 10; try++ {
		tx := db.MustBegin()
		t.Cleanup(func() { _ = tx.Rollback() })
		pub, err := outbox.NewTxPublisher(tx, outbox.TxPublisherConfig{Exchange: "x"})
		if err != nil {
			t.Fatal(err)
		}
		msgs := make([]*message.Message, rows)
		pos := make(map[string]int, rows)
		for i := range msgs {
			msgs[i] = message.NewMessage(watermill.NewUUID(), []byte("x"))
			pos[msgs[i].UUID] = i
		}
		if err := pub.Publish("t", msgs...); err != nil {
			t.Fatal(err)
		}
		publishBatch(t, db, "x", "t", 1) // after T's rows: the claim walks all of them to reach it
		type result struct {
			ids  []string
			held *outbox.HeldClaim
			err  error
		}
		done := make(chan result, 1)
		start := time.Now()
		go func() {
			ids, held, err := outbox.Claim(s, 1000, "r")
			done <- result{ids, held, err}
		}()
		time.Sleep(time.Duration(try) * 4 * time.Millisecond)
		if err := tx.Commit(); err != nil {
			t.Fatal(err)
		}
		r := <-done
		if r.err != nil {
			t.Fatal(r.err)
		}
		t.Cleanup(func() { _ = r.held.Abandon() })
		// The claim's rows of T must be T's first ones, in order.
		n := 0
		for _, id := range r.ids {
			p, ok := pos[id]
			if !ok {
				continue
			}
			if p != n {
				t.Fatalf("try %d (commit %s into the claim): the claim's rows of the transaction are its rows %d.. at %d, want its first ones in order", try, time.Since(start).Round(time.Millisecond), p, n)
			}
			n++
		}
		if err := r.held.Abandon(); err != nil {
			t.Fatal(err)
		}
		if _, err := db.Exec("TRUNCATE TABLE acemq_outbox"); err != nil {
			t.Fatal(err)
		}
	}
}

// A row without a created_at (a nullable column of another library's
// table) is still claimed, and fails alone as malformed, whatever bounds
// the claim's walk by created_at.
func TestStore_MySQL_RowWithoutCreatedAt_StillClaimed(t *testing.T) {
	db := migrated(t, testdb.MySQL)
	if _, err := db.Exec("ALTER TABLE acemq_outbox MODIFY created_at DATETIME(6) NULL"); err != nil {
		t.Fatal(err)
	}
	s, err := outbox.NewStore(db.DB, outbox.StoreConfig{Dialect: outbox.MySQL})
	if err != nil {
		t.Fatal(err)
	}
	msgs := publishBatch(t, db, "x", "t", 2)
	if _, err := db.Exec("UPDATE acemq_outbox SET created_at = NULL WHERE id = ?", msgs[0].UUID); err != nil {
		t.Fatal(err)
	}
	ids, held, err := outbox.Claim(s, 10, "r")
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = held.Abandon() }()
	if len(ids) != 2 {
		t.Fatalf("claimed %v, want both rows, the one without a created_at too", ids)
	}
}
