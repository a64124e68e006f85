package integration_test

import (
	"cmp"
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/acemq/watermill-outbox/internal/testdb"
)

// chaosKind is one way the world breaks.
type chaosKind int

const (
	killRelay             chaosKind = iota // SIGKILL the relay process, start another, at once or after a while
	restartRelay                           // SIGTERM the relay (a deploy): it finishes its batch and exits 0; start another
	killRelayAfterConfirm                  // the next relay SIGKILLs itself between confirm and mark
	killRelayHoldingClaim                  // the next relay SIGKILLs itself with a batch claimed, nothing sent
	closeBroker                            // the broker closes the relay's (and the consumers') connections
	restartConsumer                        // a consumer's router stops, nacking what it holds, and a new one starts
	killRelayDB                            // the database terminates the relay's connections
	killAllDB                              // the database terminates every connection of the service and the relay
	chaosKinds
)

var chaosNames = [chaosKinds]string{
	killRelay:             "relay SIGKILLed and restarted",
	restartRelay:          "relay stopped with SIGTERM and restarted",
	killRelayAfterConfirm: "relay died between confirm and mark",
	killRelayHoldingClaim: "relay died holding a claim",
	closeBroker:           "broker closed our connections",
	restartConsumer:       "consumer restarted",
	killRelayDB:           "relay's database connections killed",
	killAllDB:             "all database connections killed",
}

// closeConsumerConnection says whether the broker closes the consumers'
// connections too. Not under -race: watermill-amqp v3's reconnect writes
// ConnectionWrapper.connected in one goroutine while the subscriber's reads
// it in another (ThreeDotsLabs/watermill#693), which the race detector
// reports and which no code of ours can avoid; restartConsumer stands in
// for it. OUTBOX_E2E_CLOSE_CONSUMER=1 closes them under -race anyway.
func closeConsumerConnection() bool {
	return !raceEnabled || os.Getenv("OUTBOX_E2E_CLOSE_CONSUMER") != ""
}

// kinds is the chaos that applies to the run's database.
func (r *run) kinds() []chaosKind {
	kinds := []chaosKind{killRelay, restartRelay, killRelayAfterConfirm, killRelayHoldingClaim, closeBroker, restartConsumer}
	if r.sc.kind != testdb.SQLite {
		kinds = append(kinds, killRelayDB, killAllDB)
	}
	return kinds
}

// chaosLog counts, per kind, the events and those that hit something (a
// process, a connection).
type chaosLog struct {
	events, hits [chaosKinds]int
	brokerConns  int // connections the broker closed
	dbConns      int // database connections terminated
}

func (l *chaosLog) summary() string {
	var parts []string
	for k := chaosKind(0); k < chaosKinds; k++ {
		if l.events[k] > 0 || l.hits[k] > 0 {
			parts = append(parts, fmt.Sprintf("%s %d", chaosNames[k], l.hits[k]))
		}
	}
	return strings.Join(parts, ", ")
}

// runChaos breaks something at random moments, in a bounded loop, for the
// scenario's chaos time, and then on, up to three times as long (rabbitmqctl
// alone takes seconds on a loaded machine), until every kind
// that applies has hit something: a run must prove what it claims. The first
// acts take each kind once, in random order; after that owed kinds come
// first more often. ctx ends it early (the test is being torn down).
func (r *run) runChaos(ctx context.Context, rng *rand.Rand, began time.Time) {
	kinds := r.kinds()
	owed := map[chaosKind]bool{}
	for _, k := range kinds {
		owed[k] = true
	}
	firstPass := rng.Perm(len(kinds))
	// The broker's close goes last in the first pass: rabbitmqctl boots an
	// Erlang VM per call, which took over 30 s on a loaded machine, and
	// every kind after it went untried.
	slices.SortStableFunc(firstPass, func(a, b int) int {
		return cmp.Compare(b2i(kinds[a] == closeBroker), b2i(kinds[b] == closeBroker))
	})
	// Past the chaos time the loop goes on only while a kind is owed, for
	// three times the chaos time, and at least a minute more than it.
	until, hardStop := began.Add(r.sc.chaos), began.Add(max(3*r.sc.chaos, r.sc.chaos+time.Minute))
	maxEvents := int(3*r.sc.chaos/(150*time.Millisecond)) + 1 // bounded, whatever the clock does
	for i := 0; i < maxEvents; i++ {
		if now := time.Now(); now.After(hardStop) || (now.After(until) && len(owed) == 0) {
			return
		}
		if !sleepCtx(ctx, 150*time.Millisecond+time.Duration(rng.Int64N(int64(900*time.Millisecond)))) {
			return
		}
		// A relay that killed itself is restarted here, as an orchestrator
		// would.
		for slot := range r.relay.slots() {
			if n := r.relay.reap(slot); n > 0 {
				r.t.Logf("chaos %5.1fs: relay #%d died by its own hand; #%d started", time.Since(began).Seconds(), n, r.relay.started+1)
				r.relay.start(slot, dieSpec{})
			}
		}
		r.countDeaths()
		for _, k := range []chaosKind{killRelayAfterConfirm, killRelayHoldingClaim} {
			if r.chaos.hits[k] > 0 {
				delete(owed, k)
			}
		}
		var kind chaosKind
		switch {
		case i < len(firstPass):
			kind = kinds[firstPass[i]]
		case len(owed) > 0 && rng.Float64() < 0.6:
			var left []chaosKind
			for _, k := range kinds {
				if owed[k] {
					left = append(left, k)
				}
			}
			kind = left[rng.IntN(len(left))]
		default:
			kind = kinds[rng.IntN(len(kinds))]
		}
		r.chaos.events[kind]++
		hit, detail := r.breakSomething(ctx, kind, rng)
		if hit {
			r.chaos.hits[kind]++
			delete(owed, kind)
		}
		r.t.Logf("chaos %5.1fs: %s: %s", time.Since(began).Seconds(), chaosNames[kind], detail)
	}
}

func b2i(b bool) int {
	if b {
		return 1
	}
	return 0
}

// countDeaths takes the relays' deaths by their own hand from the
// supervisor: they happen between the chaos's acts.
func (r *run) countDeaths() {
	r.chaos.hits[killRelayAfterConfirm] = r.relay.deaths[dieAfterConfirm]
	r.chaos.hits[killRelayHoldingClaim] = r.relay.deaths[dieHoldingClaim]
}

// breakSomething does one act of chaos and says whether it hit anything.
func (r *run) breakSomething(ctx context.Context, kind chaosKind, rng *rand.Rand) (bool, string) {
	slot := rng.IntN(r.relay.slots()) // the relay it strikes, when it strikes one
	switch kind {
	case killRelay:
		n := r.relay.kill(slot)
		// Half the time the orchestrator takes a while: a backlog builds,
		// and the next relay drains it in full batches, pipelined.
		var down time.Duration
		if rng.IntN(2) == 0 {
			down = 500*time.Millisecond + time.Duration(rng.Int64N(int64(2*time.Second)))
			sleepCtx(ctx, down)
		}
		r.relay.start(slot, dieSpec{})
		return n > 0, fmt.Sprintf("relay #%d killed, #%d started after %s", n, r.relay.started, down.Round(time.Millisecond))
	case restartRelay:
		if err := r.relay.stop(slot, 30*time.Second); err != nil {
			r.t.Errorf("relay in slot %d did not stop cleanly on SIGTERM: %v", slot, err)
		}
		r.relay.start(slot, dieSpec{})
		n := r.relay.started
		return true, fmt.Sprintf("relay in slot %d stopped, #%d started", slot, n)
	case killRelayAfterConfirm, killRelayHoldingClaim:
		// It hits when the relay dies by its own hand; reap counts that.
		n := r.relay.kill(slot)
		die := dieSpec{point: dieAfterConfirm, batch: 1 + rng.IntN(3)}
		if kind == killRelayHoldingClaim {
			die.point = dieHoldingClaim
		}
		r.relay.start(slot, die)
		return false, fmt.Sprintf("relay #%d killed, #%d started to die %s", n, r.relay.started, die)
	case closeBroker:
		names := []string{r.connName("relay")}
		if closeConsumerConnection() {
			for _, c := range r.consumerGroups() {
				for i := range c.instances {
					names = append(names, c.connName(i))
				}
			}
		}
		n, err := closeConnections(names...)
		if err != nil {
			r.t.Errorf("closing broker connections: %v", err)
		}
		r.chaos.brokerConns += n
		return n > 0, fmt.Sprintf("%d connections closed", n)
	case restartConsumer:
		groups := r.consumerGroups()
		c := groups[rng.IntN(len(groups))]
		i := rng.IntN(c.instances)
		if err := c.restart(i); err != nil {
			r.t.Errorf("restarting %s consumer %d: %v", c.name, i, err)
			return false, err.Error()
		}
		return true, fmt.Sprintf("%s consumer %d", c.name, i)
	case killRelayDB, killAllDB:
		n, err := r.killDB(kind == killAllDB)
		if err != nil {
			r.t.Errorf("killing database connections: %v", err)
		}
		r.chaos.dbConns += n
		return n > 0, fmt.Sprintf("%d connections terminated", n)
	}
	return false, "?"
}

// killDB terminates the relay's database connections, or with all every
// connection of the service and the relay, and returns how many.
func (r *run) killDB(all bool) (int, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if r.sc.kind == testdb.Postgres {
		q := "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1 AND pid <> pg_backend_pid()"
		args := []any{r.relayName}
		if all {
			q = "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name IN ($1, $2) AND pid <> pg_backend_pid()"
			args = append(args, r.appName)
		}
		rows, err := r.killer.QueryContext(ctx, q, args...)
		if err != nil {
			return 0, err
		}
		defer rows.Close()
		n := 0
		for rows.Next() {
			var ok bool
			if err := rows.Scan(&ok); err != nil {
				return n, err
			}
			if ok {
				n++
			}
		}
		return n, rows.Err()
	}
	q, args := "SELECT id FROM information_schema.processlist WHERE user = ?", []any{r.relayUser}
	if all || r.relayUser == "" {
		q, args = "SELECT id FROM information_schema.processlist WHERE db = DATABASE() AND id <> CONNECTION_ID()", nil
	}
	var ids []int64
	rows, err := r.killer.QueryContext(ctx, q, args...)
	if err != nil {
		return 0, err
	}
	for rows.Next() {
		var id int64
		if err := rows.Scan(&id); err != nil {
			rows.Close()
			return 0, err
		}
		ids = append(ids, id)
	}
	rows.Close()
	n := 0
	for _, id := range ids {
		if _, err := r.killer.ExecContext(ctx, "KILL "+strconv.FormatInt(id, 10)); err == nil {
			n++ // an error: it was gone already
		}
	}
	return n, nil
}

// closeConnections makes the broker close the connections of the given
// names, and returns how many it closed. Only ours: other packages' tests
// use the same broker at the same time.
func closeConnections(names ...string) (int, error) {
	out, err := exec.Command("rabbitmqctl", "-q", "list_connections", "--no-table-headers", "pid", "client_properties").CombinedOutput()
	if err != nil {
		return 0, fmt.Errorf("rabbitmqctl list_connections: %v: %s", err, out)
	}
	closed := 0
	for _, line := range strings.Split(string(out), "\n") {
		pid, props, ok := strings.Cut(line, "\t")
		if !ok {
			continue
		}
		for _, name := range names {
			if strings.Contains(props, `{"connection_name","`+name+`"}`) {
				if exec.Command("rabbitmqctl", "-q", "close_connection", pid, "outbox e2e chaos").Run() == nil {
					closed++ // an error: it was gone already
				}
				break
			}
		}
	}
	return closed, nil
}

// queueDepth is how many messages the queue holds, ready or delivered and
// not yet acked.
func queueDepth(queue string) (int64, error) {
	out, err := exec.Command("rabbitmqctl", "-q", "list_queues", "--no-table-headers", "name", "messages").CombinedOutput()
	if err != nil {
		return 0, fmt.Errorf("rabbitmqctl list_queues: %v: %s", err, out)
	}
	for _, line := range strings.Split(string(out), "\n") {
		name, n, ok := strings.Cut(strings.TrimSpace(line), "\t")
		if ok && name == queue {
			return strconv.ParseInt(strings.TrimSpace(n), 10, 64)
		}
	}
	return 0, fmt.Errorf("queue %s not listed", queue)
}
