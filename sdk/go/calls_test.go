package cbserve_test

// Deadlines, retries, single-use streams and error sentinels, against the in-process fake server.

import (
	"context"
	"errors"
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
	client, err := cbserve.Dial(testContext(t), addr, cbserve.WithStreamTimeout(200*time.Millisecond))
	if err != nil {
		t.Fatalf("Dial: %v", err)
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
	long, err := cbserve.Dial(testContext(t), addr, cbserve.WithStreamTimeout(time.Hour))
	if err != nil {
		t.Fatalf("Dial: %v", err)
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
	client, err := cbserve.Dial(testContext(t), startFake(t, fake, nil))
	if err != nil {
		t.Fatalf("Dial: %v", err)
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
	once, err := cbserve.Dial(testContext(t), startFake(t, fake, nil), cbserve.WithRetryAttempts(1))
	if err != nil {
		t.Fatalf("Dial: %v", err)
	}
	defer once.Close()
	calls := fake.callCount()
	if _, err := once.ModelInfo(testContext(t)); !errors.Is(err, cbserve.ErrUnavailable) {
		t.Errorf("ModelInfo without retries, answered UNAVAILABLE: %v; want ErrUnavailable", err)
	}
	if made := fake.callCount() - calls; made != 1 {
		t.Errorf("ModelInfo without retries made %d calls; want 1", made)
	}
	if _, err := cbserve.Dial(testContext(t), "127.0.0.1:1", cbserve.WithRetryAttempts(6)); !errors.Is(err, cbserve.ErrInvalidArgument) {
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
		cbserve.ErrUnauthenticated, cbserve.ErrNotFound} {
		fake := &fakeGeneration{infoErrors: []error{status.Error(want.Code, "scripted")}}
		client, err := cbserve.Dial(testContext(t), startFake(t, fake, nil))
		if err != nil {
			t.Fatalf("Dial: %v", err)
		}
		_, err = client.ModelInfo(testContext(t))
		_ = client.Close()
		if !errors.Is(err, want) || errors.Is(err, cbserve.ErrInternal) || status.Code(err) != want.Code {
			t.Errorf("ModelInfo answered %s: %v; want %v only", want.Code, err, want)
		}
	}
}

func TestKeepaliveOptionConnects(t *testing.T) {
	client, err := cbserve.Dial(testContext(t), startFake(t, &fakeGeneration{}, nil),
		cbserve.WithKeepalive(10*time.Second, 5*time.Second))
	if err != nil {
		t.Fatalf("Dial: %v", err)
	}
	defer client.Close()
	if _, err := client.ModelInfo(testContext(t)); err != nil {
		t.Errorf("ModelInfo with keepalive: %v", err)
	}
}
