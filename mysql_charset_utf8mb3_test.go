package outbox_test

import (
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/acemq/watermill-outbox/internal/testdb"
)

// Under a DSN's charset=utf8 (utf8mb3), text of the Basic Multilingual
// Plane (é, ü, Cyrillic, CJK) is read as sent: a body over 64 KiB holding
// "é" is stored as given. A first cut of the character set check refused
// any text outside ASCII there (a code review); only a character beyond
// the plane (an emoji) is what utf8mb3 cannot read.
func TestTxPublisher_MySQL_Utf8mb3_BigBodyWithBMPText_Stored(t *testing.T) {
	db := migrated(t, testdb.MySQL)
	legacy := openWithCharset(t, db, "utf8")
	body := strings.Repeat("a", 70<<10) + " café über"
	m := message.NewMessage(watermill.NewUUID(), []byte(body))
	if err := commitPublish(legacy, "orders", []*message.Message{m}); err != nil {
		t.Fatalf("publish of a %d-byte body with BMP text under charset=utf8: %v", len(body), err)
	}
	var got string
	if err := db.Get(&got, "SELECT body FROM acemq_outbox WHERE id = ?", m.UUID); err != nil {
		t.Fatal(err)
	}
	if got != body {
		t.Fatalf("stored %d bytes ending %q", len(got), got[len(got)-12:])
	}
}
