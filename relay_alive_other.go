//go:build !unix

package outbox

import (
	"errors"
	"time"
)

var errHeldElsewhere = errors.New("locked by another process")

// holdFile: no flock here; a relay killed with rows leases them until its
// lease ends.
func holdFile(string, time.Duration) (func(), error) { return nil, errors.ErrUnsupported }

func lockGone(string) (func(bool), bool, error) { return nil, false, nil }
