package outbox

// SetAfterPublishHook installs fn to run between the broker's confirms and
// the marks of every sweep: the window in which a relay's death duplicates.
func SetAfterPublishHook(f *Forwarder, fn func(published []string)) { f.afterPublish = fn }

// ClaimsOverlap reports whether the store's claims may overlap (pipelining).
func ClaimsOverlap(s *Store) bool { return s.claimsOverlap() }
