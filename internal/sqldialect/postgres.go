package sqldialect

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
)

// postgres holds all SQL text for PostgreSQL.
type postgres struct{}

func (postgres) Name() string       { return "postgres" }
func (postgres) DriverName() string { return "pgx" }

func (postgres) quoteIdent(part string) string { return `"` + part + `"` }

// TimeArg sends the time in UTC. For a timestamptz column the zone makes no
// difference; a timestamp column (without time zone, as Rails and the other
// AceMQ libraries create acemq_outbox) gets the time's wall clock from pgx,
// which under a TZ other than UTC would store local time in a table every
// other service reads as UTC, and compare leases and cutoffs off by hours.
func (postgres) TimeArg(t time.Time) any { return t.UTC() }

// fromDriver: pgx returns a timestamptz as its instant (in time.Local) and a
// timestamp as its stored wall clock in UTC, which is the UTC time written.
func (postgres) fromDriver(t time.Time) time.Time { return instant(t) }

func (postgres) inline(q Query) (Query, bool) { return q, false }

func (postgres) rebind(q string) string { return rebindDollar(q) }

// Listens: a trigger notifies NotifyChannel at commit
// (sqlschema/postgres/0003_notify_acemq_outbox.up.sql).
func (postgres) Listens() bool { return true }

func (postgres) WatchesFile() bool { return false }

// NotifyChannel is the channel the acemq_outbox trigger notifies on commit.
const NotifyChannel = "acemq_outbox"

// Listen subscribes a connection to NotifyChannel.
func Listen() Query { return Query{SQL: "LISTEN " + NotifyChannel} }

// RetryChannel is the channel Wake notifies beside NotifyChannel: rows
// were made pending again (retry, republish), which a relay draining a
// backlog goes back for (its cursor is past them). This library's own:
// the AceMQ libraries of other languages listen on NotifyChannel alone.
const RetryChannel = "acemq_outbox_retry"

// ListenRetries subscribes a connection to RetryChannel.
func ListenRetries() Query { return Query{SQL: "LISTEN " + RetryChannel} }

// NotifyTriggerName is the trigger of migration 0003 that notifies
// NotifyChannel when a transaction that inserted outbox rows commits.
const NotifyTriggerName = "acemq_outbox_notify"

// NotifyTrigger reads what a listening relay needs to know of the outbox
// table, one row:
//   - the payload the trigger sends for it, schema.table as
//     TG_TABLE_SCHEMA || '.' || TG_TABLE_NAME spell it, read back from the
//     catalog so that an unqualified name resolves as the connection's
//     search_path resolves it; NULL when the table is not there. The
//     channel is the database's: every schema's outbox notifies on it, and
//     this is how a relay tells its own table's commits from others';
//   - whether its NotifyTriggerName fires for an ordinary session (enabled,
//     'O', or ALWAYS, 'A'): false when it is missing (a table another
//     library created, before this library's migrations ran), disabled
//     (ALTER TABLE … DISABLE TRIGGER) or set to fire on replicas only;
//   - the table's quiet sequence (migration 0010), schema-qualified and
//     quoted, when it is there and this role may set it; NULL otherwise.
func (o *Outbox) NotifyTrigger() Query {
	return o.query(`SELECT n.nspname || '.' || c.relname, EXISTS (SELECT 1 FROM pg_trigger g WHERE g.tgrelid = c.oid AND g.tgname = '`+
		NotifyTriggerName+`' AND g.tgenabled IN ('O', 'A')), CASE WHEN has_sequence_privilege(s.oid, 'UPDATE')`+
		` THEN quote_ident(n.nspname) || '.' || quote_ident(s.relname) END`+
		` FROM (SELECT to_regclass(?) AS t) r LEFT JOIN pg_class c ON c.oid = r.t LEFT JOIN pg_namespace n ON n.oid = c.relnamespace`+
		` LEFT JOIN `+quietSequenceOf, o.table)
}

// quietSequenceOf joins the quiet sequence of the table c, as the trigger
// of migration 0010 finds it: in c's schema, named c's name and "_quiet"
// (no match where that is longer than a name can be), a sequence.
const quietSequenceOf = `pg_class s ON s.relnamespace = c.relnamespace AND s.relname = c.relname || '_quiet' AND s.relkind = 'S'`

// QuietLeft (PostgreSQL) reads how many more milliseconds the table's
// NOTIFY trigger stays quiet (0: it notifies), from its quiet sequence;
// no row when there is none (migration 0010 not applied) or this role
// may not read it. Column: bigint.
func (o *Outbox) QuietLeft() Query {
	return o.query(`SELECT GREATEST(COALESCE(pg_sequence_last_value(s.oid), 0) - (extract(epoch FROM clock_timestamp()) * 1000)::bigint, 0)`+
		` FROM pg_class c JOIN `+quietSequenceOf+` WHERE c.oid = to_regclass(?) AND has_sequence_privilege(s.oid, 'SELECT')`, o.table)
}

// QuietFor (PostgreSQL) keeps the table's NOTIFY trigger quiet for ms
// milliseconds from now on the server's clock (migration 0010), by setting
// its quiet sequence, as NotifyTrigger names it. A sequence's value is
// not transactional: the trigger sees it at once.
func QuietFor(sequence string, ms int64) Query {
	return Query{SQL: "SELECT setval($1::regclass, (extract(epoch FROM clock_timestamp()) * 1000)::bigint + $2)", Args: []any{sequence, ms}}
}

// QuietOff (PostgreSQL) lets the table's NOTIFY trigger notify again.
func QuietOff(sequence string) Query {
	return Query{SQL: "SELECT setval($1::regclass, 0)", Args: []any{sequence}}
}

// NeverSent (PostgreSQL) reports whether err says that a statement never
// reached the server: database/sql's driver.ErrBadConn, which pgx's stdlib
// returns for what pgconn deems safe to retry, or pgconn's own word. Any
// other error may come after the server ran it (setval, which no rollback
// undoes).
func NeverSent(err error) bool {
	return errors.Is(err, driver.ErrBadConn) || pgconn.SafeToRetry(err)
}

// QuietOver (PostgreSQL) reports whether every transaction the NOTIFY
// trigger kept quiet has ended, by taking the advisory lock they hold
// shared (migration 0010's key: 'acmq' in the high 32 bits, the table's
// oid in the low), exclusively, without waiting, for the statement's own
// transaction only. Column: bool (true as well when the table is not
// there).
func (o *Outbox) QuietOver() Query {
	return o.query(`SELECT COALESCE(pg_try_advisory_xact_lock((1633906033::bigint << 32) | to_regclass(?)::oid::bigint), true)`, o.table)
}

// Wake (PostgreSQL) sends the notification the table's NOTIFY trigger
// sends when rows are inserted, for rows an UPDATE made pending again
// (retry, republish), which the trigger does not see: listening relays
// claim them now rather than at their next poll. It sends the same on
// RetryChannel first, for relays in a drain to go back for them. No row,
// and no notification, when the table is not there.
func (o *Outbox) Wake() Query {
	return o.query(`SELECT pg_notify('`+RetryChannel+`', t.name), pg_notify('`+NotifyChannel+`', t.name)`+
		` FROM (SELECT n.nspname || '.' || c.relname AS name FROM pg_class c`+
		` JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = to_regclass(?)) t`, o.table)
}

// AlsoOnSearchPath (PostgreSQL) lists, as schema.table in search-path
// order, the tables of the outbox's name in the path's other schemas than
// the one the name resolves to: what a process with another search_path
// would read and write under the same name (a database an earlier Migrate
// split, say; see the CHANGELOG). No row for a schema-qualified name.
// Column: text.
func (o *Outbox) AlsoOnSearchPath() Query {
	return o.query(`SELECT n.nspname || '.' || c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace`+
		` WHERE ? = '' AND c.relname = ? AND c.relkind IN ('r', 'p') AND n.nspname = ANY (current_schemas(false))`+
		` AND c.oid IS DISTINCT FROM to_regclass(?) ORDER BY array_position(current_schemas(false), n.nspname)`, o.schema, o.name, o.table)
}

// NarrowColumns (MySQL) lists the outbox's text columns whose character
// set cannot hold every character (utf8mb3, latin1: anything but utf8mb4
// and binary), as "column (charset)" in table order. A table another
// library created in utf8mb3 is one: the publisher's Publish of a 4-byte
// character (an emoji) fails there under strict mode, and is stored as "?"
// with a warning without it. Column: text.
func (o *Outbox) NarrowColumns() Query {
	schema := "DATABASE()"
	args := []any{o.name}
	if o.schema != "" {
		schema = "?"
		args = []any{o.schema, o.name}
	}
	return o.query("SELECT CONCAT(COLUMN_NAME, ' (', CHARACTER_SET_NAME, ')') FROM information_schema.COLUMNS"+
		" WHERE TABLE_SCHEMA = "+schema+" AND TABLE_NAME = ? AND CHARACTER_SET_NAME IS NOT NULL"+
		" AND CHARACTER_SET_NAME NOT IN ('utf8mb4', 'binary') ORDER BY ORDINAL_POSITION", args...)
}

// Leases: PostgreSQL has FOR UPDATE SKIP LOCKED, so a claim is a row lock
// held by the relay's transaction. A relay that dies releases it with its
// connection, at once; a second relay skips the locked rows.
func (postgres) Leases() bool { return false }

// LocksPassedOver: FOR UPDATE locks only the rows the claim returns.
func (postgres) LocksPassedOver() bool { return false }

func (postgres) GapLocks() bool { return false }

func (postgres) PadsKeys() bool { return false }

func (postgres) TextKeys() bool { return true }

func (postgres) BlobIDs() bool { return false }

func (postgres) EndsTransaction(err error) bool { return err != nil }

func (postgres) TimeoutEnds(error) (Query, bool) { return Query{}, false }

func (postgres) AsksByBegin() bool { return false }

func (postgres) SilentRollbacks() bool { return false }

// CommitRolledBack: pgx's ErrTxCommitRollback ("commit unexpectedly
// resulted in rollback"), lib/pq's ErrInFailedTransaction, by their text:
// the dialect imports no driver.
func (postgres) CommitRolledBack(err error) bool {
	if err == nil {
		return false
	}
	s := err.Error()
	return strings.Contains(s, "commit unexpectedly resulted in rollback") || strings.Contains(s, "in a failed transaction")
}

// Conflict: SQLSTATE 40001 (serialization_failure: under REPEATABLE READ
// or SERIALIZABLE, a row changed since the transaction's snapshot) and
// 40P01 (deadlock_detected).
func (postgres) Conflict(err error) bool {
	s := sqlState(err)
	return s == "40001" || s == "40P01"
}

// ConnLost: a connection exception (class 08), the backend terminated
// or the server shutting down (57P01–57P03), a statement that never
// reached the server (NeverSent), pgx's closed connection, or
// database/sql's done connection.
func (postgres) ConnLost(err error) bool {
	if err == nil {
		return false
	}
	s := sqlState(err)
	return strings.HasPrefix(s, "08") || s == "57P01" || s == "57P02" || s == "57P03" ||
		NeverSent(err) || errors.Is(err, sql.ErrConnDone) || strings.Contains(err.Error(), "conn closed")
}

// MissingTable: undefined_table (42P01). Not a missing schema
// (3F000), which no migration makes.
func (postgres) MissingTable(err error) bool { return sqlState(err) == "42P01" }

// MissingColumn: undefined_column (42703).
func (postgres) MissingColumn(err error) bool { return sqlState(err) == "42703" }

// CannotHold: a character the database's encoding lacks (22021
// character_not_in_repertoire, 22P05 untranslatable_character).
func (postgres) CannotHold(err error) bool {
	s := sqlState(err)
	return s == "22021" || s == "22P05"
}

// TxAborted reports whether err, a statement's on PostgreSQL, was refused
// because an earlier error aborted the transaction (25P02): the
// transaction will roll back whatever its caller does.
func TxAborted(err error) bool { return sqlState(err) == "25P02" }

// sqlState is err's SQLSTATE, read through SQLState(), which both pgx's and
// lib/pq's errors have, where their texts differ ("… (SQLSTATE 55P03)",
// "pq: canceling statement due to lock timeout"); "" for another error.
func sqlState(err error) string {
	var e interface{ SQLState() string }
	if !errors.As(err, &e) {
		return ""
	}
	return e.SQLState()
}

// PreparesRelay: pgx caches the statements it prepares on each connection
// already, and a DSN set up for a pooler that cannot keep them (pgbouncer in
// transaction mode) must have its way.
func (postgres) PreparesRelay() bool { return false }

func (postgres) insertedAll(res Result, n int) (bool, error) { return affectedAll(res, n) }

func (postgres) insertOutbox(table, cols string, n, rows int) string {
	return insertOutboxOnConflict(table, cols, n, rows, dollar)
}

func (postgres) raiseSeqs(sequences string, keys []KeyCount) Query {
	sql, args := raiseSeqsOnConflict(sequences, keys)
	return Query{SQL: rebindDollar(sql), Args: args}
}

// insertNumbered is one statement: the raise of the keys is a
// data-modifying CTE whose RETURNING the rows read their numbers from (the
// table itself, read in the same statement, would show the numbers before
// the raise).
func (postgres) insertNumbered(o *Outbox, rows []Row, keys []KeyCount) []Query {
	raise, args := raiseSeqsOnConflict(o.sequences, keys)
	insert, insertArgs := o.numberedInsert("INSERT INTO", rows, keys, "n")
	return []Query{{
		SQL:  rebindDollar("WITH n AS (" + raise + " RETURNING aggregate_id, last_seq) " + insert + " ON CONFLICT (id) DO NOTHING"),
		Args: append(args, insertArgs...),
	}}
}

func (postgres) claim(table string, p ClaimParams, where string, args []any) Query {
	if len(p.Points) > 0 {
		// Ordered by an expression no index holds: ordered by created_at,
		// in the claim's transaction (enable_sort off, see claimSetup),
		// the planner walked the whole pending index, the id a filter,
		// rather than look the points up by the primary key and sort
		// them; unordered, a LIMIT kept the newest of them.
		return Query{SQL: rebindDollar("SELECT " + postgresClaimed + " FROM " + table + " " + claimAlias + " WHERE " + where +
			" ORDER BY (created_at + interval '0 seconds'), id LIMIT ? FOR UPDATE SKIP LOCKED"), Args: append(args, p.Limit)}
	}
	return Query{SQL: rebindDollar(lockingClaim(postgresClaimed, table+" "+claimAlias, where)), Args: append(args, p.Limit)}
}

// keyHead: InFlight's ids are a json array, read as a set (a hashed
// subplan, made once per claim). A NULL in it would make NOT IN unknown
// for every row, and the predecessor ours: none is read. The ids are
// compared as text, as the claim read them (see text): an id column of
// another type (uuid, which another library's table may have) has no
// operator with text, and its claims failed while keyed records were in
// flight.
func (d postgres) keyHead(table, alias string, p ClaimParams) string {
	notOurs := ""
	if len(p.InFlight) > 0 {
		notOurs = d.notOurs("p")
	}
	return keyHeadNotExists(table, alias, notOurs)
}

func (postgres) windows() bool { return true }

// pointsInIndex: by a list of their created_at and one of their ids (see
// atPoints and claim). A disjunction of pairs is no index condition to
// PostgreSQL: a claim ordered by created_at filtered every entry of the
// index with it.
func (postgres) pointsInIndex() bool { return false }

// latest sorts after every time a timestamp column holds.
func (postgres) latest() string { return "'infinity'" }

func (postgres) notOurs(alias string) string {
	return " AND " + alias + ".id::text NOT IN (SELECT j FROM json_array_elements_text(?::json) j WHERE j IS NOT NULL)"
}

// byPlace is the condition on a row's ctid that windowClaim's lookups
// start with, where the table's rows have one (see ClaimParams.ByID).
func byPlace(p ClaimParams) string {
	if p.ByID {
		return ""
	}
	return claimAlias + ".ctid = hs.ctid AND "
}

// place is the ctid of the rows of alias that windowClaim chooses, a
// NULL where the table's rows have none (see ClaimParams.ByID).
func place(p ClaimParams, alias string) string {
	if p.ByID {
		return "NULL::tid AS ctid"
	}
	return alias + ".ctid"
}

// TupleIDs reads whether the table's rows have a ctid, which a windowed
// claim locks them by on PostgreSQL: a table or a partitioned one, not a
// view (which a relay's Table may name, over the outbox). One row, a
// bool: false for a relation that is not there.
func (o *Outbox) TupleIDs() Query {
	return o.query("SELECT COALESCE((SELECT relkind IN ('r', 'p') FROM pg_class WHERE oid = to_regclass(?)), false)", o.table)
}

// windowClaim locks near's rows in its walk, as the claim does. Beyond
// the window it chooses first and locks after, each row as it comes, and
// only as many as it returns: the heads and the first unkeyed rows (2n +
// 256 of them, through 0013's index: past as many held by other claims, it
// takes younger rows, or fewer), oldest first, each locked
// by its id, skipped if another claim holds it, until near's shortfall is
// made up. A lock taken in the choice would skip a head another relay
// holds and take the record after it; a walk of the unkeyed rows that
// locked as it went would lock rows the claim then left unsent (a review
// found them skipped by every claim until this one's batch was marked).
// Heads are read and locked one by one through LATERAL: a join left to
// the planner hashed the whole table. Each candidate is locked by its
// ctid, read with it (a TID scan), and its id: looked up by id alone, on
// statistics taken while the table was small the planner took the pending
// index, whose id is its second column, and each lookup walked all of it
// (385,165 blocks, 586 ms, for a claim from the head behind 2,256 rows in
// flight). A row updated since its candidate was read has another ctid:
// the lock's recheck finds it no longer matches, and the claim passes it
// over, for the next to take if it is still claimable.
func (postgres) windowClaim(o *Outbox, p ClaimParams, where string, args []any) Query {
	var b sqlBuilder
	b.add("WITH RECURSIVE ")
	o.windowNear(&b, p, where, args, postgresClaimed, " FOR UPDATE SKIP LOCKED")
	b.add(", ")
	o.windowKeys(&b, p)
	b.add(", heads AS MATERIALIZED (SELECT hh.id, hh.created_at, hh.ctid FROM keys CROSS JOIN LATERAL (")
	o.keyHeadOf(&b, p, "h.id, h.created_at, "+place(p, "h"), "keys.k")
	b.add(") hh WHERE keys.k IS NOT NULL)")
	b.add(", far AS (SELECT x.* FROM (SELECT id, created_at, ctid FROM (SELECT id, created_at, ctid FROM heads UNION ALL SELECT * FROM (SELECT " +
		claimAlias + ".id, " + claimAlias + ".created_at, " + place(p, claimAlias) + " FROM " + o.table + " " + claimAlias + " WHERE " + unkeyedRows + " AND ")
	o.farWhere(&b, p, "id")
	b.add(" ORDER BY created_at, id LIMIT ?) u) cand ORDER BY created_at, id) hs CROSS JOIN LATERAL (SELECT "+postgresClaimed+" FROM "+o.table+" "+claimAlias+
		" WHERE "+byPlace(p)+claimAlias+".id = hs.id AND ", 2*p.Limit+256)
	o.farWhere(&b, p, "id")
	limit, largs := farLimit(p)
	b.add(" FOR UPDATE SKIP LOCKED) x LIMIT "+limit+")", largs...)
	if p.KeysRead > 0 {
		// Each row taken beyond the window says where the read of the keys
		// stopped: how many it read, and the last (see ScanClaimedSlice).
		b.add(" SELECT *, NULL::bigint AS keys_read, NULL AS keys_last FROM near" +
			" UNION ALL SELECT *, (SELECT count(k) FROM keys), (SELECT k FROM keys WHERE k IS NOT NULL ORDER BY i DESC LIMIT 1) FROM far ORDER BY created_at, id")
	} else {
		b.add(" SELECT * FROM near UNION ALL SELECT * FROM far ORDER BY created_at, id")
	}
	return Query{SQL: rebindDollar(b.sql), Args: b.args}
}

// claimSetup makes the planner walk the pending index in order, which is the
// only good plan for the claim. Statistics gathered while the table was
// small (a new table, or a quiet one before an outage's backlog) make it
// believe a handful of rows are pending, and it then fetches all of them
// and sorts them: 9 ms per claim over 20,000 pending rows, 165 ms over
// 200,000, against a fraction of a millisecond. SET LOCAL ends with the
// claim's transaction.
//
// It also turns idle_in_transaction_session_timeout off for the claim's
// transaction: the claim holds its rows' locks, idle, while its batch is
// out (and behind the batches in flight before it), and a timeout a DBA set
// on the role or the database ended the session then, released the rows to
// another relay's claim, and failed the mark, so the batch went out twice.
// (PostgreSQL 17's transaction_timeout would do the same; a claim cannot
// name it on the servers before 17, which refuse an unknown setting.)
//
// And it turns the JIT off: a claim whose plan looks costly (a windowed
// one, a walk the statistics misjudge) passed jit_above_cost, and
// compiling it took hundreds of milliseconds (600 ms of a windowed claim
// that ran in 18 ms without).
func (postgres) claimSetup() string {
	return "SELECT set_config('enable_sort', 'off', true), set_config('idle_in_transaction_session_timeout', '0', true), set_config('jit', 'off', true)"
}

// busyTimeout: the server queues writers.
func (postgres) busyTimeout() string { return "" }

// pendingIndex: the partial index is found by the planner; nothing to name.
func (postgres) pendingIndex() string { return "" }

func (postgres) keyIndex() string { return "" }

func (postgres) zonedTimes() string { return "" }

// idType: an unqualified name is the table it resolves to on the
// search_path, as in createdAtPrecision. A domain is its base type, also
// through domains over domains.
func (postgres) idType() string {
	return "WITH RECURSIVE d(oid) AS (SELECT a.atttypid FROM pg_catalog.pg_attribute a" +
		" WHERE a.attrelid = to_regclass(COALESCE(quote_ident(?) || '.', '') || quote_ident(?))" +
		" AND a.attname = 'id' AND NOT a.attisdropped" +
		" UNION ALL SELECT t.typbasetype FROM pg_catalog.pg_type t JOIN d ON t.oid = d.oid WHERE t.typbasetype <> 0)" +
		" SELECT COALESCE((SELECT format_type(d.oid, NULL) FROM d JOIN pg_catalog.pg_type t ON t.oid = d.oid" +
		" WHERE t.typbasetype = 0), '')"
}

// postgresClaimed is the claim's select list (see claimed).
var postgresClaimed = claimed(postgres{})

// createdAtPrecision: an unqualified name is the table it resolves to on
// the search_path, as every statement's; a timestamp without a precision
// keeps 6 digits.
func (postgres) createdAtPrecision() string {
	return "SELECT CASE WHEN a.atttypmod < 0 THEN 6 ELSE a.atttypmod END FROM pg_catalog.pg_attribute a" +
		" WHERE a.attrelid = to_regclass(COALESCE(quote_ident(?) || '.', '') || quote_ident(?))" +
		" AND a.attname = 'created_at' AND NOT a.attisdropped AND a.atttypid IN ('timestamp'::regtype, 'timestamptz'::regtype)"
}

func (d postgres) timeCmp(col, op string, t time.Time) (string, []any) {
	return timeColumnCmp(d, col, op, t)
}

func (d postgres) instantCmp(col, op string, t time.Time) (string, []any) {
	return timeColumnCmp(d, col, op, t)
}

func (postgres) timeOf(col string) string { return col }

// timeText: pgx reads a timestamptz as the instant it is.
func (postgres) timeText(expr string) string { return expr }

// bytes: the collations a table gets by default (and Rails') are
// deterministic, equal only where the bytes are.
func (postgres) bytes(col string) string { return col }

func (postgres) keepCreatedAt() string { return "" }

// text: a character(n) column reads back padded with spaces to n, and an
// id, a routing key or an exchange read so is not the one written: the
// relay sent "<uuid>" and 28 spaces as the message id, which every inbox
// refuses, and a padded routing key goes nowhere. As text the padding is
// gone; comparisons with the column (id IN (…), the cursor) ignore it
// already, so the marks and claims find the row by the unpadded value.
func (postgres) text(col string) string { return col + "::text" }

// currentRead: under READ COMMITTED, the default, each statement reads
// what was committed before it; under REPEATABLE READ an insert that
// meets a row its snapshot does not see fails as a serialization failure,
// before anything reads back.
func (postgres) currentRead() string { return "" }

func (postgres) stored(col string) string { return col }

// purgePublished locks the rows it picks, skipping locked ones: a row made
// pending again while the purge waited for it (Republish, an operator's
// UPDATE) is then read again and left, where a plain id IN (…) would have
// deleted it on the id alone, the re-check of the row PostgreSQL does
// after a wait covering only the DELETE's own condition.
func (postgres) purgePublished(table, before string) string {
	return "DELETE FROM " + table + " WHERE id IN (SELECT id FROM " + table +
		" WHERE published_at IS NOT NULL AND " + before + " ORDER BY published_at LIMIT ? FOR UPDATE SKIP LOCKED)"
}

func (postgres) insertProcessed(table string) string { return insertProcessedOnConflict(table) }

func (postgres) purgeProcessed(table, before string) string {
	return purgeProcessedByKey(table, before)
}

func (postgres) insertInboxSequence() string { return insertInboxSequenceOnConflict }

func (postgres) insertInboxHeld() string { return insertInboxHeldOnConflict }

// applyInOrder is one statement, as the plain inbox's key is: the advance
// is a data-modifying CTE, and the dedupe key is inserted only from the row
// it returns at m.Seq, so that one affected row says both happened. (Two
// statements cost a round trip more than the plain inbox's one, about a
// quarter more per message with the commit's fsync: outbox-bench inbox.)
func (postgres) applyInOrder(in *Inbox, m InOrder) []ApplyStep {
	q := "WITH s AS (" + advanceInboxSequenceOnConflict + ") INSERT INTO " + in.table +
		" (consumer_name, message_id, processed_at) SELECT ?, ?, ? FROM s WHERE s.last_seq = ? ON CONFLICT DO NOTHING"
	return []ApplyStep{{
		Query: Query{SQL: rebindDollar(q), Args: []any{
			m.Consumer, m.Key, firstSeq(m.Seq), m.Seq, m.Seq - 1,
			m.Consumer, InboxKey(m.MessageID), postgres{}.TimeArg(m.At), m.Seq,
		}},
		Done: oneRow,
	}}
}

func (postgres) lockInboxSequence() string { return selectInboxSequence + " FOR UPDATE" }

// migrationLockKey is an arbitrary constant shared by every process that
// migrates: pg_advisory_xact_lock makes the second one wait for the first.
const migrationLockKey = 0x6163656d71 // "acemq"

func (postgres) WithMigrationLock(ctx context.Context, conn *sql.Conn, fn func(Execer) error) error {
	return retryTableLocks(ctx, time.Now().Add(migrationLockTimeout*time.Second), func() error { return migrateOnce(ctx, conn, fn) }, func(err error) bool {
		return sqlState(err) == "55P03" // lock_not_available: lock_timeout
	})
}

// migrateOnce runs fn in one transaction under the migration lock.
func migrateOnce(ctx context.Context, conn *sql.Conn, fn func(Execer) error) error {
	// DDL is transactional on PostgreSQL: the lock, the schema and the record
	// of it commit together, and a failure leaves nothing half-made. READ
	// COMMITTED whatever the role's, database's or DSN's
	// default_transaction_isolation: under REPEATABLE READ or SERIALIZABLE
	// the snapshot is taken by pg_advisory_xact_lock, before its wait, and a
	// process that waited for another's Migrate would not see the versions
	// it recorded, run them again and fail recording them (23505, 40001).
	tx, err := conn.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelReadCommitted})
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback() }()
	if _, err := tx.ExecContext(ctx, "SELECT pg_advisory_xact_lock($1)", migrationLockKey); err != nil {
		return err
	}
	// After the migration lock, whose wait is another Migrate's.
	if _, err := tx.ExecContext(ctx, fmt.Sprintf("SET LOCAL lock_timeout = '%dms'", migrationTableLockWait.Milliseconds())); err != nil {
		return err
	}
	var schema string
	switch err := tx.QueryRowContext(ctx, migrateWhereOutboxIs).Scan(&schema, new(string)); {
	case errors.Is(err, sql.ErrNoRows):
	case err != nil:
		return fmt.Errorf("find the schema acemq_outbox resolves to: %w", err)
	}
	if err := fn(tx); err != nil {
		if schema != "" {
			return fmt.Errorf("in schema %s, where acemq_outbox resolves on the search_path: %w", schema, err)
		}
		return err
	}
	return tx.Commit()
}

// migrateWhereOutboxIs puts the schema of the acemq_outbox an unqualified
// name resolves to first in the migration's search_path, for its
// transaction only (set_config's is_local), when that is not the schema
// CREATE TABLE would use (current_schema). With search_path=svc,public and
// the estate's table in public, the name means public's table, and the
// migrations' CREATE TABLE IF NOT EXISTS would otherwise make a second,
// empty one in svc, which the name would mean from then on. The rest of the
// schema (its counters, the inbox's tables, the record of migrations) goes
// beside the table it serves. Without such a table nothing changes (nor
// for a view or a temporary table of that name).
const migrateWhereOutboxIs = `SELECT n.nspname, set_config('search_path', quote_ident(n.nspname) || ', ' || current_setting('search_path'), true)
    FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
    WHERE c.oid = to_regclass('acemq_outbox') AND c.relkind IN ('r', 'p') AND c.relpersistence <> 't'
      AND n.nspname IS DISTINCT FROM current_schema()`

// createMigrationsTable creates the table only where current_schema has
// none: PostgreSQL checks the CREATE privilege on the schema before it
// looks whether the table exists, so CREATE TABLE IF NOT EXISTS alone made
// Migrate fail for a role that may not create tables there (a service
// running with least privilege, or one whose outbox is in a schema another
// role owns), even on a database with every migration applied.
func (postgres) createMigrationsTable() string {
	return `DO $acemq$ BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
                   WHERE n.nspname = current_schema() AND c.relname = 'acemq_schema_migrations') THEN
        CREATE TABLE IF NOT EXISTS acemq_schema_migrations (
            version    integer        PRIMARY KEY,
            name       varchar(255)   NOT NULL,
            applied_at timestamptz(6) NOT NULL DEFAULT now()
        );
    END IF;
END $acemq$`
}

func (postgres) insertMigration() string {
	return "INSERT INTO acemq_schema_migrations (version, name) VALUES ($1, $2)"
}

// PostgresDefaultIsolation reads the isolation level a transaction begun
// with none named runs under in this session ("read committed",
// "repeatable read", "serializable"): a role's, a database's or the
// DSN's default_transaction_isolation.
const PostgresDefaultIsolation = "SELECT current_setting('default_transaction_isolation')"
