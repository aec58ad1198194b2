package cbserve

import (
	"time"

	"google.golang.org/grpc/codes"
)

// RequestStatus is the lifecycle state of a request, as its chunks report it.
type RequestStatus string

// A request moves Queued -> Prefilling -> Decoding and ends in exactly one of Finished,
// Cancelled or Failed.
const (
	RequestStatusUnspecified RequestStatus = "unspecified"
	RequestQueued            RequestStatus = "queued"
	RequestPrefilling        RequestStatus = "prefilling"
	RequestDecoding          RequestStatus = "decoding"
	RequestFinished          RequestStatus = "finished"
	RequestCancelled         RequestStatus = "cancelled"
	RequestFailed            RequestStatus = "failed"
)

// Terminal reports whether s ends its request (finished, cancelled or failed).
func (s RequestStatus) Terminal() bool {
	return s == RequestFinished || s == RequestCancelled || s == RequestFailed
}

// FinishReason says why a request ended; empty while it has not.
type FinishReason string

// The reasons a request ends.
const (
	// FinishEOS: an end-of-sequence token was generated (it is part of the output).
	FinishEOS FinishReason = "eos"
	// FinishStop: a token of WithStopTokenIDs was generated (it is the last of the output;
	// StopTokenID says which), or the output text contained a string of WithStop (the text ends
	// before it; StopString says which).
	FinishStop FinishReason = "stop"
	// FinishLength: max_new_tokens were generated, or the model's context is full.
	FinishLength FinishReason = "length"
	// FinishCancelled: the request was cancelled.
	FinishCancelled FinishReason = "cancelled"
	// FinishError: the request failed while running (Completion.Error says why).
	FinishError FinishReason = "error"
)

// TopLogprob is one of the most likely alternatives at a generation step.
type TopLogprob struct {
	TokenID uint32
	Logprob float32
}

// TokenLogprob is the log-probability of one generated token (of the distribution
// WithLogprobsMode names: by default log_softmax of the raw logits), with the most likely
// alternatives when WithLogprobs(n) asked for n > 0.
type TokenLogprob struct {
	TokenID uint32
	Logprob float32
	Top     []TopLogprob
	// LogKeptMass, with WithReturnKeptMass: the natural log of the probability mass top-k, top-p
	// and min-p kept of the distribution they truncated (after logit bias, penalties and
	// temperature); 0 when they removed nothing. A LogprobsProcessed Logprob plus it is the
	// token's log-probability before truncation. Nil when not asked for.
	LogKeptMass *float32
}

// PromptLogprob is the log-probability of one prompt token given the tokens before it, with the
// most likely tokens at its position when WithPromptLogprobs(n) asked for n > 0.
type PromptLogprob struct {
	TokenID uint32
	Logprob float32
	Top     []TopLogprob
}

// Usage holds the token counts of one request.
type Usage struct {
	// PromptTokens is the number of prompt tokens (after tokenization / chat templating).
	PromptTokens int
	// GeneratedTokens is the number of tokens generated so far (all of them at the end); with
	// WithN(n > 1), by the chunk's or completion's own sequence.
	GeneratedTokens int
	// CachedTokens is the number of prompt tokens served from the prefix cache.
	CachedTokens int
}

// Timings says when a request went through its stages (server wall clock). Instants not
// reached yet are the zero time; durations not known yet are 0.
type Timings struct {
	QueuedAt         time.Time
	ScheduledAt      time.Time
	FirstTokenAt     time.Time
	FinishedAt       time.Time
	QueueTime        time.Duration // ScheduledAt - QueuedAt
	TimeToFirstToken time.Duration // FirstTokenAt - QueuedAt
}

// Chunk is a piece of one request's output: a delta. A request's chunks, in order, form its
// whole output: their TokenIDs concatenate (TokenIndex is the index of TokenIDs[0] among the
// request's generated tokens) and so do their Texts. A chunk may carry no token (a status
// change, the final usage). With WithN(n > 1) the request has n sequences, whose chunks come
// interleaved: Index says whose, and everything else in the chunk (tokens, text, status, finish
// reason, Usage.GeneratedTokens) is that sequence's, so the above holds per Index. Each sequence
// ends with its own terminal chunk; the request is over once all n have.
type Chunk struct {
	// RequestID is the id of the request this chunk belongs to.
	RequestID string
	// Index is the sequence this chunk belongs to, 0 to n - 1 with WithN(n); always 0 otherwise.
	Index int
	// TokenIndex is the index, among the request's generated tokens, of TokenIDs[0].
	TokenIndex int
	// TokenIDs are the newly generated token ids.
	TokenIDs []uint32
	// Text is the newly decoded text; it never splits a UTF-8 character, nor releases text that
	// may begin a WithStop string, so it may lag TokenIDs. Always empty when the server has no
	// tokenizer (ModelInfo.HasTokenizer).
	Text string
	// Status is the request's status after this chunk.
	Status RequestStatus
	// FinishReason is set on the chunk that ends the request.
	FinishReason FinishReason
	// Error describes the failure of a request whose Status is RequestFailed.
	Error string
	// ErrorCode is the status code that best describes that failure (codes.OK otherwise).
	ErrorCode codes.Code
	// Logprobs has one entry per token of TokenIDs when logprobs were requested.
	Logprobs []TokenLogprob
	// Usage holds the token counts so far; always set on the final chunk.
	Usage *Usage
	// Timings are the request's timings so far; always set on the final chunk.
	Timings *Timings
	// WeightVersion is the version of the weights that produced this chunk's tokens.
	WeightVersion uint64
	// TokenTimestamps has, with WithRecordTimestamps, the time each token was generated at.
	TokenTimestamps []time.Time
	// StopTokenID is, on the chunk that ends a request with FinishStop because it generated a
	// token of WithStopTokenIDs, that token; nil otherwise.
	StopTokenID *uint32
	// StopString is, on the chunk that ends a request with FinishStop because its text
	// contained a string of WithStop, that string; empty otherwise.
	StopString string
	// PromptLogprobs has, with WithPromptLogprobs, one entry per prompt token after the first
	// (the first has nothing before it), on the chunk that carries the first generated token
	// (TokenIndex 0) only.
	PromptLogprobs []PromptLogprob
}

// Finished reports whether this chunk ends its request (finished, cancelled or failed); with
// WithN(n > 1), its sequence (Index): the request ends once every sequence's chunks have.
func (c *Chunk) Finished() bool { return c.Status.Terminal() }

// Completion is the whole output of one request, or with WithN(n > 1) of one of its sequences
// (GenerateN returns one per sequence).
type Completion struct {
	// RequestID is the request's id.
	RequestID string
	// Index is the sequence this completion is, 0 to n - 1 (GenerateN); 0 for Generate.
	Index int
	// TokenIDs are the generated token ids.
	TokenIDs []uint32
	// Text is the decoded output, cut before a matched WithStop string (empty when the server
	// has no tokenizer).
	Text string
	// FinishReason says why the request ended: FinishEOS, FinishStop (then StopTokenID or
	// StopString says which stop), FinishLength, FinishCancelled or FinishError (then Error says
	// why).
	FinishReason FinishReason
	// StopTokenID is the WithStopTokenIDs token that ended the request (the last of TokenIDs),
	// nil when none did.
	StopTokenID *uint32
	// StopString is the WithStop string the text matched, empty when none did.
	StopString string
	// Error describes a failure while the request ran (FinishReason == FinishError).
	Error string
	// Usage holds the request's token counts.
	Usage *Usage
	// Timings are the request's timings.
	Timings *Timings
	// Logprobs has one entry per generated token when logprobs were requested.
	Logprobs []TokenLogprob
	// PromptLogprobs has, with WithPromptLogprobs, one entry per prompt token after the first.
	PromptLogprobs []PromptLogprob
	// WeightVersion is the version of the weights that produced the last token.
	WeightVersion uint64
	// WeightVersions lists every weight version seen, in order (more than one when the weights
	// were updated while the request ran).
	WeightVersions []uint64
	// TokenTimestamps has, with WithRecordTimestamps, the time each token was generated at.
	TokenTimestamps []time.Time
}

// ModelInfo describes the served model.
type ModelInfo struct {
	ModelName        string
	VocabSize        int
	MaxContextLength int
	// EOSTokenIDs are the model's own end-of-sequence ids (used when a request sets none).
	EOSTokenIDs     []uint32
	HasChatTemplate bool
	HasTokenizer    bool
	WeightVersion   uint64
}

// Status is the engine's state and counters (Admin.Status).
type Status struct {
	Running            bool
	Paused             bool
	PauseHolders       int
	QueuedRequests     int
	ActiveRequests     int
	KVBlocksUsed       int
	KVBlocksTotal      int
	PrefixCacheHitRate float64
	WeightVersion      uint64
	Preemptions        uint64
	Offloads           uint64
	Restores           uint64
	RecomputedTokens   uint64
	PrefixCacheQueries uint64
	PrefixCacheHits    uint64
	FinishedRequests   uint64
	PromptTokens       uint64
	GeneratedTokens    uint64
	// Counters holds further server-defined counters, by name.
	Counters map[string]float64
	// PrefixCachingEnabled says whether prefix caching is on (off for models with
	// sliding-window layers, whatever the configuration).
	PrefixCachingEnabled bool
}

// StopResult is what Admin.Stop did.
type StopResult struct {
	// DrainedRequests finished normally while draining.
	DrainedRequests int
	// FailedRequests were failed or cancelled by the stop.
	FailedRequests int
	// AlreadyStopped is true when the engine was already stopped (nothing was done).
	AlreadyStopped bool
}

// WeightsUpdate is what Admin.UpdateWeights (or UpdateWeightsFromPath) did.
type WeightsUpdate struct {
	// WeightVersion is the version of the weights now served: the previous version + 1.
	WeightVersion uint64
	// TensorsUpdated is the number of tensors replaced.
	TensorsUpdated int
	// VersionLabel is the label given with WithVersionLabel, if any.
	VersionLabel string
}
