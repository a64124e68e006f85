// Command outboxctl operates the acemq_outbox table of a service: what is
// pending or stuck, retrying what is stuck, purging what is old, running the
// relay as a process of its own, and creating the schema.
//
//	outboxctl --db postgres://app@db/shop status
//	outboxctl --db 'app:secret@tcp(db:3306)/shop' stuck --json
//	outboxctl --db /var/lib/shop/shop.db retry --all-stuck
//	outboxctl purge --published-older-than 7d --processed-older-than 30d
//	outboxctl relay --amqp amqp://guest:guest@rabbit:5672/ --listen :9464
//	outboxctl migrate
//
// The database is --db or OUTBOX_DB: a postgres:// URL, a go-sql-driver
// MySQL DSN (user:pass@tcp(host:port)/db) or mysql:// URL, or an SQLite
// path or file: URI. The broker is --amqp or OUTBOX_AMQP_URL: one amqp://
// URL, or a cluster's nodes' URLs separated by commas, of which the relay
// uses the first that answers and moves on to the next when it loses it.
//
// Exit codes: 0 done, 1 failed (the one line on stderr says why and what to
// do), 2 the command line was wrong.
//
// The command lives in internal/outboxctl, where tests run it in process.
package main

import (
	"os"

	"github.com/acemq/watermill-outbox/internal/outboxctl"
)

func main() {
	os.Exit(outboxctl.Main(os.Args[1:], os.Getenv, os.Stdout, os.Stderr))
}
