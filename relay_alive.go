package outbox

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill"
)

// On SQLite a claim is a lease in locked_by and locked_until, not a row
// lock that ends with its connection: a relay killed with rows in flight
// (kill -9, a power cut) left them, and their keys, for the rest of its
// lease, 60 s by default. An in-process relay starts again under a new
// RelayID and waited out its own former leases (a user review of an edge
// till: 205 rows late by up to 60 s after a restart). So a running relay
// holds an advisory lock (flock) on a file beside the database, named for
// its RelayID, which the operating system lets go when the process ends
// however it ends; a relay that finds a lease whose holder's file is not
// locked knows that relay is gone, and ends its leases at once. A holder
// with no such file (another library's relay, Sweep without Run) is left
// to its lease, as before.

// aliveWait is how long a relay starting waits for its file, which a relay
// taking back its former run's leases holds meanwhile (one statement,
// which may wait for SQLite's write lock), before it takes the file for
// another running process's.
const aliveWait = 15 * time.Second

// aliveEvery is how often a running relay on SQLite looks for the leases of
// relays that are gone, besides at its start: a relay killed beside a
// running one leaves its rows for this long at most, rather than Lease.
// One read of the pending rows' lease holders.
const aliveEvery = 5 * time.Second

// aliveFile is the file whose lock says relay is running on the SQLite
// database file db: named by a digest, as a RelayID may hold any text.
func aliveFile(db, relay string) string {
	sum := sha256.Sum256([]byte(relay))
	return db + "-acemq-relay-" + hex.EncodeToString(sum[:8])
}

// holdAlive takes the lock of f's RelayID beside the SQLite database, and
// ends the leases a former run under the same RelayID (set by hand) left,
// before the relay's first claim (a relay that found the former run's file
// free after it would end this run's first leases, and so would this one).
// It returns the database's file and the lock's release, or "" where the
// lock cannot be had (an in-memory database, a platform without flock, a
// directory it cannot write): leases then run out as before.
func (f *Forwarder) holdAlive(ctx context.Context) (db string, release func()) {
	db, err := f.store.databaseFile(ctx)
	if err != nil || db == "" {
		return "", nil // the watch says why, where it watches
	}
	path := aliveFile(db, f.cfg.RelayID)
	release, err = holdFile(path, aliveWait)
	if errors.Is(err, errHeldElsewhere) {
		f.log.Error("Outbox forwarder: another running process has this relay's RelayID; each relay needs its own, or it may take the other's rows in flight for its own", nil, watermill.LogFields{"file": path})
		return "", nil
	}
	if err != nil {
		f.log.Debug("Outbox forwarder: no lock beside the SQLite database to tell other relays it runs; a relay killed here leaves its rows until its lease ends", watermill.LogFields{"file": path, "error": err.Error()})
		return "", nil
	}
	// Under sweepMu: a Sweep of this Forwarder, beside Run, may have rows
	// in flight under this RelayID's leases (a review: ended, another
	// relay published them again). Written only where such leases are: a
	// write at every start, beside the file watch's first connection
	// attaching a database, made that attach fail ("database is locked",
	// in a CI run) and the relay poll.
	f.sweepMu.Lock()
	defer f.sweepMu.Unlock()
	holders, err := f.leaseHolders(ctx)
	if err != nil {
		f.log.Error("Outbox forwarder: could not look for the leases a former run of this RelayID left", err, nil)
		return db, release
	}
	if !slices.Contains(holders, f.cfg.RelayID) {
		return db, release
	}
	end := f.store.q.EndLeases(f.cfg.RelayID)
	if res, err := f.store.db.ExecContext(ctx, end.SQL, end.Args...); err != nil {
		f.log.Error("Outbox forwarder: could not end the leases a former run of this RelayID left", err, nil)
	} else if n, _ := res.RowsAffected(); n > 0 {
		f.log.Info("Outbox forwarder took back the rows a former run of its RelayID left under a lease", watermill.LogFields{"rows": n})
	}
	return db, release
}

// leaseHolders reads the relays that hold live leases on unpublished rows.
func (f *Forwarder) leaseHolders(ctx context.Context) ([]string, error) {
	q := f.store.q.LeaseHolders(time.Now())
	rows, err := f.store.db.QueryContext(ctx, q.SQL, q.Args...)
	if err != nil {
		return nil, err
	}
	var holders []string
	for rows.Next() {
		var h string
		if err := rows.Scan(&h); err != nil {
			_ = rows.Close()
			return nil, err
		}
		holders = append(holders, h)
	}
	return holders, rows.Close()
}

// keepTakingBack takes back the leases of relays that are gone, at once and
// then every aliveEvery, until ctx ends.
func (f *Forwarder) keepTakingBack(ctx context.Context, db string) {
	for {
		f.takeBack(ctx, db)
		if !sleepCtx(ctx, aliveEvery) {
			return
		}
	}
}

// takeBack is endLeasesOfGone, which wakes the relay for the rows it freed.
func (f *Forwarder) takeBack(ctx context.Context, db string) {
	if n, err := f.endLeasesOfGone(ctx, db); err != nil && ctx.Err() == nil {
		f.log.Error("Outbox forwarder: could not look for the leases of relays that are gone", err, nil)
	} else if n > 0 {
		f.Notify()
	}
}

// endLeasesOfGone ends the leases of every relay whose lock file beside db
// is there and locked by no process, and returns how many rows it freed.
func (f *Forwarder) endLeasesOfGone(ctx context.Context, db string) (int64, error) {
	s := f.store
	holders, err := f.leaseHolders(ctx)
	if err != nil {
		return 0, err
	}
	var freed int64
	defer removeGoneFiles(db, holders)
	for _, h := range holders {
		path := aliveFile(db, h)
		if h == f.cfg.RelayID {
			continue // this run's (a former run's went at its start)
		}
		// The gone relay's file stays locked until its leases are ended
		// and it is unlinked: checked and then ended, a relay restarted
		// under that RelayID between the two had its first leases ended
		// (a review).
		release, gone, err := lockGone(path)
		if err != nil || !gone {
			continue // running, or not ours to tell
		}
		end := s.q.EndLeases(h)
		res, err := s.db.ExecContext(ctx, end.SQL, end.Args...)
		release(err == nil) // kept on a failure, for the next look
		if err != nil {
			return freed, fmt.Errorf("end the leases of relay %q: %w", h, err)
		}
		n, _ := res.RowsAffected()
		freed += n
		if n == 0 {
			continue
		}
		f.log.Info("Outbox forwarder took back the rows of a relay that is gone (its process ended with them under a lease)", watermill.LogFields{"gone_relay": h, "rows": n})
	}
	return freed, nil
}

// removeGoneFiles removes the lock files beside db that no process holds
// and whose relay holds no live lease of the holders read: those of relays
// that ended with none in flight (kill -9 at nearly any moment of a flow,
// a crash loop), which no look for leases would ever remove (a review
// counted one per relay killed, seven after seven kills). A relay that
// creates its file and has not yet locked it finds it unlinked and opens
// it again (holdFile). A relay that claimed after holders was read and
// was gone by the look loses its file, and its rows wait out their lease,
// as before files.
func removeGoneFiles(db string, holders []string) {
	entries, err := os.ReadDir(filepath.Dir(db))
	if err != nil {
		return
	}
	leased := make(map[string]bool, len(holders))
	for _, h := range holders {
		leased[filepath.Clean(aliveFile(db, h))] = true
	}
	prefix := filepath.Base(db) + "-acemq-relay-"
	for _, e := range entries {
		name := e.Name()
		if !strings.HasPrefix(name, prefix) || len(name) != len(prefix)+16 {
			continue
		}
		path := filepath.Join(filepath.Dir(db), name)
		if leased[path] {
			continue // endLeasesOfGone's
		}
		if release, gone, err := lockGone(path); err == nil && gone {
			release(true)
		}
	}
}
