package outbox

import "database/sql"

// SwapInboxPrepared replaces each in-order statement the ordered inbox
// prepared with the same SQL prepared on other, which its transactions
// cannot use: every prepared run then fails, as on a proxy that lost them.
// It returns how many it replaced.
func SwapInboxPrepared(in *Inbox, other *sql.DB) (int, error) {
	p := in.ordered.prepared
	p.mu.Lock()
	defer p.mu.Unlock()
	for q, st := range p.stmts {
		swapped, err := other.Prepare(q)
		if err != nil {
			return 0, err
		}
		_ = st.Close()
		p.stmts[q] = swapped
	}
	return len(p.stmts), nil
}

// InboxPrepared is how many in-order statements the ordered inbox runs
// prepared.
func InboxPrepared(in *Inbox) int {
	p := in.ordered.prepared
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.stmts)
}
