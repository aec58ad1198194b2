package cbserve_test

import (
	"errors"
	"math"
	"strings"
	"testing"

	cbserve "github.com/cbserve/cbserve/sdk/go"
)

// TestClientRefusesValuesOutsideTheServersBounds: each value is refused before any call, with an
// error naming the option and the bound; the bound itself is accepted and sent.
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
		name     string
		refused  cbserve.GenerateOption
		mentions []string
		bound    cbserve.GenerateOption
	}{
		{"max new tokens", cbserve.WithMaxNewTokens(cbserve.MinMaxNewTokens - 1), []string{"WithMaxNewTokens(0)", "[1, 4294967295]"},
			cbserve.WithMaxNewTokens(cbserve.MinMaxNewTokens)},
		{"top logprobs", cbserve.WithLogprobs(cbserve.MaxTopLogprobs + 1), []string{"WithLogprobs(21)", "[0, 20]"},
			cbserve.WithLogprobs(cbserve.MaxTopLogprobs)},
		{"presence penalty", cbserve.WithPresencePenalty(-2.5), []string{"WithPresencePenalty(-2.5)", "[-2, 2]"},
			cbserve.WithPresencePenalty(-cbserve.MaxAbsPresenceFrequencyPenalty)},
		{"frequency penalty", cbserve.WithFrequencyPenalty(2.5), []string{"WithFrequencyPenalty(2.5)", "[-2, 2]"},
			cbserve.WithFrequencyPenalty(cbserve.MaxAbsPresenceFrequencyPenalty)},
		{"logit bias value", cbserve.WithLogitBias(map[uint32]float64{7: 100.5}), []string{"token 7", "100.5", "[-100, 100]"},
			cbserve.WithLogitBias(map[uint32]float64{7: -cbserve.MaxAbsLogitBias})},
		{"logit bias entries", cbserve.WithLogitBias(bias(cbserve.MaxLogitBiasEntries+1, 1)), []string{"301 entries", "at most 300"},
			cbserve.WithLogitBias(bias(cbserve.MaxLogitBiasEntries, 1))},
		{"stop strings", cbserve.WithStop(stopStrings(cbserve.MaxStopStrings+1, 1)...), []string{"17 strings", "at most 16"},
			cbserve.WithStop(stopStrings(cbserve.MaxStopStrings, 1)...)},
		{"stop string length", cbserve.WithStop(stopStrings(1, cbserve.MaxStopStringChars+1)...), []string{"257 characters", "1 to 256"},
			cbserve.WithStop(stopStrings(1, cbserve.MaxStopStringChars)...)},
		{"empty stop string", cbserve.WithStop(""), []string{"0 characters", "1 to 256"}, cbserve.WithStop("x")},
		{"request id length", cbserve.WithRequestID(strings.Repeat("r", cbserve.MaxRequestIDBytes+1)), []string{"129 bytes", "at most 128"},
			cbserve.WithRequestID(strings.Repeat("r", cbserve.MaxRequestIDBytes))},
		{"request id characters", cbserve.WithRequestID("has space"), []string{`"has space"`, "printable ASCII"},
			cbserve.WithRequestID("no-space")},
		{"temperature", cbserve.WithTemperature(-0.5), []string{"WithTemperature(-0.5)", ">= 0"}, cbserve.WithTemperature(0)},
		{"top p", cbserve.WithTopP(0), []string{"WithTopP(0)", "(0, 1]"}, cbserve.WithTopP(1)},
		{"min p above", cbserve.WithMinP(1.5), []string{"WithMinP(1.5)", "sampling.min_p", "[0, 1]"},
			cbserve.WithMinP(cbserve.MaxMinP)},
		{"min p below", cbserve.WithMinP(-0.25), []string{"WithMinP(-0.25)", "sampling.min_p", "[0, 1]"}, cbserve.WithMinP(0)},
		{"min p NaN", cbserve.WithMinP(math.NaN()), []string{"WithMinP(NaN)", "sampling.min_p"}, cbserve.WithMinP(0.5)},
		{"stop token ids", cbserve.WithStopTokenIDs(ids(cbserve.MaxStopTokenIds + 1)...),
			[]string{"WithStopTokenIDs", "65 ids", "sampling.stop_token_ids", "at most 64"},
			cbserve.WithStopTokenIDs(ids(cbserve.MaxStopTokenIds)...)},
		{"prompt logprobs above", cbserve.WithPromptLogprobs(cbserve.MaxPromptLogprobs + 1),
			[]string{"WithPromptLogprobs(21)", "[0, 20]", "sampling.prompt_logprobs"}, cbserve.WithPromptLogprobs(cbserve.MaxPromptLogprobs)},
		{"prompt logprobs below", cbserve.WithPromptLogprobs(-1), []string{"WithPromptLogprobs(-1)", "[0, 20]", "sampling.prompt_logprobs"},
			cbserve.WithPromptLogprobs(0)},
		{"priority above", cbserve.WithPriority(cbserve.MaxPriority + 1),
			[]string{"WithPriority(2147483648)", "priority", "[-2147483648, 2147483647]"}, cbserve.WithPriority(cbserve.MaxPriority)},
		{"priority below", cbserve.WithPriority(cbserve.MinPriority - 1),
			[]string{"WithPriority(-2147483649)", "priority", "[-2147483648, 2147483647]"}, cbserve.WithPriority(cbserve.MinPriority)},
		{"regex length", cbserve.WithRegex(strings.Repeat("é", cbserve.MaxStructuredOutputChars+1)),
			[]string{"WithRegex", "sampling.structured_output.regex", "65537 characters", "1 to 65536"},
			cbserve.WithRegex(strings.Repeat("é", cbserve.MaxStructuredOutputChars))},
		{"empty regex", cbserve.WithRegex(""), []string{"WithRegex", "sampling.structured_output.regex", "0 characters"},
			cbserve.WithRegex("[a-z]+")},
		{"grammar length", cbserve.WithGrammar(strings.Repeat("g", cbserve.MaxStructuredOutputChars+1)),
			[]string{"WithGrammar", "sampling.structured_output.grammar", "65537 characters", "1 to 65536"},
			cbserve.WithGrammar(strings.Repeat("g", cbserve.MaxStructuredOutputChars))},
		{"empty grammar", cbserve.WithGrammar(""), []string{"WithGrammar", "sampling.structured_output.grammar", "0 characters"},
			cbserve.WithGrammar(`root ::= "yes" | "no"`)},
		{"json schema length", cbserve.WithJSONSchema(quoted(cbserve.MaxStructuredOutputChars + 1)),
			[]string{"WithJSONSchema", "sampling.structured_output.json_schema", "65537 characters", "1 to 65536"},
			cbserve.WithJSONSchema(quoted(cbserve.MaxStructuredOutputChars))},
		{"empty json schema", cbserve.WithJSONSchema([]byte{}), []string{"WithJSONSchema", "sampling.structured_output.json_schema", "0 characters"},
			cbserve.WithJSONSchema([]byte(`{"type": "object"}`))},
		{"json schema not JSON", cbserve.WithJSONSchema("{type: object}"),
			[]string{"WithJSONSchema", "sampling.structured_output.json_schema", "not valid JSON"}, cbserve.WithJSONSchema(`{"type": "object"}`)},
		{"json schema that does not marshal", cbserve.WithJSONSchema(map[string]any{"type": func() {}}),
			[]string{"WithJSONSchema", "does not marshal"}, cbserve.WithJSONSchema(map[string]any{"type": "object"})},
		{"n above", cbserve.WithN(cbserve.MaxN + 1), []string{"WithN(129)", "sampling.n", "[1, 128]"}, cbserve.WithN(cbserve.MaxN)},
		{"n below", cbserve.WithN(0), []string{"WithN(0)", "sampling.n", "[1, 128]"}, cbserve.WithN(1)},
		{"n negative", cbserve.WithN(-1), []string{"WithN(-1)", "sampling.n", "[1, 128]"}, cbserve.WithN(2)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			calls := fake.callCount()
			_, err := client.Generate(testContext(t), cbserve.Text("hi"), tc.refused)
			var e *cbserve.Error
			if !errors.Is(err, cbserve.ErrInvalidArgument) || !errors.As(err, &e) || !containsAll(e.Message, tc.mentions...) {
				t.Errorf("error %v; want ErrInvalidArgument mentioning %q", err, tc.mentions)
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
	if !errors.Is(err, cbserve.ErrInvalidArgument) || !strings.Contains(err.Error(), "WithMinNewTokens(5): must not exceed WithMaxNewTokens(4)") {
		t.Errorf("min new tokens above max new tokens: %v; want ErrInvalidArgument naming both", err)
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
