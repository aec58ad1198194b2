package cbserve_test

// Deadlines, retries, single-use streams and error sentinels, against the in-process fake server.

import (
	"context"
	"errors"
	"net"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	cbserve "github.com/cbserve/cbserve/sdk/go"
)

// containsAll reports whether s contains every one of parts.
func containsAll(s string, parts ...string) bool {
	for _, part := range parts {
		if !strings.Contains(s, part) {
			return false
		}
	}
	return true
}

func TestStreamTimeoutEndsStalledStreams(t *testing.T) {
	addr := startFake(t, &fakeGeneration{stall: true}, nil)
	client, err := cbserve.NewClient(addr, cbserve.WithStreamTimeout(200*time.Millisecond))
	if err != nil {
		t.Fatalf("NewClient: %v", err)
	}
	defer client.Close()
	calls := map[string]func() error{
		"Generate": func() error {
			_, err := client.Generate(context.Background(), cbserve.Text("hi"))
			return err
		},
		"Results": func() error {
			for _, err := range client.Results(context.Background(), "some-id", 0) {
				return err
			}
			return nil
		},
	}
	for name, call := range calls {
		started := time.Now()
		err := call()
		if !errors.Is(err, cbserve.ErrDeadlineExceeded) {
			t.Errorf("%s on a stalled server: %v; want ErrDeadlineExceeded", name, err)
		}
		if elapsed := time.Since(started); elapsed > 3*time.Second {
			t.Errorf("%s took %s; want about 200 ms (the stream timeout)", name, elapsed)
		}
	}

	// A context's own deadline replaces the client's, here a shorter one.
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	long, err := cbserve.NewClient(addr, cbserve.WithStreamTimeout(time.Hour))
	if err != nil {
		t.Fatalf("NewClient: %v", err)
	}
	defer long.Close()
	if _, err := long.Generate(ctx, cbserve.Text("hi")); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("Generate past its context's deadline: %v; want context.DeadlineExceeded", err)
	}
}

func TestIdempotentCallsAreRetried(t *testing.T) {
	unavailable := status.Error(codes.Unavailable, "loading")
	fake := &fakeGeneration{
		infoErrors:   []error{unavailable, unavailable},
		cancelErrors: []error{unavailable},
	}
	client, err := cbserve.NewClient(startFake(t, fake, nil))
	if err != nil {
		t.Fatalf("NewClient: %v", err)
	}
	defer client.Close()
	if info, err := client.ModelInfo(testContext(t)); err != nil || info.ModelName != "fake" {
		t.Fatalf("ModelInfo after two UNAVAILABLE answers = %+v, %v; want the model info", info, err)
	}
	if calls := fake.callCount(); calls != 3 {
		t.Errorf("ModelInfo made %d calls; want 3 (two retries)", calls)
	}
	if cancelled, err := client.Cancel(testContext(t), "id"); err != nil || !cancelled {
		t.Errorf("Cancel after one UNAVAILABLE answer = %v, %v; want true", cancelled, err)
	}

	// Other codes are not retried, and WithRetryAttempts(1) turns retries off.
	fake.mu.Lock()
	fake.infoErrors = []error{status.Error(codes.Internal, "bug"), unavailable}
	fake.mu.Unlock()
	if _, err := client.ModelInfo(testContext(t)); !errors.Is(err, cbserve.ErrInternal) {
		t.Errorf("ModelInfo answered INTERNAL: %v; want ErrInternal, not retried", err)
	}
	once, err := cbserve.NewClient(startFake(t, fake, nil), cbserve.WithRetryAttempts(1))
	if err != nil {
		t.Fatalf("NewClient: %v", err)
	}
	defer once.Close()
	calls := fake.callCount()
	if _, err := once.ModelInfo(testContext(t)); !errors.Is(err, cbserve.ErrUnavailable) {
		t.Errorf("ModelInfo without retries, answered UNAVAILABLE: %v; want ErrUnavailable", err)
	}
	if made := fake.callCount() - calls; made != 1 {
		t.Errorf("ModelInfo without retries made %d calls; want 1", made)
	}
	if _, err := cbserve.NewClient("127.0.0.1:1", cbserve.WithRetryAttempts(6)); !errors.Is(err, cbserve.ErrInvalidArgument) {
		t.Errorf("WithRetryAttempts(6): %v; want ErrInvalidArgument (gRPC allows at most 5)", err)
	}
}

func TestStreamSequenceIsSingleUse(t *testing.T) {
	fake, client := dialRecordingFake(t)
	stream := client.Stream(testContext(t), cbserve.Text("hi"))
	_, tokens := collect(t, stream)
	if string(rune(tokens[0])) != "o" {
		t.Fatalf("first range: tokens %v; want the fake's answer", tokens)
	}
	var second []error
	for chunk, err := range stream {
		if chunk != nil {
			t.Errorf("second range yielded a chunk %+v", chunk)
		}
		second = append(second, err)
	}
	if len(second) != 1 || !errors.Is(second[0], cbserve.ErrFailedPrecondition) || !strings.Contains(second[0].Error(), "call Stream again") {
		t.Errorf("second range yielded %v; want one ErrFailedPrecondition saying to call Stream again", second)
	}
	fake.mu.Lock()
	defer fake.mu.Unlock()
	if len(fake.generated) != 1 {
		t.Errorf("two ranges over one Stream sent %d requests; want 1", len(fake.generated))
	}
}

func TestSentinelsMatchTheirCodes(t *testing.T) {
	for _, want := range []*cbserve.Error{cbserve.ErrPermissionDenied, cbserve.ErrFailedPrecondition, cbserve.ErrUnimplemented,
		cbserve.ErrUnauthenticated, cbserve.ErrNotFound, cbserve.ErrAborted, cbserve.ErrOutOfRange} {
		fake := &fakeGeneration{infoErrors: []error{status.Error(want.Code, "scripted")}}
		client, err := cbserve.NewClient(startFake(t, fake, nil))
		if err != nil {
			t.Fatalf("NewClient: %v", err)
		}
		_, err = client.ModelInfo(testContext(t))
		_ = client.Close()
		if !errors.Is(err, want) || errors.Is(err, cbserve.ErrInternal) || status.Code(err) != want.Code {
			t.Errorf("ModelInfo answered %s: %v; want %v only", want.Code, err, want)
		}
	}
}

func TestKeepaliveOptionConnects(t *testing.T) {
	client, err := cbserve.NewClient(startFake(t, &fakeGeneration{}, nil),
		cbserve.WithKeepalive(10*time.Second, 5*time.Second))
	if err != nil {
		t.Fatalf("NewClient: %v", err)
	}
	defer client.Close()
	if _, err := client.ModelInfo(testContext(t)); err != nil {
		t.Errorf("ModelInfo with keepalive: %v", err)
	}
}

// TestGenerationIsRetriedWhenNothingRan: a Generate call that fails with UNAVAILABLE before the
// server took its request (a trailers-only status, or an UNAVAILABLE chunk as a draining replica
// answers) is made again; other codes, and a client of WithRetryAttempts(1), are not.
func TestGenerationIsRetriedWhenNothingRan(t *testing.T) {
	fake, client := dialRecordingFake(t)
	unavailable := status.Error(codes.Unavailable, "the model is still loading")
	fake.mu.Lock()
	fake.generateErrors, fake.rejectNext = []error{unavailable}, 1
	fake.mu.Unlock()
	completion, err := client.Generate(testContext(t), cbserve.Text("hi"))
	if err != nil || completion.Text != "ok" {
		t.Fatalf("Generate after a loading replica and a draining one: %+v, %v; want the completion", completion, err)
	}
	if calls := len(fake.generatedRequests()); calls != 3 {
		t.Errorf("Generate made %d calls; want 3", calls)
	}

	fake.mu.Lock()
	fake.rejectNext = 1
	fake.mu.Unlock()
	var chunks []*cbserve.Chunk
	for chunk, err := range client.Stream(testContext(t), cbserve.Text("hi")) {
		if err != nil {
			t.Fatalf("Stream after a draining replica: %v", err)
		}
		chunks = append(chunks, chunk)
	}
	if len(chunks) != 2 || chunks[0].Status != cbserve.RequestQueued {
		t.Errorf("Stream after a draining replica yielded %d chunks, the first %+v; want the QUEUED one, then the rest", len(chunks), chunks[0])
	}

	fake.mu.Lock()
	fake.generateErrors = []error{status.Error(codes.Internal, "bug")}
	fake.mu.Unlock()
	before := len(fake.generatedRequests())
	if _, err := client.Generate(testContext(t), cbserve.Text("hi")); !errors.Is(err, cbserve.ErrInternal) {
		t.Errorf("Generate answered INTERNAL: %v; want ErrInternal", err)
	}
	if calls := len(fake.generatedRequests()) - before; calls != 1 {
		t.Errorf("Generate answered INTERNAL made %d calls; want 1", calls)
	}

	once, err := cbserve.NewClient(startFake(t, fake, nil), cbserve.WithRetryAttempts(1))
	if err != nil {
		t.Fatalf("NewClient: %v", err)
	}
	defer once.Close()
	fake.mu.Lock()
	fake.generateErrors = []error{unavailable}
	fake.mu.Unlock()
	before = len(fake.generatedRequests())
	if _, err := once.Generate(testContext(t), cbserve.Text("hi")); !errors.Is(err, cbserve.ErrUnavailable) ||
		!strings.HasSuffix(err.Error(), ": the model is still loading") {
		t.Errorf("Generate without retries, answered UNAVAILABLE: %v; want ErrUnavailable: the model is still loading", err)
	}
	if calls := len(fake.generatedRequests()) - before; calls != 1 {
		t.Errorf("Generate without retries made %d calls; want 1", calls)
	}
}

// TestBrokenGenerationIsMadeAgainOnlyWhereTheCallerSawNothing: a stream broken after its first
// chunk ends a Stream range with ErrUnavailable (the chunk was yielded), while Generate, which had
// shown nothing, makes the call again under a fresh request id, unless the caller chose the id.
func TestBrokenGenerationIsMadeAgainOnlyWhereTheCallerSawNothing(t *testing.T) {
	fake, client := dialRecordingFake(t)
	broken := status.Error(codes.Unavailable, "error reading from server: EOF")
	fake.mu.Lock()
	fake.midStreamErrors = []error{broken}
	fake.mu.Unlock()
	completion, err := client.Generate(testContext(t), cbserve.Text("hi"))
	if err != nil || completion.Text != "ok" {
		t.Fatalf("Generate over a stream that broke: %+v, %v; want the completion", completion, err)
	}
	requests := fake.generatedRequests()
	if len(requests) != 2 || requests[0].GetRequestId() == requests[1].GetRequestId() || completion.RequestID != requests[1].GetRequestId() {
		t.Errorf("Generate over a stream that broke sent %d requests; want 2, the second, the completion's, with an id of its own", len(requests))
	}

	fake.mu.Lock()
	fake.midStreamErrors = []error{broken}
	fake.mu.Unlock()
	var errs []error
	for _, err := range client.Stream(testContext(t), cbserve.Text("hi")) {
		if err != nil {
			errs = append(errs, err)
		}
	}
	if len(errs) != 1 || !errors.Is(errs[0], cbserve.ErrUnavailable) {
		t.Errorf("Stream over a stream that broke after a yielded chunk: errors %v; want one ErrUnavailable", errs)
	}

	fake.mu.Lock()
	fake.midStreamErrors = []error{broken}
	fake.mu.Unlock()
	before := len(fake.generatedRequests())
	if _, err := client.Generate(testContext(t), cbserve.Text("hi"), cbserve.WithRequestID("mine")); !errors.Is(err, cbserve.ErrUnavailable) {
		t.Errorf("Generate(WithRequestID) over a stream that broke: %v; want ErrUnavailable", err)
	}
	if calls := len(fake.generatedRequests()) - before; calls != 1 {
		t.Errorf("Generate(WithRequestID) over a stream that broke made %d calls; want 1", calls)
	}
}

// TestDeadlineErrorsSayWhichDeadline: a passed deadline names the deadline (the client's timeout
// or the context's), how long the call had, and what sets it; gRPC's own wording is not shown.
func TestDeadlineErrorsSayWhichDeadline(t *testing.T) {
	addr := startFake(t, &fakeGeneration{stall: true}, nil)
	client, err := cbserve.NewClient(addr, cbserve.WithStreamTimeout(200*time.Millisecond))
	if err != nil {
		t.Fatalf("NewClient: %v", err)
	}
	defer client.Close()
	_, err = client.Generate(context.Background(), cbserve.Text("hi"))
	want := "cbserve: DeadlineExceeded: the client's stream timeout of 200ms passed: WithStreamTimeout sets it (0: none), " +
		"and a deadline on the call's context replaces it for one call"
	if !errors.Is(err, cbserve.ErrDeadlineExceeded) || err.Error() != want {
		t.Errorf("Generate past the stream timeout:\n\t%v\nwant\n\t%s", err, want)
	}

	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	_, err = client.Generate(ctx, cbserve.Text("hi"))
	if !errors.Is(err, context.DeadlineExceeded) || !containsAll(err.Error(), "the deadline of the call's context passed, 300ms after the call began",
		"replaces the client's WithStreamTimeout") {
		t.Errorf("Generate past its context's deadline: %v; want the context's deadline named", err)
	}

	// A server that accepts connections but never answers: the deadline passes while gRPC waits
	// for a connection, and the error says so in the same words.
	silent, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer silent.Close()
	go func() {
		for {
			conn, err := silent.Accept()
			if err != nil {
				return
			}
			t.Cleanup(func() { _ = conn.Close() })
		}
	}()
	unreachable, err := cbserve.NewClient(silent.Addr().String(), cbserve.WithDefaultTimeout(300*time.Millisecond))
	if err != nil {
		t.Fatalf("NewClient: %v", err)
	}
	defer unreachable.Close()
	_, err = unreachable.ModelInfo(context.Background())
	want = "cbserve: DeadlineExceeded: the client's default timeout of 300ms passed: WithDefaultTimeout sets it (0: none), " +
		"and a deadline on the call's context replaces it for one call"
	if !errors.Is(err, cbserve.ErrDeadlineExceeded) || err.Error() != want {
		t.Errorf("ModelInfo of a server that never answers:\n\t%v\nwant\n\t%s", err, want)
	}
}

// TestUnavailableErrorsShowTheCauseOnly: an unreachable server's error, after gRPC's retries,
// carries the cause without gRPC's nested "rpc error: code = ... desc = ..." text, and without the
// "max retries exhausted: failed after 4 attempts" its retries wrap the last try's status in.
func TestUnavailableErrorsShowTheCauseOnly(t *testing.T) {
	closed, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := closed.Addr().String()
	_ = closed.Close()
	client, err := cbserve.NewClient(addr, cbserve.WithDefaultTimeout(5*time.Second))
	if err != nil {
		t.Fatalf("NewClient: %v", err)
	}
	defer client.Close()
	_, err = client.ModelInfo(testContext(t))
	if !errors.Is(err, cbserve.ErrUnavailable) || strings.Contains(err.Error(), "rpc error") || !strings.HasSuffix(err.Error(), `connect: connection refused"`) {
		t.Errorf("ModelInfo of a closed port: %v; want ErrUnavailable ending with the refused connection, without gRPC's nesting or its retries' count", err)
	}
}
