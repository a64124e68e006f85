package outboxctl

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/acemq/watermill-outbox/internal/testdb"
)

// Guards for code a second mutation run (over 57a5c26..3c90cc0) found
// unguarded: each fails when the code it names is broken.

// A DSN with the scheme's // left out ("postgres:…", "mysql:…") is refused
// as a usage error naming the form wanted, not opened as an SQLite file of
// that name in the working directory.
func TestSchemeWithoutSlashes_RefusedNotTakenForAnSQLiteFile(t *testing.T) {
	dir := t.TempDir()
	t.Chdir(dir)
	for _, dsn := range []string{"postgres:postgres@127.0.0.1:5432/test", "PostgreSQL:postgres@127.0.0.1/test"} {
		r := ctl(t, nil, "migrate", "--db", dsn)
		if r.code != exitUsage || !strings.Contains(r.stderr, "scheme://") {
			t.Errorf("migrate --db %q: exit %d, want %d naming scheme://:\n%s%s", dsn, r.code, exitUsage, r.stdout, r.stderr)
		}
		if entries, _ := os.ReadDir(dir); len(entries) != 0 {
			t.Errorf("migrate --db %q created %s in the working directory", dsn, entries[0].Name())
		}
	}
}

// The relay refuses an SQLite database opened read-only (mode=ro) up
// front, as a usage error, before it dials the broker: it writes its
// claims and marks.
func TestRelay_SQLiteReadOnly_UsageError(t *testing.T) {
	db := migrated(t, testdb.SQLite)
	path := db.DSN
	if i := strings.IndexByte(path, '?'); i >= 0 {
		path = path[:i]
	}
	path = strings.TrimPrefix(path, "file:")
	if !filepath.IsAbs(path) {
		t.Skipf("the test database is not a file: %s", db.DSN)
	}
	r := ctl(t, nil, "relay", "--db", "file:"+path+"?mode=ro", "--amqp", "amqp://guest:guest@127.0.0.1:1/", "--listen", "")
	if r.code != exitUsage || !strings.Contains(r.stderr, "read-only") {
		t.Errorf("relay on a read-only SQLite database: exit %d, want %d naming read-only:\n%s", r.code, exitUsage, r.stderr)
	}
}
