package outbox_test

import (
	"context"
	"database/sql"
	"encoding/binary"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/go-sql-driver/mysql"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// openWithLoc opens db's MySQL database again with parseTime and loc as a
// DSN's loc=Local gives on a host in that zone.
func openWithLoc(t *testing.T, db *testdb.DB, loc *time.Location) *sql.DB {
	t.Helper()
	cfg, err := mysql.ParseDSN(db.DSN)
	if err != nil {
		t.Fatal(err)
	}
	cfg.ParseTime, cfg.Loc = true, loc
	c, err := mysql.NewConnector(cfg)
	if err != nil {
		t.Fatal(err)
	}
	p := sql.OpenDB(c)
	t.Cleanup(func() { _ = p.Close() })
	return p
}

// MySQL with parseTime and loc=Local on a host in Europe/Berlin: a row
// created at 02:30 UTC on 2026-03-29, a wall clock in the hour Berlin's
// clocks skip, is read at 02:30, not at 03:30 (go-sql-driver's time.Time
// of it, in loc, is an hour on, and the wall clock is what the column
// holds): the oldest pending age and the stuck list.
func TestStore_MySQLLocWithDaylightSaving_TimeInTheSkippedHour_ReadAsStored(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.MySQL)
	insertRaw(t, db, "r1", "ex", "k", "{}", "utf-8")
	if _, err := db.Exec("UPDATE acemq_outbox SET created_at = '2026-03-29 02:30:00.000000' WHERE id = 'r1'"); err != nil {
		t.Fatal(err)
	}
	berlin, err := time.LoadLocation("Europe/Berlin")
	if err != nil {
		t.Skip(err)
	}
	s, err := outbox.NewStore(openWithLoc(t, db, berlin), outbox.StoreConfig{Dialect: outbox.MySQL})
	if err != nil {
		t.Fatal(err)
	}
	st, err := s.Stats(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	want := time.Date(2026, 3, 29, 2, 30, 0, 0, time.UTC)
	if !st.OldestPending.Equal(want) {
		t.Errorf("oldest pending read as %s, want %s", st.OldestPending, want)
	}
	if _, err := db.Exec("UPDATE acemq_outbox SET attempts = 10 WHERE id = 'r1'"); err != nil {
		t.Fatal(err)
	}
	stuck, err := s.Stuck(context.Background(), 10)
	if err != nil || len(stuck) != 1 || !stuck[0].CreatedAt.Equal(want) {
		t.Errorf("stuck %+v (%v), want r1 created at %s", stuck, err, want)
	}
}

// gapNow is a zone whose clocks go forward an hour 30 minutes ago, as
// Europe/Berlin's do at 01:00 UTC on the last Sunday of March: every UTC
// wall clock of the last 30 minutes and the next 30 is a local time that
// does not exist.
func gapNow(t *testing.T) *time.Location {
	at := time.Now().Add(-30 * time.Minute).Unix()
	b := []byte("TZif")
	b = append(b, make([]byte, 16)...)
	for _, n := range []uint32{0, 0, 0, 1, 2, 8} { // isut, isstd, leap, time, type, char
		b = binary.BigEndian.AppendUint32(b, n)
	}
	b = binary.BigEndian.AppendUint32(b, uint32(int32(at)))
	b = append(b, 1)
	b = append(b, 0, 0, 0, 0, 0, 0) // +00:00, std, "STD"
	b = binary.BigEndian.AppendUint32(b, 3600)
	b = append(b, 1, 4) // +01:00, dst, "DST"
	b = append(b, "STD\x00DST\x00"...)
	loc, err := time.LoadLocationFromTZData("Gap/Now", b)
	if err != nil {
		t.Fatal(err)
	}
	return loc
}

// A keyed call that meets an id already there (a retried transaction) in
// such an hour, through loc=Local: the key is numbered 1..n. Before,
// readBack did not know its own new row by its created_at (read an hour
// late), left it with its number and gave the number back: the next
// publish took that number again, out of order, and every one after it
// failed on the key's unique (aggregate_id, seq).
func TestTxPublisher_MySQLLocWithDaylightSaving_KeyedRetryInTheSkippedHour_KeyNumbered1ToN(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.MySQL)
	p := openWithLoc(t, db, gapNow(t))
	publish := func(ids ...string) error {
		tx, err := p.Begin()
		if err != nil {
			return err
		}
		defer func() { _ = tx.Rollback() }()
		pub, err := outbox.NewTxPublisher(tx, outbox.TxPublisherConfig{Dialect: outbox.MySQL})
		if err != nil {
			return err
		}
		var msgs []*message.Message
		for _, id := range ids {
			m := message.NewMessage(id, []byte(id))
			m.Metadata.Set(outbox.MetadataAggregateID, "order-1")
			msgs = append(msgs, m)
		}
		if err := pub.Publish("orders", msgs...); err != nil {
			return err
		}
		return tx.Commit()
	}
	if err := publish("m1"); err != nil {
		t.Fatal(err)
	}
	if err := publish("m1", "m2"); err != nil { // a retry carrying m1 again, and m2
		t.Fatalf("retry: %v", err)
	}
	for _, id := range []string{"m3", "m4"} {
		if err := publish(id); err != nil {
			t.Errorf("publish %s on the key afterwards: %v", id, err)
		}
	}
	var rows []struct {
		ID  string `db:"id"`
		Seq int64  `db:"seq"`
	}
	if err := db.Select(&rows, "SELECT id, seq FROM acemq_outbox ORDER BY id"); err != nil {
		t.Fatal(err)
	}
	var counter int64
	_ = db.Get(&counter, "SELECT last_seq FROM acemq_outbox_sequences")
	t.Logf("rows (id, seq) %v, key counter %d", rows, counter)
	for i, r := range rows {
		if r.Seq != int64(i+1) {
			t.Errorf("%s has seq %d, want %d (published in the order m1..m4)", r.ID, r.Seq, i+1)
		}
	}
}

// Republish's cursor through the same DSN: a batch ending at a published_at
// in the skipped hour carried its cursor an hour on (read through the
// driver, passed back in loc), and the rows published in that hour after
// it were never made pending.
func TestRepublisher_MySQLLocWithDaylightSaving_CursorInTheSkippedHour_EveryRowMadePending(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.MySQL)
	berlin, err := time.LoadLocation("Europe/Berlin")
	if err != nil {
		t.Skip(err)
	}
	var b strings.Builder
	b.WriteString("INSERT INTO acemq_outbox (id, exchange_name, routing_key, body, headers, created_at, published_at, processed_at) VALUES ")
	for i := 0; i < 1005; i++ {
		if i > 0 {
			b.WriteString(", ")
		}
		at := "2026-03-29 02:10:00.000000"
		if i >= 1000 {
			at = "2026-03-29 02:40:00.000000"
		}
		fmt.Fprintf(&b, "('r-%06d', '', 'orders', 'x', '{}', '%s', '%s', NULL)", i, at, at)
	}
	db.MustExec(b.String())
	rp, err := outbox.NewRepublisher(openWithLoc(t, db, berlin), outbox.RepublisherConfig{Dialect: outbox.MySQL, TrackedTopics: outbox.NewTrackedTopics("orders"), Grace: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	n, err := rp.Republish(context.Background())
	if err != nil || n != 1005 {
		t.Errorf("Republish: %d, %v; want all 1005 made pending", n, err)
	}
}
