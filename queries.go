package outbox

import (
	"strconv"
	"strings"
)

// storeQueries is the SQL of a Store, built once for its dialect and table.
// The text here is portable SQL written with "?" placeholders; each dialect
// rebinds it and supplies what differs (the claim, the purge) from its own
// file.
type storeQueries struct {
	d            Dialect
	table        string
	claimLocked  string // PostgreSQL, MySQL: rows locked in an open transaction
	claimLease   string // SQLite: rows leased in locked_by/locked_until
	markFailed   string
	releaseLease string
	stats        string
	stuck        string
	retryStuck   string
	purge        string
}

// claimColumns are read by scanClaimed, in this order.
const claimColumns = "id, exchange_name, routing_key, body, body_encoding, content_type, headers, created_at, attempts"

// claimable is the relay's condition: unpublished, under the attempt ceiling,
// not under a live lease (ours, or one written by an AceMQ relay in another
// language). Arguments: max attempts, now.
const claimable = "published_at IS NULL AND attempts < ? AND (locked_until IS NULL OR locked_until < ?)"

func newStoreQueries(d Dialect, table string) storeQueries {
	q := storeQueries{d: d, table: table}
	r := d.rebind
	q.claimLocked = r("SELECT " + claimColumns + " FROM " + table + " WHERE " + claimable +
		" ORDER BY created_at, id LIMIT ? FOR UPDATE SKIP LOCKED")
	q.claimLease = r("UPDATE " + table + " SET locked_by = ?, locked_until = ? WHERE id IN (SELECT id FROM " + table +
		" WHERE " + claimable + " ORDER BY created_at, id LIMIT ?) RETURNING " + claimColumns)
	q.markFailed = r("UPDATE " + table + " SET attempts = ?, last_error = ?, locked_by = NULL, locked_until = NULL WHERE id = ?")
	q.releaseLease = r("UPDATE " + table + " SET locked_by = NULL, locked_until = NULL WHERE locked_by = ? AND published_at IS NULL")
	q.stats = r("SELECT COALESCE(SUM(CASE WHEN attempts < ? THEN 1 ELSE 0 END), 0), " +
		"COALESCE(SUM(CASE WHEN attempts >= ? THEN 1 ELSE 0 END), 0), " +
		"MIN(CASE WHEN attempts < ? THEN created_at END) FROM " + table + " WHERE published_at IS NULL")
	q.stuck = r("SELECT id, exchange_name, routing_key, attempts, last_error, created_at FROM " + table +
		" WHERE published_at IS NULL AND attempts >= ? ORDER BY created_at, id LIMIT ?")
	q.retryStuck = r("UPDATE " + table + " SET attempts = 0, locked_by = NULL, locked_until = NULL" +
		" WHERE published_at IS NULL AND attempts >= ?")
	q.purge = r(d.purgePublished(table))
	return q
}

// markPublished marks n rows published. Arguments: published_at, then the ids.
func (q storeQueries) markPublished(n int) string {
	return q.d.rebind("UPDATE " + q.table + " SET published_at = ?, locked_by = NULL, locked_until = NULL WHERE id IN (" +
		placeholders(n) + ")")
}

// retry makes n unpublished rows pending again. Arguments: the ids.
func (q storeQueries) retry(n int) string {
	return q.d.rebind("UPDATE " + q.table + " SET attempts = 0, locked_by = NULL, locked_until = NULL" +
		" WHERE published_at IS NULL AND id IN (" + placeholders(n) + ")")
}

// rebindDollar turns "?" placeholders into PostgreSQL's $1, $2, ….
func rebindDollar(q string) string {
	var b strings.Builder
	b.Grow(len(q) + 16)
	n := 0
	for i := 0; i < len(q); i++ {
		if q[i] == '?' {
			n++
			b.WriteByte('$')
			b.WriteString(strconv.Itoa(n))
			continue
		}
		b.WriteByte(q[i])
	}
	return b.String()
}
