package outbox

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/jmoiron/sqlx"

	"github.com/acemq/watermill-outbox/internal/sqldialect"
)

// dbClock is the database server's clock, as one process reads it. The
// at-most-once inbox's stamps (a key running until, done at) are written by
// one process and read by the others, whose hosts' clocks may be seconds
// apart: compared with each process's own clock, a copy on a host 40 s
// ahead took a key still running for done, and acked its message as a
// duplicate while the first handler ran; that handler then failed, and the
// message was lost. The stamps are written and compared on the server's
// clock instead: this process's clock plus an offset, measured against the
// server's at the first stamp and once a minute after (off by at most half
// the measure's round trip).
type dbClock struct {
	query string           // reads the server's time; "" on SQLite, whose server is this host
	local func() time.Time // time.Now; a test's skewed one

	mu     sync.Mutex
	offset time.Duration // the server's clock minus this process's
	read   time.Time     // the local time offset was measured at; zero: never
}

// dbClockEvery is how often the offset is measured again (a host's clock
// stepped by NTP).
const dbClockEvery = time.Minute

func newDBClock(d Dialect) *dbClock {
	c := &dbClock{local: time.Now}
	switch d {
	case Postgres:
		c.query = "SELECT clock_timestamp()"
	case MySQL:
		c.query = "SELECT CAST(UTC_TIMESTAMP(6) AS CHAR)" // text: see sqldialect's mysql timeText
	}
	return c
}

// now is the server's time now. Should a measure fail after an earlier
// one, the earlier offset stands. The measure runs outside the lock: on a
// pool whose connections are all taken it waits for one, and the other
// deliveries, each under its own context, take the last offset meanwhile.
func (c *dbClock) now(ctx context.Context, db *sqlx.DB, d sqldialect.Dialect) (time.Time, error) {
	if c.query == "" {
		return c.local(), nil
	}
	c.mu.Lock()
	at, offset, read := c.local(), c.offset, c.read
	c.mu.Unlock()
	if !read.IsZero() && at.Sub(read) <= dbClockEvery && !at.Before(read) {
		return c.local().Add(offset), nil
	}
	server := sqldialect.NewTime(d)
	sent := c.local()
	if err := db.QueryRowContext(ctx, c.query).Scan(server); err != nil {
		if read.IsZero() {
			return time.Time{}, fmt.Errorf("outbox: inbox: read the database server's clock: %w", err)
		}
		return c.local().Add(offset), nil
	}
	back := c.local()
	offset = server.T.Sub(sent.Add(back.Sub(sent) / 2))
	c.mu.Lock()
	c.offset, c.read = offset, back
	c.mu.Unlock()
	return c.local().Add(offset), nil
}
