package testcluster_test

import (
	"context"
	"crypto/rand"
	"fmt"
	"os"
	"slices"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/acemq/watermill-outbox/internal/testcluster"
)

func TestMain(m *testing.M) { os.Exit(testcluster.Main(m)) }

// TestCluster_ThreeNodesAreOneCluster_AndAQuorumQueueSurvivesItsLeaderStopping
// is the smoke test of the cluster the failover tests stand on: if it
// passes, a queue declared on one node is one queue on all three, a publish
// confirmed by one node is delivered by another, and losing the queue's
// leader loses no confirmed publish while two nodes of three remain.
func TestCluster_ThreeNodesAreOneCluster_AndAQuorumQueueSurvivesItsLeaderStopping(t *testing.T) {
	c := testcluster.Shared(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()

	for i := range testcluster.Size {
		running, err := c.Running(ctx, i)
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(running, c.Nodes()) {
			t.Fatalf("node %s sees running %v, want all of %v", c.Node(i), running, c.Nodes())
		}
	}

	queue := "testcluster_smoke_" + rand.Text()
	ch1 := channel(t, c.URL(0))
	if _, err := ch1.QueueDeclare(queue, true, false, false, false, amqp.Table{"x-queue-type": "quorum"}); err != nil {
		t.Fatalf("declaring quorum queue through %s: %v", c.Node(0), err)
	}
	t.Cleanup(func() {
		// Through whichever node is up: a failed test may have left one stopped.
		for i := range testcluster.Size {
			if ch, err := dialChannel(c.URL(i)); err == nil {
				_, _ = ch.QueueDelete(queue, false, false, false)
				return
			}
		}
	})

	// Declared through node 1, the queue is there through node 3.
	ch3 := channel(t, c.URL(2))
	if _, err := ch3.QueueDeclarePassive(queue, true, false, false, false, amqp.Table{"x-queue-type": "quorum"}); err != nil {
		t.Fatalf("the queue declared through %s is not there through %s: %v", c.Node(0), c.Node(2), err)
	}

	// Confirmed through node 2, consumed through node 3.
	publishConfirmed(ctx, t, c.URL(1), queue, "one")
	if got := consumeOne(ctx, t, ch3, queue); got != "one" {
		t.Fatalf("consumed %q through %s, want %q", got, c.Node(2), "one")
	}

	// Stop the leader's node: the two others are a majority and confirm.
	leader, err := c.QueueLeader(ctx, queue)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("leader of %s is %s; stopping its app", queue, c.Node(leader))
	if err := c.StopApp(ctx, leader); err != nil {
		t.Fatal(err)
	}
	restarted := false
	t.Cleanup(func() {
		if !restarted {
			// Leave the shared cluster whole for the next test.
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			_ = c.StartApp(ctx, leader)
		}
	})
	other, third := (leader+1)%testcluster.Size, (leader+2)%testcluster.Size
	waitFor(ctx, t, "the others to see "+c.Node(leader)+" leave", func() (bool, error) {
		running, err := c.Running(ctx, other)
		return err == nil && len(running) == testcluster.Size-1 && !slices.Contains(running, c.Node(leader)), err
	})
	publishConfirmed(ctx, t, c.URL(other), queue, "two")
	if got := consumeOne(ctx, t, channel(t, c.URL(third)), queue); got != "two" {
		t.Fatalf("with %s stopped, consumed %q through %s, want %q", c.Node(leader), got, c.Node(third), "two")
	}

	// Started again, the node rejoins and serves the queue.
	if err := c.StartApp(ctx, leader); err != nil {
		t.Fatal(err)
	}
	restarted = true
	waitFor(ctx, t, c.Node(leader)+" to rejoin", func() (bool, error) {
		running, err := c.Running(ctx, third)
		return err == nil && slices.Equal(running, c.Nodes()), err
	})
	publishConfirmed(ctx, t, c.URL(leader), queue, "three")
	if got := consumeOne(ctx, t, channel(t, c.URL(leader)), queue); got != "three" {
		t.Fatalf("after rejoining, consumed %q through %s, want %q", got, c.Node(leader), "three")
	}
}

func dialChannel(url string) (*amqp.Channel, error) {
	conn, err := amqp.Dial(url)
	if err != nil {
		return nil, err
	}
	ch, err := conn.Channel()
	if err != nil {
		conn.Close()
		return nil, err
	}
	return ch, nil
}

func channel(t *testing.T, url string) *amqp.Channel {
	t.Helper()
	conn, err := amqp.Dial(url)
	if err != nil {
		t.Fatalf("dial %s: %v", url, err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	ch, err := conn.Channel()
	if err != nil {
		t.Fatalf("channel on %s: %v", url, err)
	}
	return ch
}

// publishConfirmed publishes body to queue through url and waits for the
// broker's ack: a nack, a return or no answer by the deadline fails.
func publishConfirmed(ctx context.Context, t *testing.T, url, queue, body string) {
	t.Helper()
	ch := channel(t, url)
	if err := ch.Confirm(false); err != nil {
		t.Fatalf("confirm mode on %s: %v", url, err)
	}
	returns := ch.NotifyReturn(make(chan amqp.Return, 1))
	pctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	conf, err := ch.PublishWithDeferredConfirmWithContext(pctx, "", queue, true, false,
		amqp.Publishing{DeliveryMode: amqp.Persistent, Body: []byte(body)})
	if err != nil {
		t.Fatalf("publish through %s: %v", url, err)
	}
	acked, err := conf.WaitContext(pctx)
	if err != nil {
		t.Fatalf("publish %q through %s: no confirm: %v", body, url, err)
	}
	select {
	case r := <-returns:
		t.Fatalf("publish %q through %s returned: %s", body, url, r.ReplyText)
	default:
	}
	if !acked {
		t.Fatalf("publish %q through %s was nacked", body, url)
	}
}

func consumeOne(ctx context.Context, t *testing.T, ch *amqp.Channel, queue string) string {
	t.Helper()
	tag := "smoke-" + rand.Text()
	deliveries, err := ch.Consume(queue, tag, false, false, false, false, nil)
	if err != nil {
		t.Fatalf("consume %s: %v", queue, err)
	}
	defer func() { _ = ch.Cancel(tag, false) }()
	select {
	case d, ok := <-deliveries:
		if !ok {
			t.Fatalf("consumer on %s closed", queue)
		}
		if err := d.Ack(false); err != nil {
			t.Fatal(err)
		}
		return string(d.Body)
	case <-time.After(30 * time.Second):
		t.Fatalf("nothing delivered from %s within 30s", queue)
	case <-ctx.Done():
		t.Fatal(ctx.Err())
	}
	return ""
}

// waitFor polls cond until it holds or a minute passes.
func waitFor(ctx context.Context, t *testing.T, what string, cond func() (bool, error)) {
	t.Helper()
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	tick := time.NewTicker(250 * time.Millisecond)
	defer tick.Stop()
	var last error
	for {
		ok, err := cond()
		if ok {
			return
		}
		last = err
		select {
		case <-ctx.Done():
			t.Fatalf("waiting for %s: %v (last error: %v)", what, ctx.Err(), fmt.Sprint(last))
		case <-tick.C:
		}
	}
}
