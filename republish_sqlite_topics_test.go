package outbox_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// SQLite's limit is 32,766 variables: a Republisher tracking 17,000 topics
// fits it with one per topic. A first cut of the BLOB routing_key mend gave
// each topic twice (as TEXT and as BLOB), and every Republish failed ("too
// many SQL variables"; a code review).
func TestRepublish_SQLite_ManyTrackedTopics_WithinThePlaceholderLimit(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	topic := "orders-" + testdb.RandomName()
	id := publishN(t, db, "", topic, 1)[0]
	publishAllAt(t, db, time.Now().Add(-time.Hour))
	topics := []string{topic}
	for i := 0; i < 17000; i++ {
		topics = append(topics, fmt.Sprintf("t.%05d", i))
	}
	rp, err := outbox.NewRepublisher(db.DB, outbox.RepublisherConfig{TrackedTopics: outbox.NewTrackedTopics(topics...), Grace: 10 * time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	n, err := rp.Republish(context.Background())
	if err != nil || n != 1 || stateOf(t, db, id).Published {
		t.Fatalf("Republish tracking %d topics on SQLite: %d made pending, %v; want 1, no error", len(topics), n, err)
	}
}
