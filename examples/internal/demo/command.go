package demo

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"

	"github.com/ThreeDotsLabs/watermill"
)

// Program is an example's run function: what its main runs, and what its
// tests run, with writers they can read.
type Program func(ctx context.Context, args []string, stdout, stderr io.Writer) int

// Main runs program on the process's arguments and writers until it returns
// or SIGINT or SIGTERM cancels it, and exits with its code.
func Main(program Program) {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := program(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// Command is the command line every example has: -db, -amqp and -v, and
// the stderr it reports to. The program defines its own flags on Flags,
// then parses.
type Command struct {
	Name  string
	Flags *flag.FlagSet
	// Stderr serialises its writes: the relay, the router and the program
	// all report to it.
	Stderr  io.Writer
	DSN     string
	AMQPURL string
	Verbose bool
}

// NewCommand is the command line of the program name, reporting to stderr.
func NewCommand(name string, stderr io.Writer) *Command {
	c := &Command{Name: name, Stderr: &syncWriter{w: stderr}}
	c.Flags = flag.NewFlagSet(name, flag.ContinueOnError)
	c.Flags.SetOutput(c.Stderr)
	c.Flags.StringVar(&c.DSN, "db", "", "a PostgreSQL URL (postgres://…) or a MySQL DSN (user@tcp(host:3306)/db); default: SQLite in a temporary file")
	c.Flags.StringVar(&c.AMQPURL, "amqp", defaultAMQPURL, "the RabbitMQ URL, or a cluster's nodes' URLs separated by commas")
	c.Flags.BoolVar(&c.Verbose, "v", false, "log what Watermill and the relay do, to stderr")
	return c
}

// Logger is Watermill's standard logger on Stderr with -v, else silence.
func (c *Command) Logger() watermill.LoggerAdapter {
	if !c.Verbose {
		return watermill.NopLogger{}
	}
	return watermill.NewStdLoggerWithOut(c.Stderr, false, false)
}

// Run checks that the broker answers, opens the database (file names the
// SQLite one of a run without -db), says on stdout which of each it uses,
// and runs body on them. Whatever body started stops when it returns, the
// last started first; the database closes last; and a failure of any step
// is one line on Stderr and exit code 1.
func (c *Command) Run(ctx context.Context, file string, stdout io.Writer, body func(*Service) error) int {
	if err := checkBroker(c.AMQPURL); err != nil {
		fmt.Fprintf(c.Stderr, "%s: %v\n", c.Name, err)
		return 1
	}
	db, err := OpenDB(ctx, c.DSN, file)
	if err != nil {
		fmt.Fprintf(c.Stderr, "%s: %v\n", c.Name, err)
		return 1
	}
	fmt.Fprintf(stdout, "%s: %s, RabbitMQ %s\n", c.Name, db.Where, redactURLs(c.AMQPURL))

	s := &Service{Name: c.Name, DB: db, AMQPURL: c.AMQPURL, Stderr: c.Stderr, Log: c.Logger()}
	err = body(s)
	err = errors.Join(err, s.stop(), db.Close())
	if err != nil {
		fmt.Fprintf(c.Stderr, "%s: %v\n", c.Name, err)
		return 1
	}
	return 0
}
