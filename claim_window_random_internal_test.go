package outbox

import (
	"context"
	"database/sql"
	"fmt"
	"math/rand"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/acemq/watermill-outbox/internal/sqldialect"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// rvRow is a row of a random table of TestClaim_Windowed_TakesWhatAnUnwindowedClaimTakes_Random.
type rvRow struct {
	id        string
	key       string // "" unkeyed
	seq       any    // nil: NULL
	at        time.Time
	published bool
	attempts  int
	leasedBy  string // sqlite: a live lease of this relay
	nullAt    bool
	blob      bool
	other     bool // held by another relay (lock / lease)
}

// rvInsert writes rows by SQL, as another library would.
func rvInsert(t *testing.T, db *testdb.DB, rows []rvRow) {
	t.Helper()
	q := db.Rebind("INSERT INTO acemq_outbox (id, exchange_name, routing_key, body, created_at, aggregate_id, seq, published_at, attempts, locked_by, locked_until) VALUES (?, 'x', 'k', 'b', ?, ?, ?, ?, ?, ?, ?)")
	for _, r := range rows {
		var at any = r.at.UTC()
		if db.Kind != testdb.Postgres {
			at = r.at.UTC().Format("2006-01-02 15:04:05.000000")
		}
		if r.nullAt {
			at = nil
		}
		if r.other && r.leasedBy == "" {
			r.leasedBy = "other"
		}
		var key any
		if r.key != "" {
			key = r.key
		}
		var pub any
		if r.published {
			pub = at
		}
		var lb, lu any
		if r.leasedBy != "" && db.Kind != testdb.Postgres {
			lb = r.leasedBy
			if db.Kind == testdb.Postgres {
				lu = time.Now().Add(time.Hour).UTC()
			} else {
				lu = time.Now().Add(time.Hour).UTC().Format("2006-01-02 15:04:05.000000")
			}
		}
		var id any = r.id
		if r.blob {
			id = []byte(r.id)
		}
		if _, err := db.Exec(q, id, at, key, r.seq, pub, r.attempts, lb, lu); err != nil {
			t.Fatal(err)
		}
	}
}

// rvClaim runs the claim p in a transaction it rolls back, and returns the
// ids it took.
func rvClaim(t *testing.T, db *testdb.DB, s *Store, p sqldialect.ClaimParams) ([]string, error) {
	t.Helper()
	ctx := context.Background()
	tx, err := db.DB.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback() }()
	q := s.q.Claim(p)
	rows, err := tx.QueryContext(ctx, q.SQL, q.Args...)
	if err != nil {
		return nil, err
	}
	var ids []string
	err = eachRow(rows, func(vals []any) {
		switch v := vals[0].(type) {
		case string:
			ids = append(ids, v)
		case []byte:
			ids = append(ids, string(v))
		default:
			ids = append(ids, fmt.Sprint(v))
		}
	})
	return ids, err
}

// On random tables (keys with quotes and letters outside ASCII, records
// without a seq, published and stuck ones, created_at ties and NULLs,
// uuid ids on PostgreSQL and blob ids on SQLite, rows another relay holds,
// in-flight prefixes of keys, cursors with and without an id), a windowed
// claim of every size and window takes the rows an unwindowed claim of the
// same size takes, and the windowed probe answers as the unwindowed one.
// (Written by a reviewer of the windowed claim.)
func TestClaim_Windowed_TakesWhatAnUnwindowedClaimTakes_Random(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		kind, variant string
		d             Dialect
	}{{testdb.Postgres, "plain", Postgres}, {testdb.Postgres, "nullat", Postgres}, {testdb.Postgres, "uuid", Postgres}, {testdb.SQLite, "plain", SQLite}, {testdb.SQLite, "blob", SQLite}} {
		t.Run(c.kind+"/"+c.variant, func(t *testing.T) {
			t.Parallel()
			db := testdb.New(t, c.kind)
			if err := Migrate(context.Background(), db.DB, c.d); err != nil {
				t.Fatal(err)
			}
			switch c.variant {
			case "nullat":
				db.MustExec("ALTER TABLE acemq_outbox ALTER created_at DROP NOT NULL")
			case "uuid":
				db.MustExec("ALTER TABLE acemq_outbox ALTER id TYPE uuid USING id::uuid")
			}
			s, err := NewStore(db.DB, StoreConfig{Dialect: c.d})
			if err != nil {
				t.Fatal(err)
			}
			rng := rand.New(rand.NewSource(1))
			base := time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)
			keys := []string{"", "", "a", "b", "c", `o'"\ü`}
			fails := 0
			for iter := 0; iter < 60 && fails < 5; iter++ {
				db.MustExec("DELETE FROM acemq_outbox")
				var rows []rvRow
				seqs := map[string]int64{}
				n := 5 + rng.Intn(25)
				for i := 0; i < n; i++ {
					k := keys[rng.Intn(len(keys))]
					r := rvRow{id: fmt.Sprintf("r%02d", i), key: k, at: base.Add(time.Duration(rng.Intn(8)) * time.Second)}
					r.blob = c.variant == "blob" && rng.Intn(2) == 0
					if c.variant == "uuid" {
						r.id = fmt.Sprintf("00000000-0000-0000-0000-%012x", rng.Intn(1<<40))
					}
					if c.variant == "nullat" && rng.Intn(5) == 0 {
						r.nullAt = true
					}
					if rng.Intn(8) == 0 {
						r.other = true
					}
					if k != "" {
						if rng.Intn(10) == 0 {
							r.seq = nil
						} else {
							seqs[k]++
							r.seq = seqs[k]
						}
					}
					r.published = rng.Intn(5) == 0
					if rng.Intn(8) == 0 {
						r.attempts = 10
					}
					rows = append(rows, r)
				}
				// In flight: a prefix of some keys' pending records.
				var inFlight []string
				for _, k := range keys[2:] {
					if rng.Intn(2) == 0 {
						continue
					}
					var ks []*rvRow
					for i := range rows {
						if rows[i].key == k && rows[i].seq != nil && !rows[i].published {
							ks = append(ks, &rows[i])
						}
					}
					slices.SortFunc(ks, func(a, b *rvRow) int { return int(a.seq.(int64) - b.seq.(int64)) })
					m := rng.Intn(len(ks) + 1)
					for _, r := range ks[:m] {
						inFlight = append(inFlight, r.id)
						if c.kind == testdb.SQLite {
							r.leasedBy = "r"
						}
					}
				}
				rvInsert(t, db, rows)
				var otherTx *sql.Tx
				if c.kind == testdb.Postgres {
					var ids []any
					var ph []string
					for _, r := range rows {
						if r.other && !slices.Contains(inFlight, r.id) {
							ids = append(ids, r.id)
							ph = append(ph, fmt.Sprintf("$%d", len(ids)))
						}
					}
					if len(ids) > 0 {
						otherTx, err = db.DB.Begin()
						if err != nil {
							t.Fatal(err)
						}
						if _, err := otherTx.Exec("SELECT 1 FROM acemq_outbox WHERE id::text IN ("+strings.Join(ph, ",")+") FOR UPDATE", ids...); err != nil {
							t.Fatal(err)
						}
					}
				}
				var lockTx *sql.Tx
				if c.kind == testdb.Postgres && len(inFlight) > 0 {
					// our own earlier claim holds them
					lockTx, err = db.DB.Begin()
					if err != nil {
						t.Fatal(err)
					}
					ph := make([]string, len(inFlight))
					args := make([]any, len(inFlight))
					for i, id := range inFlight {
						ph[i] = fmt.Sprintf("$%d", i+1)
						args[i] = id
					}
					if _, err := lockTx.Exec("SELECT 1 FROM acemq_outbox WHERE id::text IN ("+strings.Join(ph, ",")+") FOR UPDATE", args...); err != nil {
						t.Fatal(err)
					}
				}
				var after *sqldialect.Cursor
				switch rng.Intn(3) {
				case 1:
					r := rows[rng.Intn(len(rows))]
					after = &sqldialect.Cursor{CreatedAt: r.at, ID: r.id}
				case 2:
					after = &sqldialect.Cursor{CreatedAt: base.Add(time.Duration(rng.Intn(8)) * time.Second)}
				}
				now := time.Now()
				p := sqldialect.ClaimParams{Limit: 1000, MaxAttempts: 10, Now: now, After: after, InFlight: inFlight, RelayID: "r2", LeaseUntil: now.Add(time.Minute)}
				ref, err := rvClaim(t, db, s, p)
				if err != nil {
					t.Fatalf("unwindowed: %v", err)
				}
				for _, lim := range []int{1, 2, 3, 5, 100} {
					for _, w := range []int{1, 2, 3, 5, 8, 40} {
						pw := p
						pw.Limit, pw.Window = lim, w
						got, err := rvClaim(t, db, s, pw)
						if err != nil {
							t.Fatalf("windowed n=%d w=%d: %v", lim, w, err)
						}
						want, err := rvClaim(t, db, s, sqldialect.ClaimParams{Limit: lim, MaxAttempts: 10, Now: now, After: after, InFlight: inFlight, RelayID: "r2", LeaseUntil: now.Add(time.Minute)})
						if err != nil {
							t.Fatal(err)
						}
						bad := false
						for _, id := range got {
							if !slices.Contains(ref, id) {
								bad = true
							}
						}
						{
							// A slice of the keys read in the claim: a
							// short one from anywhere takes only rows an
							// unwindowed claim takes, none twice; one that
							// reaches the last key takes what it takes.
							ps := pw
							ps.KeysRead = 1 + rng.Intn(3)
							if i := rng.Intn(len(keys) + 1); i < len(keys) {
								ps.KeysFrom = keys[i]
							}
							from := ps.KeysFrom
							some, err := rvClaim(t, db, s, ps)
							if err != nil {
								t.Fatalf("windowed n=%d w=%d slice %d after %v: %v", lim, w, ps.KeysRead, from, err)
							}
							for i, id := range some {
								if !slices.Contains(ref, id) || slices.Contains(some[:i], id) {
									fails++
									t.Errorf("iter %d n=%d w=%d slice %d after %v: took %v, all claimable %v", iter, lim, w, ps.KeysRead, from, some, ref)
									break
								}
							}
							ps.KeysRead, ps.KeysFrom = len(keys)+1, nil
							all, err := rvClaim(t, db, s, ps)
							if err != nil {
								t.Fatal(err)
							}
							as, ws := slices.Clone(all), slices.Clone(want)
							slices.Sort(as)
							slices.Sort(ws)
							if !slices.Equal(as, ws) {
								fails++
								t.Errorf("iter %d n=%d w=%d every key in a slice: took %v, unwindowed %v", iter, lim, w, all, want)
							}
						}
						gs, ws := slices.Clone(got), slices.Clone(want)
						slices.Sort(gs)
						slices.Sort(ws)
						if bad || len(got) != len(want) || !slices.Equal(gs, ws) {
							fails++
							t.Errorf("iter %d n=%d w=%d after=%+v inFlight=%v:\n windowed   %v\n unwindowed %v (all claimable %v)\n rows %+v", iter, lim, w, after, inFlight, got, want, ref, rows)
						}
					}
				}
				probe := func(w int) bool {
					q := s.q.Claimable(sqldialect.ClaimParams{MaxAttempts: 10, Now: now, Window: w})
					var one int
					err := db.DB.QueryRow(q.SQL, q.Args...).Scan(&one)
					if err != nil && err != sql.ErrNoRows {
						t.Fatalf("probe w=%d: %v", w, err)
					}
					return err == nil
				}
				pw0 := probe(0)
				for _, w := range []int{1, 2, 3, 5, 40, 256} {
					if got := probe(w); got != pw0 {
						fails++
						t.Errorf("iter %d: probe with window %d says %v, unwindowed %v; rows %+v", iter, w, got, pw0, rows)
					}
				}
				if lockTx != nil {
					_ = lockTx.Rollback()
				}
				if otherTx != nil {
					_ = otherTx.Rollback()
				}
			}
		})
	}
}
