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
	d           Dialect
	table       string
	claimLocked [2]string // PostgreSQL, MySQL: rows locked in an open transaction; [1] after a cursor
	claimLease  [2]string // SQLite: rows leased in locked_by/locked_until; [1] after a cursor
	markFailed  string
	stats       string
	stuck       string
	retryStuck  string
	purge       string
	probe       string
	countSince  string
	countBefore string
}

// claimColumns are read by scanClaimed, in this order.
const claimColumns = "id, exchange_name, routing_key, body, body_encoding, content_type, headers, created_at, attempts"

// claimable is the relay's condition: unpublished, under the attempt ceiling,
// not under a live lease (ours, or one written by an AceMQ relay in another
// language). Arguments: max attempts, now.
const claimable = "published_at IS NULL AND attempts < ? AND (locked_until IS NULL OR locked_until < ?)"

// afterCursor resumes a drain after the last row claimed, rather than at the
// head of the pending index, where the entries of rows just marked published
// linger until MySQL's purge or PostgreSQL's vacuum removes them: scanning
// them on every claim makes a long drain quadratic. Written as a range on
// created_at plus a filter so that MySQL's range optimizer uses the index.
// Arguments: created_at, created_at, id.
const afterCursor = "created_at >= ? AND (created_at > ? OR id > ?)"

// claimConditions are a claim's WHERE: [0] from the head, [1] after a cursor.
var claimConditions = [2]string{claimable, claimable + " AND " + afterCursor}

// newStoreQueries builds the SQL for table, quoted.
func newStoreQueries(d Dialect, table string) storeQueries {
	q := storeQueries{d: d, table: table}
	r := d.rebind
	q.claimLocked = claimLocked(d, table, "")
	for i, cond := range claimConditions {
		q.claimLease[i] = r("UPDATE " + table + " SET locked_by = ?, locked_until = ? WHERE id IN (SELECT id FROM " + table +
			" WHERE " + cond + " ORDER BY created_at, id LIMIT ?) RETURNING " + claimColumns)
	}
	q.markFailed = r("UPDATE " + table + " SET attempts = ?, last_error = ?, locked_by = NULL, locked_until = NULL WHERE id = ?")
	q.stats = r("SELECT COALESCE(SUM(CASE WHEN attempts < ? THEN 1 ELSE 0 END), 0), " +
		"COALESCE(SUM(CASE WHEN attempts >= ? THEN 1 ELSE 0 END), 0), " +
		"MIN(CASE WHEN attempts < ? THEN created_at END) FROM " + table + " WHERE published_at IS NULL")
	q.stuck = r("SELECT id, exchange_name, routing_key, attempts, last_error, created_at FROM " + table +
		" WHERE published_at IS NULL AND attempts >= ? ORDER BY created_at, id LIMIT ?")
	q.retryStuck = r("UPDATE " + table + " SET attempts = 0, locked_by = NULL, locked_until = NULL" +
		" WHERE published_at IS NULL AND attempts >= ?")
	q.purge = r(d.purgePublished(table))
	q.probe = "SELECT 1 FROM " + table + " WHERE 1 = 0"
	q.countSince = r("SELECT COUNT(*) FROM " + table + " WHERE published_at IS NOT NULL AND published_at >= ?")
	q.countBefore = r("SELECT COUNT(*) FROM " + table + " WHERE published_at IS NOT NULL AND published_at < ?")
	return q
}

// claimLocked is the locking claim, [1] after a cursor; with an index
// (quoted), it walks that one.
func claimLocked(d Dialect, table, index string) [2]string {
	from := table
	if index != "" {
		from += " FORCE INDEX (" + index + ")"
	}
	var q [2]string
	for i, cond := range claimConditions {
		q[i] = d.rebind("SELECT " + claimColumns + " FROM " + from + " WHERE " + cond +
			" ORDER BY created_at, id LIMIT ? FOR UPDATE SKIP LOCKED")
	}
	return q
}

// markPublished marks n rows published. Arguments: published_at, then the ids.
func (q storeQueries) markPublished(n int) string {
	return q.d.rebind("UPDATE " + q.table + " SET published_at = ?, locked_by = NULL, locked_until = NULL WHERE id IN (" +
		placeholders(n) + ")")
}

// releaseLease frees n leased rows that were neither published nor failed.
// Arguments: the relay id, then the ids. By id, not by relay: a release by
// locked_by alone scans every pending row.
func (q storeQueries) releaseLease(n int) string {
	return q.d.rebind("UPDATE " + q.table + " SET locked_by = NULL, locked_until = NULL WHERE locked_by = ? AND id IN (" +
		placeholders(n) + ")")
}

// retry makes n unpublished rows pending again. Arguments: the ids.
func (q storeQueries) retry(n int) string {
	return q.d.rebind("UPDATE " + q.table + " SET attempts = 0, locked_by = NULL, locked_until = NULL" +
		" WHERE published_at IS NULL AND id IN (" + placeholders(n) + ")")
}

// republish makes published, unprocessed records of n routing keys pending
// again. Arguments: the published-before cutoff, then the routing keys. The
// conditions are re-checked on the row the update locks, so a record two
// instances race for is made pending once.
func (q storeQueries) republish(n int) string {
	return q.d.rebind("UPDATE " + q.table + " SET published_at = NULL, attempts = 0, locked_by = NULL, locked_until = NULL" +
		" WHERE published_at IS NOT NULL AND published_at < ? AND processed_at IS NULL AND routing_key IN (" + placeholders(n) + ")")
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
