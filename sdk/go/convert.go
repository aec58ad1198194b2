package cbserve

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"strings"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/types/known/timestamppb"

	pb "github.com/cbserve/cbserve/sdk/go/gen/cbserve/v1"
)

var requestStatuses = map[pb.RequestStatus]RequestStatus{
	pb.RequestStatus_REQUEST_STATUS_QUEUED:     RequestQueued,
	pb.RequestStatus_REQUEST_STATUS_PREFILLING: RequestPrefilling,
	pb.RequestStatus_REQUEST_STATUS_DECODING:   RequestDecoding,
	pb.RequestStatus_REQUEST_STATUS_FINISHED:   RequestFinished,
	pb.RequestStatus_REQUEST_STATUS_CANCELLED:  RequestCancelled,
	pb.RequestStatus_REQUEST_STATUS_FAILED:     RequestFailed,
}

var finishReasons = map[pb.FinishReason]FinishReason{
	pb.FinishReason_FINISH_REASON_EOS:       FinishEOS,
	pb.FinishReason_FINISH_REASON_STOP:      FinishStop,
	pb.FinishReason_FINISH_REASON_LENGTH:    FinishLength,
	pb.FinishReason_FINISH_REASON_CANCELLED: FinishCancelled,
	pb.FinishReason_FINISH_REASON_ERROR:     FinishError,
}

// rejectionCodes are the failures of a Generate-stream add that AddRequest would have returned
// as a status: Generate and Stream return them as an *Error, as Submit would.
var rejectionCodes = map[codes.Code]bool{
	codes.InvalidArgument:   true,
	codes.AlreadyExists:     true,
	codes.ResourceExhausted: true,
	codes.Unavailable:       true,
	codes.NotFound:          true,
}

// newRequestID returns a random client-side request id (32 hex digits). Ids chosen by the
// client make retries of AddRequest idempotent.
func newRequestID() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

func timeOf(ts *timestamppb.Timestamp) time.Time {
	if ts == nil {
		return time.Time{}
	}
	return ts.AsTime()
}

func seconds(s *float64) time.Duration {
	if s == nil {
		return 0
	}
	return time.Duration(*s * float64(time.Second))
}

func chunkFromProto(c *pb.GenerationChunk) *Chunk {
	if c == nil {
		c = &pb.GenerationChunk{}
	}
	status, ok := requestStatuses[c.GetStatus()]
	if !ok {
		status = RequestStatusUnspecified
	}
	chunk := &Chunk{
		RequestID:     c.GetRequestId(),
		Index:         int(c.GetIndex()),
		TokenIndex:    int(c.GetTokenIndex()),
		TokenIDs:      c.GetTokenIds(),
		Text:          c.GetText(),
		Status:        status,
		FinishReason:  finishReasons[c.GetFinishReason()],
		Error:         c.GetError(),
		ErrorCode:     codes.Code(c.GetErrorCode()),
		WeightVersion: c.GetWeightVersion(),
	}
	for i, lp := range c.GetLogprobs() {
		entry := TokenLogprob{Logprob: lp.GetLogprob(), LogKeptMass: lp.LogKeptMass}
		if i < len(chunk.TokenIDs) {
			entry.TokenID = chunk.TokenIDs[i]
		}
		for _, t := range lp.GetTopLogprobs() {
			entry.Top = append(entry.Top, TopLogprob{TokenID: t.GetTokenId(), Logprob: t.GetLogprob()})
		}
		chunk.Logprobs = append(chunk.Logprobs, entry)
	}
	if u := c.GetUsage(); u != nil {
		chunk.Usage = &Usage{
			PromptTokens:    int(u.GetPromptTokens()),
			GeneratedTokens: int(u.GetGeneratedTokens()),
			CachedTokens:    int(u.GetCachedTokens()),
		}
	}
	if t := c.GetTimings(); t != nil {
		chunk.Timings = &Timings{
			QueuedAt:         timeOf(t.GetQueuedAt()),
			ScheduledAt:      timeOf(t.GetScheduledAt()),
			FirstTokenAt:     timeOf(t.GetFirstTokenAt()),
			FinishedAt:       timeOf(t.GetFinishedAt()),
			QueueTime:        seconds(t.QueueTimeS),
			TimeToFirstToken: seconds(t.TimeToFirstTokenS),
		}
	}
	for _, s := range c.GetTokenTimestamps() {
		chunk.TokenTimestamps = append(chunk.TokenTimestamps, unixSeconds(s))
	}
	switch reason := c.GetStopReason().(type) {
	case *pb.GenerationChunk_StopTokenId:
		id := reason.StopTokenId
		chunk.StopTokenID = &id
	case *pb.GenerationChunk_StopString:
		chunk.StopString = reason.StopString
	}
	for _, lp := range c.GetPromptLogprobs() {
		entry := PromptLogprob{TokenID: lp.GetTokenId(), Logprob: lp.GetLogprob()}
		for _, t := range lp.GetTopLogprobs() {
			entry.Top = append(entry.Top, TopLogprob{TokenID: t.GetTokenId(), Logprob: t.GetLogprob()})
		}
		chunk.PromptLogprobs = append(chunk.PromptLogprobs, entry)
	}
	return chunk
}

// rejection returns the error of a FAILED chunk that reports a request the server refused to
// queue, else nil.
func rejection(c *Chunk) error {
	if c.Status == RequestFailed && rejectionCodes[c.ErrorCode] {
		return &Error{Code: c.ErrorCode, Message: c.Error}
	}
	return nil
}

// completionBuilder assembles a request's chunks, in order, into a Completion. Tokens are
// placed by TokenIndex: a chunk overlapping tokens already received contributes only the new
// ones; a gap is an error.
type completionBuilder struct {
	c    Completion
	text strings.Builder
	done bool
	// sequence names the sequence (c.Index) in errors: set for the sequences of WithN(n > 1).
	sequence bool
}

func (b *completionBuilder) add(chunk *Chunk) error {
	have := len(b.c.TokenIDs)
	if chunk.TokenIndex > have && len(chunk.TokenIDs) > 0 {
		name := "request " + b.c.RequestID
		if b.sequence {
			name += fmt.Sprintf(", sequence %d,", b.c.Index)
		}
		return newError(codes.DataLoss, "%s: got tokens from index %d, expected %d", name, chunk.TokenIndex, have)
	}
	skip := max(0, have-chunk.TokenIndex)
	if skip < len(chunk.TokenIDs) {
		b.c.TokenIDs = append(b.c.TokenIDs, chunk.TokenIDs[skip:]...)
	}
	if skip < len(chunk.Logprobs) {
		b.c.Logprobs = append(b.c.Logprobs, chunk.Logprobs[skip:]...)
	}
	if skip < len(chunk.TokenTimestamps) {
		b.c.TokenTimestamps = append(b.c.TokenTimestamps, chunk.TokenTimestamps[skip:]...)
	}
	b.text.WriteString(chunk.Text)
	if b.c.PromptLogprobs == nil && len(chunk.PromptLogprobs) > 0 {
		b.c.PromptLogprobs = chunk.PromptLogprobs
	}
	if chunk.Usage != nil {
		b.c.Usage = chunk.Usage
	}
	if chunk.Timings != nil {
		b.c.Timings = chunk.Timings
	}
	if v := chunk.WeightVersion; len(chunk.TokenIDs) > 0 && v != 0 {
		if n := len(b.c.WeightVersions); n == 0 || b.c.WeightVersions[n-1] != v {
			b.c.WeightVersions = append(b.c.WeightVersions, v)
		}
	}
	if chunk.Finished() {
		b.done = true
		b.c.FinishReason = chunk.FinishReason
		if b.c.FinishReason == "" { // never from a conforming server
			switch chunk.Status {
			case RequestCancelled:
				b.c.FinishReason = FinishCancelled
			case RequestFailed:
				b.c.FinishReason = FinishError
			default:
				b.c.FinishReason = "unknown"
			}
		}
		b.c.Error = chunk.Error
		b.c.StopTokenID = chunk.StopTokenID
		b.c.StopString = chunk.StopString
	}
	return nil
}

func (b *completionBuilder) build() *Completion {
	c := b.c
	c.Text = b.text.String()
	if n := len(c.WeightVersions); n > 0 {
		c.WeightVersion = c.WeightVersions[n-1]
	}
	return &c
}

func modelInfoFromProto(m *pb.GetModelInfoResponse) *ModelInfo {
	return &ModelInfo{
		ModelName:        m.GetModelName(),
		VocabSize:        int(m.GetVocabSize()),
		MaxContextLength: int(m.GetMaxContextLength()),
		EOSTokenIDs:      m.GetEosTokenIds(),
		HasChatTemplate:  m.GetHasChatTemplate(),
		HasTokenizer:     m.GetHasTokenizer(),
		WeightVersion:    m.GetWeightVersion(),
	}
}

func statusFromProto(s *pb.GetStatusResponse) *Status {
	return &Status{
		Running:              s.GetRunning(),
		Paused:               s.GetPaused(),
		PauseHolders:         int(s.GetPauseHolders()),
		QueuedRequests:       int(s.GetQueuedRequests()),
		ActiveRequests:       int(s.GetActiveRequests()),
		KVBlocksUsed:         int(s.GetKvBlocksUsed()),
		KVBlocksTotal:        int(s.GetKvBlocksTotal()),
		PrefixCacheHitRate:   s.GetPrefixCacheHitRate(),
		WeightVersion:        s.GetWeightVersion(),
		Preemptions:          s.GetPreemptions(),
		Offloads:             s.GetOffloads(),
		Restores:             s.GetRestores(),
		RecomputedTokens:     s.GetRecomputedTokens(),
		PrefixCacheQueries:   s.GetPrefixCacheQueries(),
		PrefixCacheHits:      s.GetPrefixCacheHits(),
		FinishedRequests:     s.GetFinishedRequests(),
		PromptTokens:         s.GetPromptTokens(),
		GeneratedTokens:      s.GetGeneratedTokens(),
		Counters:             s.GetCounters(),
		PrefixCachingEnabled: s.GetPrefixCachingEnabled(),
	}
}
