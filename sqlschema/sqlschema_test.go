package sqlschema

import (
	"reflect"
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
