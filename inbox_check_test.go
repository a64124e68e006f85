package outbox_test

import (
	"context"
	"strings"
	"testing"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// Check reads the inbox's columns: an InboxTable naming the outbox table
// (the name every other config's Table takes) passed it, reading no
// column, and every delivery then failed (an API review). It fails,
// naming the field; the inbox's own table passes.
func TestInbox_Check_TableWithoutTheInboxsColumns_FailsNamingTheField(t *testing.T) {
	t.Parallel()
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		ctx := context.Background()
		if err := newInbox(t, db, outbox.InboxConfig{ConsumerName: "c"}).Check(ctx); err != nil {
			t.Errorf("Check of processed_messages: %v", err)
		}
		err := newInbox(t, db, outbox.InboxConfig{ConsumerName: "c", InboxTable: outbox.DefaultTable}).Check(ctx)
		if err == nil || !strings.Contains(err.Error(), "InboxTable") {
			t.Errorf("Check of acemq_outbox as the inbox table: %v, want an error naming InboxTable", err)
		}
	})
}
