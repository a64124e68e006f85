package outbox_test

import (
	"fmt"
	"testing"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// BenchmarkOrderedInbox_DrainOfOneKey: a key's n messages held behind its
// first, which then arrives and releases them, each applied in a
// transaction of its own. msg/s should not fall as n grows: each applied
// message recounted the key's held messages left (n²/2 index entries for
// the drain), 948 msg/s at 3,000 and 475 at 15,000 on PostgreSQL then.
//
//	go test -run '^$' -bench OrderedInbox_DrainOfOneKey -benchtime 1x .
func BenchmarkOrderedInbox_DrainOfOneKey(b *testing.B) {
	for _, kind := range []string{testdb.Postgres, testdb.MySQL, testdb.SQLite} {
		for _, n := range []int{3000, 15000} {
			b.Run(fmt.Sprintf("%s/held=%d", kind, n), func(b *testing.B) {
				seqs := make([]int, 0, n)
				for s := 2; s <= n+1; s++ {
					seqs = append(seqs, s)
				}
				var applied int
				for i := 0; i < b.N; i++ {
					b.StopTimer()
					db := migrated(b, kind)
					createEffects(b, db)
					var l applyLog
					h := orderedInbox(b, db, outbox.InboxConfig{}).Middleware(l.handler(b, db))
					deliver(b, h, "hot", seqs...)
					b.StartTimer()
					deliver(b, h, "hot", 1)
					b.StopTimer()
					if got := len(l.of("hot")); got != n+1 {
						b.Fatalf("applied %d, want %d", got, n+1)
					}
					applied += n
				}
				b.ReportMetric(float64(applied)/b.Elapsed().Seconds(), "msg/s")
			})
		}
	}
}
