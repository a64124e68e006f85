package sharedtable_test

import (
	"strings"
	"testing"

	"github.com/go-sql-driver/mysql"
	"github.com/jmoiron/sqlx"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
	"github.com/acemq/watermill-outbox/internal/testrails"
	"github.com/acemq/watermill-outbox/internal/testutil"
)

// A MySQL table another library made with TIMESTAMP columns (Laravel's
// $table->timestamp()), which MySQL converts from and to each session's
// time_zone. Read through a session that is not at UTC (a server whose
// time_zone is SYSTEM on a host outside UTC), every time the relay writes
// and compares is hours off for relays connected at UTC: their live lease
// reads expired, and the row goes out twice. The relay says so at its first
// claim, naming the columns and the fix; at UTC it says nothing.
func TestMySQL_TimestampColumnsInASessionNotAtUTC_RelaySaysSo(t *testing.T) {
	for _, tc := range []struct{ zone, want string }{
		{"-05:00", "created_at,locked_until,published_at of `acemq_outbox` are TIMESTAMP"},
		{"+00:00", ""},
	} {
		t.Run(tc.zone, func(t *testing.T) {
			db := testdb.New(t, testdb.MySQL)
			testrails.CreateTable(t, db)
			if _, err := db.Exec("ALTER TABLE acemq_outbox MODIFY created_at TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6)," +
				" MODIFY published_at TIMESTAMP(6) NULL DEFAULT NULL, MODIFY locked_until TIMESTAMP(6) NULL DEFAULT NULL"); err != nil {
				t.Fatal(err)
			}
			cfg, err := mysql.ParseDSN(db.DSN)
			if err != nil {
				t.Fatal(err)
			}
			cfg.Params = map[string]string{"time_zone": "'" + tc.zone + "'"}
			lib, err := sqlx.Open("mysql", cfg.FormatDSN())
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = lib.Close() })
			if err := outbox.Migrate(t.Context(), lib.DB, outbox.MySQL); err != nil {
				t.Fatal(err)
			}
			log := &testutil.ErrorLog{}
			c := &conn{lib: lib}
			f := c.forwarder(t, outbox.ForwarderConfig{Logger: log})
			sweepAll(t, f)
			sweepAll(t, f)
			msgs := log.Msgs()
			switch {
			case tc.want == "" && len(msgs) > 0:
				t.Errorf("at UTC the relay logged %q", msgs)
			case tc.want != "" && (len(msgs) != 1 || !strings.Contains(msgs[0], tc.want) || !strings.Contains(msgs[0], "-18000 s from UTC") || !strings.Contains(msgs[0], "time_zone=%27%2B00%3A00%27")):
				t.Errorf("logged %q, want once: %q, the offset and the DSN's fix", msgs, tc.want)
			}
		})
	}
}
