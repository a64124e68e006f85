package demo

import (
	"context"
	"errors"
	"fmt"
	"io"

	"github.com/ThreeDotsLabs/watermill"

	outbox "github.com/acemq/watermill-outbox"
)

// Service is what an example's program works with once Command.Run has
// checked the broker and opened the database.
type Service struct {
	// Name is the program's, at the head of what it reports.
	Name    string
	DB      *DB
	AMQPURL string
	Stderr  io.Writer
	Log     watermill.LoggerAdapter

	stops []func() error // of what the service started, in that order
}

// stop stops what the service started, in the order it started it, and
// joins their errors.
func (s *Service) stop() error {
	var errs []error
	for _, stop := range s.stops {
		errs = append(errs, stop())
	}
	return errors.Join(errs...)
}

// Migrate creates the outbox's and the inbox's tables, then the program's
// own from ddl, which its errors call tables.
func (s *Service) Migrate(ctx context.Context, tables string, ddl []string) error {
	if err := outbox.Migrate(ctx, s.DB.DB.DB, s.DB.Dialect); err != nil {
		return err
	}
	for _, stmt := range ddl {
		if _, err := s.DB.ExecContext(ctx, stmt); err != nil {
			return fmt.Errorf("create %s: %w", tables, err)
		}
	}
	return nil
}
