package cbserve

import (
	"encoding/json"
	"maps"
	"math"
	"time"

	"google.golang.org/grpc/codes"

	pb "github.com/cbserve/cbserve/sdk/go/gen/cbserve/v1"
)

type promptKind int

const (
	promptNone promptKind = iota
	promptText
	promptTokens
	promptChat
)

// Prompt is what a request generates from: text, token ids, or a chat conversation. Build one
// with [Text], [Tokens] or [Chat]. The zero Prompt is no prompt (the server rejects it).
type Prompt struct {
	kind     promptKind
	text     string
	tokens   []uint32
	messages []Message
}

// Message is one message of a chat conversation.
type Message struct {
	// Role is the speaker's role as the model's chat template knows it: usually "system",
	// "user" or "assistant".
	Role string
	// Content is the message's text.
	Content string
}

// Text is a plain-text prompt, tokenized by the server (needs a model with a tokenizer).
func Text(s string) Prompt { return Prompt{kind: promptText, text: s} }

// Tokens is a prompt of token ids, passed to the model as they are (each must be below the
// model's vocabulary size): Tokens(1, 2, 3), or Tokens(ids...) for a slice (copied).
func Tokens(ids ...uint32) Prompt {
	return Prompt{kind: promptTokens, tokens: append([]uint32(nil), ids...)}
}

// Chat is a chat conversation, oldest message first, rendered by the server with the model's
// chat template (needs a model with one: ModelInfo.HasChatTemplate). By default the model
// answers the last message; WithAddGenerationPrompt(false) continues it instead.
func Chat(messages ...Message) Prompt {
	return Prompt{kind: promptChat, messages: append([]Message(nil), messages...)}
}

// GenerateOption sets a sampling or request parameter of Generate, Stream and Submit. Options
// not given take the server's defaults (normally the model's generation config), which differ
// from zero values: WithTemperature(0) is greedy, no WithTemperature is the model's default.
type GenerateOption struct {
	apply func(*requestConfig)
}

type requestConfig struct {
	requestID           string
	maxNewTokens        *int
	temperature         *float64
	topK                *int
	topP                *float64
	seed                *uint64
	eos                 []uint32
	ignoreEOS           bool
	stop                []string
	repetitionPenalty   *float64
	presencePenalty     *float64
	frequencyPenalty    *float64
	logitBias           map[uint32]float64
	minNewTokens        *int
	logprobs            *int
	recordTimestamps    bool
	addGenerationPrompt *bool
	minP                *float64
	stopTokenIDs        []uint32
	skipSpecialTokens   *bool
	promptLogprobs      *int
	priority            *int
	n                   *int
	logprobsMode        LogprobsMode
	returnKeptMass      bool
	// structured holds every structured-output option given, in order: check refuses more than one.
	structured []structuredOutput
}

// structuredKind is the constraint a structured-output option sets (StructuredOutput's oneof).
type structuredKind int

const (
	structuredJSONSchema structuredKind = iota
	structuredJSONObject
	structuredRegex
	structuredGrammar
)

// structuredOutput is one structured-output option as given.
type structuredOutput struct {
	option string // the option's name, for errors
	kind   structuredKind
	field  string // the wire field, for errors
	spec   string // the schema, pattern or grammar (empty for WithJSONObject)
	err    error  // WithJSONSchema's marshalling error, reported by check
}

// WithMaxNewTokens caps the number of generated tokens (EOS included); n must be at least
// MinMaxNewTokens (1), and the prompt plus n tokens must fit in the model's context.
func WithMaxNewTokens(n int) GenerateOption {
	return GenerateOption{func(c *requestConfig) { c.maxNewTokens = &n }}
}

// WithTemperature sets the softmax temperature: 0 is greedy decoding; must be >= 0.
func WithTemperature(t float64) GenerateOption {
	return GenerateOption{func(c *requestConfig) { c.temperature = &t }}
}

// WithTopK samples only among the k most likely tokens; 0 disables the filter.
func WithTopK(k int) GenerateOption {
	return GenerateOption{func(c *requestConfig) { c.topK = &k }}
}

// WithTopP sets nucleus sampling's probability mass, in (0, 1]; 1 disables the filter.
func WithTopP(p float64) GenerateOption {
	return GenerateOption{func(c *requestConfig) { c.topP = &p }}
}

// WithSeed seeds the request's own random generator: a sampled output is then reproducible,
// whatever else shares its batches.
func WithSeed(seed uint64) GenerateOption {
	return GenerateOption{func(c *requestConfig) { c.seed = &seed }}
}

// WithEOS sets the token ids that end generation (the id is emitted, then the request finishes
// with FinishEOS), replacing the model's own EOS ids for this request.
func WithEOS(ids ...uint32) GenerateOption {
	// Copied now: a caller that reuses its slice after building the option must not change it.
	ids = append([]uint32(nil), ids...)
	return GenerateOption{func(c *requestConfig) { c.eos = ids }}
}

// WithIgnoreEOS makes EOS tokens not stop generation: the request runs to its max new tokens.
func WithIgnoreEOS() GenerateOption {
	return GenerateOption{func(c *requestConfig) { c.ignoreEOS = true }}
}

// WithStop sets strings that end generation when the decoded output contains one (the request
// then finishes with FinishStop): the text ends just before the first match, while TokenIDs
// still include the token that completed it. A stream holds back text that may begin a stop
// string. At most MaxStopStrings (16) strings of 1 to MaxStopStringChars (256) characters
// each; needs a model with a tokenizer.
func WithStop(stop ...string) GenerateOption {
	stop = append([]string(nil), stop...) // copied now, as in WithEOS
	return GenerateOption{func(c *requestConfig) { c.stop = stop }}
}

// WithRepetitionPenalty divides the logits of tokens already in the prompt or the output by p
// when positive and multiplies them when negative (transformers' semantics): p > 1 discourages
// repeats. Must be finite and > 0; 1 disables it.
func WithRepetitionPenalty(p float64) GenerateOption {
	return GenerateOption{func(c *requestConfig) { c.repetitionPenalty = &p }}
}

// WithPresencePenalty lowers the logits of tokens generated at least once by p (OpenAI's
// semantics; the prompt does not count). In [-MaxAbsPresenceFrequencyPenalty,
// MaxAbsPresenceFrequencyPenalty] ([-2, 2]); 0 disables it.
func WithPresencePenalty(p float64) GenerateOption {
	return GenerateOption{func(c *requestConfig) { c.presencePenalty = &p }}
}

// WithFrequencyPenalty lowers the logit of each generated token by p times the number of times
// it was generated (OpenAI's semantics). In [-MaxAbsPresenceFrequencyPenalty,
// MaxAbsPresenceFrequencyPenalty] ([-2, 2]); 0 disables it.
func WithFrequencyPenalty(p float64) GenerateOption {
	return GenerateOption{func(c *requestConfig) { c.frequencyPenalty = &p }}
}

// WithLogitBias adds bias[id] to token id's logit at every step, before penalties and sampling
// (-100 all but bans it, 100 all but forces it). At most MaxLogitBiasEntries (300) ids, each
// below the vocab size; biases in [-MaxAbsLogitBias, MaxAbsLogitBias] ([-100, 100]).
func WithLogitBias(bias map[uint32]float64) GenerateOption {
	bias = maps.Clone(bias) // copied now, as in WithEOS
	return GenerateOption{func(c *requestConfig) { c.logitBias = bias }}
}

// WithMinNewTokens keeps EOS tokens from ending the request before it has generated n tokens
// (stop strings still can); n must be >= 0 and at most the max new tokens.
func WithMinNewTokens(n int) GenerateOption {
	return GenerateOption{func(c *requestConfig) { c.minNewTokens = &n }}
}

// WithLogprobs returns each generated token's log-probability, and the n most likely
// alternatives at each step when n > 0; n is in [0, MaxTopLogprobs] ([0, 20]).
func WithLogprobs(n int) GenerateOption {
	return GenerateOption{func(c *requestConfig) { c.logprobs = &n }}
}

// LogprobsMode says which distribution the log-probabilities of WithLogprobs are of (vLLM's
// logprobs_mode).
type LogprobsMode int

const (
	// LogprobsServerDefault leaves it to the server: its --logprobs-mode, raw unless set.
	LogprobsServerDefault LogprobsMode = iota
	// LogprobsRaw: log_softmax of the model's logits, before anything touches them
	// (vLLM's raw_logprobs).
	LogprobsRaw
	// LogprobsProcessed: of the distribution each token was drawn from (vLLM's
	// processed_logprobs): after logit bias, penalties and structured-output masks, then, when
	// the request samples (temperature > 0), temperature, top-k, top-p and min-p. What an
	// importance ratio between a trainer and this sampler needs. Tokens the filters removed are
	// left out of the alternatives.
	LogprobsProcessed
)

// WithLogprobsMode sets which distribution the log-probabilities of WithLogprobs are of
// (default LogprobsServerDefault). Prompt log-probabilities are always raw.
func WithLogprobsMode(mode LogprobsMode) GenerateOption {
	return GenerateOption{func(c *requestConfig) { c.logprobsMode = mode }}
}

// WithRequestID sets the request's id (at most MaxRequestIDBytes (128) bytes of printable ASCII
// without spaces, unique among the server's live requests). Without it, or with "", the client
// picks a random one.
func WithRequestID(id string) GenerateOption {
	return GenerateOption{func(c *requestConfig) { c.requestID = id }}
}

// WithReturnKeptMass returns, with each generated token's log-probability (it implies
// WithLogprobs), the log of the probability mass top-k, top-p and min-p kept
// (TokenLogprob.LogKeptMass). The server refuses it for a greedy request (temperature 0 or unset
// without a sampling default): its token is drawn from no distribution.
func WithReturnKeptMass() GenerateOption {
	return GenerateOption{func(c *requestConfig) { c.returnKeptMass = true }}
}

// WithRecordTimestamps returns the time each token was generated at (Chunk.TokenTimestamps,
// Completion.TokenTimestamps).
func WithRecordTimestamps() GenerateOption {
	return GenerateOption{func(c *requestConfig) { c.recordTimestamps = true }}
}

// WithAddGenerationPrompt sets, for a Chat prompt, whether the template opens the assistant's
// turn (true, the default: the model answers the last message) or not (false: the model
// continues the last, assistant, message).
func WithAddGenerationPrompt(add bool) GenerateOption {
	return GenerateOption{func(c *requestConfig) { c.addGenerationPrompt = &add }}
}

// WithMinP samples only among the tokens whose probability is at least p times the most likely
// token's (after temperature, top-k and top-p): 1 keeps only the most likely token, 0 disables
// the filter. In [0, MaxMinP] ([0, 1]).
func WithMinP(p float64) GenerateOption {
	return GenerateOption{func(c *requestConfig) { c.minP = &p }}
}

// WithStopTokenIDs sets token ids that end generation besides the EOS ids, WithIgnoreEOS or not:
// the id is emitted (it is the last of the output), then the request finishes with FinishStop
// and Chunk.StopTokenID / Completion.StopTokenID set to it. WithMinNewTokens holds them back as
// it does EOS. At most MaxStopTokenIds (64) ids, each below the vocab size.
func WithStopTokenIDs(ids ...uint32) GenerateOption {
	ids = append([]uint32(nil), ids...) // copied now, as in WithEOS
	return GenerateOption{func(c *requestConfig) { c.stopTokenIDs = ids }}
}

// WithSkipSpecialTokens sets whether the output text leaves out special tokens (BOS, EOS,
// chat-template markers): true, the server's default, leaves them out. Token ids are unaffected.
func WithSkipSpecialTokens(skip bool) GenerateOption {
	return GenerateOption{func(c *requestConfig) { c.skipSpecialTokens = &skip }}
}

// WithPromptLogprobs returns, for each prompt token after the first, its log-probability given
// the tokens before it and the n most likely tokens at its position (vLLM's prompt_logprobs), in
// the PromptLogprobs of the chunk that carries the first generated token and of the Completion;
// n is in [0, MaxPromptLogprobs] ([0, 20]). Such a request does not use the prefix cache for its
// prompt.
func WithPromptLogprobs(n int) GenerateOption {
	return GenerateOption{func(c *requestConfig) { c.promptLogprobs = &n }}
}

// WithPriority sets the request's scheduling priority under the server's "priority" scheduler
// (--scheduler-type priority): smaller values are admitted first (ties first-come), and when
// memory runs out the running request with the largest value is preempted first. Other
// schedulers ignore it. In [MinPriority, MaxPriority] (an int32); default 0.
func WithPriority(p int) GenerateOption {
	return GenerateOption{func(c *requestConfig) { c.priority = &p }}
}

// WithN samples n completions from the prompt (parallel sampling, vLLM's and OpenAI's n): the
// prompt is computed once and its KV cache shared, and each of the n sequences then samples on its
// own (penalties, stop conditions, logprobs and structured output apply per sequence). With
// WithSeed(s), sequence i samples with seed s + i (mod 2^64), so it equals a request of n = 1 with
// that seed. n is in [1, MaxN] ([1, 128]); default 1. Use it with GenerateN (which sets it), Stream
// or Submit: their chunks carry the sequence's Chunk.Index, and the request ends once every
// sequence has. Generate returns one completion, so it refuses n > 1.
func WithN(n int) GenerateOption {
	return GenerateOption{func(c *requestConfig) { c.n = &n }}
}

// WithJSONSchema constrains the output to an instance of a JSON schema: every token is sampled
// among those that keep the output a valid prefix, and the request ends once the JSON value is
// complete. schema is the schema's JSON text as a string, []byte or json.RawMessage, or any
// other value, which is marshalled with encoding/json now (a map[string]any, a struct, a schema
// type of a JSON-schema library). At most one of WithJSONSchema, WithJSONObject, WithRegex and
// WithGrammar per request; a spec of at most MaxStructuredOutputChars (65536) characters. A schema
// the server cannot compile fails the request with ErrInvalidArgument quoting the compiler.
func WithJSONSchema(schema any) GenerateOption {
	spec := structuredOutput{option: "WithJSONSchema", kind: structuredJSONSchema, field: "json_schema"}
	switch s := schema.(type) {
	case string:
		spec.spec = s
	case []byte:
		spec.spec = string(s)
	case json.RawMessage:
		spec.spec = string(s)
	default:
		data, err := json.Marshal(schema)
		spec.spec, spec.err = string(data), err
	}
	return GenerateOption{func(c *requestConfig) { c.structured = append(c.structured, spec) }}
}

// WithJSONObject constrains the output to a JSON object (any object), as WithJSONSchema does to
// a schema's instances.
func WithJSONObject() GenerateOption {
	spec := structuredOutput{option: "WithJSONObject", kind: structuredJSONObject, field: "json_object"}
	return GenerateOption{func(c *requestConfig) { c.structured = append(c.structured, spec) }}
}

// WithRegex constrains the whole output to match a regular expression, as WithJSONSchema does to
// a schema's instances.
func WithRegex(pattern string) GenerateOption {
	spec := structuredOutput{option: "WithRegex", kind: structuredRegex, field: "regex", spec: pattern}
	return GenerateOption{func(c *requestConfig) { c.structured = append(c.structured, spec) }}
}

// WithGrammar constrains the output to derive from an EBNF grammar (Lark / GBNF style, start rule
// "start" or "root"), as WithJSONSchema does to a schema's instances.
func WithGrammar(grammar string) GenerateOption {
	spec := structuredOutput{option: "WithGrammar", kind: structuredGrammar, field: "grammar", spec: grammar}
	return GenerateOption{func(c *requestConfig) { c.structured = append(c.structured, spec) }}
}

// logprobsModes maps each LogprobsMode to the wire's.
var logprobsModes = map[LogprobsMode]pb.LogprobsMode{
	LogprobsServerDefault: pb.LogprobsMode_LOGPROBS_MODE_UNSPECIFIED,
	LogprobsRaw:           pb.LogprobsMode_LOGPROBS_MODE_RAW,
	LogprobsProcessed:     pb.LogprobsMode_LOGPROBS_MODE_PROCESSED,
}

// buildRequest turns a prompt and options into a GenerationRequest, refusing values outside the
// server's bounds (bounds.go) before anything is sent. What needs the model (token ids below the
// vocab size, the prompt fitting its context) is the server's to check.

func buildRequest(prompt Prompt, opts []GenerateOption) (*pb.GenerationRequest, error) {
	cfg := applyGenerateOptions(opts)
	if err := cfg.check(); err != nil {
		return nil, err
	}
	request := &pb.GenerationRequest{RequestId: cfg.requestID, RecordTimestamps: cfg.recordTimestamps}
	if cfg.addGenerationPrompt != nil && prompt.kind != promptChat {
		return nil, newError(codes.InvalidArgument, "WithAddGenerationPrompt applies to Chat prompts only")
	}
	switch prompt.kind {
	case promptText:
		request.Prompt = &pb.GenerationRequest_Text{Text: prompt.text}
	case promptTokens:
		request.Prompt = &pb.GenerationRequest_TokenIds{TokenIds: &pb.TokenIds{Ids: prompt.tokens}}
	case promptChat:
		chat := &pb.ChatMessages{AddGenerationPrompt: cfg.addGenerationPrompt}
		for _, m := range prompt.messages {
			chat.Messages = append(chat.Messages, &pb.ChatMessage{Role: m.Role, Content: m.Content})
		}
		request.Prompt = &pb.GenerationRequest_Messages{Messages: chat}
	}
	sampling := &pb.SamplingParams{
		EosTokenIds:       cfg.eos,
		IgnoreEos:         cfg.ignoreEOS,
		Stop:              cfg.stop,
		Temperature:       wireFloat(cfg.temperature),
		TopP:              wireFloat(cfg.topP),
		Seed:              cfg.seed,
		RepetitionPenalty: wireFloat(cfg.repetitionPenalty),
		PresencePenalty:   wireFloat(cfg.presencePenalty),
		FrequencyPenalty:  wireFloat(cfg.frequencyPenalty),
		LogitBias:         wireFloats(cfg.logitBias),
	}
	sampling.MaxNewTokens = wireUint32(cfg.maxNewTokens)
	sampling.TopK = wireUint32(cfg.topK)
	sampling.MinNewTokens = wireUint32(cfg.minNewTokens)
	if cfg.logprobs != nil {
		sampling.Logprobs = true
		if *cfg.logprobs > 0 {
			sampling.TopLogprobs = wireUint32(cfg.logprobs)
		}
	}
	sampling.MinP = wireFloat(cfg.minP)
	sampling.StopTokenIds = cfg.stopTokenIDs
	sampling.SkipSpecialTokens = cfg.skipSpecialTokens
	sampling.PromptLogprobs = wireUint32(cfg.promptLogprobs)
	sampling.N = wireUint32(cfg.n)
	sampling.LogprobsMode = logprobsModes[cfg.logprobsMode]
	sampling.ReturnKeptMass = cfg.returnKeptMass
	if len(cfg.structured) == 1 {
		sampling.StructuredOutput = cfg.structured[0].proto()
	}
	request.Sampling = sampling
	if cfg.priority != nil {
		request.Priority = int32(*cfg.priority) // checked to fit
	}
	return request, nil
}

// proto returns the wire's StructuredOutput of a structured-output option.
func (s structuredOutput) proto() *pb.StructuredOutput {
	switch s.kind {
	case structuredJSONObject:
		return &pb.StructuredOutput{Constraint: &pb.StructuredOutput_JsonObject{JsonObject: true}}
	case structuredRegex:
		return &pb.StructuredOutput{Constraint: &pb.StructuredOutput_Regex{Regex: s.spec}}
	case structuredGrammar:
		return &pb.StructuredOutput{Constraint: &pb.StructuredOutput_Grammar{Grammar: s.spec}}
	default:
		return &pb.StructuredOutput{Constraint: &pb.StructuredOutput_JsonSchema{JsonSchema: s.spec}}
	}
}

// applyGenerateOptions applies opts in order (a later option wins); the zero GenerateOption does
// nothing.
func applyGenerateOptions(opts []GenerateOption) requestConfig {
	var cfg requestConfig
	for _, opt := range opts {
		if opt.apply != nil {
			opt.apply(&cfg)
		}
	}
	return cfg
}

// unixSeconds converts seconds since the Unix epoch to a time.Time.
func unixSeconds(s float64) time.Time {
	sec, frac := math.Modf(s)
	return time.Unix(int64(sec), int64(frac*1e9))
}

// wireUint32 converts an optional count option, already checked to fit, to the wire's uint32;
// unset stays unset.
func wireUint32(v *int) *uint32 {
	if v == nil {
		return nil
	}
	u := uint32(*v)
	return &u
}

// wireFloat narrows an optional float option to the wire's float32; unset stays unset.
func wireFloat(v *float64) *float32 {
	if v == nil {
		return nil
	}
	f := float32(*v)
	return &f
}

// wireFloats narrows a float map option to the wire's float32 values, in a map of its own
// (a request never shares the option's map); unset or empty is nil.
func wireFloats(m map[uint32]float64) map[uint32]float32 {
	if len(m) == 0 {
		return nil
	}
	out := make(map[uint32]float32, len(m))
	for k, v := range m {
		out[k] = float32(v)
	}
	return out
}
