// Package outboxctl is the outboxctl command (cmd/outboxctl), as a function
// of its arguments, environment and output, so that tests run it in their
// own process: under a time zone of their choosing, on their own databases.
package outboxctl

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"sort"
	"strconv"
	"strings"
	"syscall"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/sqldialect"
)

const (
	exitOK    = 0
	exitFail  = 1
	exitUsage = 2
)

// Main is the whole program but for the process: arguments (without the
// program's name), environment and output come in, the exit code goes out.
// SIGINT and SIGTERM cancel the command's context: the relay finishes its
// batch in flight and a purge reports what it deleted. A second signal
// kills the process as usual.
func Main(args []string, env func(string) string, stdout, stderr io.Writer) int {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	context.AfterFunc(ctx, stop) // once stopping, a second signal is not caught
	return Run(ctx, args, env, stdout, stderr)
}

// Run is Main with the context given rather than one of signals.
func Run(ctx context.Context, args []string, env func(string) string, stdout, stderr io.Writer) int {
	c := &cli{ctx: ctx, env: env, stdout: stdout, stderr: stderr}
	err := c.main(args)
	switch {
	case err == nil:
		return exitOK
	case errors.Is(err, flag.ErrHelp):
		return exitOK
	}
	msg := oneLine(err.Error())
	if sqldialect.Busy(err) {
		// "database is locked" alone said neither why nor what to do (a
		// review of a service on SQLite).
		msg += " (another connection held the SQLite database's write lock past the busy timeout, _busy_timeout in --db:" +
			" a long transaction or a VACUUM in another process; run the command again once it ends)"
	}
	fmt.Fprintln(stderr, "outboxctl: "+msg)
	var ue *usageError
	if errors.As(err, &ue) {
		return exitUsage
	}
	return exitFail
}

// usageError is a command line that cannot be run as written: exit code 2.
type usageError struct{ msg string }

func (e *usageError) Error() string { return e.msg }

func usagef(format string, args ...any) error {
	return &usageError{msg: fmt.Sprintf(format, args...)}
}

// oneLine keeps an error to the one line the exit promises, whatever the
// drivers put in it.
func oneLine(s string) string {
	return strings.Join(strings.Fields(s), " ")
}

// globals are the flags every command takes, before or after its name.
type globals struct {
	db          string
	amqp        string
	table       string
	inboxTable  string
	maxAttempts int
}

// defaultGlobals are the global flags' defaults.
var defaultGlobals = globals{table: outbox.DefaultTable, inboxTable: outbox.DefaultInboxTable, maxAttempts: outbox.DefaultMaxAttempts}

// register adds the global flags to fs, bound to g, keeping the values g
// has. The defaults -h shows are the built-in ones, never a --db given
// before the command nor OUTBOX_DB (read only after parsing), so that help
// output never carries a password.
func (g *globals) register(fs *flag.FlagSet) {
	current := *g
	defer func() { *g = current }()
	d := defaultGlobals
	fs.StringVar(&g.db, "db", d.db, "database: postgres://… URL, MySQL DSN user:pass@tcp(host:port)/db, or SQLite path (env OUTBOX_DB)")
	fs.StringVar(&g.amqp, "amqp", d.amqp, "RabbitMQ URL amqp://user:pass@host:5672/vhost, or a cluster's nodes' URLs separated by commas, for relay (env OUTBOX_AMQP_URL)")
	fs.StringVar(&g.table, "table", d.table, "outbox table, name or schema.name (env OUTBOX_TABLE)")
	fs.StringVar(&g.inboxTable, "inbox-table", d.inboxTable, "inbox table, name or schema.name (env OUTBOX_INBOX_TABLE)")
	fs.IntVar(&g.maxAttempts, "max-attempts", d.maxAttempts, "attempts after which the relay leaves a row alone (stuck); give every command the relay's (env OUTBOX_MAX_ATTEMPTS)")
}

// noteGiven notes the global flags fs's parse was given.
func (c *cli) noteGiven(fs *flag.FlagSet) {
	if c.given == nil {
		c.given = make(map[string]bool)
	}
	fs.Visit(func(f *flag.Flag) { c.given[f.Name] = true })
}

// fromEnv sets the global flags that were not given from the environment:
// an operator exports the relay's once (OUTBOX_MAX_ATTEMPTS above all),
// and stuck, retry and status agree with it. Given to the relay alone, a
// --max-attempts of 3 left stuck printing "no stuck rows (none unpublished
// at 10 attempts)", retry --all-stuck retrying nothing, and status
// counting stuck rows as pending (a review's finding).
func (c *cli) fromEnv() error {
	if c.g.db == "" {
		c.g.db = c.env("OUTBOX_DB")
	}
	if c.g.amqp == "" {
		c.g.amqp = c.env("OUTBOX_AMQP_URL")
	}
	if v := c.env("OUTBOX_TABLE"); v != "" && !c.given["table"] {
		c.g.table = v
	}
	if v := c.env("OUTBOX_INBOX_TABLE"); v != "" && !c.given["inbox-table"] {
		c.g.inboxTable = v
	}
	if v := c.env("OUTBOX_MAX_ATTEMPTS"); v != "" && !c.given["max-attempts"] {
		n, err := strconv.Atoi(strings.TrimSpace(v))
		if err != nil || n < 1 {
			return usagef("OUTBOX_MAX_ATTEMPTS: %q; want a number, at least 1", v)
		}
		c.g.maxAttempts = n
	}
	if c.g.maxAttempts < 1 {
		return usagef("--max-attempts: %d; want at least 1", c.g.maxAttempts)
	}
	return nil
}

type cli struct {
	ctx            context.Context
	env            func(string) string
	stdout, stderr io.Writer
	g              globals
	given          map[string]bool // the global flags given, before or after the command's name
	command        string          // the command's name, once main found it
}

type command struct {
	name    string
	summary string
	run     func(c *cli, args []string) error
}

var commands = []command{
	{"status", "pending, oldest pending age, failing (the oldest: what waits behind it), stuck, published in the last hour, inbox size, held messages, PostgreSQL's wake-up", (*cli).status},
	{"stuck", "the rows the relay gave up on, with where they go and why they failed; --failing: those failing still; --set-aside: those a consumer set aside", (*cli).stuck},
	{"retry", "make rows pending again, attempts reset: retry ID... | retry --all-stuck", (*cli).retry},
	{"resend", "send published records again, processed mark cleared (a message set aside once its cause is fixed): resend ID... | resend --key K --seq N", (*cli).resend},
	{"discard", "delete stuck records an operator gives up on, each printed first (their only copy): discard ID...", (*cli).discard},
	{"restore", "write a poison copy back as the message it copies (its id, topic, key and number), where the message's own record is gone: restore COPY_ID...", (*cli).restore},
	{"show", "where records are: published (processed, set aside, held or skipped by a consumer), pending, stuck, in flight, not there: show ID... | show --key K --seq N", (*cli).show},
	{"purge", "delete old published rows and inbox keys in bounded batches; never pending rows", (*cli).purge},
	{"held", "ordered inbox: keys with held messages, what they wait for and since when", (*cli).held},
	{"skip-gap", "ordered inbox: give up on a key's missing messages: skip-gap --consumer C --key K --from A --through B", (*cli).skipGap},
	{"skip-held", "ordered inbox: give up on a key's next message, held and failing: skip-held --consumer C --key K --seq N", (*cli).skipHeld},
	{"relay", "publish pending rows to RabbitMQ until SIGINT/SIGTERM; serves /metrics and /healthz", (*cli).relay},
	{"migrate", "create or update acemq_outbox and processed_messages", (*cli).migrate},
}

func commandNames() string {
	names := make([]string, len(commands))
	for i, cmd := range commands {
		names[i] = cmd.name
	}
	return strings.Join(names, ", ")
}

func (c *cli) main(args []string) error {
	c.g = defaultGlobals
	fs := flag.NewFlagSet("outboxctl", flag.ContinueOnError)
	c.g.register(fs)
	fs.SetOutput(io.Discard)
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			c.usage(c.stdout, fs)
			return err
		}
		return usagef("%v (see outboxctl -h)", err)
	}
	c.noteGiven(fs)
	if fs.NArg() == 0 {
		c.usage(c.stderr, fs)
		return usagef("no command given; want one of %s", commandNames())
	}
	name, rest := fs.Arg(0), fs.Args()[1:]
	if name == "help" {
		c.usage(c.stdout, fs)
		return nil
	}
	for _, cmd := range commands {
		if cmd.name == name {
			c.command = name
			return cmd.run(c, rest)
		}
	}
	return usagef("unknown command %q; want one of %s (see outboxctl -h)", name, commandNames())
}

func (c *cli) usage(w io.Writer, fs *flag.FlagSet) {
	fmt.Fprint(w, `outboxctl operates the acemq_outbox table of a service.

Usage:
  outboxctl [global flags] <command> [flags] [arguments]

Commands:
`)
	for _, cmd := range commands {
		fmt.Fprintf(w, "  %-9s  %s\n", cmd.name, cmd.summary)
	}
	fmt.Fprint(w, "\nGlobal flags (before or after the command):\n")
	printFlags(w, fs)
	fmt.Fprint(w, `
outboxctl <command> -h describes a command's own flags.
Exit codes: 0 done, 1 failed, 2 wrong command line.
`)
}

// printFlags lists fs's flags, sorted, with their defaults, the way
// flag.PrintDefaults does but with the double dashes people type.
func printFlags(w io.Writer, fs *flag.FlagSet) {
	var all []*flag.Flag
	fs.VisitAll(func(f *flag.Flag) { all = append(all, f) })
	sort.Slice(all, func(i, j int) bool { return all[i].Name < all[j].Name })
	for _, f := range all {
		name, usage := flag.UnquoteUsage(f)
		line := "  --" + f.Name
		if name != "" {
			line += " " + name
		}
		fmt.Fprintf(w, "%s\n      %s", line, usage)
		switch {
		case f.DefValue == "" || f.DefValue == "false":
		case strings.Contains(usage, "(default "):
			// The usage says what 0 or "" stands for; "(default 0s)"
			// after it contradicted it.
		case name == "string":
			fmt.Fprintf(w, " (default %q)", f.DefValue)
		default:
			fmt.Fprintf(w, " (default %s)", f.DefValue)
		}
		fmt.Fprintln(w)
	}
}

// flagSet is a command's flag set, with the global flags on it too so they
// may follow the command's name.
func (c *cli) flagSet(name string) *flag.FlagSet {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	c.g.register(fs)
	return fs
}

// takesIDs are the commands whose arguments are record ids.
var takesIDs = map[string]bool{"retry": true, "resend": true, "show": true, "discard": true, "restore": true}

// parse parses a command's arguments, flags and positional arguments in any
// order ("retry a b --json" as well as "retry --json a b"; after "--" all
// are positional), and returns the positional ones.
func (c *cli) parse(fs *flag.FlagSet, args []string, synopsis string) ([]string, error) {
	var positional []string
	for {
		if err := fs.Parse(args); err != nil {
			if errors.Is(err, flag.ErrHelp) {
				c.commandUsage(fs, synopsis)
				return nil, err
			}
			if name, ok := strings.CutPrefix(err.Error(), "flag provided but not defined: -"); ok && takesIDs[fs.Name()] && name != "" && name[0] >= '0' && name[0] <= '9' {
				// An id that starts with "-" (a negative number another
				// library wrote), given bare; not a mistyped flag, which
				// after -- would be taken for an id (a code review).
				return nil, usagef("%s: %v (an id that starts with \"-\" goes after --, as in outboxctl %s -- -%s; see outboxctl %s -h)", fs.Name(), err, fs.Name(), name, fs.Name())
			}
			return nil, usagef("%s: %v (see outboxctl %s -h)", fs.Name(), err, fs.Name())
		}
		rest := fs.Args()
		if len(rest) == 0 {
			break
		}
		if consumed := len(args) - len(rest); consumed > 0 && args[consumed-1] == "--" {
			positional = append(positional, rest...)
			break
		}
		positional = append(positional, rest[0])
		args = rest[1:]
	}
	c.noteGiven(fs)
	if err := c.fromEnv(); err != nil {
		return nil, err
	}
	return positional, nil
}

func (c *cli) commandUsage(fs *flag.FlagSet, synopsis string) {
	fmt.Fprintf(c.stdout, "Usage:\n  %s\n\nFlags:\n", synopsis)
	printFlags(c.stdout, fs)
}

// noArgs refuses positional arguments a command does not take.
func noArgs(fs *flag.FlagSet, args []string) error {
	if len(args) > 0 {
		return usagef("%s: unexpected argument %q (see outboxctl %s -h)", fs.Name(), args[0], fs.Name())
	}
	return nil
}
