// Command outbox-bench measures what the outbox costs the code that uses it,
// on real databases, and prints one result per line as "name value unit" on
// stdout, so that runs can be diffed and tracked. Progress and notes go to
// stderr.
//
//	go run ./cmd/outbox-bench -scenario txpublish
//	go run ./cmd/outbox-bench -scenario txpublish -db postgres -n 5000
//
// Each scenario runs on an isolated database per dialect (internal/testdb:
// its own schema on PostgreSQL, database on MySQL/MariaDB, file on SQLite),
// dropped at the end, also on error or interrupt.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"runtime/pprof"
	"slices"
	"sort"
	"strconv"
	"strings"
	"syscall"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// scenarioFunc runs one scenario on every dialect of cfg and reports its
// results. A scenario lives in a file of its own, named after it.
type scenarioFunc func(ctx context.Context, cfg config, out *reporter) error

// scenarios maps -scenario to its function; a new scenario (relay, latency,
// inbox) is a file plus a line here.
var scenarios = map[string]scenarioFunc{
	"txpublish":    runTxPublish,
	"relay":        runRelay,
	"latency":      runLatency,
	"pendingquery": runPendingQuery,
	"inbox":        runInbox,
}

// config is what the flags say, shared by every scenario.
type config struct {
	kinds  []string // testdb kinds, in the order given
	n      int      // measured iterations per variant; 0 = the scenario's default
	warmup int      // discarded iterations per variant; -1 = the scenario's default
	dir    string   // holds the SQLite files
}

func main() {
	maybeOutboxctl()
	maybeFloorRelay()
	os.Exit(run())
}

func run() int {
	var (
		scenario = flag.String("scenario", "txpublish", "scenario to run: "+strings.Join(scenarioNames(), ", "))
		dbs      = flag.String("db", strings.Join(testdb.Kinds, ","), "comma-separated dialects to run: postgres, mysql, sqlite")
		n        = flag.Int("n", 0, "measured iterations per variant (0 = the scenario's default)")
		warmup   = flag.Int("warmup", -1, "discarded warm-up iterations per variant (-1 = the scenario's default)")
		pgDSN    = flag.String("postgres", testdb.PostgresDSN(), "PostgreSQL server DSN; the bench creates and drops a schema in it")
		myDSN    = flag.String("mysql", testdb.MySQLDSN(), "MySQL/MariaDB server DSN; the bench creates and drops a database in it")
		cpuProf  = flag.String("cpuprofile", "", "write a CPU profile of the scenario to this file")
	)
	flag.Parse()
	if flag.NArg() > 0 {
		return usage("unexpected arguments: %q", flag.Args())
	}
	fn, ok := scenarios[*scenario]
	if !ok {
		return usage("unknown scenario %q; want one of %s", *scenario, strings.Join(scenarioNames(), ", "))
	}
	kinds, err := parseKinds(*dbs)
	if err != nil {
		return usage("-db: %v", err)
	}
	if *n < 0 {
		return usage("-n must be positive, or 0 for the default")
	}
	if *warmup < -1 {
		return usage("-warmup must be 0 or more, or -1 for the default")
	}
	// testdb reads its servers from these variables; setting them makes the
	// flags the single source for the rest of the run.
	if err := errors.Join(
		os.Setenv("OUTBOX_TEST_POSTGRES_DSN", *pgDSN),
		os.Setenv("OUTBOX_TEST_MYSQL_DSN", *myDSN),
	); err != nil {
		return fail(err)
	}

	// Every server must answer before anything runs: a bench that silently
	// drops a dialect produces results that look complete and are not.
	for _, kind := range kinds {
		if err := testdb.Reachable(kind); err != nil {
			return fail(fmt.Errorf("%s is unreachable: %w (start it, pass -%s DSN, or leave it out of -db)", kind, err, kind))
		}
	}

	dir, err := os.MkdirTemp("", "outbox-bench-")
	if err != nil {
		return fail(err)
	}
	defer os.RemoveAll(dir)

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	if *cpuProf != "" {
		f, err := os.Create(*cpuProf)
		if err != nil {
			return fail(err)
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			return fail(err)
		}
		defer pprof.StopCPUProfile()
	}

	cfg := config{kinds: kinds, n: *n, warmup: *warmup, dir: dir}
	if err := fn(ctx, cfg, &reporter{}); err != nil {
		return fail(fmt.Errorf("scenario %s: %w", *scenario, err))
	}
	return 0
}

func usage(format string, args ...any) int {
	fmt.Fprintf(os.Stderr, "outbox-bench: "+format+"\n", args...)
	flag.Usage()
	return 2
}

func fail(err error) int {
	fmt.Fprintf(os.Stderr, "outbox-bench: %v\n", err)
	return 1
}

func scenarioNames() []string {
	names := make([]string, 0, len(scenarios))
	for name := range scenarios {
		names = append(names, name)
	}
	sort.Strings(names)
	return names
}

func parseKinds(list string) ([]string, error) {
	var kinds []string
	for _, k := range strings.Split(list, ",") {
		k = strings.TrimSpace(k)
		if k == "" {
			continue
		}
		if k == "mariadb" {
			k = testdb.MySQL
		}
		if !slices.Contains(testdb.Kinds, k) {
			return nil, fmt.Errorf("unknown dialect %q; want %s", k, strings.Join(testdb.Kinds, ", "))
		}
		if slices.Contains(kinds, k) {
			return nil, fmt.Errorf("dialect %q given twice", k)
		}
		kinds = append(kinds, k)
	}
	if len(kinds) == 0 {
		return nil, errors.New("no dialect given")
	}
	return kinds, nil
}

// dialects maps a testdb kind to the library's dialect.
var dialects = map[string]outbox.Dialect{
	testdb.Postgres: outbox.Postgres,
	testdb.MySQL:    outbox.MySQL,
	testdb.SQLite:   outbox.SQLite,
}

// withDatabase runs fn on a fresh isolated database of kind with the outbox
// schema migrated, and drops the database afterwards whatever fn returned.
func withDatabase(ctx context.Context, kind, dir string, fn func(db *testdb.DB, d outbox.Dialect) error) (err error) {
	d, ok := dialects[kind]
	if !ok {
		return fmt.Errorf("no dialect for %q", kind)
	}
	db, err := testdb.Open(ctx, kind, dir)
	if err != nil {
		return fmt.Errorf("%s: creating the isolated database: %w", kind, err)
	}
	defer func() {
		if closeErr := db.Close(); closeErr != nil {
			err = errors.Join(err, fmt.Errorf("%s: dropping %s: %w", kind, db.Name, closeErr))
		}
	}()
	if err := db.PingContext(ctx); err != nil {
		return fmt.Errorf("%s: %w", kind, err)
	}
	if err := outbox.Migrate(ctx, db.DB.DB, d); err != nil {
		return fmt.Errorf("%s: %w", kind, err)
	}
	if err := fn(db, d); err != nil {
		return fmt.Errorf("%s: %w", kind, err)
	}
	return nil
}

// reporter writes results to stdout, one "name value unit" line each, as
// soon as they are known, so a later failure does not lose earlier results.
type reporter struct{}

func (*reporter) metric(name string, value float64, unit string) {
	if strings.ContainsAny(name, " \t\n") || strings.ContainsAny(unit, " \t\n") || name == "" || unit == "" {
		panic(fmt.Sprintf("outbox-bench: malformed metric %q %q", name, unit))
	}
	fmt.Fprintf(os.Stdout, "%s %s %s\n", name, strconv.FormatFloat(value, 'f', decimals(unit), 64), unit)
}

// note writes progress to stderr.
func note(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "# "+format+"\n", args...)
}

func decimals(unit string) int {
	switch unit {
	case "ratio":
		return 3
	case "count":
		return 0
	}
	return 1
}
