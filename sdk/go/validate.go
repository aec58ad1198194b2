package cbserve

import (
	"encoding/json"
	"maps"
	"math"
	"slices"
	"unicode/utf8"

	"google.golang.org/grpc/codes"
)

// check refuses, with ErrInvalidArgument naming the option, the value and the bound, a value the
// server would refuse whatever the model: the bounds are the server's own (bounds.go, generated
// from sdk/sampling_bounds.json). Bounds that depend on the model (vocab size, context length)
// are left to the server.
func (c *requestConfig) check() error {
	if err := checkRequestID(c.requestID); err != nil {
		return err
	}
	if c.maxNewTokens != nil {
		if err := checkCount("WithMaxNewTokens", *c.maxNewTokens, MinMaxNewTokens, math.MaxUint32, " (MinMaxNewTokens)"); err != nil {
			return err
		}
	}
	if c.minNewTokens != nil {
		if err := checkCount("WithMinNewTokens", *c.minNewTokens, 0, math.MaxUint32, ""); err != nil {
			return err
		}
		if c.maxNewTokens != nil && *c.minNewTokens > *c.maxNewTokens {
			return newError(codes.InvalidArgument, "WithMinNewTokens(%d): must not exceed WithMaxNewTokens(%d)",
				*c.minNewTokens, *c.maxNewTokens)
		}
	}
	if c.topK != nil {
		if err := checkCount("WithTopK", *c.topK, 0, math.MaxUint32, " (0 = off)"); err != nil {
			return err
		}
	}
	if c.logprobs != nil {
		if err := checkCount("WithLogprobs", *c.logprobs, 0, MaxTopLogprobs, " (MaxTopLogprobs)"); err != nil {
			return err
		}
	}
	if c.temperature != nil && !(isFinite(*c.temperature) && *c.temperature >= 0) {
		return newError(codes.InvalidArgument, "WithTemperature(%g): must be a finite number >= 0 (0 = greedy)", *c.temperature)
	}
	if c.topP != nil && !(isFinite(*c.topP) && *c.topP > 0 && *c.topP <= 1) {
		return newError(codes.InvalidArgument, "WithTopP(%g): must be in (0, 1] (1 = off)", *c.topP)
	}
	if c.repetitionPenalty != nil && !(isFinite(*c.repetitionPenalty) && *c.repetitionPenalty > 0) {
		return newError(codes.InvalidArgument, "WithRepetitionPenalty(%g): must be a finite number > 0 (1 = off)", *c.repetitionPenalty)
	}
	for _, penalty := range []struct {
		option string
		value  *float64
	}{{"WithPresencePenalty", c.presencePenalty}, {"WithFrequencyPenalty", c.frequencyPenalty}} {
		if p := penalty.value; p != nil && !(isFinite(*p) && math.Abs(*p) <= MaxAbsPresenceFrequencyPenalty) {
			return newError(codes.InvalidArgument, "%s(%g): must be in [-%g, %g] (MaxAbsPresenceFrequencyPenalty)",
				penalty.option, *p, MaxAbsPresenceFrequencyPenalty, MaxAbsPresenceFrequencyPenalty)
		}
	}
	if err := checkLogitBias(c.logitBias); err != nil {
		return err
	}
	if err := checkStop(c.stop); err != nil {
		return err
	}
	if c.minP != nil && !(isFinite(*c.minP) && *c.minP >= 0 && *c.minP <= MaxMinP) {
		return newError(codes.InvalidArgument, "WithMinP(%g): sampling.min_p must be in [0, %g] (MaxMinP; 0 = off)", *c.minP, MaxMinP)
	}
	if len(c.stopTokenIDs) > MaxStopTokenIds {
		return newError(codes.InvalidArgument, "WithStopTokenIDs: %d ids; sampling.stop_token_ids takes at most %d (MaxStopTokenIds)",
			len(c.stopTokenIDs), MaxStopTokenIds)
	}
	if c.promptLogprobs != nil {
		if err := checkCount("WithPromptLogprobs", *c.promptLogprobs, 0, MaxPromptLogprobs,
			" (sampling.prompt_logprobs, MaxPromptLogprobs)"); err != nil {
			return err
		}
	}
	if c.n != nil {
		if err := checkCount("WithN", *c.n, 1, MaxN, " (sampling.n, MaxN)"); err != nil {
			return err
		}
	}
	if _, ok := logprobsModes[c.logprobsMode]; !ok {
		return newError(codes.InvalidArgument, "WithLogprobsMode(%d): not a LogprobsMode (LogprobsServerDefault, LogprobsRaw or LogprobsProcessed)",
			c.logprobsMode)
	}
	if p := c.priority; p != nil && (*p < MinPriority || *p > MaxPriority) {
		return newError(codes.InvalidArgument, "WithPriority(%d): priority must be in [%d, %d] (MinPriority, MaxPriority: an int32)",
			*p, MinPriority, MaxPriority)
	}
	return checkStructuredOutput(c.structured)
}

// checkStructuredOutput refuses more than one structured-output option, and a spec the server
// would refuse whatever the model: empty, over MaxStructuredOutputChars characters, not UTF-8, or
// (a JSON schema) not JSON. Whether it compiles is the server's to say.
func checkStructuredOutput(given []structuredOutput) error {
	if len(given) > 1 {
		return newError(codes.InvalidArgument, "%s and %s: at most one structured-output option per request "+
			"(sampling.structured_output holds one constraint)", given[0].option, given[1].option)
	}
	if len(given) == 0 {
		return nil
	}
	s := given[0]
	field := "sampling.structured_output." + s.field
	if s.err != nil {
		return newError(codes.InvalidArgument, "%s: the schema does not marshal to JSON: %v", s.option, s.err)
	}
	if s.kind == structuredJSONObject {
		return nil
	}
	if !utf8.ValidString(s.spec) {
		return newError(codes.InvalidArgument, "%s: %s is not valid UTF-8", s.option, field)
	}
	if n := utf8.RuneCountInString(s.spec); n < 1 || n > MaxStructuredOutputChars {
		return newError(codes.InvalidArgument, "%s: %s has %d characters; it must have 1 to %d (MaxStructuredOutputChars)",
			s.option, field, n, MaxStructuredOutputChars)
	}
	if s.kind == structuredJSONSchema && !json.Valid([]byte(s.spec)) {
		return newError(codes.InvalidArgument, "%s: %s is not valid JSON", s.option, field)
	}
	return nil
}

func checkRequestID(id string) error {
	if len(id) > MaxRequestIDBytes {
		return newError(codes.InvalidArgument, "WithRequestID: the id is %d bytes; at most %d (MaxRequestIDBytes)",
			len(id), MaxRequestIDBytes)
	}
	for i := range len(id) {
		if id[i] <= ' ' || id[i] > '~' {
			return newError(codes.InvalidArgument, "WithRequestID(%q): byte %d is not printable ASCII (spaces excluded)", id, i)
		}
	}
	return nil
}

func checkLogitBias(bias map[uint32]float64) error {
	if len(bias) > MaxLogitBiasEntries {
		return newError(codes.InvalidArgument, "WithLogitBias: %d entries; at most %d (MaxLogitBiasEntries)",
			len(bias), MaxLogitBiasEntries)
	}
	for _, id := range slices.Sorted(maps.Keys(bias)) {
		if b := bias[id]; !isFinite(b) || math.Abs(b) > MaxAbsLogitBias {
			return newError(codes.InvalidArgument, "WithLogitBias: token %d has bias %g; biases must be in [-%g, %g] (MaxAbsLogitBias)",
				id, b, MaxAbsLogitBias, MaxAbsLogitBias)
		}
	}
	return nil
}

func checkStop(stop []string) error {
	if len(stop) > MaxStopStrings {
		return newError(codes.InvalidArgument, "WithStop: %d strings; at most %d (MaxStopStrings)", len(stop), MaxStopStrings)
	}
	for i, s := range stop {
		if !utf8.ValidString(s) {
			return newError(codes.InvalidArgument, "WithStop: string %d (%q) is not valid UTF-8", i, s)
		}
		if n := utf8.RuneCountInString(s); n < 1 || n > MaxStopStringChars {
			return newError(codes.InvalidArgument, "WithStop: string %d has %d characters; each must have 1 to %d (MaxStopStringChars)",
				i, n, MaxStopStringChars)
		}
	}
	return nil
}

// checkCount refuses an integer option outside [lo, hi]; note follows the bounds.
func checkCount(option string, v, lo int, hi uint64, note string) error {
	if v < lo || uint64(v) > hi {
		return newError(codes.InvalidArgument, "%s(%d): must be in [%d, %d]%s", option, v, lo, hi, note)
	}
	return nil
}

// nonNegativeUint32 converts an int argument to the wire's uint32, refusing what does not fit.
func nonNegativeUint32(name string, v int) (uint32, error) {
	if v < 0 || uint64(v) > math.MaxUint32 {
		return 0, newError(codes.InvalidArgument, "%s must be in [0, %d], got %d", name, uint32(math.MaxUint32), v)
	}
	return uint32(v), nil
}

func isFinite(f float64) bool { return !math.IsInf(f, 0) && !math.IsNaN(f) }
