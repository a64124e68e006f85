package outbox

import (
	"testing"

	"github.com/acemq/watermill-outbox/internal/testdb"
)

// pgUUID reads what PostgreSQL's uuid input reads, and nothing else: asked
// of PostgreSQL itself for each form.
func TestPgUUID_AgreesWithPostgreSQL(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, testdb.Postgres)
	for _, s := range []string{
		"a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11", "A0EEBC99-9C0B-4EF8-BB6D-6BB9BD380A11",
		"{a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11}", "a0eebc999c0b4ef8bb6d6bb9bd380a11",
		"a0ee-bc99-9c0b-4ef8-bb6d-6bb9-bd38-0a11", "{a0eebc99-9c0b4ef8-bb6d6bb9-bd380a11}",
		"a0eebc99--9c0b-4ef8-bb6d-6bb9bd380a11", "-a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11",
		"a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11-", "a0eebc9-99c0b-4ef8-bb6d-6bb9bd380a11",
		"a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a1", "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a111",
		"{a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11", "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11}",
		"urn:uuid:a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11", " a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11",
		"01M8Y7KJNQRW7DVDZ2DFT1T3BX", "g0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11", "", "{}",
	} {
		var ok bool
		if err := db.Get(&ok, "SELECT pg_input_is_valid($1, 'uuid')", s); err != nil {
			// Before PostgreSQL 16: ask by casting.
			_, cerr := db.Exec("SELECT $1::uuid", s)
			ok = cerr == nil
		}
		if got := pgUUID(s); got != ok {
			t.Errorf("pgUUID(%q) = %v, PostgreSQL reads it: %v", s, got, ok)
		}
		want := ""
		if ok {
			if err := db.Get(&want, "SELECT $1::uuid::text", s); err != nil {
				t.Fatal(err)
			}
		}
		if got := canonicalUUID(s); got != want {
			t.Errorf("canonicalUUID(%q) = %q, PostgreSQL writes it %q", s, got, want)
		}
	}
}
