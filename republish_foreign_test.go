package outbox_test

import (
	"context"
	"testing"
	"time"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
	"github.com/acemq/watermill-outbox/internal/testrails"
)

// foreignPublishedAt are published_at values as other AceMQ libraries
// write them into an SQLite acemq_outbox (ISO 8601 text: Rust's sqlx
// RFC 3339, JavaScript's toISOString, a writer's local offset; Java's
// sqlite-jdbc Unix milliseconds), and this library's own form, by name;
// old ones published an hour ago, young ones a minute ago. A cutoff
// between the two (Grace, a retention of 10 minutes) must take every old
// one and no young one. As text, "…T…" sorts above this library's
// "… …" of the same day, and text with an offset is not UTC: +05:00 an
// hour ago reads as four hours ahead, -05:00 a minute ago as five hours
// behind, whatever the time of day.
func foreignPublishedAt(now time.Time) (old, young map[string]any) {
	hourAgo, minuteAgo := now.Add(-time.Hour).UTC(), now.Add(-time.Minute).UTC()
	east, west := time.FixedZone("", 5*3600), time.FixedZone("", -5*3600)
	old = map[string]any{
		"js-Z":        hourAgo.Format("2006-01-02T15:04:05.000Z"),
		"rust-+00:00": hourAgo.Format("2006-01-02T15:04:05.000000+00:00"),
		"T-+05:00":    hourAgo.In(east).Format("2006-01-02T15:04:05.000000-07:00"),
		"java-millis": hourAgo.UnixMilli(),
		"own":         hourAgo.Format("2006-01-02 15:04:05.000000"),
	}
	young = map[string]any{
		"js-Z":         minuteAgo.Format("2006-01-02T15:04:05.000Z"),
		"rust-+00:00":  minuteAgo.Format("2006-01-02T15:04:05.000000+00:00"),
		"space--05:00": minuteAgo.In(west).Format("2006-01-02 15:04:05.000000-07:00"),
		"java-millis":  minuteAgo.UnixMilli(),
		"own":          minuteAgo.Format("2006-01-02 15:04:05.000000"),
	}
	return old, young
}

// writeForeignPublishedAt publishes one record of topic per value and sets
// its published_at to it; it returns the ids by "old:" or "young:" name.
func writeForeignPublishedAt(t *testing.T, db *testdb.DB, topic string, now time.Time) map[string]string {
	t.Helper()
	old, young := foreignPublishedAt(now)
	ids := map[string]string{}
	for prefix, values := range map[string]map[string]any{"old:": old, "young:": young} {
		for name, v := range values {
			id := publishN(t, db, "", topic, 1)[0]
			db.MustExec("UPDATE acemq_outbox SET published_at = ? WHERE id = ?", v, id)
			ids[prefix+name] = id
		}
	}
	return ids
}

// On SQLite, a record another AceMQ library marked published in ISO 8601
// text is resent by the instant it was published, not by its text: one
// published an hour ago is sent again whatever its form, one published a
// minute ago (inside Grace) is left alone whatever its offset. Compared
// as text, "…T…" records of the cutoff's UTC date were not resent until
// the next day, and one with a -05:00 offset was resent inside Grace.
func TestRepublish_SQLiteISOPublishedAt_ResentByInstantNotByText(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.SQLite)
	ids := writeForeignPublishedAt(t, db, "orders", time.Now())
	rp, err := outbox.NewRepublisher(db.DB, outbox.RepublisherConfig{TrackedTopics: outbox.NewTrackedTopics("orders"), Grace: 10 * time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	n, err := rp.Republish(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	old, young := foreignPublishedAt(time.Now())
	for name := range old {
		if stateOf(t, db, ids["old:"+name]).Published {
			t.Errorf("%s published an hour ago (%v): not made pending", name, old[name])
		}
	}
	for name := range young {
		if !stateOf(t, db, ids["young:"+name]).Published {
			t.Errorf("%s published a minute ago (%v), inside Grace: made pending", name, young[name])
		}
	}
	if n != int64(len(old)) {
		t.Errorf("Republish made %d pending, want the %d old", n, len(old))
	}
}

// PurgePublished and the counts beside it compare published_at as
// Republish does: on SQLite a record another library marked published in
// ISO 8601 text an hour ago is purged (and counted as published before
// the cutoff), one marked a minute ago is kept, whatever its offset.
func TestStore_SQLiteISOPublishedAt_PurgedByInstantNotByText(t *testing.T) {
	t.Parallel()
	db := migrated(t, testdb.SQLite)
	now := time.Now()
	ids := writeForeignPublishedAt(t, db, "orders", now)
	old, young := foreignPublishedAt(now)
	store, err := outbox.NewStore(db.DB, outbox.StoreConfig{})
	if err != nil {
		t.Fatal(err)
	}
	cutoff := now.Add(-10 * time.Minute)
	if n, err := store.PublishedBefore(context.Background(), cutoff); err != nil || n != int64(len(old)) {
		t.Errorf("PublishedBefore = %d, %v; want the %d old", n, err, len(old))
	}
	if n, err := store.PublishedSince(context.Background(), cutoff); err != nil || n != int64(len(young)) {
		t.Errorf("PublishedSince = %d, %v; want the %d young", n, err, len(young))
	}
	n, err := store.PurgePublished(context.Background(), 10*time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	var left []string
	if err := db.Select(&left, "SELECT id FROM acemq_outbox"); err != nil {
		t.Fatal(err)
	}
	kept := map[string]bool{}
	for _, id := range left {
		kept[id] = true
	}
	for name := range old {
		if kept[ids["old:"+name]] {
			t.Errorf("%s published an hour ago (%v): kept", name, old[name])
		}
	}
	for name := range young {
		if !kept[ids["young:"+name]] {
			t.Errorf("%s published a minute ago (%v): purged", name, young[name])
		}
	}
	if n != int64(len(old)) {
		t.Errorf("PurgePublished deleted %d, want the %d old", n, len(old))
	}
}

// An acemq_outbox the Rails library created on MySQL/MariaDB keeps the
// database's case- and accent-insensitive collation on routing_key and
// exchange_name. AMQP routing keys and exchange names are case-sensitive,
// and the inbox's TrackedTopics compares them exactly: records under
// "Orders" or "ÓRDERS" (or to exchange "Shop") are another topic's, which
// no tracked consumer marks. Republish leaves them alone; compared by the
// collation, every boot sent them again.
func TestRepublish_RailsTableMySQL_RoutingKeyOfAnotherCase_LeftAlone(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, testdb.MySQL)
	testrails.CreateTable(t, db)
	migrate(t, db)
	old := time.Now().Add(-time.Hour)
	testrails.Insert(t, db, testrails.Row{ID: "tracked", Exchange: "shop", RoutingKey: "orders", Body: "{}", CreatedAt: old, PublishedAt: old})
	others := []testrails.Row{
		{ID: "key-case", Exchange: "shop", RoutingKey: "Orders"},
		{ID: "key-accent", Exchange: "shop", RoutingKey: "ÓRDERS"},
		{ID: "key-trailing-space", Exchange: "shop", RoutingKey: "orders "},
		{ID: "exchange-case", Exchange: "Shop", RoutingKey: "orders"},
	}
	for _, r := range others {
		r.Body, r.CreatedAt, r.PublishedAt = "{}", old, old
		testrails.Insert(t, db, r)
	}
	rp, err := outbox.NewRepublisher(db.DB, outbox.RepublisherConfig{TrackedTopics: outbox.NewTrackedTopics("orders"), Exchanges: []string{"shop"}, Grace: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	for boot := 1; boot <= 2; boot++ {
		n, err := rp.Republish(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		if n != 1 {
			t.Errorf("boot %d made %d records pending, want 1 (routing key \"orders\" to \"shop\")", boot, n)
		}
		for _, r := range others {
			if !stateOf(t, db, r.ID).Published {
				t.Errorf("boot %d: record %s (%q to %q) made pending", boot, r.ID, r.RoutingKey, r.Exchange)
			}
		}
		// The relay sent the tracked record again, an hour ago; nobody marked it.
		db.MustExec("UPDATE acemq_outbox SET published_at = ? WHERE published_at IS NULL", testrails.Time(old))
	}
}
