package sqlschema

import (
	"reflect"
	"slices"
	"strings"
	"testing"
)

// The guarded steps come out of their comment lines in file order among
// the plain statements, which alone are what the tools (and Statements)
// run; a guard out of place is refused rather than run unguarded.
func TestSteps_GuardedStepsInFileOrder_ToolsSeeOnlyPlainSQL(t *testing.T) {
	file := `-- +goose Up
CREATE TABLE a (x int);
-- +acemq Unless SELECT 1 FROM pragma_table_info('a') WHERE name = 'y'
-- +acemq Run ALTER TABLE a ADD COLUMN y int
SELECT 1;
`
	steps, err := Steps(file)
	want := []Step{
		{Run: "CREATE TABLE a (x int);"},
		{Run: "ALTER TABLE a ADD COLUMN y int", Unless: "SELECT 1 FROM pragma_table_info('a') WHERE name = 'y'"},
		{Run: "SELECT 1;"},
	}
	if err != nil || !reflect.DeepEqual(steps, want) {
		t.Errorf("Steps = %q, %v; want %q", steps, err, want)
	}
	if got := Statements(file); !reflect.DeepEqual(got, []string{"CREATE TABLE a (x int);", "SELECT 1;"}) {
		t.Errorf("Statements = %q, want the plain statements only", got)
	}
	for _, bad := range []string{
		"-- +acemq Run ALTER TABLE a ADD COLUMN y int\n",
		"-- +acemq Unless SELECT 1\n",
		"-- +acemq Unless SELECT 1\n-- +acemq Unless SELECT 2\n-- +acemq Run DO 0\n",
		"-- +acemq Unless\n-- +acemq Run DO 0\n",
		"-- +acemq When SELECT 1\n",
	} {
		if _, err := Steps(bad); err == nil {
			t.Errorf("Steps(%q) accepted it", bad)
		}
	}
}

// Every dialect's files parse.
func TestMigrations_EveryDialect_Parse(t *testing.T) {
	for _, d := range Dialects {
		if _, err := Migrations(d); err != nil {
			t.Errorf("%s: %v", d, err)
		}
	}
}

// Every column a SQLite step adds to acemq_outbox is one 0001 makes with
// the table: goose and golang-migrate skip the steps, and a table they
// made without the column was one the library could not use (0005's
// aggregate_id and seq were, and no relay could claim a row).
func TestMigrations_SQLite_EveryColumnAStepAdds_0001MakesWithTheTable(t *testing.T) {
	migs, err := Migrations("sqlite")
	if err != nil {
		t.Fatal(err)
	}
	create := Statements(migs[0].Up)[0]
	if !strings.HasPrefix(create, "CREATE TABLE IF NOT EXISTS acemq_outbox (") {
		t.Fatalf("0001's first statement is %q, want acemq_outbox's CREATE TABLE", create)
	}
	var columns []string
	for _, line := range strings.Split(create, "\n")[1:] {
		if fields := strings.Fields(line); len(fields) > 1 {
			columns = append(columns, fields[0])
		}
	}
	const add = "ALTER TABLE acemq_outbox ADD COLUMN "
	steps := 0
	for _, m := range migs {
		for _, s := range m.UpSteps {
			column, ok := strings.CutPrefix(s.Run, add)
			if !ok || s.Unless == "" {
				continue
			}
			steps++
			if name := strings.Fields(column)[0]; !slices.Contains(columns, name) {
				t.Errorf("%s adds %s, which 0001 does not make (it makes %v)", m.Name, name, columns)
			}
		}
	}
	if steps == 0 {
		t.Fatalf("no step adds a column: the test looks for %q", add)
	}
}
