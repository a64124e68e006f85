package outbox

import (
	"strings"
	"testing"
	"unicode/utf8"
)

// A long failure reason in plain ASCII, cut to last_error's size, stays
// plain ASCII: markFailed writes it at once, not after a savepoint as it
// writes a reason some column might refuse (the cut was marked with "…",
// which sent every long reason down that path, a statement more each).
func TestStorableError_LongASCIIReason_CutInASCII(t *testing.T) {
	reason := storableError(strings.Repeat("refused: ", 200))
	if n := utf8.RuneCountInString(reason); n != maxLastError {
		t.Errorf("cut to %d characters, want %d", n, maxLastError)
	}
	if !strings.HasSuffix(reason, "...") || asciiError(reason) != reason {
		t.Errorf("cut reason %q…: not plain ASCII ending in ...; markFailed writes it under a savepoint", reason[len(reason)-20:])
	}
}
