package outbox

import (
	"context"
	"database/sql"
)

// SetAfterPublishHook installs fn to run between the broker's confirms and
// the marks of every sweep: the window in which a relay's death duplicates.
// An error fails the marks, as a database failure would.
func SetAfterPublishHook(f *Forwarder, fn func(published []string) error) { f.afterPublish = fn }

// ClaimsOverlap reports whether the store's claims may overlap (pipelining).
func ClaimsOverlap(s *Store) bool { return s.claimsOverlap() }

// PendingIndex is the step of a locking claim that looks the pending index
// up in tx if it is not known yet, and returns the index the claim names.
func PendingIndex(s *Store, tx *sql.Tx) (string, error) {
	return s.pendingIndex(context.Background(), tx)
}

// SwapPrepared replaces each statement the relay prepared with the same SQL
// prepared on other, which the relay's transactions cannot use: every
// prepared claim and mark then fails, as on a proxy that lost them. It
// returns how many it replaced.
func SwapPrepared(f *Forwarder, other *sql.DB) (int, error) {
	m := f.store.stmts.Load()
	if m == nil {
		return 0, nil
	}
	swapped := make(map[string]*sql.Stmt, len(*m))
	for q := range *m {
		st, err := other.Prepare(q)
		if err != nil {
			return 0, err
		}
		swapped[q] = st
	}
	f.store.stmts.Store(&swapped)
	return len(swapped), nil
}

// Prepared is how many statements the relay runs prepared.
func Prepared(f *Forwarder) int {
	if m := f.store.stmts.Load(); m != nil {
		return len(*m)
	}
	return 0
}
