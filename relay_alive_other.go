//go:build !unix

package outbox

import "errors"

var errHeldElsewhere = errors.New("locked by another process")

// holdFile: no flock here; a relay killed with rows leases them until its
// lease ends.
func holdFile(string) (func(), error) { return nil, errors.ErrUnsupported }

func lockFree(string) (bool, error) { return false, nil }
