package cbserve_test

import (
	"context"
	"errors"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	cbserve "github.com/cbserve/cbserve/sdk/go"
)

// byteTokens is the prompt of the test model's byte-level tokenizer for text: one token per byte.
func byteTokens(text string) []uint32 {
	ids := make([]uint32, len(text))
	for i := range len(text) {
		ids[i] = uint32(text[i])
	}
	return ids
}

// testContext bounds one test's calls.
func testContext(t *testing.T) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func newClient(t *testing.T) *cbserve.Client {
	t.Helper()
	client, err := cbserve.NewClient(serverAddr)
	if err != nil {
		t.Fatalf("NewClient: %v", err)
	}
	t.Cleanup(func() { _ = client.Close() })
	return client
}

func newAdmin(t *testing.T, token string) *cbserve.Admin {
	t.Helper()
	admin, err := cbserve.NewAdmin(adminAddr, token)
	if err != nil {
		t.Fatalf("NewAdmin: %v", err)
	}
	t.Cleanup(func() { _ = admin.Close() })
	return admin
}

// collect ranges over a chunk sequence and returns its chunks and the tokens they carry.
func collect(t *testing.T, seq func(func(*cbserve.Chunk, error) bool)) ([]*cbserve.Chunk, []uint32) {
	t.Helper()
	var chunks []*cbserve.Chunk
	var tokens []uint32
	for chunk, err := range seq {
		if err != nil {
			t.Fatalf("stream: %v", err)
		}
		chunks = append(chunks, chunk)
		tokens = append(tokens, chunk.TokenIDs...)
	}
	return chunks, tokens
}

// waitIdle polls the admin status until no request is active or queued and no KV block is
// used, failing the test after timeout.
func waitIdle(t *testing.T, admin *cbserve.Admin, timeout time.Duration) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		status, err := admin.Status(testContext(t))
		if err != nil {
			t.Fatalf("Status: %v", err)
		}
		if status.KVBlocksUsed == 0 && status.ActiveRequests == 0 && status.QueuedRequests == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("after %s: %d KV blocks used, %d active and %d queued requests; want none",
				timeout, status.KVBlocksUsed, status.ActiveRequests, status.QueuedRequests)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func TestModelInfo(t *testing.T) {
	info, err := newClient(t).ModelInfo(testContext(t))
	if err != nil {
		t.Fatalf("ModelInfo: %v", err)
	}
	// Weight versions start at 1 (the weights tests raise it).
	if info.VocabSize != 256 || !info.HasTokenizer || info.WeightVersion == 0 || info.MaxContextLength <= 0 {
		t.Errorf("ModelInfo = %+v; want vocab 256, a tokenizer, a weight version", info)
	}
}

func TestGenerateIsDeterministic(t *testing.T) {
	client, ctx := newClient(t), testContext(t)
	prompt := cbserve.Text("Hello, cbserve")
	first, err := client.Generate(ctx, prompt, cbserve.WithMaxNewTokens(12), cbserve.WithTemperature(0))
	if err != nil {
		t.Fatalf("Generate: %v", err)
	}
	second, err := client.Generate(ctx, prompt, cbserve.WithMaxNewTokens(12), cbserve.WithTemperature(0))
	if err != nil {
		t.Fatalf("Generate: %v", err)
	}
	if len(first.TokenIDs) != 12 || first.FinishReason != cbserve.FinishLength {
		t.Fatalf("Generate = %d tokens, finish %q; want 12, length", len(first.TokenIDs), first.FinishReason)
	}
	if !slices.Equal(first.TokenIDs, second.TokenIDs) || first.Text != second.Text {
		t.Errorf("two greedy generates differ: %v %q vs %v %q", first.TokenIDs, first.Text, second.TokenIDs, second.Text)
	}
	if first.RequestID == "" || first.RequestID == second.RequestID {
		t.Errorf("request ids %q and %q; want two distinct ids", first.RequestID, second.RequestID)
	}
	if u := first.Usage; u == nil || u.PromptTokens != len("Hello, cbserve") || u.GeneratedTokens != 12 {
		t.Errorf("Usage = %+v; want %d prompt tokens (one per byte), 12 generated", u, len("Hello, cbserve"))
	}
	if first.WeightVersion == 0 || first.Timings == nil || first.Timings.FinishedAt.IsZero() {
		t.Errorf("WeightVersion = %d, Timings = %+v; want a weight version and a finish time", first.WeightVersion, first.Timings)
	}

	// The tokenizer is byte-level without BOS: the text prompt is its bytes as token ids.
	tokens, err := client.Generate(ctx, cbserve.Tokens(byteTokens("Hello, cbserve")...), cbserve.WithMaxNewTokens(12))
	if err != nil {
		t.Fatalf("Generate(Tokens): %v", err)
	}
	if !slices.Equal(tokens.TokenIDs, first.TokenIDs) {
		t.Errorf("Tokens prompt gave %v, Text prompt %v", tokens.TokenIDs, first.TokenIDs)
	}
}

func TestGenerateAndStreamAgree(t *testing.T) {
	client, ctx := newClient(t), testContext(t)
	prompt := cbserve.Text("Once upon a time")
	completion, err := client.Generate(ctx, prompt, cbserve.WithMaxNewTokens(20))
	if err != nil {
		t.Fatalf("Generate: %v", err)
	}
	chunks, tokens := collect(t, client.Stream(ctx, prompt, cbserve.WithMaxNewTokens(20)))
	if !slices.Equal(tokens, completion.TokenIDs) {
		t.Fatalf("Stream tokens %v; Generate tokens %v", tokens, completion.TokenIDs)
	}
	if first := chunks[0]; first.Status != cbserve.RequestQueued || len(first.TokenIDs) != 0 {
		t.Errorf("first chunk: status %q with %d tokens; want queued, none", first.Status, len(first.TokenIDs))
	}
	var text strings.Builder
	next := 0
	for i, chunk := range chunks {
		if chunk.RequestID != chunks[0].RequestID {
			t.Errorf("chunk %d: request id %q, want %q", i, chunk.RequestID, chunks[0].RequestID)
		}
		if len(chunk.TokenIDs) > 0 && chunk.TokenIndex != next {
			t.Errorf("chunk %d: token index %d, want %d", i, chunk.TokenIndex, next)
		}
		next += len(chunk.TokenIDs)
		text.WriteString(chunk.Text)
		if chunk.Finished() != (i == len(chunks)-1) {
			t.Errorf("chunk %d of %d: Finished() = %v", i, len(chunks), chunk.Finished())
		}
	}
	last := chunks[len(chunks)-1]
	if last.Status != cbserve.RequestFinished || last.FinishReason != cbserve.FinishLength || last.Usage == nil {
		t.Errorf("last chunk: status %q, finish %q, usage %v; want finished, length, usage", last.Status, last.FinishReason, last.Usage)
	}
	if text.String() != completion.Text {
		t.Errorf("Stream text %q; Generate text %q", text.String(), completion.Text)
	}
}

func TestSamplingOptions(t *testing.T) {
	client, ctx := newClient(t), testContext(t)
	prompt := cbserve.Tokens(1, 2, 3, 4)
	opts := []cbserve.GenerateOption{cbserve.WithMaxNewTokens(10), cbserve.WithTemperature(1.5), cbserve.WithTopK(50),
		cbserve.WithTopP(0.9), cbserve.WithSeed(7), cbserve.WithLogprobs(2), cbserve.WithRecordTimestamps()}
	a, err := client.Generate(ctx, prompt, opts...)
	if err != nil {
		t.Fatalf("Generate: %v", err)
	}
	b, err := client.Generate(ctx, prompt, opts...)
	if err != nil {
		t.Fatalf("Generate: %v", err)
	}
	if !slices.Equal(a.TokenIDs, b.TokenIDs) {
		t.Errorf("same seed, different tokens: %v vs %v", a.TokenIDs, b.TokenIDs)
	}
	if len(a.Logprobs) != len(a.TokenIDs) || len(a.TokenTimestamps) != len(a.TokenIDs) {
		t.Fatalf("%d tokens, %d logprobs, %d timestamps; want as many", len(a.TokenIDs), len(a.Logprobs), len(a.TokenTimestamps))
	}
	for i, lp := range a.Logprobs {
		if lp.TokenID != a.TokenIDs[i] || lp.Logprob > 0 || len(lp.Top) != 2 || lp.Top[0].Logprob < lp.Top[1].Logprob {
			t.Errorf("logprob %d = %+v; want token %d, logprob <= 0, 2 alternatives best first", i, lp, a.TokenIDs[i])
		}
	}
	if ts := a.TokenTimestamps[0]; time.Since(ts) > time.Minute || time.Since(ts) < 0 {
		t.Errorf("token timestamp %v is not recent", ts)
	}

	// WithEOS: the first generated token ends the request when it is the EOS.
	eos, err := client.Generate(ctx, prompt, cbserve.WithMaxNewTokens(10), cbserve.WithEOS(a.TokenIDs[0]),
		cbserve.WithSeed(7), cbserve.WithTemperature(1.5), cbserve.WithTopK(50), cbserve.WithTopP(0.9))
	if err != nil {
		t.Fatalf("Generate(WithEOS): %v", err)
	}
	if eos.FinishReason != cbserve.FinishEOS || !slices.Equal(eos.TokenIDs, a.TokenIDs[:1]) {
		t.Errorf("WithEOS(%d): %v, finish %q; want [%d], eos", a.TokenIDs[0], eos.TokenIDs, eos.FinishReason, a.TokenIDs[0])
	}
	ignored, err := client.Generate(ctx, prompt, cbserve.WithMaxNewTokens(10), cbserve.WithEOS(a.TokenIDs[0]),
		cbserve.WithIgnoreEOS(), cbserve.WithSeed(7), cbserve.WithTemperature(1.5), cbserve.WithTopK(50), cbserve.WithTopP(0.9))
	if err != nil {
		t.Fatalf("Generate(WithIgnoreEOS): %v", err)
	}
	if ignored.FinishReason != cbserve.FinishLength || len(ignored.TokenIDs) != 10 {
		t.Errorf("WithIgnoreEOS: %d tokens, finish %q; want 10, length", len(ignored.TokenIDs), ignored.FinishReason)
	}
}

func TestSubmitAndResults(t *testing.T) {
	client, ctx := newClient(t), testContext(t)
	prompt := cbserve.Text("The quick brown fox")
	id, err := client.Submit(ctx, prompt, cbserve.WithMaxNewTokens(16), cbserve.WithRequestID("go-submit-1"))
	if err != nil {
		t.Fatalf("Submit: %v", err)
	}
	if id != "go-submit-1" {
		t.Errorf("Submit returned id %q, want go-submit-1", id)
	}
	chunks, all := collect(t, client.Results(ctx, id, 0))
	if len(all) != 16 || chunks[len(chunks)-1].FinishReason != cbserve.FinishLength {
		t.Fatalf("Results(0): %d tokens, last chunk %+v; want 16 tokens, length", len(all), chunks[len(chunks)-1])
	}
	want, err := client.Generate(ctx, prompt, cbserve.WithMaxNewTokens(16))
	if err != nil {
		t.Fatalf("Generate: %v", err)
	}
	if !slices.Equal(all, want.TokenIDs) {
		t.Errorf("Submit+Results gave %v; Generate %v", all, want.TokenIDs)
	}
	for _, k := range []int{1, 5, 15, 16} {
		chunks, tail := collect(t, client.Results(ctx, id, k))
		if !slices.Equal(tail, all[k:]) {
			t.Errorf("Results(%d) = %v; want %v", k, tail, all[k:])
		}
		for _, chunk := range chunks {
			if len(chunk.TokenIDs) > 0 && chunk.TokenIndex < k {
				t.Errorf("Results(%d): a chunk starts at token index %d", k, chunk.TokenIndex)
			}
		}
		if last := chunks[len(chunks)-1]; !last.Finished() || last.Usage == nil || last.Usage.GeneratedTokens != 16 {
			t.Errorf("Results(%d): last chunk %+v; want a final chunk with usage", k, last)
		}
	}
	// Without WithRequestID the client picks the id.
	id2, err := client.Submit(ctx, prompt, cbserve.WithMaxNewTokens(2))
	if err != nil || len(id2) != 32 {
		t.Fatalf("Submit = %q, %v; want a 32-digit id", id2, err)
	}
	if _, tokens := collect(t, client.Results(ctx, id2, 0)); len(tokens) != 2 {
		t.Errorf("Results: %d tokens, want 2", len(tokens))
	}
}

func TestCancel(t *testing.T) {
	client, ctx := newClient(t), testContext(t)
	admin := newAdmin(t, adminToken)
	id, err := client.Submit(ctx, cbserve.Text("cancel me"), cbserve.WithMaxNewTokens(900), cbserve.WithIgnoreEOS())
	if err != nil {
		t.Fatalf("Submit: %v", err)
	}
	cancelled, err := client.Cancel(ctx, id)
	if err != nil || !cancelled {
		t.Fatalf("Cancel = %v, %v; want true", cancelled, err)
	}
	chunks, _ := collect(t, client.Results(ctx, id, 0))
	if last := chunks[len(chunks)-1]; last.Status != cbserve.RequestCancelled || last.FinishReason != cbserve.FinishCancelled {
		t.Errorf("last chunk: status %q, finish %q; want cancelled", last.Status, last.FinishReason)
	}
	again, err := client.Cancel(ctx, id)
	if err != nil || again {
		t.Errorf("second Cancel = %v, %v; want false", again, err)
	}
	if unknown, err := client.Cancel(ctx, "no-such-request"); err != nil || unknown {
		t.Errorf("Cancel(unknown) = %v, %v; want false, nil", unknown, err)
	}
	waitIdle(t, admin, 5*time.Second)
}

func TestCancelByContext(t *testing.T) {
	client := newClient(t)
	admin := newAdmin(t, adminToken)
	waitIdle(t, admin, 5*time.Second)
	ctx, cancel := context.WithCancel(testContext(t))
	defer cancel()
	// A 40-byte prompt and up to 900 tokens: several 16-token KV pages once it runs.
	prompt := cbserve.Text(strings.Repeat("cancel by context ", 3)[:40])
	tokens, sawBlocks := 0, false
	var streamErr error
	for chunk, err := range client.Stream(ctx, prompt, cbserve.WithMaxNewTokens(900), cbserve.WithIgnoreEOS()) {
		if err != nil {
			streamErr = err
			break
		}
		if chunk.Finished() {
			t.Fatalf("the request ended (%s) before the context was cancelled", chunk.Status)
		}
		tokens += len(chunk.TokenIDs)
		if tokens >= 3 && !sawBlocks {
			status, err := admin.Status(testContext(t))
			if err != nil {
				t.Fatalf("Status: %v", err)
			}
			if status.KVBlocksUsed == 0 || status.ActiveRequests != 1 {
				t.Errorf("while streaming: %d KV blocks used, %d active requests; want some, 1", status.KVBlocksUsed, status.ActiveRequests)
			}
			sawBlocks = true
			cancel()
		}
	}
	if !errors.Is(streamErr, cbserve.ErrCanceled) || !errors.Is(streamErr, context.Canceled) {
		t.Fatalf("after cancel: error %v; want ErrCanceled matching context.Canceled", streamErr)
	}
	waitIdle(t, admin, 5*time.Second)

	// A deadline ends Generate the same way.
	short, cancelShort := context.WithTimeout(testContext(t), 300*time.Millisecond)
	defer cancelShort()
	_, err := client.Generate(short, prompt, cbserve.WithMaxNewTokens(900), cbserve.WithIgnoreEOS())
	if !errors.Is(err, cbserve.ErrDeadlineExceeded) || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Generate past its deadline: %v; want ErrDeadlineExceeded", err)
	}
	waitIdle(t, admin, 5*time.Second)
}

func TestBreakingOutOfStreamCancels(t *testing.T) {
	client, ctx := newClient(t), testContext(t)
	admin := newAdmin(t, adminToken)
	var id string
	tokens := 0
	for chunk, err := range client.Stream(ctx, cbserve.Text("break out"), cbserve.WithMaxNewTokens(900), cbserve.WithIgnoreEOS()) {
		if err != nil {
			t.Fatalf("Stream: %v", err)
		}
		id = chunk.RequestID
		if tokens += len(chunk.TokenIDs); tokens >= 3 {
			break
		}
	}
	waitIdle(t, admin, 5*time.Second)
	chunks, _ := collect(t, client.Results(ctx, id, 0))
	if last := chunks[len(chunks)-1]; last.Status != cbserve.RequestCancelled {
		t.Errorf("after break: the request's last status is %q, want cancelled", last.Status)
	}
}

func TestBadInput(t *testing.T) {
	client, ctx := newClient(t), testContext(t)
	check := func(name string, err error, want *cbserve.Error, mention string) {
		t.Helper()
		if !errors.Is(err, want) {
			t.Errorf("%s: error %v; want %v", name, err, want)
			return
		}
		var e *cbserve.Error
		if !errors.As(err, &e) || e.Code != want.Code || status.Code(err) != want.Code {
			t.Errorf("%s: error %#v; want an *Error with code %s", name, err, want.Code)
		}
		if !strings.Contains(e.Message, mention) {
			t.Errorf("%s: message %q does not mention %q", name, e.Message, mention)
		}
		for _, other := range []*cbserve.Error{cbserve.ErrInvalidArgument, cbserve.ErrNotFound, cbserve.ErrUnavailable} {
			if other != want && errors.Is(err, other) {
				t.Errorf("%s: error %v also matches %v", name, err, other)
			}
		}
	}
	_, err := client.Generate(ctx, cbserve.Text(""))
	check("empty text", err, cbserve.ErrInvalidArgument, "empty")
	_, err = client.Generate(ctx, cbserve.Tokens())
	check("no token", err, cbserve.ErrInvalidArgument, "empty")
	_, err = client.Generate(ctx, cbserve.Prompt{})
	check("zero Prompt", err, cbserve.ErrInvalidArgument, "")
	_, err = client.Generate(ctx, cbserve.Tokens(1, 999))
	check("token 999", err, cbserve.ErrInvalidArgument, "999")
	_, err = client.Submit(ctx, cbserve.Tokens(999))
	check("Submit token 999", err, cbserve.ErrInvalidArgument, "999")
	_, err = client.Generate(ctx, cbserve.Text("x"), cbserve.WithMaxNewTokens(0))
	check("max new tokens 0 (client-side)", err, cbserve.ErrInvalidArgument, "sampling.max_new_tokens must be an int >= 1, got 0")
	_, err = client.Generate(ctx, cbserve.Text("x"), cbserve.WithMaxNewTokens(100000))
	check("max new tokens past the context (server-side)", err, cbserve.ErrInvalidArgument, "max_new_tokens")
	_, err = client.Generate(ctx, cbserve.Text("x"), cbserve.WithTemperature(-1))
	check("temperature -1 (client-side)", err, cbserve.ErrInvalidArgument, "sampling.temperature must be a finite number >= 0, got -1.0")

	for chunk, err := range client.Results(ctx, "no-such-request", 0) {
		check("Results(unknown)", err, cbserve.ErrNotFound, "no-such-request")
		if chunk != nil {
			t.Errorf("Results(unknown) yielded a chunk %+v", chunk)
		}
	}

	id, err := client.Submit(ctx, cbserve.Text("dup"), cbserve.WithRequestID("go-dup"), cbserve.WithMaxNewTokens(900), cbserve.WithIgnoreEOS())
	if err != nil {
		t.Fatalf("Submit: %v", err)
	}
	defer func() { _, _ = client.Cancel(context.Background(), id) }()
	_, err = client.Submit(ctx, cbserve.Text("dup"), cbserve.WithRequestID("go-dup"))
	check("Submit duplicate id", err, cbserve.ErrAlreadyExists, "go-dup")
	_, err = client.Generate(ctx, cbserve.Text("dup"), cbserve.WithRequestID("go-dup"))
	check("Generate duplicate id", err, cbserve.ErrAlreadyExists, "go-dup")
}

func TestUnreachableServer(t *testing.T) {
	ports, err := freePorts(1)
	if err != nil {
		t.Fatal(err)
	}
	client, err := cbserve.NewClient("127.0.0.1:"+strconv.Itoa(ports[0]), cbserve.WithDefaultTimeout(2*time.Second))
	if err != nil {
		t.Fatalf("NewClient: %v", err)
	}
	defer client.Close()
	_, err = client.ModelInfo(testContext(t))
	if !errors.Is(err, cbserve.ErrUnavailable) || status.Code(err) != codes.Unavailable {
		t.Errorf("ModelInfo on a closed port: %v; want ErrUnavailable", err)
	}
}
