package cbserve

import (
	"encoding/json"
	"fmt"
	"maps"
	"math"
	"slices"
	"strconv"
	"strings"
	"unicode/utf8"

	"google.golang.org/grpc/codes"
)

// check refuses a value the server would refuse whatever the model, before anything is sent, with
// ErrInvalidArgument and the server's own message: the wire field, the bound, the value given
// (sampling.max_new_tokens must be an int >= 1, got 0), so that the same mistake reads the same
// from every SDK and from the server. The bounds are the server's (bounds.go, generated from
// sdk/sampling_bounds.json); those that depend on the model (vocab size, context length) are left
// to the server.
func (c *requestConfig) check() error {
	if err := checkRequestID(c.requestID); err != nil {
		return err
	}
	counts := []struct {
		field  string
		value  *int
		lo, hi int
		note   string
	}{
		{"sampling.max_new_tokens", c.maxNewTokens, MinMaxNewTokens, -1, ""},
		{"sampling.top_k", c.topK, 0, -1, " (0 disables it)"},
		{"sampling.top_logprobs", c.logprobs, 0, MaxTopLogprobs, ""},
		{"sampling.min_new_tokens", c.minNewTokens, 0, -1, ""},
		{"sampling.prompt_logprobs", c.promptLogprobs, 0, MaxPromptLogprobs, " (0: the prompt token's only)"},
		{"sampling.n", c.n, 1, MaxN, ""},
	}
	for _, count := range counts {
		if count.value == nil {
			continue
		}
		if err := checkInt(count.field, *count.value, count.lo, count.hi, count.note, math.MaxUint32, "uint32"); err != nil {
			return err
		}
	}
	if c.minNewTokens != nil && c.maxNewTokens != nil && *c.minNewTokens > *c.maxNewTokens {
		return refuse("sampling.min_new_tokens", " (%d) must not exceed max_new_tokens (%d)", *c.minNewTokens, *c.maxNewTokens)
	}
	penalty := MaxAbsPresenceFrequencyPenalty
	numbers := []struct {
		field    string
		value    *float64
		bounds   string
		inBounds func(float64) bool
	}{
		{"sampling.temperature", c.temperature, ">= 0", func(v float64) bool { return v >= 0 }},
		{"sampling.top_p", c.topP, "in (0, 1]", func(v float64) bool { return v > 0 && v <= 1 }},
		{"sampling.min_p", c.minP, fmt.Sprintf("in [0, %g] (0 disables it)", MaxMinP), func(v float64) bool { return v >= 0 && v <= MaxMinP }},
		{"sampling.repetition_penalty", c.repetitionPenalty, "> 0 (1 disables it)", func(v float64) bool { return v > 0 }},
		{"sampling.presence_penalty", c.presencePenalty, fmt.Sprintf("in [-%g, %g]", penalty, penalty),
			func(v float64) bool { return math.Abs(v) <= penalty }},
		{"sampling.frequency_penalty", c.frequencyPenalty, fmt.Sprintf("in [-%g, %g]", penalty, penalty),
			func(v float64) bool { return math.Abs(v) <= penalty }},
	}
	for _, number := range numbers {
		if number.value != nil {
			if err := checkNumber(number.field, *number.value, number.bounds, number.inBounds); err != nil {
				return err
			}
		}
	}
	if err := checkStop(c.stop); err != nil {
		return err
	}
	if err := checkLogitBias(c.logitBias); err != nil {
		return err
	}
	if len(c.stopTokenIDs) > MaxStopTokenIds {
		return refuse("sampling.stop_token_ids", ": at most %d token ids, got %d", MaxStopTokenIds, len(c.stopTokenIDs))
	}
	if _, ok := logprobsModes[c.logprobsMode]; !ok {
		return refuse("sampling.logprobs_mode", ": unknown value %d; expected LogprobsRaw or LogprobsProcessed (or LogprobsServerDefault)",
			c.logprobsMode)
	}
	if c.priority != nil {
		if err := checkInt("priority", *c.priority, MinPriority, MaxPriority, "", math.MaxInt32, "int32"); err != nil {
			return err
		}
	}
	return checkStructuredOutput(c.structured)
}

// refuse is the server's refusal of a request field: ErrInvalidArgument, the field's wire name,
// then what is wrong with it.
func refuse(field, format string, args ...any) *Error {
	return &Error{Code: codes.InvalidArgument, Message: field + fmt.Sprintf(format, args...)}
}

// checkInt refuses an integer outside [lo, hi] (hi < 0: no upper bound) as the server words it,
// then one that does not fit the wire's field (wireMax, the width named by wire).
func checkInt(field string, v, lo, hi int, note string, wireMax uint64, wire string) error {
	if v < lo || (hi >= 0 && v > hi) {
		bounds := fmt.Sprintf(">= %d", lo)
		if hi >= 0 {
			bounds = fmt.Sprintf("in [%d, %d]", lo, hi)
		}
		return refuse(field, " must be an int %s%s, got %d", bounds, note, v)
	}
	if v > 0 && uint64(v) > wireMax {
		return refuse(field, " must be at most %d (the wire's %s), got %d", wireMax, wire, v)
	}
	return nil
}

// checkNumber refuses NaN, an infinity, or a number outside bounds, as the server words it.
func checkNumber(field string, v float64, bounds string, inBounds func(float64) bool) error {
	if math.IsNaN(v) || math.IsInf(v, 0) || !inBounds(v) {
		return refuse(field, " must be a finite number %s, got %s", bounds, pythonFloat(v))
	}
	return nil
}

// pythonFloat formats f as Python's repr does (-1.0, 0.5, 1e-05, 1e+16, nan, inf), which is how
// the server writes the value it refuses.
func pythonFloat(f float64) string {
	switch {
	case math.IsNaN(f):
		return "nan"
	case math.IsInf(f, 1):
		return "inf"
	case math.IsInf(f, -1):
		return "-inf"
	}
	scientific := strconv.FormatFloat(f, 'e', -1, 64)
	exponent, _ := strconv.Atoi(scientific[strings.IndexByte(scientific, 'e')+1:])
	if f != 0 && (exponent < -4 || exponent >= 16) {
		return scientific
	}
	fixed := strconv.FormatFloat(f, 'f', -1, 64)
	if !strings.Contains(fixed, ".") {
		fixed += ".0"
	}
	return fixed
}

// checkStructuredOutput refuses more than one structured-output option, and a spec the server
// would refuse whatever the model: empty, or over MaxStructuredOutputChars characters. A spec that
// is not UTF-8, or a JSON schema that is not JSON, is refused here too (the wire cannot carry the
// one, the grammar compiler would refuse the other); whether a spec compiles is the server's to
// say.
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
		return refuse(field, ": %s's schema does not marshal to JSON: %v", s.option, s.err)
	}
	if s.kind == structuredJSONObject {
		return nil
	}
	if !utf8.ValidString(s.spec) {
		return refuse(field, " is not valid UTF-8")
	}
	n := utf8.RuneCountInString(s.spec)
	if n == 0 {
		return refuse(field, " must not be empty")
	}
	if n > MaxStructuredOutputChars {
		return refuse(field, " must be at most %d characters, got %d", MaxStructuredOutputChars, n)
	}
	if s.kind == structuredJSONSchema && !json.Valid([]byte(s.spec)) {
		return refuse(field, " is not valid JSON")
	}
	return nil
}

func checkRequestID(id string) error {
	if id == "" {
		return nil
	}
	printable := true
	for i := range len(id) {
		printable = printable && id[i] > ' ' && id[i] <= '~'
	}
	if len(id) > MaxRequestIDBytes || !printable {
		return refuse("request_id", " must be at most %d bytes of printable ASCII, got %q", MaxRequestIDBytes, id)
	}
	return nil
}

func checkLogitBias(bias map[uint32]float64) error {
	if len(bias) > MaxLogitBiasEntries {
		return refuse("sampling.logit_bias", ": at most %d entries, got %d", MaxLogitBiasEntries, len(bias))
	}
	bound := fmt.Sprintf("in [-%g, %g]", MaxAbsLogitBias, MaxAbsLogitBias)
	for _, id := range slices.Sorted(maps.Keys(bias)) {
		field := fmt.Sprintf("sampling.logit_bias[%d]", id)
		if err := checkNumber(field, bias[id], bound, func(v float64) bool { return math.Abs(v) <= MaxAbsLogitBias }); err != nil {
			return err
		}
	}
	return nil
}

func checkStop(stop []string) error {
	if len(stop) > MaxStopStrings {
		return refuse("sampling.stop", ": at most %d strings, got %d", MaxStopStrings, len(stop))
	}
	for i, s := range stop {
		field := fmt.Sprintf("sampling.stop[%d]", i)
		if !utf8.ValidString(s) {
			return refuse(field, " is not valid UTF-8: %q", s)
		}
		if n := utf8.RuneCountInString(s); n < 1 || n > MaxStopStringChars {
			return refuse(field, " must be 1 to %d characters, got %d", MaxStopStringChars, n)
		}
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
