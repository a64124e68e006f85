package outbox_test

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"strings"
	"sync"
	"testing"

	"github.com/acemq/watermill-outbox/internal/testdb"
)

// hookConnector opens connections of db's driver to db.DSN whose queries
// call hook (under a lock) before they run: a way to act between two of a
// walk's statements deterministically.
type hookConnector struct {
	drv  driver.Driver
	dsn  string
	mu   sync.Mutex
	hook func(query string)
}

func (c *hookConnector) Connect(context.Context) (driver.Conn, error) {
	conn, err := c.drv.Open(c.dsn)
	if err != nil {
		return nil, err
	}
	return &hookConn{Conn: conn, c: c}, nil
}

func (c *hookConnector) Driver() driver.Driver { return c.drv }

type hookConn struct {
	driver.Conn
	c *hookConnector
}

func (h *hookConn) QueryContext(ctx context.Context, query string, args []driver.NamedValue) (driver.Rows, error) {
	h.c.mu.Lock()
	hook := h.c.hook
	h.c.mu.Unlock()
	if hook != nil {
		hook(query)
	}
	return h.Conn.(driver.QueryerContext).QueryContext(ctx, query, args)
}

func (h *hookConn) ExecContext(ctx context.Context, query string, args []driver.NamedValue) (driver.Result, error) {
	return h.Conn.(driver.ExecerContext).ExecContext(ctx, query, args)
}

func (h *hookConn) BeginTx(ctx context.Context, opts driver.TxOptions) (driver.Tx, error) {
	return h.Conn.(driver.ConnBeginTx).BeginTx(ctx, opts)
}

func (h *hookConn) CheckNamedValue(nv *driver.NamedValue) error {
	if c, ok := h.Conn.(driver.NamedValueChecker); ok {
		return c.CheckNamedValue(nv)
	}
	return driver.ErrSkip
}

func (h *hookConn) ResetSession(ctx context.Context) error {
	if r, ok := h.Conn.(driver.SessionResetter); ok {
		return r.ResetSession(ctx)
	}
	return nil
}

// hookedDB is a second pool on db's database whose queries call hook first.
func hookedDB(t testing.TB, db *testdb.DB, hook func(query string)) *sql.DB {
	t.Helper()
	c := &hookConnector{drv: db.DB.Driver(), dsn: db.DSN, hook: hook}
	h := sql.OpenDB(c)
	t.Cleanup(func() { _ = h.Close() })
	return h
}

// isRepublishPick tells a Republish's pick of a later batch (one with a cursor).
func isRepublishPick(q string, later bool) bool {
	if !strings.Contains(q, "processed_at IS NULL") || !strings.Contains(q, "ORDER BY published_at, id LIMIT") {
		return false
	}
	return !later || strings.Contains(q, "published_at = ") || strings.Contains(q, "published_at >= ")
}
