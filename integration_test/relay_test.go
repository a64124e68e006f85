package integration_test

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/acemq/watermill-outbox/internal/testdb"
	"github.com/acemq/watermill-outbox/internal/testutil"
)

// relaySupervisor starts relay processes (re-executions of this test
// binary, see relayMain), several at once, one per slot, as a service
// deployed with replicas would run them; kills them, and tells a relay's
// death by its own hand from a crash. It is used by one goroutine at a time:
// the chaos goroutine while it runs, the test's before and after.
type relaySupervisor struct {
	t       *testing.T
	env     []string
	out     *testutil.LockedBuffer
	cur     []*relayChild // by slot; nil while none runs there
	started int
	// deaths counts, per point (dieAfterConfirm, dieHoldingClaim), the
	// relays that SIGKILLed themselves there, as they were told to.
	deaths map[string]int
}

// dieSpec tells a relay where to kill itself; the zero value never.
type dieSpec struct {
	point string // dieAfterConfirm or dieHoldingClaim
	batch int    // at its batch-th batch
}

func (d dieSpec) String() string {
	if d.point == "" {
		return "-"
	}
	return fmt.Sprintf("%s at batch %d", d.point, d.batch)
}

type relayChild struct {
	n     int
	die   dieSpec
	cmd   *exec.Cmd
	ready chan struct{} // closed when the relay said relayReady
	done  chan struct{} // closed when it exited
	err   error         // of Wait, once done is closed
}

// newRelaySupervisor supervises slots relays running at once.
func newRelaySupervisor(t *testing.T, slots int, driver, dsn, connName string) *relaySupervisor {
	s := &relaySupervisor{t: t, out: &testutil.LockedBuffer{}, cur: make([]*relayChild, slots), deaths: map[string]int{}, env: []string{
		envRelay + "=1", envRelayDriver + "=" + driver, envRelayDSN + "=" + dsn,
		envRelayAMQP + "=" + testdb.AMQPURL(), envRelayConn + "=" + connName,
	}}
	t.Cleanup(func() {
		s.killAll() // no relay outlives its test
		if t.Failed() {
			t.Logf("relay processes' output (last 300 lines):\n%s", s.out.Tail(300))
		}
	})
	return s
}

// slots is how many relays run at once.
func (s *relaySupervisor) slots() int { return len(s.cur) }

// start starts a relay in slot, which must be free, which kills itself
// where die says.
func (s *relaySupervisor) start(slot int, die dieSpec) {
	s.started++
	c := &relayChild{n: s.started, die: die, ready: make(chan struct{}), done: make(chan struct{})}
	c.cmd = exec.Command(os.Args[0], "-test.run=^$")
	c.cmd.Env = append(os.Environ(), s.env...)
	if die.point != "" {
		c.cmd.Env = append(c.cmd.Env, envRelayDie+"="+die.point+":"+strconv.Itoa(die.batch))
	}
	fmt.Fprintf(s.out, "=== relay #%d in slot %d (dies: %s)\n", c.n, slot, die)
	c.cmd.Stdout = &readyWriter{out: s.out, ready: c.ready}
	c.cmd.Stderr = s.out
	if err := c.cmd.Start(); err != nil {
		s.t.Errorf("start relay process: %v", err)
		return
	}
	go func() {
		c.err = c.cmd.Wait()
		close(c.done)
	}()
	s.cur[slot] = c
}

// killAll SIGKILLs every relay and waits for them.
func (s *relaySupervisor) killAll() {
	for slot := range s.cur {
		s.kill(slot)
	}
}

// kill SIGKILLs slot's relay, if one runs, waits for it, and returns its
// number (0 if none was running).
func (s *relaySupervisor) kill(slot int) int {
	c := s.cur[slot]
	if c == nil {
		return 0
	}
	s.cur[slot] = nil
	select {
	case <-c.done:
		s.judge(c) // it had died on its own
		return 0
	default:
	}
	_ = c.cmd.Process.Signal(syscall.SIGKILL)
	<-c.done
	return c.n
}

// reap returns the number of slot's relay if it has died on its own (0 if
// it runs, or none does). Dying where it was told to is counted; any other
// death fails the test.
func (s *relaySupervisor) reap(slot int) int {
	c := s.cur[slot]
	if c == nil {
		return 0
	}
	select {
	case <-c.done:
	default:
		return 0
	}
	s.cur[slot] = nil
	s.judge(c)
	return c.n
}

func (s *relaySupervisor) judge(c *relayChild) {
	if !s.diedAsTold(c) {
		s.t.Errorf("relay #%d exited on its own: %v (exit status 66 is the race detector's); see its output", c.n, c.err)
	}
}

// diedAsTold counts and reports an exited relay that SIGKILLed itself where
// it was told to.
func (s *relaySupervisor) diedAsTold(c *relayChild) bool {
	var exit *exec.ExitError
	if c.die.point != "" && errors.As(c.err, &exit) {
		if ws, ok := exit.Sys().(syscall.WaitStatus); ok && ws.Signaled() && ws.Signal() == syscall.SIGKILL {
			s.deaths[c.die.point]++
			return true
		}
	}
	return false
}

// stop asks slot's relay to stop with SIGTERM, once it is ready to take
// it, and expects a clean exit within timeout. A relay that dies by its own
// hand meanwhile, as it was told to, is counted as such.
func (s *relaySupervisor) stop(slot int, timeout time.Duration) error {
	c := s.cur[slot]
	if c == nil {
		return errors.New("no relay running")
	}
	s.cur[slot] = nil
	deadline := time.NewTimer(timeout)
	defer deadline.Stop()
	select {
	case <-c.ready:
		_ = c.cmd.Process.Signal(syscall.SIGTERM)
	case <-c.done:
	case <-deadline.C:
	}
	select {
	case <-c.done:
		if c.err != nil && s.diedAsTold(c) {
			return nil
		}
		return c.err
	case <-deadline.C:
		_ = c.cmd.Process.Signal(syscall.SIGKILL)
		<-c.done
		return fmt.Errorf("relay #%d still running %s after it was started; killed", c.n, timeout)
	}
}

// readyWriter passes a relay's stdout on, and closes ready when the relay
// says relayReady.
type readyWriter struct {
	out   *testutil.LockedBuffer
	ready chan struct{}
	seen  []byte // stdout so far, until the line is seen
	done  bool
}

func (w *readyWriter) Write(p []byte) (int, error) {
	if !w.done {
		w.seen = append(w.seen, p...)
		if bytes.Contains(w.seen, []byte(relayReady+"\n")) {
			w.done, w.seen = true, nil
			close(w.ready)
		}
	}
	return w.out.Write(p)
}
