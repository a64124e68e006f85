package outbox

// SetAfterPublishHook installs fn to run between the broker's confirms and
// the marks of every sweep: the window in which a relay's death duplicates.
// An error fails the marks, as a database failure would.
func SetAfterPublishHook(f *Forwarder, fn func(published []string) error) { f.afterPublish = fn }

// ClaimsOverlap reports whether the store's claims may overlap (pipelining).
func ClaimsOverlap(s *Store) bool { return s.claimsOverlap() }
