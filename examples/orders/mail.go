package main

import (
	"sync"

	"github.com/ThreeDotsLabs/watermill/message"
)

// mailer stands in for the email service that tells customers their order
// is on its way: an email sent is sent, whatever rolls back after.
type mailer struct {
	mu     sync.Mutex
	emails map[string]int // per order id
}

func newMailer() *mailer { return &mailer{emails: map[string]int{}} }

// notify is the notification consumer's handler, behind an inbox with
// AtMostOnce: the message's key has committed before it runs, so a
// redelivery of the message, after a crash or not, emails no one again.
func (m *mailer) notify(_ *message.Message, f fulfilment) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.emails[f.OrderID]++
	return nil
}

// sent is how many of the orders orderIDs had their customer emailed, and
// how many emails went to them in all.
func (m *mailer) sent(orderIDs []string) (notified, emails int) {
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, id := range orderIDs {
		if n := m.emails[id]; n > 0 {
			notified++
			emails += n
		}
	}
	return notified, emails
}
