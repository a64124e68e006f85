package demo

import (
	"errors"
	"io"

	"github.com/ThreeDotsLabs/watermill"
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
