package cbserve_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	cbserve "github.com/cbserve/cbserve/sdk/go"
)

func TestAdminAuth(t *testing.T) {
	for name, token := range map[string]string{"wrong token": "not-the-token", "no token": ""} {
		_, err := newAdmin(t, token).Status(testContext(t))
		if !errors.Is(err, cbserve.ErrUnauthenticated) {
			t.Errorf("%s: Status error %v; want ErrUnauthenticated", name, err)
		}
	}
	lease, err := newAdmin(t, "not-the-token").Pause(testContext(t))
	if !errors.Is(err, cbserve.ErrUnauthenticated) || lease != nil {
		t.Errorf("Pause with a wrong token: %v; want ErrUnauthenticated and no lease", err)
	}
	status, err := newAdmin(t, adminToken).Status(testContext(t))
	if err != nil {
		t.Fatalf("Status: %v", err)
	}
	// Weight versions start at 1 (the weights tests raise it).
	if !status.Running || status.Paused || status.KVBlocksTotal == 0 || status.WeightVersion == 0 {
		t.Errorf("Status = %+v; want running, not paused, some KV blocks, a weight version", status)
	}
}

func TestPause(t *testing.T) {
	client, ctx := newClient(t), testContext(t)
	admin := newAdmin(t, adminToken)
	lease, err := admin.Pause(ctx)
	if err != nil {
		t.Fatalf("Pause: %v", err)
	}
	defer lease.Release()
	status, err := admin.Status(ctx)
	if err != nil {
		t.Fatalf("Status: %v", err)
	}
	if !status.Paused || status.PauseHolders != 1 {
		t.Errorf("while paused: Paused %v, %d holders; want true, 1", status.Paused, status.PauseHolders)
	}

	var tokens atomic.Int64
	type result struct {
		tokens   int
		finished *cbserve.Chunk
		err      error
	}
	done := make(chan result, 1)
	go func() {
		var r result
		for chunk, err := range client.Stream(ctx, cbserve.Text("paused"), cbserve.WithMaxNewTokens(8)) {
			if err != nil {
				r.err = err
				break
			}
			tokens.Add(int64(len(chunk.TokenIDs)))
			r.tokens += len(chunk.TokenIDs)
			if chunk.Finished() {
				r.finished = chunk
			}
		}
		done <- r
	}()
	time.Sleep(300 * time.Millisecond)
	if n := tokens.Load(); n != 0 {
		t.Errorf("%d tokens generated while paused; want none", n)
	}
	select {
	case r := <-done:
		t.Fatalf("the stream ended while paused: %+v", r)
	default:
	}

	lease.Release()
	lease.Release() // idempotent
	select {
	case r := <-done:
		if r.err != nil || r.tokens != 8 || r.finished == nil || r.finished.FinishReason != cbserve.FinishLength {
			t.Errorf("after release: %+v; want 8 tokens, finish length", r)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the stream did not complete within 10 s of the release")
	}
	if status, err := admin.Status(ctx); err != nil || status.Paused || status.PauseHolders != 0 {
		t.Errorf("after release: Status = %+v, %v; want not paused", status, err)
	}
}

func TestPauseLease(t *testing.T) {
	admin, ctx := newAdmin(t, adminToken), testContext(t)
	started := time.Now()
	lease, err := admin.Pause(ctx, cbserve.WithLease(time.Second))
	if err != nil {
		t.Fatalf("Pause: %v", err)
	}
	defer lease.Release()
	if !lease.Held() || lease.Holders != 1 || lease.WeightVersion == 0 {
		t.Errorf("lease = %+v, held %v; want held, 1 holder, a weight version", lease, lease.Held())
	}
	if until := lease.LeaseExpiresAt.Sub(started); until <= 0 || until > 3*time.Second {
		t.Errorf("lease expires %s after the Pause call; want about 1 s (WithLease)", until)
	}
	second, err := admin.Pause(ctx)
	if err != nil {
		t.Fatalf("second Pause: %v", err)
	}
	if second.Holders != 2 {
		t.Errorf("second lease: %d holders; want 2 (pauses nest)", second.Holders)
	}
	second.Release()
	if second.Held() || !lease.Held() {
		t.Errorf("after releasing the second lease: held %v and %v; want false, true", second.Held(), lease.Held())
	}

	// The server drops the first hold when its lease expires; the lease sees it end.
	select {
	case <-lease.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("the lease is still held 10 s after its 1 s lease")
	}
	if lease.Held() {
		t.Error("Held() = true after Done was closed")
	}
	if status, err := admin.Status(ctx); err != nil || status.Paused {
		t.Errorf("after the lease expired: Status = %+v, %v; want not paused", status, err)
	}
}

func TestPauseEndsWithContext(t *testing.T) {
	admin := newAdmin(t, adminToken)
	ctx, cancel := context.WithCancel(testContext(t))
	lease, err := admin.Pause(ctx, cbserve.WithPauseMode(cbserve.PauseWait), cbserve.WithLease(time.Minute))
	if err != nil {
		t.Fatalf("Pause: %v", err)
	}
	defer lease.Release()
	cancel()
	select {
	case <-lease.Done():
	case <-time.After(5 * time.Second):
		t.Fatal("the lease is still held 5 s after the Pause context was cancelled")
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		status, err := admin.Status(testContext(t))
		if err != nil {
			t.Fatalf("Status: %v", err)
		}
		if !status.Paused {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the engine is still paused 5 s after the Pause context was cancelled")
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func TestStopAndStart(t *testing.T) {
	client, ctx := newClient(t), testContext(t)
	admin := newAdmin(t, adminToken)
	stopped, err := admin.Stop(ctx, false, cbserve.WithDrainTimeout(5*time.Second))
	if err != nil {
		t.Fatalf("Stop: %v", err)
	}
	defer func() { _, _ = admin.Start(context.Background()) }()
	if stopped.AlreadyStopped {
		t.Errorf("Stop = %+v; the engine was running", stopped)
	}
	if again, err := admin.Stop(ctx, true); err != nil || !again.AlreadyStopped {
		t.Errorf("second Stop = %+v, %v; want AlreadyStopped", again, err)
	}
	if status, err := admin.Status(ctx); err != nil || status.Running {
		t.Errorf("after Stop: Status = %+v, %v; want not running", status, err)
	}
	if _, err := client.Generate(ctx, cbserve.Text("stopped"), cbserve.WithMaxNewTokens(2)); !errors.Is(err, cbserve.ErrUnavailable) {
		t.Errorf("Generate while stopped: %v; want ErrUnavailable", err)
	}
	started, err := admin.Start(ctx)
	if err != nil || !started {
		t.Fatalf("Start = %v, %v; want true", started, err)
	}
	if started, err := admin.Start(ctx); err != nil || started {
		t.Errorf("second Start = %v, %v; want false (already running)", started, err)
	}
	completion, err := client.Generate(ctx, cbserve.Text("started"), cbserve.WithMaxNewTokens(2))
	if err != nil || len(completion.TokenIDs) != 2 {
		t.Fatalf("Generate after Start = %+v, %v", completion, err)
	}
}
