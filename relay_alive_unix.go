//go:build unix

package outbox

import (
	"errors"
	"os"
	"syscall"
)

// errHeldElsewhere: another process holds the lock.
var errHeldElsewhere = errors.New("locked by another process")

// holdFile creates path if need be and locks it until release.
func holdFile(path string) (release func(), err error) {
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		return nil, err
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		_ = f.Close()
		if errors.Is(err, syscall.EWOULDBLOCK) {
			return nil, errHeldElsewhere
		}
		return nil, err
	}
	return func() {
		_ = os.Remove(path) // before the unlock: another relay finds no file, not a free one
		_ = f.Close()
	}, nil
}

// lockFree reports whether path is there and locked by no process.
func lockFree(path string) (bool, error) {
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if errors.Is(err, os.ErrNotExist) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	defer f.Close()
	err = syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
	if errors.Is(err, syscall.EWOULDBLOCK) {
		return false, nil
	}
	return err == nil, err
}
