package cbserve_test

import (
	"errors"
	"math"
	"slices"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	cbserve "github.com/cbserve/cbserve/sdk/go"
	pb "github.com/cbserve/cbserve/sdk/go/gen/cbserve/v1"
)

// TestClientRefusesValuesOutsideTheServersBounds: each value is refused before any call, with the
// server's message (the wire field, the bound, the value); the bound itself is accepted and sent.
func TestClientRefusesValuesOutsideTheServersBounds(t *testing.T) {
	fake, client := dialRecordingFake(t)
	stopStrings := func(n, chars int) []string {
		stop := make([]string, n)
		for i := range stop {
			stop[i] = strings.Repeat("é", chars) // characters, not bytes, as the server counts
		}
		return stop
	}
	ids := func(n int) []uint32 {
		out := make([]uint32, n)
		for i := range out {
			out[i] = uint32(i)
		}
		return out
	}
	quoted := func(chars int) string { return `"` + strings.Repeat("x", chars-2) + `"` } // a JSON value of that many characters
	bias := func(entries int, value float64) map[uint32]float64 {
		m := map[uint32]float64{}
		for id := range entries {
			m[uint32(id)] = value
		}
		return m
	}
	for _, tc := range []struct {
		name    string
		refused cbserve.GenerateOption
		message string // the server's, for the same value
		bound   cbserve.GenerateOption
	}{
		{"max new tokens", cbserve.WithMaxNewTokens(cbserve.MinMaxNewTokens - 1), "sampling.max_new_tokens must be an int >= 1, got 0",
			cbserve.WithMaxNewTokens(cbserve.MinMaxNewTokens)},
		{"max new tokens past the wire's uint32", cbserve.WithMaxNewTokens(math.MaxUint32 + 1),
			"sampling.max_new_tokens must be at most 4294967295 (the wire's uint32), got 4294967296", cbserve.WithMaxNewTokens(math.MaxUint32)},
		{"top k", cbserve.WithTopK(-1), "sampling.top_k must be an int >= 0 (0 disables it), got -1", cbserve.WithTopK(0)},
		{"top logprobs", cbserve.WithLogprobs(cbserve.MaxTopLogprobs + 1), "sampling.top_logprobs must be an int in [0, 20], got 21",
			cbserve.WithLogprobs(cbserve.MaxTopLogprobs)},
		{"min new tokens", cbserve.WithMinNewTokens(-1), "sampling.min_new_tokens must be an int >= 0, got -1", cbserve.WithMinNewTokens(0)},
		{"presence penalty", cbserve.WithPresencePenalty(-2.5), "sampling.presence_penalty must be a finite number in [-2, 2], got -2.5",
			cbserve.WithPresencePenalty(-cbserve.MaxAbsPresenceFrequencyPenalty)},
		{"frequency penalty", cbserve.WithFrequencyPenalty(2.5), "sampling.frequency_penalty must be a finite number in [-2, 2], got 2.5",
			cbserve.WithFrequencyPenalty(cbserve.MaxAbsPresenceFrequencyPenalty)},
		{"repetition penalty", cbserve.WithRepetitionPenalty(0), "sampling.repetition_penalty must be a finite number > 0 (1 disables it), got 0.0",
			cbserve.WithRepetitionPenalty(1)},
		{"logit bias value", cbserve.WithLogitBias(map[uint32]float64{7: 100.5}),
			"sampling.logit_bias[7] must be a finite number in [-100, 100], got 100.5",
			cbserve.WithLogitBias(map[uint32]float64{7: -cbserve.MaxAbsLogitBias})},
		{"logit bias entries", cbserve.WithLogitBias(bias(cbserve.MaxLogitBiasEntries+1, 1)), "sampling.logit_bias: at most 300 entries, got 301",
			cbserve.WithLogitBias(bias(cbserve.MaxLogitBiasEntries, 1))},
		{"stop strings", cbserve.WithStop(stopStrings(cbserve.MaxStopStrings+1, 1)...), "sampling.stop: at most 16 strings, got 17",
			cbserve.WithStop(stopStrings(cbserve.MaxStopStrings, 1)...)},
		{"stop string length", cbserve.WithStop("x", stopStrings(1, cbserve.MaxStopStringChars+1)[0]),
			"sampling.stop[1] must be 1 to 256 characters, got 257", cbserve.WithStop(stopStrings(1, cbserve.MaxStopStringChars)...)},
		{"empty stop string", cbserve.WithStop(""), "sampling.stop[0] must be 1 to 256 characters, got 0", cbserve.WithStop("x")},
		{"request id length", cbserve.WithRequestID(strings.Repeat("r", cbserve.MaxRequestIDBytes+1)),
			`request_id must be at most 128 bytes of printable ASCII, got "` + strings.Repeat("r", cbserve.MaxRequestIDBytes+1) + `"`,
			cbserve.WithRequestID(strings.Repeat("r", cbserve.MaxRequestIDBytes))},
		{"request id characters", cbserve.WithRequestID("has space"), `request_id must be at most 128 bytes of printable ASCII, got "has space"`,
			cbserve.WithRequestID("no-space")},
		{"temperature", cbserve.WithTemperature(-1), "sampling.temperature must be a finite number >= 0, got -1.0", cbserve.WithTemperature(0)},
		{"temperature infinite", cbserve.WithTemperature(math.Inf(1)), "sampling.temperature must be a finite number >= 0, got inf",
			cbserve.WithTemperature(2)},
		{"top p", cbserve.WithTopP(0), "sampling.top_p must be a finite number in (0, 1], got 0.0", cbserve.WithTopP(1)},
		{"min p above", cbserve.WithMinP(1.5), "sampling.min_p must be a finite number in [0, 1] (0 disables it), got 1.5",
			cbserve.WithMinP(cbserve.MaxMinP)},
		{"min p below", cbserve.WithMinP(-0.25), "sampling.min_p must be a finite number in [0, 1] (0 disables it), got -0.25", cbserve.WithMinP(0)},
		{"min p NaN", cbserve.WithMinP(math.NaN()), "sampling.min_p must be a finite number in [0, 1] (0 disables it), got nan", cbserve.WithMinP(0.5)},
		{"stop token ids", cbserve.WithStopTokenIDs(ids(cbserve.MaxStopTokenIds + 1)...), "sampling.stop_token_ids: at most 64 token ids, got 65",
			cbserve.WithStopTokenIDs(ids(cbserve.MaxStopTokenIds)...)},
		{"prompt logprobs above", cbserve.WithPromptLogprobs(cbserve.MaxPromptLogprobs + 1),
			"sampling.prompt_logprobs must be an int in [0, 20] (0: the prompt token's only), got 21", cbserve.WithPromptLogprobs(cbserve.MaxPromptLogprobs)},
		{"prompt logprobs below", cbserve.WithPromptLogprobs(-1),
			"sampling.prompt_logprobs must be an int in [0, 20] (0: the prompt token's only), got -1", cbserve.WithPromptLogprobs(0)},
		{"priority above", cbserve.WithPriority(cbserve.MaxPriority + 1),
			"priority must be an int in [-2147483648, 2147483647], got 2147483648", cbserve.WithPriority(cbserve.MaxPriority)},
		{"priority below", cbserve.WithPriority(cbserve.MinPriority - 1),
			"priority must be an int in [-2147483648, 2147483647], got -2147483649", cbserve.WithPriority(cbserve.MinPriority)},
		{"regex length", cbserve.WithRegex(strings.Repeat("é", cbserve.MaxStructuredOutputChars+1)),
			"sampling.structured_output.regex must be at most 65536 characters, got 65537",
			cbserve.WithRegex(strings.Repeat("é", cbserve.MaxStructuredOutputChars))},
		{"empty regex", cbserve.WithRegex(""), "sampling.structured_output.regex must not be empty", cbserve.WithRegex("[a-z]+")},
		{"grammar length", cbserve.WithGrammar(strings.Repeat("g", cbserve.MaxStructuredOutputChars+1)),
			"sampling.structured_output.grammar must be at most 65536 characters, got 65537",
			cbserve.WithGrammar(strings.Repeat("g", cbserve.MaxStructuredOutputChars))},
		{"empty grammar", cbserve.WithGrammar(""), "sampling.structured_output.grammar must not be empty", cbserve.WithGrammar(`root ::= "yes" | "no"`)},
		{"json schema length", cbserve.WithJSONSchema(quoted(cbserve.MaxStructuredOutputChars + 1)),
			"sampling.structured_output.json_schema must be at most 65536 characters, got 65537",
			cbserve.WithJSONSchema(quoted(cbserve.MaxStructuredOutputChars))},
		{"empty json schema", cbserve.WithJSONSchema([]byte{}), "sampling.structured_output.json_schema must not be empty",
			cbserve.WithJSONSchema([]byte(`{"type": "object"}`))},
		{"json schema not JSON", cbserve.WithJSONSchema("{type: object}"), "sampling.structured_output.json_schema is not valid JSON",
			cbserve.WithJSONSchema(`{"type": "object"}`)},
		{"json schema that does not marshal", cbserve.WithJSONSchema(map[string]any{"type": func() {}}),
			"sampling.structured_output.json_schema: WithJSONSchema's schema does not marshal to JSON: json: unsupported type: func()",
			cbserve.WithJSONSchema(map[string]any{"type": "object"})},
		{"n above", cbserve.WithN(cbserve.MaxN + 1), "sampling.n must be an int in [1, 128], got 129", cbserve.WithN(cbserve.MaxN)},
		{"n below", cbserve.WithN(0), "sampling.n must be an int in [1, 128], got 0", cbserve.WithN(1)},
		{"n negative", cbserve.WithN(-1), "sampling.n must be an int in [1, 128], got -1", cbserve.WithN(2)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			calls := fake.callCount()
			_, err := client.Generate(testContext(t), cbserve.Text("hi"), tc.refused)
			var e *cbserve.Error
			if !errors.Is(err, cbserve.ErrInvalidArgument) || !errors.As(err, &e) || e.Message != tc.message {
				t.Errorf("error %v;\nwant ErrInvalidArgument: %s", err, tc.message)
			}
			if _, err := client.Submit(testContext(t), cbserve.Text("hi"), tc.refused); !errors.Is(err, cbserve.ErrInvalidArgument) {
				t.Errorf("Submit: error %v; want ErrInvalidArgument", err)
			}
			if made := fake.callCount() - calls; made != 0 {
				t.Errorf("a refused value made %d calls; want none", made)
			}
			// The bound goes through Stream, which takes every option Generate does and also WithN(n > 1)
			// (Generate, which returns one completion, refuses that).
			for _, err := range client.Stream(testContext(t), cbserve.Text("hi"), tc.bound) {
				if err != nil {
					t.Errorf("the bound itself: %v; want it sent", err)
				}
			}
		})
	}

	_, err := client.Generate(testContext(t), cbserve.Text("hi"), cbserve.WithMaxNewTokens(4), cbserve.WithMinNewTokens(5))
	if want := "sampling.min_new_tokens (5) must not exceed max_new_tokens (4)"; !errors.Is(err, cbserve.ErrInvalidArgument) ||
		!strings.HasSuffix(err.Error(), ": "+want) {
		t.Errorf("min new tokens above max new tokens: %v; want ErrInvalidArgument: %s", err, want)
	}

	// At most one structured-output option, even of one kind.
	calls := fake.callCount()
	for _, pair := range [][2]cbserve.GenerateOption{
		{cbserve.WithJSONObject(), cbserve.WithRegex("[a-z]+")},
		{cbserve.WithRegex("a"), cbserve.WithRegex("b")},
		{cbserve.WithJSONSchema(`{"type": "object"}`), cbserve.WithGrammar(`root ::= "x"`)},
	} {
		_, err := client.Generate(testContext(t), cbserve.Text("hi"), pair[0], pair[1])
		if !errors.Is(err, cbserve.ErrInvalidArgument) || !containsAll(err.Error(), "at most one structured-output option", "sampling.structured_output") {
			t.Errorf("two structured-output options: %v; want ErrInvalidArgument", err)
		}
	}
	_, err = client.Generate(testContext(t), cbserve.Text("hi"), cbserve.WithJSONObject(), cbserve.WithRegex("[a-z]+"))
	if err == nil || !strings.Contains(err.Error(), "WithJSONObject and WithRegex") {
		t.Errorf("WithJSONObject and WithRegex: %v; want an error naming both", err)
	}
	if made := fake.callCount() - calls; made != 0 {
		t.Errorf("two structured-output options made %d calls; want none", made)
	}
}

// TestClientRefusalsReadAsTheServers: for each bound the wire can carry past, the message the
// client refuses a value with is the live server's own for the same value, sent raw.
func TestClientRefusalsReadAsTheServers(t *testing.T) {
	client := newClient(t)
	raw := pb.NewGenerationServiceClient(client.Conn())
	u32 := func(v uint32) *uint32 { return &v }
	f32 := func(v float32) *float32 { return &v }
	for _, tc := range []struct {
		name   string
		option cbserve.GenerateOption
		wire   func(*pb.GenerationRequest)
	}{
		{"max new tokens", cbserve.WithMaxNewTokens(0), func(r *pb.GenerationRequest) { r.Sampling.MaxNewTokens = u32(0) }},
		{"top logprobs", cbserve.WithLogprobs(21), func(r *pb.GenerationRequest) {
			r.Sampling.Logprobs, r.Sampling.TopLogprobs = true, u32(21)
		}},
		{"temperature", cbserve.WithTemperature(-1), func(r *pb.GenerationRequest) { r.Sampling.Temperature = f32(-1) }},
		{"top p", cbserve.WithTopP(0), func(r *pb.GenerationRequest) { r.Sampling.TopP = f32(0) }},
		{"min p", cbserve.WithMinP(1.5), func(r *pb.GenerationRequest) { r.Sampling.MinP = f32(1.5) }},
		{"repetition penalty", cbserve.WithRepetitionPenalty(0), func(r *pb.GenerationRequest) { r.Sampling.RepetitionPenalty = f32(0) }},
		{"presence penalty", cbserve.WithPresencePenalty(-2.5), func(r *pb.GenerationRequest) { r.Sampling.PresencePenalty = f32(-2.5) }},
		{"frequency penalty", cbserve.WithFrequencyPenalty(2.5), func(r *pb.GenerationRequest) { r.Sampling.FrequencyPenalty = f32(2.5) }},
		{"min new tokens above max", cbserve.WithMinNewTokens(5), func(r *pb.GenerationRequest) {
			r.Sampling.MinNewTokens = u32(5)
		}},
		{"logit bias value", cbserve.WithLogitBias(map[uint32]float64{7: 100.5}), func(r *pb.GenerationRequest) {
			r.Sampling.LogitBias = map[uint32]float32{7: 100.5}
		}},
		{"logit bias entries", cbserve.WithLogitBias(manyBiases(cbserve.MaxLogitBiasEntries + 1)), func(r *pb.GenerationRequest) {
			r.Sampling.LogitBias = map[uint32]float32{}
			for id := range manyBiases(cbserve.MaxLogitBiasEntries + 1) {
				r.Sampling.LogitBias[id] = 1
			}
		}},
		{"stop strings", cbserve.WithStop(slices.Repeat([]string{"x"}, cbserve.MaxStopStrings+1)...), func(r *pb.GenerationRequest) {
			r.Sampling.Stop = slices.Repeat([]string{"x"}, cbserve.MaxStopStrings+1)
		}},
		{"stop string length", cbserve.WithStop("x", strings.Repeat("é", cbserve.MaxStopStringChars+1)), func(r *pb.GenerationRequest) {
			r.Sampling.Stop = []string{"x", strings.Repeat("é", cbserve.MaxStopStringChars+1)}
		}},
		{"stop token ids", cbserve.WithStopTokenIDs(make([]uint32, cbserve.MaxStopTokenIds+1)...), func(r *pb.GenerationRequest) {
			r.Sampling.StopTokenIds = make([]uint32, cbserve.MaxStopTokenIds+1)
		}},
		{"prompt logprobs", cbserve.WithPromptLogprobs(21), func(r *pb.GenerationRequest) { r.Sampling.PromptLogprobs = u32(21) }},
		{"n above", cbserve.WithN(cbserve.MaxN + 1), func(r *pb.GenerationRequest) { r.Sampling.N = u32(cbserve.MaxN + 1) }},
		{"n zero", cbserve.WithN(0), func(r *pb.GenerationRequest) { r.Sampling.N = u32(0) }},
		{"request id", cbserve.WithRequestID("has space"), func(r *pb.GenerationRequest) { r.RequestId = "has space" }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			request := &pb.GenerationRequest{Prompt: &pb.GenerationRequest_Text{Text: "hi"},
				Sampling: &pb.SamplingParams{MaxNewTokens: u32(4)}}
			options := []cbserve.GenerateOption{cbserve.WithMaxNewTokens(4), tc.option}
			tc.wire(request)
			_, err := raw.AddRequest(testContext(t), &pb.AddRequestRequest{Request: request})
			server := status.Convert(err)
			if server.Code() != codes.InvalidArgument {
				t.Fatalf("the server took the value: %v", err)
			}
			_, err = client.Submit(testContext(t), cbserve.Text("hi"), options...)
			var e *cbserve.Error
			if !errors.As(err, &e) || e.Code != codes.InvalidArgument {
				t.Fatalf("the client: %v; want ErrInvalidArgument", err)
			}
			// The server's request_id message leaves out the value; the client adds it.
			if e.Message != server.Message() && !(tc.name == "request id" && strings.HasPrefix(e.Message, server.Message()+", got ")) {
				t.Errorf("the client refuses with\n\t%s\nthe server with\n\t%s", e.Message, server.Message())
			}
		})
	}
}

func manyBiases(n int) map[uint32]float64 {
	biases := make(map[uint32]float64, n)
	for id := range n {
		biases[uint32(id)] = 1
	}
	return biases
}
