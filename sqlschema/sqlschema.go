// Package sqlschema holds the SQL migrations of watermill-outbox, one folder
// per dialect: postgres, mysql (MySQL 8 and MariaDB 10.6+) and sqlite.
//
// Each folder holds numbered NNNN_name.up.sql and NNNN_name.down.sql files in
// golang-migrate's layout, usable as they are by golang-migrate and atlas.
// Every up file also carries goose's "-- +goose Up" annotation; goose users
// pass [Goose] (the up files alone) to goose.NewProvider, since goose wants
// one file per version. Every statement is idempotent (IF NOT EXISTS), so a
// database migrated by one tool can later be migrated by another.
//
// Applications that use no migration tool call outbox.Migrate, which applies
// these same files under a lock and records them.
//
// # Steps plain SQL cannot take
//
// A table another AceMQ library created may lack a column, and SQLite can
// add one only with ALTER TABLE … ADD COLUMN, which fails when the column is
// there: it has no IF NOT EXISTS for columns, and plain SQL cannot run a
// statement on a condition. Such a step is written as two comment lines,
// which the tools skip and outbox.Migrate runs (see [Steps]):
//
//	-- +acemq Unless SELECT 1 FROM pragma_table_info('acemq_outbox') WHERE name = 'processed_at'
//	-- +acemq Run ALTER TABLE acemq_outbox ADD COLUMN processed_at DATETIME
//
// Users of the tools on such a table run the Run statements it needs
// themselves, once, before the tool runs the file that holds them: a plain
// statement after them may need the column (the indexes of sqlite/0005 and
// 0007 do, and fail naming it). A table the files create needs none:
// sqlite/0001 makes it with every column a step adds. PostgreSQL and MySQL
// need none either: their files say the same in plain SQL.
package sqlschema

import (
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"strings"
)

//go:embed postgres/*.sql mysql/*.sql sqlite/*.sql
var FS embed.FS

// Dialects are the folder names of FS.
var Dialects = []string{"postgres", "mysql", "sqlite"}

// Dir returns the migrations of one dialect ("postgres", "mysql", "sqlite"),
// both up and down files, rooted at the dialect's folder.
func Dir(dialect string) (fs.FS, error) {
	for _, d := range Dialects {
		if d == dialect {
			return fs.Sub(FS, dialect)
		}
	}
	return nil, fmt.Errorf("sqlschema: unknown dialect %q (want one of %s)", dialect, strings.Join(Dialects, ", "))
}

// Goose returns the up migrations of one dialect only, the layout goose reads.
func Goose(dialect string) (fs.FS, error) {
	dir, err := Dir(dialect)
	if err != nil {
		return nil, err
	}
	return upOnly{dir}, nil
}

// Migration is one numbered step of a dialect's schema.
type Migration struct {
	Version int
	Name    string
	Up      string
	Down    string
	// UpSteps are the statements of Up as outbox.Migrate runs them: those
	// of Statements, and the guarded steps, in file order.
	UpSteps []Step
}

// Migrations returns a dialect's migrations in version order.
func Migrations(dialect string) ([]Migration, error) {
	dir, err := Dir(dialect)
	if err != nil {
		return nil, err
	}
	ups, err := fs.Glob(dir, "*.up.sql")
	if err != nil {
		return nil, err
	}
	out := make([]Migration, 0, len(ups)) // Glob sorts, and the names are zero-padded.
	for _, up := range ups {
		base := strings.TrimSuffix(up, ".up.sql")
		var version int
		if _, err := fmt.Sscanf(base, "%04d_", &version); err != nil {
			return nil, fmt.Errorf("sqlschema: %s/%s: name does not start with a version: %w", dialect, up, err)
		}
		upSQL, err := fs.ReadFile(dir, up)
		if err != nil {
			return nil, err
		}
		downSQL, err := fs.ReadFile(dir, base+".down.sql")
		if err != nil {
			return nil, fmt.Errorf("sqlschema: %s/%s has no down file: %w", dialect, up, err)
		}
		steps, err := Steps(string(upSQL))
		if err != nil {
			return nil, fmt.Errorf("sqlschema: %s/%s: %w", dialect, up, err)
		}
		out = append(out, Migration{Version: version, Name: base, Up: string(upSQL), Down: string(downSQL), UpSteps: steps})
	}
	return out, nil
}

// Statements splits a migration file into the statements a driver without
// multi-statement support executes one by one. A statement ends with a ";"
// at the end of a line outside a $$-quoted body (a PostgreSQL function);
// "--" comment lines are dropped, the guarded steps of Steps among them.
func Statements(sqlText string) []string {
	steps, _ := split(sqlText)
	var out []string
	for _, s := range steps {
		if s.Unless == "" {
			out = append(out, s.Run)
		}
	}
	return out
}

// Step is one statement of a migration as outbox.Migrate runs it: Run,
// unless Unless, a query, returns a row.
type Step struct {
	Run    string
	Unless string
}

// directive starts the comment lines of a guarded step.
const directive = "-- +acemq "

// Steps splits a migration file into the steps outbox.Migrate runs: the
// statements of Statements, and a guarded step for each pair of lines
//
//	-- +acemq Unless <query>
//	-- +acemq Run <statement>
//
// in file order. Each is one line, with no ";" at the end.
func Steps(sqlText string) ([]Step, error) { return split(sqlText) }

func split(sqlText string) ([]Step, error) {
	var (
		out      []Step
		cur      strings.Builder
		inDollar bool
		unless   string
		errs     []error
	)
	for i, line := range strings.Split(sqlText, "\n") {
		trimmed := strings.TrimSpace(line)
		if !inDollar && strings.HasPrefix(trimmed, directive) {
			verb, arg, _ := strings.Cut(strings.TrimPrefix(trimmed, directive), " ")
			arg = strings.TrimSpace(arg)
			switch {
			case arg == "":
				errs = append(errs, fmt.Errorf("line %d: %q without its SQL", i+1, verb))
			case verb == "Unless" && unless == "":
				unless = arg
			case verb == "Run" && unless != "":
				out = append(out, Step{Run: arg, Unless: unless})
				unless = ""
			default:
				errs = append(errs, fmt.Errorf("line %d: %q out of place; want Unless, then Run", i+1, trimmed))
			}
			continue
		}
		if !inDollar && (trimmed == "" || strings.HasPrefix(trimmed, "--")) {
			continue
		}
		cur.WriteString(line)
		cur.WriteByte('\n')
		if strings.Count(line, "$$")%2 == 1 {
			inDollar = !inDollar
		}
		if !inDollar && strings.HasSuffix(trimmed, ";") {
			out = append(out, Step{Run: strings.TrimSpace(cur.String())})
			cur.Reset()
		}
	}
	if rest := strings.TrimSpace(cur.String()); rest != "" {
		out = append(out, Step{Run: rest})
	}
	if unless != "" {
		errs = append(errs, fmt.Errorf("an Unless with no Run after it: %q", unless))
	}
	return out, errors.Join(errs...)
}

type upOnly struct{ fs.FS }

func (u upOnly) ReadDir(name string) ([]fs.DirEntry, error) {
	entries, err := fs.ReadDir(u.FS, name)
	if err != nil {
		return nil, err
	}
	kept := entries[:0]
	for _, e := range entries {
		if strings.HasSuffix(e.Name(), ".up.sql") {
			kept = append(kept, e)
		}
	}
	return kept, nil
}
