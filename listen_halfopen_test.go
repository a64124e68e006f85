package outbox_test

import (
	"bytes"
	"net"
	"net/url"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jmoiron/sqlx"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testamqp"
	"github.com/acemq/watermill-outbox/internal/testdb"
)

// listenFreezer is a TCP proxy to PostgreSQL that can silently drop the
// traffic of the connection that sent LISTEN (a NAT entry or firewall
// state expired, a server host gone without a RST): nothing more passes
// either way, and neither end is told. Other connections pass.
type listenFreezer struct {
	addr   string
	freeze atomic.Bool
	seen   atomic.Bool // a LISTEN went through
}

func newListenFreezer(t *testing.T, server string) *listenFreezer {
	t.Helper()
	p := &listenFreezer{}
	p.addr = tcpProxy(t, server, p.pipe)
	return p
}

func (p *listenFreezer) pipe(dst, src net.Conn, isListen *atomic.Bool, fromClient bool) {
	defer func() { _ = dst.Close(); _ = src.Close() }()
	buf := make([]byte, 64<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			if fromClient && bytes.Contains(buf[:n], []byte("LISTEN acemq_outbox")) {
				isListen.Store(true)
				p.seen.Store(true)
			}
			if !(isListen.Load() && p.freeze.Load()) { // frozen: dropped
				if _, err := dst.Write(buf[:n]); err != nil {
					return
				}
			}
		}
		if err != nil {
			return
		}
	}
}

// The relay's LISTEN connection goes silently dead (no FIN, no RST: the
// path drops its packets). The relay looks at the trigger on that
// connection every triggerRecheck; the look never answered and had no
// deadline, so the relay never learnt that LISTEN was gone: woken stayed
// true, it kept waiting PollInterval per sweep, and a row another process
// committed waited for that poll (in production the look's query hangs
// until the kernel gives the connection up, tcp_retries2: some 15
// minutes). The look now gives up after listenQueryTimeout, and the relay
// sweeps and listens on a new connection.
func TestForwarder_Postgres_ListenConnectionSilentlyDead_RelayListensAgain(t *testing.T) {
	db := migrated(t, testdb.Postgres)
	t.Cleanup(outbox.SetTriggerRecheck(300 * time.Millisecond))
	u, err := url.Parse(db.DSN)
	if err != nil {
		t.Fatal(err)
	}
	p := newListenFreezer(t, u.Host)
	u.Host = p.addr
	relayDB := sqlx.MustOpen("pgx", u.String())
	t.Cleanup(func() { _ = relayDB.Close() })
	b := testamqp.New(t)
	queue := b.Queue("t")
	// A poll of 30 s: only a wake-up (or the adaptive poll of a relay that
	// knows it cannot count on NOTIFY) delivers within 10 s.
	f := newForwarder(t, &testdb.DB{DB: relayDB, Kind: db.Kind, DSN: u.String(), Name: db.Name}, outbox.ForwarderConfig{PollInterval: 30 * time.Second, MinPollInterval: 30 * time.Second})
	runInBackground(t, f)
	waitFor(t, 10*time.Second, "LISTEN through the proxy", p.seen.Load)
	waitFor(t, 10*time.Second, "woken", func() bool { return outbox.Woken(f) })
	other := otherPool(t, db)
	publishN(t, other, b.Exchange, "t", 1)
	if got := b.Drain(queue, 1, 10*time.Second); len(got) != 1 {
		t.Fatal("first row did not arrive")
	}

	p.freeze.Store(true)
	// Several rechecks are due: each is a query on the dead connection.
	time.Sleep(2 * time.Second)
	t.Logf("2 s after the LISTEN connection went dead (recheck every 300 ms): woken=%v", outbox.Woken(f))
	publishN(t, other, b.Exchange, "t", 1)
	start := time.Now()
	if got := b.Drain(queue, 1, 10*time.Second); len(got) != 1 {
		t.Fatalf("a row committed 2 s after the LISTEN connection went dead did not arrive within 10 s "+
			"(woken=%v: the relay still counts on NOTIFY and waits its 30 s poll)", outbox.Woken(f))
	}
	t.Logf("arrived after %s", time.Since(start).Round(time.Millisecond))
}
