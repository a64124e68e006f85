package outbox

import (
	"context"
	"database/sql"
	"fmt"
	"testing"
	"time"

	"github.com/acemq/watermill-outbox/internal/testdb"
)

// maxStragglers pending rows a minute old and nothing dead among them: a
// measure keeps the floor at the first of them, not lag before now with
// them as points, however slow the transfer of rows is. The measure
// timed the read of the rows themselves, 128 of them transferred and
// scanned, against a read of one row from lag before now: under CI's
// load at a relay's 1 ms, TestClaim_NoHeldSnapshot_LargeRecords_FloorStaysOff
// found the floor on. The walk is now timed as a count of them, one row
// back. A machine's load is modelled, not waited for: every read that
// sends rows back (QueryContext) takes 100 ms more, a read of one row
// (QueryRowContext) nothing more, against 50 ms to gain, so no delay of
// this machine's own decides it (a form that timed the rows took them as
// points in 20 measures of 20; the form of 300 µs against the machine's
// own delays took them in 3 of 20 of the count's under CI's load).
func TestMeasure_OldRowsNothingDead_NoPointsHoweverSlowTheirTransfer(t *testing.T) {
	t.Parallel()
	eachFloorKind(t, func(t *testing.T, db *testdb.DB, d Dialect) {
		ctx := context.Background()
		s, err := NewStore(db.DB, StoreConfig{Dialect: d})
		if err != nil {
			t.Fatal(err)
		}
		s.floor.pointsAbove = 50 * time.Millisecond
		old := time.Now().Add(-time.Minute).UTC()
		insertRows(t, db, maxStragglers, func(i int) (string, time.Time, any, any, any) {
			return fmt.Sprintf("old%03d", i), old.Add(time.Duration(i) * time.Millisecond), nil, nil, nil
		})
		conn, err := db.DB.Conn(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		index, keyIndex := "", ""
		if d == MySQL {
			index, keyIndex = s.indexNames()
		}
		took := 0
		for range 20 {
			m, err := s.measureFloor(ctx, slowRows{conn, 100 * time.Millisecond}, index, keyIndex, time.Now())
			if err != nil {
				t.Fatal(err)
			}
			if len(m.points) > 0 {
				took++
			}
		}
		if took > 0 {
			t.Errorf("%d measures of 20 took rows a minute old, nothing dead among them, as points: the floor stood above them for what their transfer took", took)
		}
	})
}

// slowRows runs statements on a connection, and delays by delay those
// that send rows back, not one row (QueryRowContext): a machine on which
// the transfer of rows is what is slow.
type slowRows struct {
	conn  *sql.Conn
	delay time.Duration
}

func (q slowRows) QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row {
	return q.conn.QueryRowContext(ctx, query, args...)
}

func (q slowRows) QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error) {
	rows, err := q.conn.QueryContext(ctx, query, args...)
	time.Sleep(q.delay)
	return rows, err
}
