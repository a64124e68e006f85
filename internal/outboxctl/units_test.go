package outboxctl

import (
	"database/sql"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/acemq/watermill-outbox/internal/sqldialect"
)

func TestParseAge_DaysHoursMinutesSeconds(t *testing.T) {
	day := 24 * time.Hour
	for in, want := range map[string]time.Duration{
		"7d": 7 * day, "36h": 36 * time.Hour, "90m": 90 * time.Minute, "45s": 45 * time.Second,
		"1d12h": 36 * time.Hour, "0s": 0, "2h30m15s": 2*time.Hour + 30*time.Minute + 15*time.Second,
	} {
		if got, ok := parseAge(in); !ok || got != want {
			t.Errorf("parseAge(%q) = %v, %v; want %v", in, got, ok, want)
		}
	}
	for _, in := range []string{"", "7", "7x", "d", "-7d", "+7d", "7 d", "1.5h", "500ms", "7D", "99999999999999d"} {
		if got, ok := parseAge(in); ok {
			t.Errorf("parseAge(%q) = %v; want refused", in, got)
		}
	}
}

func TestFormatAge(t *testing.T) {
	for d, want := range map[time.Duration]string{
		0: "0s", 59 * time.Second: "59s", 90 * time.Second: "1m30s", 2*time.Hour + 5*time.Minute: "2h5m",
		40*24*time.Hour + 3*time.Hour: "40d3h",
	} {
		if got := formatAge(d); got != want {
			t.Errorf("formatAge(%v) = %q, want %q", d, got, want)
		}
	}
}

func TestParseTarget_TellsTheDatabaseFromTheDSN(t *testing.T) {
	for _, tc := range []struct {
		in, kind, dsnHas, shown string
	}{
		{"postgres://app:pw@db:5432/shop", kindPostgres, "application_name=outboxctl", "postgres://app:xxxxx@db:5432/shop"},
		{"postgresql://db/shop?application_name=mine", kindPostgres, "application_name=mine", "postgresql://db/shop?application_name=mine"},
		{"app:pw@tcp(db:3306)/shop", kindMySQL, "parseTime=true", "app:xxxxx@tcp(db:3306)/shop"},
		{"app:p@ss/w@tcp(db:3306)/shop?tls=true", kindMySQL, "tls=true", "app:xxxxx@tcp(db:3306)/shop?tls=true"},
		{"mysql://app:pw@db/shop", kindMySQL, "tcp(db:3306)/shop", "mysql://app:xxxxx@db/shop"},
		{"/var/lib/shop.db", kindSQLite, "/var/lib/shop.db?_txlock=immediate&_busy_timeout=5000&_synchronous=FULL&_journal_mode=WAL", "/var/lib/shop.db"},
		{"file:shop.db?_busy_timeout=100", kindSQLite, "file:shop.db?_busy_timeout=100&_txlock=immediate&_synchronous=FULL&_journal_mode=WAL", "file:shop.db?_busy_timeout=100"},
	} {
		got, err := parseTarget(tc.in, true)
		if err != nil {
			t.Errorf("parseTarget(%q): %v", tc.in, err)
			continue
		}
		if got.kind != tc.kind || !strings.Contains(got.dsn, tc.dsnHas) || got.shown != tc.shown {
			t.Errorf("parseTarget(%q) = kind %s dsn %q shown %q; want %s, dsn with %q, shown %q",
				tc.in, got.kind, got.dsn, got.shown, tc.kind, tc.dsnHas, tc.shown)
		}
	}
	if got, _ := parseTarget("file:///tmp/a%20b.db?mode=rw", false); got.path != "/tmp/a b.db" {
		t.Errorf("file URI path = %q, want /tmp/a b.db", got.path)
	}
}

// WAL stays in the file, so it is asked for only by the commands that
// write as a service does, and never over a read-only open, where the
// switch fails, nor over the DSN's own journal mode.
func TestParseTarget_SQLite_WALOnlyWhenAskedWritableAndNotChosen(t *testing.T) {
	for _, tc := range []struct {
		in      string
		wal     bool
		wantWAL bool
	}{
		{"/var/lib/shop.db", true, true},
		{"/var/lib/shop.db", false, false},
		{"file:shop.db?mode=rw", true, true},
		{"file:shop.db?mode=ro", true, false},
		{"file:shop.db?_journal_mode=DELETE", true, false},
		{"file:shop.db?_journal=TRUNCATE", true, false},
	} {
		got, err := parseTarget(tc.in, tc.wal)
		if err != nil {
			t.Errorf("parseTarget(%q, %v): %v", tc.in, tc.wal, err)
			continue
		}
		if gotWAL := strings.Contains(got.dsn, "_journal_mode=WAL"); gotWAL != tc.wantWAL {
			t.Errorf("parseTarget(%q, %v) = dsn %q; want _journal_mode=WAL in it: %v", tc.in, tc.wal, got.dsn, tc.wantWAL)
		}
		if !strings.Contains(got.dsn, "_txlock=immediate") || !strings.Contains(got.dsn, "_busy_timeout=") {
			t.Errorf("parseTarget(%q, %v) = dsn %q; want _txlock and _busy_timeout whatever the journal", tc.in, tc.wal, got.dsn)
		}
	}
}

// Every connection of this tool syncs its SQLite commits (synchronous=FULL)
// unless the DSN chose otherwise: under mattn/go-sqlite3's default, NORMAL,
// a power cut may roll back a relay's mark or an operator's repair that the
// command reported done. Asked of the connection itself, not of the DSN's text.
func TestSQLiteConnections_SyncFullUnlessTheDSNChooses(t *testing.T) {
	dir := t.TempDir()
	for _, tc := range []struct {
		in   string
		want int // PRAGMA synchronous: 0 OFF, 1 NORMAL, 2 FULL
	}{
		{filepath.Join(dir, "plain.db"), 2},
		{"file:" + filepath.Join(dir, "uri.db") + "?_busy_timeout=100", 2},
		{"file:" + filepath.Join(dir, "normal.db") + "?_synchronous=NORMAL", 1},
		{"file:" + filepath.Join(dir, "off.db") + "?_sync=OFF", 0},
	} {
		for _, wal := range []bool{true, false} {
			got, err := parseTarget(tc.in, wal)
			if err != nil {
				t.Fatalf("parseTarget(%q): %v", tc.in, err)
			}
			db, err := sql.Open(got.driver, got.dsn)
			if err != nil {
				t.Fatal(err)
			}
			var sync int
			if err := db.QueryRow("PRAGMA synchronous").Scan(&sync); err != nil {
				t.Fatalf("%s: %v", tc.in, err)
			}
			_ = db.Close()
			if sync != tc.want {
				t.Errorf("--db %s (wal %v): PRAGMA synchronous = %d, want %d", tc.in, wal, sync, tc.want)
			}
		}
	}
}

func TestValidTable_OnlyIdentifiers(t *testing.T) {
	for _, in := range []string{"acemq_outbox", "app.acemq_outbox"} {
		if err := sqldialect.ValidTable(in); err != nil {
			t.Errorf("ValidTable(%q) = %v", in, err)
		}
	}
	for _, in := range []string{"", "a.b.c", `x"; DROP TABLE y; --`, "1abc", "a-b", "a b"} {
		if err := sqldialect.ValidTable(in); err == nil {
			t.Errorf("ValidTable(%q) accepted", in)
		}
	}
}
