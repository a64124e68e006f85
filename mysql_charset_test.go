package outbox_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	gomysql "github.com/go-sql-driver/mysql"
	"github.com/jmoiron/sqlx"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testamqp"
	"github.com/acemq/watermill-outbox/internal/testdb"
	"github.com/acemq/watermill-outbox/internal/testrelay"
)

// openWithCharset opens db's database again with the DSN's charset, as
// an older service's DSN (charset=utf8, 3-byte; latin1) names it.
func openWithCharset(t *testing.T, db *testdb.DB, charset string) *testdb.DB {
	t.Helper()
	cfg, err := gomysql.ParseDSN(db.DSN)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Params == nil {
		cfg.Params = map[string]string{}
	}
	cfg.Params["charset"] = charset
	legacy, err := sqlx.Open("mysql", cfg.FormatDSN())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = legacy.Close() })
	return &testdb.DB{DB: legacy, Kind: db.Kind, DSN: cfg.FormatDSN(), Name: db.Name}
}

// The inline literals (_utf8mb4 X'…') read the same under every
// connection character set, but a statement over 64 KiB goes with its
// arguments, which MySQL reads in character_set_client: under charset=utf8
// an emoji failed the statement, and under latin1 the body was stored
// garbled (mojibake), no error said (a publisher review). Stored as given,
// or refused with the cure; never garbled.
func TestTxPublisher_MySQL_DSNCharsetNotUTF8MB4_BigBodyStoredAsGivenOrRefused(t *testing.T) {
	t.Parallel()
	for _, charset := range []string{"utf8", "latin1"} {
		t.Run(charset, func(t *testing.T) {
			db := migrated(t, testdb.MySQL)
			legacy := openWithCharset(t, db, charset)
			for _, size := range []int{100, 70 << 10} {
				body := strings.Repeat("a", size) + "😀"
				m := message.NewMessage(watermill.NewUUID(), []byte(body))
				err := commitPublish(legacy, "orders", []*message.Message{m})
				var got string
				switch gerr := db.Get(&got, "SELECT body FROM acemq_outbox WHERE id = ?", m.UUID); {
				case err != nil && !strings.Contains(err.Error(), "charset=utf8mb4"):
					t.Errorf("body of %d bytes, charset=%s: %v; want it stored, or refused naming charset=utf8mb4", len(body), charset, err)
				case err != nil && gerr == nil:
					t.Errorf("body of %d bytes, charset=%s: refused (%v), yet a row was written", len(body), charset, err)
				case err == nil && got != body:
					t.Errorf("body of %d bytes, charset=%s: stored as %d bytes ending %q, want ending %q", len(body), charset, len(got), got[max(0, len(got)-10):], body[len(body)-6:])
				case size == 100 && err != nil:
					t.Errorf("body of %d bytes, charset=%s: %v; a statement whose arguments are written in reads the same under any charset", len(body), charset, err)
				}
			}
		})
	}
}

// A relay whose DSN names charset=utf8 or latin1 read the claim's text in
// it: a body and a header with an emoji went out with '?' in its place,
// acknowledged (a publisher review). It relays nothing until the DSN is
// mended, saying so, and the row stays pending; the relay on the default
// DSN sends it as published.
func TestForwarder_MySQL_DSNCharsetNotUTF8MB4_RefusesRowsWaitUnchanged(t *testing.T) {
	t.Parallel()
	for _, charset := range []string{"utf8", "latin1"} {
		t.Run(charset, func(t *testing.T) {
			db := migrated(t, testdb.MySQL)
			b := testamqp.New(t)
			queue := b.Queue("cs")
			body := "order ✓ 😀"
			m := message.NewMessage(watermill.NewUUID(), []byte(body))
			m.Metadata.Set("note", "ünïcode 😀")
			publishInTx(t, db, "cs", []*message.Message{m}, outbox.TxPublisherConfig{Exchange: b.Exchange})

			legacy := testrelay.New(t, openWithCharset(t, db, charset).DB, outbox.ForwarderConfig{})
			if n, err := legacy.Sweep(context.Background()); n != 0 || err == nil || !strings.Contains(err.Error(), "charset=utf8mb4") {
				t.Fatalf("sweep on a charset=%s DSN: %d sent, %v; want none, refused naming charset=utf8mb4", charset, n, err)
			}
			if s := stateOf(t, db, m.UUID); s.Published || s.Attempts != 0 {
				t.Fatalf("after the refused sweep: %+v, want pending, no attempt counted", s)
			}
			sweepAll(t, testrelay.New(t, db.DB, outbox.ForwarderConfig{}))
			got := b.Drain(queue, 1, 5*time.Second)
			if len(got) != 1 || string(got[0].Body) != body || got[0].Headers["note"] != "ünïcode 😀" {
				t.Fatalf("the default DSN's relay sent %d messages %v; want the one as published", len(got), got)
			}
		})
	}
}
