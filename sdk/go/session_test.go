package cbserve_test

import (
	"context"
	"errors"
	"slices"
	"sync"
	"testing"
	"time"

	cbserve "github.com/cbserve/cbserve/sdk/go"
)

func newSession(t *testing.T, client *cbserve.Client) *cbserve.Session {
	t.Helper()
	session, err := client.Session(testContext(t))
	if err != nil {
		t.Fatalf("Session: %v", err)
	}
	t.Cleanup(func() { _ = session.Close() })
	return session
}

func TestSessionRequestsFromManyGoroutinesEqualTheirOwnCalls(t *testing.T) {
	client, ctx := newClient(t), testContext(t)
	prompts := []string{"Once upon a time", "The capital of France", "A session carries"}
	want := make([][]uint32, len(prompts))
	for i, prompt := range prompts {
		completion, err := client.Generate(ctx, cbserve.Text(prompt), cbserve.WithMaxNewTokens(16), cbserve.WithIgnoreEOS())
		if err != nil {
			t.Fatalf("Generate: %v", err)
		}
		want[i] = completion.TokenIDs
	}
	session := newSession(t, client)
	got := make([][]uint32, len(prompts))
	errs := make([]error, len(prompts))
	var wg sync.WaitGroup
	for i, prompt := range prompts {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if i == 0 { // one through Stream, the others through Generate
				for chunk, err := range session.Stream(ctx, cbserve.Text(prompt), cbserve.WithMaxNewTokens(16), cbserve.WithIgnoreEOS()) {
					if err != nil {
						errs[i] = err
						return
					}
					got[i] = append(got[i], chunk.TokenIDs...)
				}
				return
			}
			completion, err := session.Generate(ctx, cbserve.Text(prompt), cbserve.WithMaxNewTokens(16), cbserve.WithIgnoreEOS())
			if err != nil {
				errs[i] = err
				return
			}
			got[i] = completion.TokenIDs
		}()
	}
	wg.Wait()
	for i := range prompts {
		if errs[i] != nil || !slices.Equal(got[i], want[i]) {
			t.Errorf("request %d on the session: tokens %v, error %v; on its own call: %v", i, got[i], errs[i], want[i])
		}
	}
}

func TestSessionRefusedRequestLeavesTheSessionServing(t *testing.T) {
	client, ctx := newClient(t), testContext(t)
	session := newSession(t, client)
	_, err := session.Generate(ctx, cbserve.Tokens(1000), cbserve.WithMaxNewTokens(4))
	if !errors.Is(err, cbserve.ErrInvalidArgument) {
		t.Fatalf("an out-of-vocabulary token: %v; want ErrInvalidArgument", err)
	}
	if _, err := session.Generate(ctx, cbserve.Text("still serving"), cbserve.WithMaxNewTokens(4)); err != nil {
		t.Fatalf("the next request on the session: %v", err)
	}
}

func TestSessionBreakCancelsOneRequestAndCloseTheRest(t *testing.T) {
	client, ctx := newClient(t), testContext(t)
	admin := newAdmin(t, adminToken)
	waitIdle(t, admin, 5*time.Second)
	session, err := client.Session(ctx)
	if err != nil {
		t.Fatalf("Session: %v", err)
	}
	var brokenID string
	for chunk, err := range session.Stream(ctx, cbserve.Text("break out"), cbserve.WithMaxNewTokens(900), cbserve.WithIgnoreEOS()) {
		if err != nil {
			t.Fatalf("Stream: %v", err)
		}
		brokenID = chunk.RequestID
		if len(chunk.TokenIDs) > 0 {
			break
		}
	}
	kept := session.Stream(ctx, cbserve.Text("left open"), cbserve.WithMaxNewTokens(900), cbserve.WithIgnoreEOS())
	var closeErr error
	for chunk, err := range kept {
		if err != nil {
			closeErr = err
			break
		}
		if len(chunk.TokenIDs) > 0 {
			go func() { _ = session.Close() }()
		}
	}
	if !errors.Is(closeErr, cbserve.ErrCanceled) {
		t.Fatalf("a request open when its session closed: %v; want ErrCanceled", closeErr)
	}
	waitIdle(t, admin, 5*time.Second)
	chunks, _ := collect(t, client.Results(ctx, brokenID, 0))
	if last := chunks[len(chunks)-1]; last.Status != cbserve.RequestCancelled {
		t.Errorf("after break: the request's last status is %q, want cancelled", last.Status)
	}
	if _, err := session.Generate(ctx, cbserve.Text("after close"), cbserve.WithMaxNewTokens(2)); !errors.Is(err, cbserve.ErrCanceled) {
		t.Errorf("a request on a closed session: %v; want ErrCanceled", err)
	}
	short, cancel := context.WithTimeout(ctx, time.Millisecond)
	defer cancel()
	<-short.Done()
	if _, err := client.Session(short); err == nil {
		t.Errorf("a session opened with a done context: no error")
	}
}
