package outbox_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// hugeID is an id of 100,000 bytes: an x-acemq-id header has no size limit
// of its own, nor does another library's text id column.
var hugeID = "evt-" + strings.Repeat("0123456789", 10_000)

// An error naming a message of a 100 KB id names it in a hundred bytes or
// so, with its size: the relay's, which it also stores as the row's
// last_error, and the inbox's, which a router logs at every delivery.
// They named it in full. An id an AceMQ library makes is named as it is; a
// short one with a space, quoted.
func TestErrors_HugeMessageID_NamedCutWithItsSize(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ id, want string }{
		{hugeID, `message "evt-0123456789012345678901234567890123456789012345678901234567890123456789012345"… (100004 bytes) to exchange`},
		{"0190f4b2-7c1e-7e33-9d1a-2b8c6f0e4a11", "message 0190f4b2-7c1e-7e33-9d1a-2b8c6f0e4a11 to exchange"},
		{"order 1", `message "order 1" to exchange`},
	} {
		err := &outbox.PublishError{Dest: outbox.ErrorContext{Exchange: "orders", RoutingKey: "created", MessageID: tc.id}, Err: errors.New("refused")}
		if got := err.Error(); !strings.Contains(got, tc.want) || len(got) > 200 {
			t.Errorf("PublishError of id %.20q… (%d bytes): %q, want it to hold %q", tc.id, len(tc.id), got, tc.want)
		}
	}
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		deliver := func(in *outbox.Inbox, msg *message.Message) error {
			_, err := in.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, nil })(msg)
			return err
		}
		noSeq := acemqMessage(hugeID)
		noSeq.Metadata.Set(outbox.HeaderAggregateID, "acct-1")
		if err := deliver(orderedInbox(t, db, outbox.InboxConfig{}), noSeq); !errors.Is(err, outbox.ErrInvalidSeq) || len(errString(err)) > 400 {
			t.Errorf("a keyed message without seq: %d bytes of error, %.300v…; want ErrInvalidSeq in 400 bytes at most", len(errString(err)), err)
		}
		// The error of a delivery whose context ended before the inbox began
		// repeats at every retry of a Retry without ResetContextOnRetry (a
		// review's catch: it named the UUID in full).
		ended := message.NewMessage(hugeID, []byte("x"))
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		ended.SetContext(ctx)
		if err := deliver(newInbox(t, db, outbox.InboxConfig{}), ended); len(errString(err)) > 600 || !strings.Contains(errString(err), "(100004 bytes)") {
			t.Errorf("a delivery whose context ended: %d bytes of error, %.300v…; want an error of 600 bytes at most naming the id's size", len(errString(err)), err)
		}
		db.MustExec("DROP TABLE processed_messages")
		if err := deliver(newInbox(t, db, outbox.InboxConfig{}), acemqMessage(hugeID)); len(errString(err)) > 400 || !strings.Contains(errString(err), "(100004 bytes)") {
			t.Errorf("a delivery whose inbox table is gone: %d bytes of error, %.300v…; want an error of 400 bytes at most naming the id's size", len(errString(err)), err)
		}
	})
}

func errString(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}
