package outboxctl

import (
	"fmt"

	outbox "github.com/acemq/watermill-outbox"
)

func (c *cli) migrate(args []string) error {
	fs := c.flagSet("migrate")
	rest, err := c.parse(fs, args, "outboxctl migrate")
	if err != nil {
		return err
	}
	if err := noArgs(fs, rest); err != nil {
		return err
	}
	// The schema files name their tables; a table of another name is the
	// operator's to create. Names exported for the other commands
	// (OUTBOX_TABLE) are theirs: migrate makes its own tables whatever
	// they say, as it did before it read them.
	if c.given["table"] && c.g.table != outbox.DefaultTable || c.given["inbox-table"] && c.g.inboxTable != outbox.DefaultInboxTable {
		return usagef("migrate creates %s and %s only; --table and --inbox-table name tables you created yourself",
			outbox.DefaultTable, outbox.DefaultInboxTable)
	}
	d, err := c.open(true)
	if err != nil {
		return err
	}
	defer d.Close()
	if err := outbox.Migrate(c.ctx, d.db, d.dialect); err != nil {
		return fmt.Errorf("migrating the %s database at %s: %w", d.kind, d.shown, err)
	}
	fmt.Fprintf(c.stdout, "%s and %s are up to date in the %s database at %s\n",
		outbox.DefaultTable, outbox.DefaultInboxTable, d.kind, d.shown)
	return nil
}
