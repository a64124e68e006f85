//go:build unix

package outbox

import (
	"errors"
	"os"
	"syscall"
	"time"
)

// errHeldElsewhere: another process holds the lock.
var errHeldElsewhere = errors.New("locked by another process")

// holdFile creates path if need be and locks it until release, waiting up
// to wait for a lock another process holds for a moment: a relay that
// takes back the leases of this RelayID's former run holds its file while
// it does, then unlinks it. A file unlinked so while this one waited is
// let go, and path opened again.
func holdFile(path string, wait time.Duration) (release func(), err error) {
	deadline := time.Now().Add(wait)
	for {
		f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o644)
		if err != nil {
			return nil, err
		}
		err = syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
		switch {
		case err == nil && samePath(f, path):
			return func() {
				_ = os.Remove(path) // before the unlock: another relay finds no file, not a free one
				_ = f.Close()
			}, nil
		case err == nil: // unlinked since it was opened
			_ = f.Close()
			continue
		}
		_ = f.Close()
		if !errors.Is(err, syscall.EWOULDBLOCK) {
			return nil, err
		}
		if time.Now().After(deadline) {
			return nil, errHeldElsewhere
		}
		time.Sleep(20 * time.Millisecond) // a lock another process holds: polled, to a deadline
	}
}

// lockGone locks path if it is there and locked by no process (its relay
// is gone), and returns what unlinks and unlocks it, in that order: held
// while the gone relay's leases are ended, so that a relay starting again
// under its RelayID waits for the end (holdFile) rather than claim rows
// whose leases are then ended. ok is false where path is not there, or
// held, or was replaced since it was opened. release(false) unlocks it
// and leaves it, for a later look.
func lockGone(path string) (release func(unlink bool), ok bool, err error) {
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if errors.Is(err, os.ErrNotExist) {
		return nil, false, nil
	}
	if err != nil {
		return nil, false, err
	}
	err = syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
	if err != nil || !samePath(f, path) {
		_ = f.Close()
		if errors.Is(err, syscall.EWOULDBLOCK) {
			err = nil
		}
		return nil, false, err
	}
	return func(unlink bool) {
		if unlink {
			_ = os.Remove(path)
		}
		_ = f.Close()
	}, true, nil
}

// samePath reports whether path still names f's file.
func samePath(f *os.File, path string) bool {
	fi, err := f.Stat()
	if err != nil {
		return false
	}
	pi, err := os.Stat(path)
	return err == nil && os.SameFile(fi, pi)
}
