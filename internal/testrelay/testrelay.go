// Package testrelay gives a test a Forwarder that publishes to the test
// broker (internal/testdb's AMQPURL) and is closed when the test ends. Only
// external test packages may import it: it imports the library.
package testrelay

import (
	"os"
	"testing"

	"github.com/ThreeDotsLabs/watermill"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// New returns a relay over db (a *sql.DB or *sqlx.DB) to RabbitMQ, with
// amqpCfg's settings if one is given (its URLs: the test broker's alone).
// It logs only with OUTBOX_TEST_DEBUG unless cfg has a Logger.
func New(t testing.TB, db any, cfg outbox.ForwarderConfig, amqpCfg ...outbox.AMQPConfig) *outbox.Forwarder {
	t.Helper()
	ac := outbox.AMQPConfig{}
	if len(amqpCfg) > 0 {
		ac = amqpCfg[0]
	}
	ac.URLs = []string{testdb.AMQPURL()}
	dest, err := outbox.NewAMQPDestination(ac)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Logger == nil {
		cfg.Logger = watermill.NewStdLogger(os.Getenv("OUTBOX_TEST_DEBUG") != "", false)
	}
	f, err := outbox.NewForwarder(db, dest, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := f.Close(); err != nil {
			t.Errorf("close forwarder: %v", err)
		}
	})
	return f
}
