package cbserve_test

// The sampling fields of SamplingParams 16 to 20 and GenerationRequest.priority against the live
// server's tiny model (main_test.go): min_p, stop token ids and the stop reason, skip special
// tokens, priority, prompt logprobs and structured output.

import (
	"encoding/json"
	"errors"
	"slices"
	"strings"
	"testing"
	"unicode/utf8"

	cbserve "github.com/cbserve/cbserve/sdk/go"
)

// greedy returns the greedy completion of prompt in n tokens (the tiny model has no EOS, so it
// runs to n).
func greedy(t *testing.T, client *cbserve.Client, prompt cbserve.Prompt, n int) *cbserve.Completion {
	t.Helper()
	completion, err := client.Generate(testContext(t), prompt, cbserve.WithMaxNewTokens(n), cbserve.WithTemperature(0))
	if err != nil {
		t.Fatalf("greedy Generate: %v", err)
	}
	if len(completion.TokenIDs) != n || completion.FinishReason != cbserve.FinishLength {
		t.Fatalf("greedy Generate: %d tokens, finish %q; want %d, length", len(completion.TokenIDs), completion.FinishReason, n)
	}
	return completion
}

// TestMinPOneIsGreedy: min_p 1 keeps only the most likely token, so sampling at temperature 1
// gives the greedy output whatever the seed.
func TestMinPOneIsGreedy(t *testing.T) {
	client := newClient(t)
	prompt := cbserve.Text("min p of one")
	want := greedy(t, client, prompt, 16)
	for _, seed := range []uint64{1, 2, 3} {
		got, err := client.Generate(testContext(t), prompt, cbserve.WithMaxNewTokens(16), cbserve.WithTemperature(1),
			cbserve.WithMinP(1), cbserve.WithSeed(seed))
		if err != nil {
			t.Fatalf("Generate(WithMinP(1)): %v", err)
		}
		if !slices.Equal(got.TokenIDs, want.TokenIDs) {
			t.Errorf("seed %d: min p 1 at temperature 1 gave %v; greedy %v", seed, got.TokenIDs, want.TokenIDs)
		}
	}
	// The same seeds without min p sample something else at least once (else the check above
	// proves nothing).
	differs := false
	for _, seed := range []uint64{1, 2, 3} {
		got, err := client.Generate(testContext(t), prompt, cbserve.WithMaxNewTokens(16), cbserve.WithTemperature(1), cbserve.WithSeed(seed))
		if err != nil {
			t.Fatalf("Generate: %v", err)
		}
		differs = differs || !slices.Equal(got.TokenIDs, want.TokenIDs)
	}
	if !differs {
		t.Errorf("sampling at temperature 1 without min p gave the greedy output for every seed")
	}
}

// TestStopTokenIDs: a token of the greedy output, given as a stop token id, ends the request at
// its first occurrence, with FinishStop and StopTokenID, in Generate and in Stream.
func TestStopTokenIDs(t *testing.T) {
	client := newClient(t)
	prompt := cbserve.Text("Hello, cbserve")
	full := greedy(t, client, prompt, 16)
	stop := full.TokenIDs[3]
	end := slices.Index(full.TokenIDs, stop) + 1
	// Another stop id that the greedy output does not contain changes nothing.
	absent := uint32(0)
	for slices.Contains(full.TokenIDs, absent) {
		absent++
	}
	opts := []cbserve.GenerateOption{cbserve.WithMaxNewTokens(16), cbserve.WithTemperature(0), cbserve.WithStopTokenIDs(absent, stop)}
	completion, err := client.Generate(testContext(t), prompt, opts...)
	if err != nil {
		t.Fatalf("Generate(WithStopTokenIDs): %v", err)
	}
	if !slices.Equal(completion.TokenIDs, full.TokenIDs[:end]) || completion.FinishReason != cbserve.FinishStop {
		t.Errorf("WithStopTokenIDs(%d, %d): %v, finish %q; want %v, stop", absent, stop, completion.TokenIDs, completion.FinishReason,
			full.TokenIDs[:end])
	}
	if completion.StopTokenID == nil || *completion.StopTokenID != stop || completion.StopString != "" {
		t.Errorf("StopTokenID %v, StopString %q; want token %d, no string", completion.StopTokenID, completion.StopString, stop)
	}

	chunks, tokens := collect(t, client.Stream(testContext(t), prompt, opts...))
	last := chunks[len(chunks)-1]
	if !slices.Equal(tokens, full.TokenIDs[:end]) || last.FinishReason != cbserve.FinishStop || last.StopTokenID == nil || *last.StopTokenID != stop {
		t.Errorf("Stream: %v, last chunk finish %q, stop token %v; want %v, stop, token %d", tokens, last.FinishReason, last.StopTokenID,
			full.TokenIDs[:end], stop)
	}
	for _, chunk := range chunks[:len(chunks)-1] {
		if chunk.StopTokenID != nil || chunk.StopString != "" {
			t.Errorf("a chunk before the last has a stop reason: %+v", chunk)
		}
	}

	// Without a stop, no stop reason.
	if full.StopTokenID != nil || full.StopString != "" {
		t.Errorf("a request that ran to its length has StopTokenID %v, StopString %q", full.StopTokenID, full.StopString)
	}
}

// TestStopStringReason: a piece of the greedy text, given as a stop string, ends the request with
// FinishStop and StopString, the text cut before it.
func TestStopStringReason(t *testing.T) {
	client := newClient(t)
	prompt := cbserve.Text("Hello, cbserve")
	full := greedy(t, client, prompt, 24)
	// A character of the greedy text past its first (the byte-level tokenizer decodes bytes of
	// no valid UTF-8 character as U+FFFD, which is left out).
	stop := ""
	for i, r := range full.Text {
		if i > 0 && r != utf8.RuneError {
			stop = string(r)
			break
		}
	}
	if stop == "" {
		t.Fatalf("the greedy text %q has no character to stop on", full.Text)
	}
	completion, err := client.Generate(testContext(t), prompt, cbserve.WithMaxNewTokens(24), cbserve.WithTemperature(0), cbserve.WithStop(stop))
	if err != nil {
		t.Fatalf("Generate(WithStop): %v", err)
	}
	want := full.Text[:strings.Index(full.Text, stop)]
	if completion.FinishReason != cbserve.FinishStop || completion.Text != want || completion.StopString != stop || completion.StopTokenID != nil {
		t.Errorf("WithStop(%q): text %q, finish %q, StopString %q, StopTokenID %v; want %q, stop, %q, none",
			stop, completion.Text, completion.FinishReason, completion.StopString, completion.StopTokenID, want, stop)
	}
	if !slices.Equal(completion.TokenIDs, full.TokenIDs[:len(completion.TokenIDs)]) {
		t.Errorf("WithStop: tokens %v are not a prefix of the greedy %v", completion.TokenIDs, full.TokenIDs)
	}
}

// TestPriorityAndSkipSpecialTokens: both are accepted and (with the default FCFS scheduler and a
// tokenizer without special tokens) change nothing; a priority outside an int32 is refused
// client-side. The order priorities give is tested with the server's own tests.
func TestPriorityAndSkipSpecialTokens(t *testing.T) {
	client := newClient(t)
	prompt := cbserve.Text("priority")
	want := greedy(t, client, prompt, 8)
	for _, opt := range []cbserve.GenerateOption{cbserve.WithPriority(-3), cbserve.WithPriority(cbserve.MaxPriority),
		cbserve.WithSkipSpecialTokens(false), cbserve.WithSkipSpecialTokens(true)} {
		got, err := client.Generate(testContext(t), prompt, cbserve.WithMaxNewTokens(8), cbserve.WithTemperature(0), opt)
		if err != nil {
			t.Fatalf("Generate: %v", err)
		}
		if !slices.Equal(got.TokenIDs, want.TokenIDs) || got.Text != want.Text || got.FinishReason != cbserve.FinishLength {
			t.Errorf("got %v %q, finish %q; want %v %q, length", got.TokenIDs, got.Text, got.FinishReason, want.TokenIDs, want.Text)
		}
	}
	if _, err := client.Submit(testContext(t), prompt, cbserve.WithMaxNewTokens(2), cbserve.WithPriority(cbserve.MinPriority)); err != nil {
		t.Errorf("Submit(WithPriority(MinPriority)): %v", err)
	}
	for _, p := range []int{cbserve.MaxPriority + 1, cbserve.MinPriority - 1} {
		_, err := client.Generate(testContext(t), prompt, cbserve.WithPriority(p))
		var e *cbserve.Error
		if !errors.Is(err, cbserve.ErrInvalidArgument) || !errors.As(err, &e) || !strings.HasPrefix(e.Message, "priority must be an int in [") {
			t.Errorf("WithPriority(%d): %v; want ErrInvalidArgument from the client naming priority", p, err)
		}
	}
}

// TestPromptLogprobs: one entry per prompt token after the first, each its token's logprob with
// the 2 most likely alternatives, on the chunk of the first generated token.
func TestPromptLogprobs(t *testing.T) {
	client := newClient(t)
	prompt := byteTokens("Hello, cbserve")
	completion, err := client.Generate(testContext(t), cbserve.Tokens(prompt...), cbserve.WithMaxNewTokens(4), cbserve.WithPromptLogprobs(2))
	if err != nil {
		t.Fatalf("Generate(WithPromptLogprobs(2)): %v", err)
	}
	if completion.FinishReason != cbserve.FinishLength {
		t.Fatalf("finish %q (%s); want length", completion.FinishReason, completion.Error)
	}
	if len(completion.PromptLogprobs) != len(prompt)-1 {
		t.Fatalf("%d prompt logprobs for %d prompt tokens; want %d", len(completion.PromptLogprobs), len(prompt), len(prompt)-1)
	}
	for i, lp := range completion.PromptLogprobs {
		if lp.TokenID != prompt[i+1] || lp.Logprob > 0 || len(lp.Top) != 2 {
			t.Errorf("prompt logprob %d = %+v; want token %d, logprob <= 0, 2 alternatives", i, lp, prompt[i+1])
			continue
		}
		// The alternatives are the most likely tokens, best first: none below the next, and the
		// best at least as likely as the prompt's token.
		if lp.Top[0].Logprob < lp.Top[1].Logprob || lp.Top[0].Logprob < lp.Logprob || lp.Top[0].TokenID == lp.Top[1].TokenID {
			t.Errorf("prompt logprob %d = %+v; want 2 distinct alternatives, best first, the best at least the token's", i, lp)
		}
		for _, top := range lp.Top {
			if top.TokenID == lp.TokenID && top.Logprob != lp.Logprob {
				t.Errorf("prompt logprob %d = %+v: its token among the alternatives with another logprob", i, lp)
			}
		}
	}

	// In a stream they come once, on the chunk of the first generated token; with 0 alternatives
	// the entries have none.
	chunks, _ := collect(t, client.Stream(testContext(t), cbserve.Tokens(prompt...), cbserve.WithMaxNewTokens(4), cbserve.WithPromptLogprobs(0)))
	seen := 0
	for _, chunk := range chunks {
		if len(chunk.PromptLogprobs) == 0 {
			continue
		}
		seen++
		if chunk.TokenIndex != 0 || len(chunk.TokenIDs) == 0 || len(chunk.PromptLogprobs) != len(prompt)-1 {
			t.Errorf("prompt logprobs on a chunk at token index %d with %d tokens, %d entries; want index 0, the first token, %d entries",
				chunk.TokenIndex, len(chunk.TokenIDs), len(chunk.PromptLogprobs), len(prompt)-1)
		}
		for i, lp := range chunk.PromptLogprobs {
			want := completion.PromptLogprobs[i]
			if lp.TokenID != want.TokenID || len(lp.Top) != 0 || !closeTo(lp.Logprob, want.Logprob) {
				t.Errorf("WithPromptLogprobs(0): entry %d = %+v; want token %d, logprob %g, no alternatives", i, lp, want.TokenID, want.Logprob)
			}
		}
	}
	if seen != 1 {
		t.Errorf("%d chunks carry prompt logprobs; want 1", seen)
	}
}

func closeTo(a, b float32) bool { return a-b < 1e-3 && b-a < 1e-3 }

// TestJSONSchemaOutput: the output of a request constrained to a JSON schema (given as a Go
// value, marshalled by the SDK) unmarshals into a value of that schema.
func TestJSONSchemaOutput(t *testing.T) {
	client := newClient(t)
	schema := map[string]any{
		"type": "object",
		"properties": map[string]any{
			"answer": map[string]any{"type": "boolean"},
			"color":  map[string]any{"enum": []string{"red", "green", "blue"}},
		},
		"required":             []string{"answer", "color"},
		"additionalProperties": false,
	}
	completion, err := client.Generate(testContext(t), cbserve.Text("Answer in JSON: "), cbserve.WithMaxNewTokens(64),
		cbserve.WithTemperature(0), cbserve.WithJSONSchema(schema))
	if err != nil {
		t.Fatalf("Generate(WithJSONSchema): %v", err)
	}
	if completion.FinishReason == cbserve.FinishError {
		t.Fatalf("the request failed: %s", completion.Error)
	}
	var value struct {
		Answer *bool   `json:"answer"`
		Color  *string `json:"color"`
	}
	decoder := json.NewDecoder(strings.NewReader(completion.Text))
	decoder.DisallowUnknownFields()
	if err := decoder.Decode(&value); err != nil {
		t.Fatalf("the output %q (finish %q) does not unmarshal: %v", completion.Text, completion.FinishReason, err)
	}
	if value.Answer == nil || value.Color == nil || !slices.Contains([]string{"red", "green", "blue"}, *value.Color) {
		t.Errorf("the output %q is not an instance of the schema", completion.Text)
	}
	if err := json.Unmarshal([]byte(completion.Text), new(any)); err != nil {
		t.Errorf("the output %q (finish %q) is not one JSON value: %v", completion.Text, completion.FinishReason, err)
	}
}
