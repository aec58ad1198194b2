package cbserve_test

import (
	"context"
	"errors"
	"net"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	grpchealth "google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	cbserve "github.com/cbserve/cbserve/sdk/go"
	pb "github.com/cbserve/cbserve/sdk/go/gen/cbserve/v1"
)

func TestStaticAddressListSpreadsCalls(t *testing.T) {
	first, second := &fakeGeneration{}, &fakeGeneration{}
	target := startFake(t, first, nil) + "," + startFake(t, second, nil)
	client, err := cbserve.NewClient(target)
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
	_, err := cbserve.NewClient("127.0.0.1:1,no-port")
	var e *cbserve.Error
	if !errors.Is(err, cbserve.ErrInvalidArgument) || !errors.As(err, &e) || !containsAll(e.Message, "no-port", "host:port") {
		t.Errorf("Dial of a list with an address without a port: %v; want ErrInvalidArgument naming it", err)
	}
}

// TestReplicasJoinAndDieWhileCallsFlow: calls flow without pause through one client whose target
// lists two replicas while the second starts (its port opens, and its health says NOT_SERVING,
// while its model loads), serves, and then the first is killed (SIGKILL, as a crash). Not one call
// may fail: health checking keeps calls off a replica that is still loading, and a call cut off by
// the crash is made again on the survivor.
func TestReplicasJoinAndDieWhileCallsFlow(t *testing.T) {
	if testing.Short() {
		t.Skip("starts two servers")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*startupTimeout)
	defer cancel()
	first, err := startServer(ctx, filepath.Join(t.TempDir(), "first.log"))
	if err != nil {
		t.Fatalf("first replica: %v", err)
	}
	t.Cleanup(first.stop)
	ports, err := freePorts(2)
	if err != nil {
		t.Fatal(err)
	}
	secondAddr := net.JoinHostPort("127.0.0.1", strconv.Itoa(ports[0]))
	client, err := cbserve.NewClient(first.addr + "," + secondAddr)
	if err != nil {
		t.Fatalf("NewClient: %v", err)
	}
	defer client.Close()

	calls := startCallFlow(t, client, 3)
	second, err := launchServer(filepath.Join(t.TempDir(), "second.log"), ports)
	if err != nil {
		t.Fatalf("second replica: %v", err)
	}
	t.Cleanup(second.stop)
	if err := second.waitServing(ctx); err != nil {
		t.Fatalf("second replica: %v", err)
	}
	replicas := []*testServer{first, second}
	// Both replicas serve once both are up.
	joined := finishedRequests(t, replicas)
	for poll := time.Now(); ; time.Sleep(50 * time.Millisecond) {
		now := finishedRequests(t, replicas)
		if now[0] > joined[0] && now[1] > joined[1] {
			break
		}
		if time.Since(poll) > 20*time.Second {
			t.Fatalf("requests finished since the second replica became SERVING: %d and %d; want both some",
				now[0]-joined[0], now[1]-joined[1])
		}
	}
	first.kill()
	survivor := replicas[1:]
	killed := finishedRequests(t, survivor)
	for poll := time.Now(); finishedRequests(t, survivor)[0] < killed[0]+20; time.Sleep(50 * time.Millisecond) {
		if time.Since(poll) > 20*time.Second {
			t.Fatalf("the surviving replica finished %d requests in 20 s after the first was killed; want 20",
				finishedRequests(t, survivor)[0]-killed[0])
		}
	}
	made, failures := calls.stop()
	for _, err := range failures {
		t.Errorf("a call failed: %v", err)
	}
	t.Logf("%d calls, %d failed", made, len(failures))
}

// callFlow is calls of Generate made back to back by several goroutines until stopped.
type callFlow struct {
	cancel   context.CancelFunc
	wg       sync.WaitGroup
	mu       sync.Mutex
	made     int
	failures []error
}

func startCallFlow(t *testing.T, client *cbserve.Client, goroutines int) *callFlow {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	flow := &callFlow{cancel: cancel}
	for range goroutines {
		flow.wg.Go(func() {
			for ctx.Err() == nil {
				callCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
				_, err := client.Generate(callCtx, cbserve.Text("flow"), cbserve.WithMaxNewTokens(4))
				cancel()
				if ctx.Err() != nil {
					return // stopped while the call ran
				}
				flow.mu.Lock()
				flow.made++
				if err != nil {
					flow.failures = append(flow.failures, err)
				}
				flow.mu.Unlock()
			}
		})
	}
	t.Cleanup(flow.cancel)
	return flow
}

// stop ends the flow and returns how many calls ended, and the errors of those that failed.
func (f *callFlow) stop() (int, []error) {
	f.cancel()
	f.wg.Wait()
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.made, f.failures
}

// finishedRequests returns each server's count of requests that reached a terminal status.
func finishedRequests(t *testing.T, servers []*testServer) []uint64 {
	t.Helper()
	var counts []uint64
	for _, server := range servers {
		admin, err := cbserve.NewAdmin(server.adminAddr, adminToken)
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

// TestReplicaThatIsNotServingIsSkipped: a replica whose grpc.health.v1 status is NOT_SERVING (a
// model still loading) gets no call, without a retry to hide one, while another serves, and calls
// it again once it turns SERVING; with no replica serving, a call reaches one anyway and returns
// its reason.
func TestReplicaThatIsNotServingIsSkipped(t *testing.T) {
	loading, serving := &fakeGeneration{}, &fakeGeneration{}
	health := grpchealth.NewServer()
	health.SetServingStatus("", healthpb.HealthCheckResponse_NOT_SERVING)
	loadingAddr := startFakeWith(t, loading, func(s *grpc.Server) { healthpb.RegisterHealthServer(s, health) })
	client, err := cbserve.NewClient(loadingAddr+","+startFake(t, serving, nil), cbserve.WithRetryAttempts(1))
	if err != nil {
		t.Fatalf("NewClient: %v", err)
	}
	defer client.Close()
	// Calls spread over half a second, so that both connections are up for most of them.
	const calls = 50
	for i := range calls {
		if _, err := client.ModelInfo(testContext(t)); err != nil {
			t.Fatalf("ModelInfo %d: %v", i, err)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if got := loading.callCount(); got != 0 {
		t.Errorf("the NOT_SERVING replica got %d of %d calls; want none", got, calls)
	}

	// With no replica serving, a call still reaches one, which says why it does not serve (as
	// the Python SDK does): here, as a server that is loading its model.
	lone, err := cbserve.NewClient(loadingAddr)
	if err != nil {
		t.Fatalf("NewClient: %v", err)
	}
	defer lone.Close()
	loadingErr := status.Error(codes.Unavailable, "the model is still loading")
	loading.mu.Lock()
	loading.generateErrors = slices.Repeat([]error{loadingErr}, cbserve.DefaultRetryAttempts)
	loading.infoErrors = slices.Repeat([]error{loadingErr}, cbserve.DefaultRetryAttempts)
	loading.mu.Unlock()
	_, err = lone.Generate(testContext(t), cbserve.Text("hi"))
	if want := "cbserve: Unavailable: the model is still loading"; err == nil || err.Error() != want {
		t.Errorf("Generate with no replica serving:\n\t%v\nwant\n\t%s", err, want)
	}
	if _, err := lone.ModelInfo(testContext(t)); !errors.Is(err, cbserve.ErrUnavailable) ||
		!strings.HasPrefix(err.Error(), "cbserve: Unavailable: the model is still loading") {
		t.Errorf("ModelInfo with no replica serving: %v; want the replica's own reason", err)
	}
	if _, err := lone.ModelInfo(testContext(t)); err != nil {
		t.Errorf("ModelInfo once the replica answers, though still NOT_SERVING: %v", err)
	}

	health.SetServingStatus("", healthpb.HealthCheckResponse_SERVING)
	before := loading.callCount()
	deadline := time.Now().Add(10 * time.Second)
	for loading.callCount() == before {
		if time.Now().After(deadline) {
			t.Fatalf("the replica got no call within 10 s of turning SERVING")
		}
		if _, err := client.ModelInfo(testContext(t)); err != nil {
			t.Fatalf("ModelInfo: %v", err)
		}
	}
}

// TestSessionWithNoReplicaServingGoesToAnyReplica: a session's call, as a Stream's, reaches a
// replica though none is SERVING, which says why it refuses it, or serves it.
func TestSessionWithNoReplicaServingGoesToAnyReplica(t *testing.T) {
	loading := &fakeGeneration{chunks: []*pb.GenerationChunk{{
		TokenIds: []uint32{7}, Status: pb.RequestStatus_REQUEST_STATUS_FINISHED,
		FinishReason: pb.FinishReason_FINISH_REASON_LENGTH,
	}}}
	health := grpchealth.NewServer()
	health.SetServingStatus("", healthpb.HealthCheckResponse_NOT_SERVING)
	client, err := cbserve.NewClient(startFakeWith(t, loading, func(s *grpc.Server) { healthpb.RegisterHealthServer(s, health) }))
	if err != nil {
		t.Fatalf("NewClient: %v", err)
	}
	defer client.Close()
	generate := func() (*cbserve.Completion, error) {
		session, err := client.Session(testContext(t))
		if err != nil {
			return nil, err
		}
		defer session.Close()
		return session.Generate(testContext(t), cbserve.Text("hi"))
	}
	loading.mu.Lock()
	loading.generateErrors = []error{status.Error(codes.Unavailable, "the model is still loading")}
	loading.mu.Unlock()
	_, err = generate()
	if want := "cbserve: Unavailable: the model is still loading"; err == nil || err.Error() != want {
		t.Errorf("a session's Generate with no replica serving:\n\t%v\nwant\n\t%s", err, want)
	}
	completion, err := generate() // the replica answers now, though still NOT_SERVING
	if err != nil || !slices.Equal(completion.TokenIDs, []uint32{7}) {
		t.Errorf("a session's Generate once the replica answers: %v, %v; want token ids [7]", completion, err)
	}
}
