package cbserve_test

import (
	"errors"
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
			if _, err := client.Generate(testContext(t), cbserve.Text("hi"), tc.bound); err != nil {
				t.Errorf("the bound itself: %v; want it sent", err)
			}
		})
	}

	_, err := client.Generate(testContext(t), cbserve.Text("hi"), cbserve.WithMaxNewTokens(4), cbserve.WithMinNewTokens(5))
	if !errors.Is(err, cbserve.ErrInvalidArgument) || !strings.Contains(err.Error(), "WithMinNewTokens(5): must not exceed WithMaxNewTokens(4)") {
		t.Errorf("min new tokens above max new tokens: %v; want ErrInvalidArgument naming both", err)
	}
}
