package outbox

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/fsnotify/fsnotify"

	"github.com/acemq/watermill-outbox/internal/sqldialect"
)

// watch wakes the relay whenever a process commits to the SQLite database
// it relays from, until ctx ends: SQLite has no LISTEN, but every commit
// writes the database's write-ahead log (or, in rollback-journal mode, the
// database file), and the operating system reports the write (inotify,
// kqueue, ReadDirectoryChangesW, through fsnotify). The relay in its own
// process (outboxctl relay) so learns of a commit within a millisecond and
// sends nothing to an idle database. The watch is on the directory, so the
// log is seen again after SQLite deletes and recreates it. The write comes
// before the commit is visible, so a woken relay's probe waits for the
// writer (see Store.hasClaimableNow). Commits to other tables of the file
// wake the relay too; each costs such a probe, and wake-ups that come while
// the relay works coalesce into one. Where the watch cannot
// be set up (an in-memory database, a file system without notifications)
// the relay says so once and polls.
func (f *Forwarder) watch(ctx context.Context) {
	path, err := f.store.databaseFile(ctx)
	if ctx.Err() != nil {
		return // the relay stopped, at its start maybe: nothing to say
	}
	if err != nil {
		f.log.Error("Outbox forwarder: cannot tell the SQLite database's file; the relay polls", err, watermill.LogFields{"poll_interval": f.cfg.PollInterval})
		return
	}
	if path == "" {
		f.log.Info("Outbox forwarder: an SQLite database without a file (in memory) cannot be watched; the relay polls", watermill.LogFields{"poll_interval": f.cfg.PollInterval})
		return
	}
	w, err := fsnotify.NewWatcher()
	if err != nil {
		f.log.Error("Outbox forwarder: no file notifications; the relay polls", err, watermill.LogFields{"poll_interval": f.cfg.PollInterval})
		return
	}
	defer w.Close()
	dir := filepath.Dir(path)
	if err := w.Add(dir); err != nil {
		f.log.Error("Outbox forwarder: cannot watch the SQLite database's directory; the relay polls", err, watermill.LogFields{"dir": dir, "poll_interval": f.cfg.PollInterval})
		return
	}
	// What the watch names may differ from what SQLite reports by a link in
	// the directory's path: compare within the directory only.
	base := filepath.Base(path)
	ours := map[string]bool{base: true, base + "-wal": true}
	f.log.Debug("Outbox forwarder watches the SQLite database for commits", watermill.LogFields{"file": path})
	// Anything committed before the watch was in place is found by the
	// first sweep after it.
	f.woken.Store(true)
	defer f.woken.Store(false)
	f.Notify()
	for {
		select {
		case <-ctx.Done():
			return
		case ev, ok := <-w.Events:
			if !ok {
				return
			}
			if ev.Has(fsnotify.Write|fsnotify.Create) && ours[filepath.Base(ev.Name)] {
				f.Notify()
			}
		case err, ok := <-w.Errors:
			if !ok {
				return
			}
			// An overflowed queue lost events: some commit may be among them.
			f.Notify()
			if !errors.Is(err, fsnotify.ErrEventOverflow) {
				f.log.Error("Outbox forwarder: file watch error", err, nil)
				if !sleepCtx(ctx, time.Second) {
					return
				}
			}
		}
	}
}

// databaseFile is the file of the SQLite database s's table is in, "" for
// an in-memory one: main's, or that of the database attached under the
// schema the table is named in ("aux.acemq_outbox"), whose log is the one
// a commit to the table writes.
func (s *Store) databaseFile(ctx context.Context) (string, error) {
	schema := s.q.Schema()
	if schema == "" {
		schema = "main"
	}
	rows, err := s.db.QueryContext(ctx, sqldialect.DatabaseList().SQL)
	if err != nil {
		return "", err
	}
	defer rows.Close()
	for rows.Next() {
		var (
			seq        int
			name, file string
		)
		if err := rows.Scan(&seq, &name, &file); err != nil {
			return "", err
		}
		if strings.EqualFold(name, schema) {
			return file, rows.Err()
		}
	}
	if err := rows.Err(); err != nil {
		return "", err
	}
	return "", fmt.Errorf("no database attached as %q on the relay's connection", schema)
}
