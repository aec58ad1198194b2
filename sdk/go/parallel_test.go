package cbserve_test

// Parallel sampling (SamplingParams.n, GenerationChunk.index, per-sequence cancel) against the
// live server's tiny model (main_test.go).

import (
	"errors"
	"math"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	cbserve "github.com/cbserve/cbserve/sdk/go"
	pb "github.com/cbserve/cbserve/sdk/go/gen/cbserve/v1"
)

// TestGenerateNGreedy: greedy sequences of one prompt all equal the greedy completion.
func TestGenerateNGreedy(t *testing.T) {
	client := newClient(t)
	prompt := cbserve.Text("three greedy sequences")
	want := greedy(t, client, prompt, 12)
	completions, err := client.GenerateN(testContext(t), prompt, 3, cbserve.WithMaxNewTokens(12), cbserve.WithTemperature(0))
	if err != nil {
		t.Fatalf("GenerateN: %v", err)
	}
	if len(completions) != 3 {
		t.Fatalf("GenerateN(3) returned %d completions", len(completions))
	}
	for i, c := range completions {
		if c.Index != i || c.RequestID == "" || c.RequestID != completions[0].RequestID {
			t.Errorf("completion %d: index %d, request %q; want index %d of request %q", i, c.Index, c.RequestID, i, completions[0].RequestID)
		}
		if !slices.Equal(c.TokenIDs, want.TokenIDs) || c.Text != want.Text || c.FinishReason != cbserve.FinishLength {
			t.Errorf("completion %d: %v %q, finish %q; want the greedy %v %q, length", i, c.TokenIDs, c.Text, c.FinishReason,
				want.TokenIDs, want.Text)
		}
		if u := c.Usage; u == nil || u.GeneratedTokens != 12 || u.PromptTokens != len("three greedy sequences") {
			t.Errorf("completion %d: usage %+v; want 12 generated tokens (its own), %d prompt tokens", i, u, len("three greedy sequences"))
		}
	}
}

// TestGenerateNSeeded: sequence i of a seeded request equals a request of n = 1 with seed s + i,
// the seed wrapping around 2^64.
func TestGenerateNSeeded(t *testing.T) {
	client := newClient(t)
	prompt := cbserve.Tokens(5, 6, 7, 8)
	for _, seed := range []uint64{11, math.MaxUint64 - 1} {
		opts := []cbserve.GenerateOption{cbserve.WithMaxNewTokens(16), cbserve.WithTemperature(1)}
		completions, err := client.GenerateN(testContext(t), prompt, 3, append(opts, cbserve.WithSeed(seed))...)
		if err != nil {
			t.Fatalf("GenerateN(seed %d): %v", seed, err)
		}
		distinct := map[string]bool{}
		for i, c := range completions {
			single, err := client.Generate(testContext(t), prompt, append(opts, cbserve.WithSeed(seed+uint64(i)))...)
			if err != nil {
				t.Fatalf("Generate(seed %d): %v", seed+uint64(i), err)
			}
			if c.Index != i || !slices.Equal(c.TokenIDs, single.TokenIDs) {
				t.Errorf("seed %d, sequence %d (index %d): %v; Generate with seed %d gave %v", seed, i, c.Index, c.TokenIDs,
					seed+uint64(i), single.TokenIDs)
			}
			distinct[string(byteString(c.TokenIDs))] = true
		}
		// Sampling at temperature 1 with three seeds gives more than one output (else the check
		// above proves little).
		if len(distinct) < 2 {
			t.Errorf("seed %d: the three sequences are all alike", seed)
		}
	}
}

func byteString(ids []uint32) []byte {
	out := make([]byte, len(ids))
	for i, id := range ids {
		out[i] = byte(id)
	}
	return out
}

// TestCancelSequence: cancelling one sequence of a running request ends it cancelled; the others
// run on to their max new tokens, and the stream ends once all have.
func TestCancelSequence(t *testing.T) {
	client, ctx := newClient(t), testContext(t)
	admin := newAdmin(t, adminToken)
	const maxNew = 400
	var id string
	cancelledAt := -1
	tokens := make([]int, 3)
	last := map[int]*cbserve.Chunk{}
	for chunk, err := range client.Stream(ctx, cbserve.Text("cancel one of three"), cbserve.WithN(3), cbserve.WithMaxNewTokens(maxNew),
		cbserve.WithIgnoreEOS(), cbserve.WithTemperature(1), cbserve.WithSeed(3)) {
		if err != nil {
			t.Fatalf("Stream: %v", err)
		}
		id = chunk.RequestID
		if last[chunk.Index] != nil && last[chunk.Index].Finished() {
			t.Errorf("a chunk of sequence %d after its terminal chunk", chunk.Index)
		}
		last[chunk.Index] = chunk
		tokens[chunk.Index] += len(chunk.TokenIDs)
		if chunk.Index == 1 && tokens[1] >= 3 && cancelledAt < 0 {
			if chunk.Finished() {
				t.Fatalf("sequence 1 ended (%s) before it was cancelled", chunk.Status)
			}
			cancelledAt = tokens[1]
			cancelled, err := client.CancelSequence(ctx, id, 1)
			if err != nil || !cancelled {
				t.Fatalf("CancelSequence(1) = %v, %v; want true", cancelled, err)
			}
		}
	}
	if cancelledAt < 0 {
		t.Fatal("sequence 1 never had 3 tokens")
	}
	for i := range 3 {
		c := last[i]
		if c == nil || !c.Finished() {
			t.Fatalf("sequence %d: last chunk %+v; want a terminal one", i, c)
		}
		if i == 1 {
			if c.Status != cbserve.RequestCancelled || c.FinishReason != cbserve.FinishCancelled || tokens[1] >= maxNew {
				t.Errorf("sequence 1: status %q, finish %q, %d tokens; want cancelled before %d", c.Status, c.FinishReason, tokens[1], maxNew)
			}
		} else if c.Status != cbserve.RequestFinished || c.FinishReason != cbserve.FinishLength || tokens[i] != maxNew {
			t.Errorf("sequence %d: status %q, finish %q, %d tokens; want finished, length, %d", i, c.Status, c.FinishReason, tokens[i], maxNew)
		}
	}
	if again, err := client.CancelSequence(ctx, id, 1); err != nil || again {
		t.Errorf("CancelSequence(1) again = %v, %v; want false", again, err)
	}
	if done, err := client.CancelSequence(ctx, id, 0); err != nil || done {
		t.Errorf("CancelSequence(0) of a finished sequence = %v, %v; want false", done, err)
	}
	waitIdle(t, admin, 5*time.Second)

	// Results replays every sequence from the token index on, interleaved.
	const from = 2
	chunks, _ := collect(t, client.Results(ctx, id, from))
	replayed := make([]int, 3)
	terminal := map[int]cbserve.RequestStatus{}
	for _, chunk := range chunks {
		if len(chunk.TokenIDs) > 0 && chunk.TokenIndex < from {
			t.Errorf("Results(%d): sequence %d's chunk starts at token index %d", from, chunk.Index, chunk.TokenIndex)
		}
		replayed[chunk.Index] += len(chunk.TokenIDs)
		if chunk.Finished() {
			terminal[chunk.Index] = chunk.Status
		}
	}
	for i := range 3 {
		if replayed[i] != tokens[i]-from {
			t.Errorf("Results(%d): %d tokens of sequence %d; want %d", from, replayed[i], i, tokens[i]-from)
		}
	}
	if want := map[int]cbserve.RequestStatus{0: cbserve.RequestFinished, 1: cbserve.RequestCancelled, 2: cbserve.RequestFinished}; len(terminal) != 3 ||
		terminal[0] != want[0] || terminal[1] != want[1] || terminal[2] != want[2] {
		t.Errorf("Results: terminal statuses %v; want %v", terminal, want)
	}
}

// TestSubmitNAndCancel: a submitted request of n sequences, one cancelled at once, then all.
func TestSubmitNAndCancel(t *testing.T) {
	client, ctx := newClient(t), testContext(t)
	admin := newAdmin(t, adminToken)
	id, err := client.Submit(ctx, cbserve.Text("submit two"), cbserve.WithN(2), cbserve.WithMaxNewTokens(900), cbserve.WithIgnoreEOS())
	if err != nil {
		t.Fatalf("Submit: %v", err)
	}
	if cancelled, err := client.CancelSequence(ctx, id, 0); err != nil || !cancelled {
		t.Fatalf("CancelSequence(0) = %v, %v; want true", cancelled, err)
	}
	if unknown, err := client.CancelSequence(ctx, id, 5); err != nil || unknown {
		t.Errorf("CancelSequence(5) of 2 sequences = %v, %v; want false", unknown, err)
	}
	if cancelled, err := client.Cancel(ctx, id); err != nil || !cancelled {
		t.Fatalf("Cancel = %v, %v; want true (sequence 1 was live)", cancelled, err)
	}
	chunks, _ := collect(t, client.Results(ctx, id, 0))
	ended := map[int]cbserve.FinishReason{}
	for _, chunk := range chunks {
		if chunk.Finished() {
			ended[chunk.Index] = chunk.FinishReason
		}
	}
	if len(ended) != 2 || ended[0] != cbserve.FinishCancelled || ended[1] != cbserve.FinishCancelled {
		t.Errorf("Results: sequences ended %v; want both cancelled", ended)
	}
	waitIdle(t, admin, 5*time.Second)
}

// TestServerRefusesBadN: the client refuses a bad n before sending it, and the server's own
// check (through the raw stubs) names the same field and bound.
func TestServerRefusesBadN(t *testing.T) {
	client, ctx := newClient(t), testContext(t)
	raw := pb.NewGenerationServiceClient(client.Conn())
	for _, n := range []uint32{0, cbserve.MaxN + 1} {
		_, err := raw.AddRequest(ctx, &pb.AddRequestRequest{Request: &pb.GenerationRequest{
			Prompt: &pb.GenerationRequest_Text{Text: "x"}, Sampling: &pb.SamplingParams{N: &n}}})
		if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "sampling.n") ||
			!strings.Contains(err.Error(), "128") {
			t.Errorf("AddRequest with n = %d: %v; want INVALID_ARGUMENT naming sampling.n and its bound", n, err)
		}
	}
	_, err := client.GenerateN(ctx, cbserve.Text("x"), cbserve.MaxN+1)
	if !errors.Is(err, cbserve.ErrInvalidArgument) || !strings.Contains(err.Error(), "sampling.n") {
		t.Errorf("GenerateN(129): %v; want ErrInvalidArgument naming sampling.n", err)
	}
}
