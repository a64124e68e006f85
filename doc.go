// Package outbox brings the transactional outbox and the idempotent inbox to
// Watermill applications on PostgreSQL, MySQL/MariaDB or SQLite and RabbitMQ.
//
// # The problem
//
// A service that commits a database change and then publishes an event loses
// the event when the process, the broker or the network fails in between, and
// invents one when it publishes first and then rolls back. The outbox makes
// "commit the change and announce it" one atomic act: the message is written
// as a row of acemq_outbox in the same transaction as the change, and a relay
// (the Forwarder) publishes committed rows to the broker afterwards.
//
// # Writing messages
//
// Swap the service's Watermill publisher for a [TxPublisher] bound to the
// transaction that makes the change:
//
//	tx, err := db.Beginx()
//	if err != nil {
//		return err
//	}
//	defer tx.Rollback()
//	// ... the business change, through tx ...
//	pub, err := outbox.NewTxPublisher(tx, outbox.TxPublisherConfig{Exchange: "shop-events"})
//	if err != nil {
//		return err
//	}
//	if err := pub.Publish("order.placed", message.NewMessage(watermill.NewUUID(), payload)); err != nil {
//		return err // rolled back: never commit past a failed Publish
//	}
//	return tx.Commit() // the row exists if and only if this succeeds
//
// Publish talks to no broker: it only writes into tx. The message's UUID is
// the row's primary key, so publishing the same message again in a retried
// transaction leaves one row.
//
// # Schema
//
// [Migrate] creates the tables, safely on every boot and from several
// processes at once. Teams with a migration tool apply the files of the
// sqlschema package instead; the column names are those of every AceMQ
// library, so one query about the outbox serves services in any language.
//
// # Guarantees
//
// At-least-once, on purpose: a row is marked published only after the broker
// confirmed it, so a crash in between sends it again, and consumers dedupe by
// message id ([Inbox]). Not exactly-once, and not ordered across records:
// order per aggregate comes from an ordering key ([MetadataAggregateID]),
// whose records are numbered at publish, sent in order by any number of
// relays, and applied in order by an [InboxConfig].Ordered inbox.
//
// # Operating it
//
// [Store] reads and mends the outbox (Stats, Stuck, Retry, Resend,
// Discard, Lookup, PurgePublished…); cmd/outboxctl is the same for an
// operator, and runs the relay as its own process. The README is the
// guide.
package outbox
