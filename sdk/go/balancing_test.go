package cbserve_test

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"sync"
	"testing"
	"time"

	cbserve "github.com/cbserve/cbserve/sdk/go"
)

func TestStaticAddressListSpreadsCalls(t *testing.T) {
	first, second := &fakeGeneration{}, &fakeGeneration{}
	target := startFake(t, first, nil) + "," + startFake(t, second, nil)
	client, err := cbserve.Dial(testContext(t), target)
	if err != nil {
		t.Fatalf("Dial(%q): %v", target, err)
	}
	defer client.Close()
	// round_robin picks among the connections that are ready, and the second may connect a moment
	// after the first: calls keep coming until both addresses have served some (or a bound passes).
	deadline := time.Now().Add(10 * time.Second)
	calls := 0
	for first.callCount() == 0 || second.callCount() == 0 {
		if time.Now().After(deadline) {
			t.Fatalf("%d calls over two addresses: %d and %d; want both used", calls, first.callCount(), second.callCount())
		}
		if _, err := client.ModelInfo(testContext(t)); err != nil {
			t.Fatalf("ModelInfo %d: %v", calls, err)
		}
		calls++
	}
	if a, b := first.callCount(), second.callCount(); a+b != calls {
		t.Errorf("%d calls, but the addresses counted %d and %d", calls, a, b)
	}
}

func TestMalformedAddressListIsRefused(t *testing.T) {
	_, err := cbserve.Dial(testContext(t), "127.0.0.1:1,no-port")
	var e *cbserve.Error
	if !errors.Is(err, cbserve.ErrInvalidArgument) || !errors.As(err, &e) || !containsAll(e.Message, "no-port", "host:port") {
		t.Errorf("Dial of a list with an address without a port: %v; want ErrInvalidArgument naming it", err)
	}
}

// TestTwoReplicas starts two replicas of the server, sends requests through one client whose
// target lists both, checks that each replica served some (its admin Status), then kills one and
// checks that calls succeed on the other within a bounded time.
func TestTwoReplicas(t *testing.T) {
	if testing.Short() {
		t.Skip("starts two servers")
	}
	ctx, cancel := context.WithTimeout(context.Background(), startupTimeout)
	defer cancel()
	replicas := make([]*testServer, 2)
	errs := make([]error, 2)
	var wg sync.WaitGroup
	for i := range replicas {
		wg.Go(func() {
			replicas[i], errs[i] = startServer(ctx, filepath.Join(t.TempDir(), fmt.Sprintf("replica-%d.log", i)))
		})
	}
	wg.Wait()
	for i, server := range replicas {
		if server != nil {
			t.Cleanup(server.stop)
		}
		if errs[i] != nil {
			t.Fatalf("replica %d: %v", i, errs[i])
		}
	}

	client, err := cbserve.Dial(testContext(t), replicas[0].addr+","+replicas[1].addr)
	if err != nil {
		t.Fatalf("Dial: %v", err)
	}
	defer client.Close()
	before := finishedRequests(t, replicas)
	const requests = 8
	for i := range requests {
		if _, err := client.Generate(testContext(t), cbserve.Text("spread"), cbserve.WithMaxNewTokens(2)); err != nil {
			t.Fatalf("Generate %d: %v", i, err)
		}
	}
	// A replica counts a request as finished just after it sends the last chunk: poll briefly.
	var served [2]uint64
	for poll := time.Now(); ; time.Sleep(50 * time.Millisecond) {
		after := finishedRequests(t, replicas)
		served = [2]uint64{after[0] - before[0], after[1] - before[1]}
		if served[0]+served[1] >= requests || time.Since(poll) > 5*time.Second {
			break
		}
	}
	if served[0] == 0 || served[1] == 0 || served[0]+served[1] != requests {
		t.Errorf("%d requests over two replicas: %d and %d served; want both some", requests, served[0], served[1])
	}

	// A crash: the client notices the broken connection and sends every call to the survivor.
	replicas[0].kill()
	const recovery = 10 * time.Second
	deadline := time.Now().Add(recovery)
	for succeeded := 0; succeeded < requests; {
		_, err := client.Generate(testContext(t), cbserve.Text("failover"), cbserve.WithMaxNewTokens(2))
		switch {
		case err == nil:
			succeeded++
		case !errors.Is(err, cbserve.ErrUnavailable):
			t.Fatalf("Generate after a replica was killed: %v; want success, or ErrUnavailable while the client notices", err)
		case time.Now().After(deadline):
			t.Fatalf("Generate still fails %s after a replica was killed: %v", recovery, err)
		default:
			succeeded = 0 // count consecutive successes only
		}
	}
	// Retried calls succeed at once: an unavailable replica is skipped, or the call retried.
	for i := range requests {
		if _, err := client.ModelInfo(testContext(t)); err != nil {
			t.Fatalf("ModelInfo %d after a replica was killed: %v", i, err)
		}
	}
}

// finishedRequests returns each server's count of requests that reached a terminal status.
func finishedRequests(t *testing.T, servers []*testServer) []uint64 {
	t.Helper()
	var counts []uint64
	for _, server := range servers {
		admin, err := cbserve.DialAdmin(testContext(t), server.adminAddr, adminToken)
		if err != nil {
			t.Fatalf("DialAdmin(%s): %v", server.adminAddr, err)
		}
		status, err := admin.Status(testContext(t))
		_ = admin.Close()
		if err != nil {
			t.Fatalf("Status of %s: %v", server.adminAddr, err)
		}
		counts = append(counts, status.FinishedRequests)
	}
	return counts
}
