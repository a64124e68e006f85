package outbox_test

import (
	"errors"
	"reflect"
	"testing"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// Outside a router a delivery names no handler, so the two handlers one
// ordered Inbox wrapped under one ConsumerName shared the route of held
// messages: seq 2, held when delivered to A, ran in B when B applied seq
// 1, and A's own delivery of 1 was then a duplicate. B's delivery is now
// refused before any statement (nacked: nothing run, held or recorded),
// and A, which had the consumer's first keyed delivery, applies both.
func TestOrderedInbox_TwoHandlersOfOneInboxOutsideARouter_SecondRefusedNeverRunsTheFirstsHeldMessage(t *testing.T) {
	eachMigrated(t, func(t *testing.T, db *testdb.DB, _ outbox.Dialect) {
		createEffects(t, db)
		var a, b applyLog
		in := orderedInbox(t, db, outbox.InboxConfig{ConsumerName: "billing"})
		ha, hb := in.Middleware(a.handler(t, db)), in.Middleware(b.handler(t, db))
		deliver(t, ha, "k", 2) // held, A's
		if _, err := hb(keyedMsg("k", 1)); !errors.Is(err, outbox.ErrConsumerShared) {
			t.Errorf("B's delivery of seq 1: %v, want ErrConsumerShared (nacked)", err)
		}
		if got := b.of("k"); len(got) != 0 {
			t.Errorf("B ran %v, want nothing: seq 2 was held for A, and seq 1 refused", got)
		}
		if n := countEffects(t, db, keyedMsg("k", 1).UUID); n != 0 {
			t.Errorf("seq 1: %d effects after B's refused delivery, want 0", n)
		}
		if n := countHeld(t, db); n != 1 {
			t.Errorf("%d held after B's refused delivery, want 1 (A's seq 2)", n)
		}
		deliver(t, ha, "k", 1)
		if got := a.of("k"); !reflect.DeepEqual(got, upTo(2)) {
			t.Errorf("A applied %v, want [1 2]", got)
		}
		assertEffectsOnce(t, db, "k", 2)
		deliver(t, ha, "k", 3) // A goes on as before
		if got := a.of("k"); !reflect.DeepEqual(got, upTo(3)) {
			t.Errorf("A applied %v, want [1 2 3]", got)
		}
	})
}
