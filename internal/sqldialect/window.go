package sqldialect

import "slices"

// A claim walks the pending index in created_at, id order and takes the
// rows that pass keyHead. Every pending record of a key but its head fails
// keyHead, so a key with a backlog (an aggregate that published 20,000
// events while the broker was away, a head stuck at MaxAttempts) made
// every claim walk its backlog and probe each entry: 300 ms a claim of 100
// on PostgreSQL at 20,000 pending records of one key, and that key drained
// at one record a claim. A windowed claim walks only the first ClaimParams.Window
// pending entries (near), and when those give fewer rows than it asks for,
// finds the rest without walking a key's backlog (far): each key's head
// through a loose scan of 0007's acemq_outbox_pending_key (one probe per
// key with pending records, not per record), and the rows no key orders
// through 0013's acemq_outbox_pending_unkeyed. Its cost grows with the
// window and the number of keys with pending records, never with one key's
// backlog.
//
// The relay asks for a window only when the pending index holds that many
// entries from where the claim starts (WindowFull): a claim over fewer is
// the claim as it was, as every claim is on MySQL, whose claims are not
// windowed.

// WindowFull tells whether the pending index holds at least window entries
// from where a claim with p starts, which makes the claim windowed. Column:
// 1; no row when it does not.
func (o *Outbox) WindowFull(p ClaimParams, window int) Query {
	from, args := o.pendingFrom(p)
	return o.query("SELECT 1 "+from+" ORDER BY created_at, id LIMIT 1 OFFSET ?", append(args, window-1)...)
}

// pendingFrom is the FROM and WHERE of the pending index's entries from
// where a claim with p starts, and its arguments.
func (o *Outbox) pendingFrom(p ClaimParams) (string, []any) {
	where, args := o.andAfter(p.After, "published_at IS NULL", nil)
	return "FROM " + o.table + " WHERE " + where, args
}

// windowNear is the CTE near: the claim as it is (where and whereArgs:
// claimWhere and the cursor), ended at the window's last entry, a range of
// the pending index, so that its walk stops there. cols is its select
// list, lock what ends it.
func (o *Outbox) windowNear(b *sqlBuilder, p ClaimParams, where string, whereArgs []any, cols, lock string) {
	b.add("near AS MATERIALIZED (SELECT "+cols+" FROM "+o.table+" "+claimAlias+" WHERE "+where, whereArgs...)
	b.add(" AND ")
	o.windowEndCmp(b, p, "<=")
	b.add(" ORDER BY created_at, id LIMIT ?"+lock+")", p.Limit)
}

// windowEndCmp is the condition that the row of the claim's alias compares
// by op with the window's last entry, in claim order.
func (o *Outbox) windowEndCmp(b *sqlBuilder, p ClaimParams, op string) {
	from, fa := o.pendingFrom(p)
	end := func(col string) {
		b.add("(SELECT "+col+" "+from+" ORDER BY created_at, id LIMIT 1 OFFSET ?)", slices.Concat(fa, []any{p.Window - 1})...)
	}
	b.add("(" + claimAlias + ".created_at, " + claimAlias + ".id) " + op + " (")
	end("created_at")
	b.add(", ")
	end("id")
	b.add(")")
}

// windowKeys is the CTE keys, the keys with pending records: a loose scan
// of the index of keys' pending records, one probe per key (neither
// database does one by itself), of p.KeysRead of them after p.KeysFrom, or
// every one (keysSlice).
func (o *Outbox) windowKeys(b *sqlBuilder, p ClaimParams) {
	o.keysSlice(b, p.KeysFrom, p.KeysRead)
}

// keysSlice is the CTE keys(k, i): up to n keys with pending records (every
// one when n is 0), in order, after the key after (nil for the first); i
// numbers them, and a last row whose k is NULL says the keys ran out. The
// keys stay in the database: a key that is not UTF-8, or a blob on SQLite,
// is read as it is.
func (o *Outbox) keysSlice(b *sqlBuilder, after any, n int) {
	b.add("keys(k, i) AS (SELECT (SELECT aggregate_id FROM " + o.table + " WHERE published_at IS NULL AND aggregate_id IS NOT NULL")
	if after != nil {
		b.add(" AND aggregate_id > ?", after)
	}
	b.add(" ORDER BY aggregate_id LIMIT 1), 1 UNION ALL SELECT (SELECT o.aggregate_id FROM " + o.table + " o WHERE o.published_at IS NULL AND o.aggregate_id IS NOT NULL AND o.aggregate_id > keys.k ORDER BY o.aggregate_id LIMIT 1), keys.i + 1" +
		" FROM keys WHERE keys.k IS NOT NULL")
	if n > 0 {
		b.add(" AND keys.i < ?", n)
	}
	b.add(")")
}

// keyHeadOf is the query of the columns cols of the head of key k (an
// expression of the enclosing query): the key's first pending record by
// seq that the relay does not have in flight, the one record of the key
// that keyHead lets through. Whether it is claimable (stuck, leased,
// locked) is asked after: one that is not holds its key, as it does in
// near.
func (o *Outbox) keyHeadOf(b *sqlBuilder, p ClaimParams, cols, k string) {
	b.add("SELECT " + cols + " FROM " + o.table + " h WHERE h.aggregate_id = " + k + " AND h.published_at IS NULL AND h.seq IS NOT NULL")
	if len(p.InFlight) > 0 {
		b.add(o.d.notOurs("h"), inFlightArg(p.InFlight))
	}
	b.add(" ORDER BY h.seq LIMIT 1")
}

// windowHeadIDs is the CTE heads(id): the id of each key's head (see
// keyHeadOf), one row per key of keys.
func (o *Outbox) windowHeadIDs(b *sqlBuilder, p ClaimParams) {
	b.add("heads(id) AS (SELECT (")
	o.keyHeadOf(b, p, "h.id", "keys.k")
	b.add(") FROM keys WHERE keys.k IS NOT NULL)")
}

// claimableWindowed is Claimable where claims are windowed: a row of the
// first p.Window entries of the pending index that a claim would take
// (all of them when there are fewer), else a claimable row no key orders,
// else a claimable key head, each after p.After when it is set, as the
// claim's far takes them; each part read only when those before it
// found nothing. Behind a blocked window the probe reads the window and
// the keys, not the backlog: an idle relay behind a stuck key's 20,000
// records used to read all of them at every poll.
func (o *Outbox) claimableWindowed(p ClaimParams, where string, args []any) Query {
	var b sqlBuilder
	b.add("WITH RECURSIVE ")
	o.windowKeys(&b, p)
	b.add(", ")
	o.windowHeadIDs(&b, p)
	from, fa := o.pendingFrom(p)
	end := func(col, none string) {
		b.add("COALESCE((SELECT "+col+" "+from+" ORDER BY created_at, id LIMIT 1 OFFSET ?), "+none+")", slices.Concat(fa, []any{p.Window - 1})...)
	}
	b.add(" SELECT * FROM (SELECT 1 AS one FROM "+o.table+" "+claimAlias+" WHERE "+where, args...)
	b.add(" AND (" + claimAlias + ".created_at, " + claimAlias + ".id) <= (")
	end("created_at", o.d.latest())
	b.add(", ")
	end("id", "NULL")
	cond, cargs := o.claimable(p.MaxAttempts, p.Now)
	cond, cargs = o.andAfter(p.After, cond, cargs)
	b.add(") LIMIT 1) w UNION ALL SELECT * FROM (SELECT 1 AS one FROM "+o.table+" "+claimAlias+" WHERE "+unkeyedRows+" AND "+cond+" LIMIT 1) u", cargs...)
	// Each head read by its id, in a scalar subquery: a join (IN, EXISTS)
	// was hashed against the whole table.
	b.add(" UNION ALL SELECT * FROM (SELECT 1 AS one FROM heads hd WHERE (SELECT 1 FROM "+o.table+" "+claimAlias+" WHERE "+claimAlias+".id = hd.id AND "+cond+") = 1 LIMIT 1) h LIMIT 1", cargs...)
	return Query{SQL: o.d.rebind(b.sql), Args: b.args}
}

// KeysSliceEnd says where the read of the keys of the windowed claim p
// (with p.KeysRead) stopped, where the claim did not say (see
// ScanClaimedSlice): how many keys it read and the last. With ids, the
// rows the claim took, it asks only if one of them lies beyond the window,
// for only then did the claim read the keys: SQLite's claim, an UPDATE,
// says nothing. Without, it asks of a claim that came back short, whose
// window fell short. Asked in the claim's own transaction, whose writes
// changed no entry of the pending index. Columns: the count, the key; no
// row when no row of ids lies beyond the window.
func (o *Outbox) KeysSliceEnd(p ClaimParams, ids []any) Query {
	var b sqlBuilder
	b.add("WITH RECURSIVE ")
	o.keysSlice(&b, p.KeysFrom, p.KeysRead)
	b.add(" SELECT (SELECT COUNT(k) FROM keys), (SELECT k FROM keys WHERE k IS NOT NULL ORDER BY i DESC LIMIT 1)")
	if ids != nil {
		b.add(" WHERE EXISTS (SELECT 1 FROM "+o.table+" "+claimAlias+" WHERE "+claimAlias+".id IN ("+placeholders(len(ids))+") AND ", ids...)
		o.windowEndCmp(&b, p, ">")
		b.add(")")
	}
	return Query{SQL: o.d.rebind(b.sql), Args: b.args}
}

// farWhere is the condition of a row a windowed claim takes beyond its
// window, on the claim's alias: claimable, after the cursor, and not taken
// by near (nearID: near's id column).
func (o *Outbox) farWhere(b *sqlBuilder, p ClaimParams, nearID string) {
	cond, args := o.claimable(p.MaxAttempts, p.Now)
	b.add(cond, args...)
	if p.After != nil {
		cond, args := o.after(p.After)
		b.add(" AND "+cond, args...)
	}
	b.add(" AND " + o.d.text(claimAlias+".id") + " NOT IN (SELECT " + nearID + " FROM near)")
}

// unkeyedRows is the condition of the rows no key orders, on the claim's
// alias: unkeyed, or without a seq, which keyHead lets through. It is
// 0013's index's, word for word.
const unkeyedRows = "(" + claimAlias + ".aggregate_id IS NULL OR " + claimAlias + ".seq IS NULL)"

// farLimit is how many rows a windowed claim takes beyond its window: those
// near left of p.Limit, none when near took them all (and what it would
// read is then not read).
func farLimit(p ClaimParams) (string, []any) {
	return "(SELECT ? - COUNT(*) FROM near)", []any{p.Limit}
}

// sqlBuilder writes a statement and its arguments in the order of its
// placeholders.
type sqlBuilder struct {
	sql  string
	args []any
}

func (b *sqlBuilder) add(s string, args ...any) {
	b.sql += s
	b.args = append(b.args, args...)
}
