package testutil

import (
	"fmt"
	"sync"

	"github.com/ThreeDotsLabs/watermill"
)

// ErrorLog is a Watermill logger that keeps what is logged at Error level,
// each as its message, ": " and its error, and the error itself, and drops
// the rest.
type ErrorLog struct {
	watermill.NopLogger
	mu   sync.Mutex
	msgs []string
	errs []error
}

// Error keeps msg and err.
func (l *ErrorLog) Error(msg string, err error, _ watermill.LogFields) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.msgs = append(l.msgs, msg+": "+fmt.Sprint(err))
	l.errs = append(l.errs, err)
}

// With returns l: the fields are not kept.
func (l *ErrorLog) With(watermill.LogFields) watermill.LoggerAdapter { return l }

// Msgs is what was logged at Error level so far.
func (l *ErrorLog) Msgs() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]string(nil), l.msgs...)
}

// Errs is the errors logged at Error level so far.
func (l *ErrorLog) Errs() []error {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]error(nil), l.errs...)
}
