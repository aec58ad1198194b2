package cbserve

import (
	"context"
	"errors"
	"io"
	"iter"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/cbserve/cbserve/sdk/go/gen/cbserve/v1"
)

// Submit's retries, and the backoff between any call's tries: the first delay, doubled each time
// up to the last (+-50% jitter).
const (
	retryAttempts  = 3
	retryBaseDelay = 100 * time.Millisecond
	retryMaxDelay  = time.Second
)

// Client is a connection to a cbserve server's GenerationService. It is safe for concurrent
// use; make one per server and share it.
type Client struct {
	conn          *grpc.ClientConn
	gen           pb.GenerationServiceClient
	anyReplica    *anyReplicaConn
	timeout       clientTimeout // of unary calls
	streamTimeout clientTimeout // of Generate, Stream and Results
	retryAttempts int           // tries of a Generate call (see generate)
}

// anyReplicaConn is a connection like the client's but without health checking, made on first
// use. A call that finds no replica serving is sent on it, so that a replica answers it: with its
// own reason (the model is still loading, the server is asleep, ...), or by serving it, having
// turned SERVING before the client's health watch said so.
type anyReplicaConn struct {
	target string
	opts   []Option
	mu     sync.Mutex
	conn   *grpc.ClientConn // nil until first used
	closed bool
}

// stub returns the generation stub of the connection, made now if it is not yet; nil once the
// client is closed or if it cannot be made.
func (a *anyReplicaConn) stub() pb.GenerationServiceClient {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closed {
		return nil
	}
	if a.conn == nil {
		conn, _, err := newConn(a.target, false, a.opts)
		if err != nil {
			return nil
		}
		a.conn = conn
	}
	return pb.NewGenerationServiceClient(a.conn)
}

func (a *anyReplicaConn) close() {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.closed = true
	if a.conn != nil {
		_ = a.conn.Close()
	}
}

// noReplicaServing reports whether a call failed because every replica's health says
// NOT_SERVING (grpc-go's pick failure), rather than on a replica.
func noReplicaServing(err error) bool {
	s, ok := status.FromError(err)
	return ok && s.Code() == codes.Unavailable && strings.Contains(s.Message(), notServingPick)
}

// fallback is the client's rule for a call that found no replica serving: a call made on gen
// that failed with err is made again on the returned stub, of the connection to any replica
// (anyReplicaConn); nil when it is not made again (it failed otherwise, it was already made on
// any replica, or the client is closed).
func (c *Client) fallback(gen pb.GenerationServiceClient, err error) pb.GenerationServiceClient {
	if gen != c.gen || !noReplicaServing(err) {
		return nil
	}
	return c.anyReplica.stub()
}

// unary makes a unary call, or opens a stream, on the client's connection, and again on one to
// any replica when no replica serves (see fallback).
func unary[T any](c *Client, call func(pb.GenerationServiceClient) (T, error)) (T, error) {
	response, err := call(c.gen)
	if gen := c.fallback(c.gen, err); gen != nil {
		return call(gen)
	}
	return response, err
}

// NewClient returns a client of the cbserve server at target: one address ("127.0.0.1:50051"),
// several replicas ("10.0.0.1:50051,10.0.0.2:50051"), or any gRPC target
// ("dns:///cbserve-headless.ns.svc.cluster.local:50051"). Calls are spread over every address the
// target lists or resolves to with gRPC's round_robin load balancing: one connection per address,
// each call on the next ready one. A replica is ready while it is reachable and its
// grpc.health.v1 status is SERVING, so one that is unreachable, still loading, draining or asleep
// is skipped until it serves again; when none serves, a call is sent to one anyway, which answers
// with its reason (the model is still loading, ...). Like grpc.NewClient, it does not wait for a
// connection: it starts connecting in the background, and calls wait for one (or fail with
// ErrUnavailable). Close the client when done with it.
func NewClient(target string, opts ...Option) (*Client, error) {
	conn, cfg, err := newConn(target, true, opts)
	if err != nil {
		return nil, err
	}
	return &Client{conn: conn, gen: pb.NewGenerationServiceClient(conn), timeout: cfg.unaryDeadline(),
		streamTimeout: cfg.streamDeadline(), retryAttempts: cfg.retryAttempts,
		anyReplica: &anyReplicaConn{target: target, opts: slices.Clone(opts)}}, nil
}

// Dial is NewClient, but first fails with ErrCanceled or ErrDeadlineExceeded if ctx is already
// done; it does not wait for a connection either.
//
// Deprecated: use NewClient (Dial's name suggested a wait it never did, as grpc.Dial's did).
func Dial(ctx context.Context, target string, opts ...Option) (*Client, error) {
	if err := ctx.Err(); err != nil {
		return nil, convertError(ctx, err)
	}
	return NewClient(target, opts...)
}

// Close closes the connection; calls in flight fail with ErrCanceled, and their Generate and
// Stream requests are cancelled on the server.
func (c *Client) Close() error {
	c.anyReplica.close()
	return c.conn.Close()
}

// Conn returns the underlying connection, e.g. for the raw stubs of
// github.com/cbserve/cbserve/sdk/go/gen/cbserve/v1.
func (c *Client) Conn() *grpc.ClientConn { return c.conn }

// Generate generates a completion for prompt and returns it whole, on the bidirectional
// Generate RPC. A request the server refuses returns an *Error (ErrInvalidArgument for an empty
// prompt or an out-of-vocabulary token, ErrAlreadyExists, ErrResourceExhausted,
// ErrUnavailable once every try has failed: see Stream for the retries); a request that fails while it runs returns a Completion with FinishReason
// FinishError and Error set. Cancelling ctx cancels the request on the server and returns
// ErrCanceled (which also matches context.Canceled); past ctx's deadline, or the client's
// stream timeout when ctx has none (WithStreamTimeout), it returns ErrDeadlineExceeded.
//
// Generate returns one completion, so WithN(n) with n > 1 fails with ErrInvalidArgument before
// anything is sent: call GenerateN for the n completions of one prompt.
func (c *Client) Generate(ctx context.Context, prompt Prompt, opts ...GenerateOption) (*Completion, error) {
	if err := refuseManySequences(opts); err != nil {
		return nil, err
	}
	return collectCompletion(func(restart func(), yield func(*Chunk, error) bool) {
		c.generate(ctx, prompt, opts, restart, yield)
	})
}

// collectCompletion assembles the one completion of a request whose chunks send yields, as generate
// does; send calls restart when it starts the request again, to forget what was collected.
func collectCompletion(send func(restart func(), yield func(*Chunk, error) bool)) (*Completion, error) {
	var b completionBuilder
	var failure error
	send(func() { b = completionBuilder{} }, func(chunk *Chunk, err error) bool {
		if err != nil {
			failure = err
			return false
		}
		if b.c.RequestID == "" {
			b.c.RequestID = chunk.RequestID
		}
		if chunk.RequestID != b.c.RequestID || b.done {
			return true
		}
		failure = b.add(chunk)
		return failure == nil
	})
	if failure != nil {
		return nil, failure
	}
	if !b.done { // the request's stream reports one that ends early; this is a safety net.
		return nil, newError(codes.Internal, "the stream of request %s ended before the request finished", b.c.RequestID)
	}
	return b.build(), nil
}

// GenerateN samples n completions from prompt (WithN(n): the prompt is computed once, then each
// sequence samples on its own) and returns them whole, ordered by sequence: completions[i].Index
// is i. With WithSeed(s), completions[i] is what Generate gives with WithSeed(s + i). n is in
// [1, MaxN]; a WithN among opts must agree with it. Each sequence ends on its own: one that fails
// while the request runs is a Completion with FinishReason FinishError and Error set, one
// cancelled with CancelSequence has FinishCancelled, and the others are unaffected. Errors are
// Generate's: a refused request, a cancelled ctx (which cancels every sequence on the server),
// a deadline.
func (c *Client) GenerateN(ctx context.Context, prompt Prompt, n int, opts ...GenerateOption) ([]*Completion, error) {
	if err := checkInt("sampling.n", n, 1, MaxN, "", math.MaxUint32, "uint32"); err != nil {
		return nil, err
	}
	if cfg := applyGenerateOptions(opts); cfg.n != nil && *cfg.n != n {
		return nil, newError(codes.InvalidArgument, "GenerateN(n = %d) with WithN(%d): give n once", n, *cfg.n)
	}
	var builders []completionBuilder
	requestID := ""
	restart := func() {
		builders, requestID = make([]completionBuilder, n), ""
		for i := range builders {
			builders[i].c.Index, builders[i].sequence = i, n > 1
		}
	}
	restart()
	var failure error
	c.generate(ctx, prompt, append(slices.Clip(opts), WithN(n)), restart, func(chunk *Chunk, err error) bool {
		if err != nil {
			failure = err
			return false
		}
		if requestID == "" {
			requestID = chunk.RequestID
		}
		if chunk.RequestID != requestID {
			return true
		}
		b := &builders[chunk.Index] // generate yields no chunk of its request outside [0, n)
		if b.done {
			return true
		}
		b.c.RequestID = requestID
		failure = b.add(chunk)
		return failure == nil
	})
	if failure != nil {
		return nil, failure
	}
	completions := make([]*Completion, n)
	for i := range builders {
		if !builders[i].done { // generate reports a stream that ends early; this is a safety net.
			return nil, newError(codes.Internal, "the stream of request %s ended before its sequence %d finished", requestID, i)
		}
		completions[i] = builders[i].build()
	}
	return completions, nil
}

// Stream generates from prompt and yields the output chunks as they come, on the bidirectional
// Generate RPC: first a chunk with status RequestQueued, then the token deltas, the last with a
// terminal status and a FinishReason. An error ends the sequence (it is yielded with a nil
// chunk): a refused request yields its *Error, as Generate returns it. With WithN(n > 1), each
// of the n sequences has such chunks, marked with its Chunk.Index and interleaved as they come;
// the range ends once every sequence has yielded its terminal chunk.
//
// The sequence is single-use: its first range sends the request (with a fresh random id unless
// WithRequestID), and a second range yields ErrFailedPrecondition without sending anything; call
// Stream again for another request. Breaking out of the loop, cancelling ctx, or reaching its
// deadline (or the client's stream timeout, WithStreamTimeout) cancels the call, and the server
// then cancels the request and frees its KV cache.
//
// A call that fails with ErrUnavailable before its first chunk (the replica refused the request
// as still loading, draining or asleep, or its connection broke) is made again, after a backoff,
// on the next ready replica, up to WithRetryAttempts tries within the deadline: nothing was
// yielded, and nothing runs on the replica that failed. Generate and GenerateN, which yield
// nothing until the request has ended, also make the call again when the connection breaks
// later (a replica killed mid-request), unless WithRequestID chose the id.
func (c *Client) Stream(ctx context.Context, prompt Prompt, opts ...GenerateOption) iter.Seq2[*Chunk, error] {
	return singleUse(func(yield func(*Chunk, error) bool) { c.generate(ctx, prompt, opts, nil, yield) })
}

// singleUse is a Stream sequence that sends its request in its first range only: a second range
// yields ErrFailedPrecondition without sending anything.
func singleUse(send iter.Seq2[*Chunk, error]) iter.Seq2[*Chunk, error] {
	var ranged atomic.Bool
	return func(yield func(*Chunk, error) bool) {
		if ranged.Swap(true) {
			yield(nil, newError(codes.FailedPrecondition,
				"this Stream sequence was already ranged over, and a range sends its request: call Stream again for another request"))
			return
		}
		send(yield)
	}
}

// refuseManySequences fails a call that returns one completion when opts ask for n > 1 (WithN).
func refuseManySequences(opts []GenerateOption) error {
	cfg := applyGenerateOptions(opts)
	if cfg.n == nil || *cfg.n <= 1 {
		return nil
	}
	if err := cfg.check(); err != nil { // a bad n says what is wrong with it first
		return err
	}
	return newError(codes.InvalidArgument,
		"WithN(%d): Generate returns one completion; call GenerateN for n > 1 (or Stream, whose chunks carry their sequence's Index)", *cfg.n)
}

// generate sends a request on a Generate call and yields its chunks, as Stream does. A call that
// fails with ErrUnavailable before it yields anything (a replica still loading, draining or asleep
// refused the request, or its connection broke) is made again, on the next ready replica, up to
// the client's retry attempts within the call's deadline: nothing ran that the caller saw, and the
// server cancels the request of a Generate call that ends. With restart non-nil, so is a call
// whose connection breaks after chunks were yielded, when the client chose the request's id:
// restart tells the caller to forget what it got (Generate collects a completion the caller has
// not seen), and the next call uses a fresh id, so a replica that still holds the old request
// cannot refuse it as a duplicate. A call that found no replica serving goes to any replica
// (fallback) before the tries count.
func (c *Client) generate(ctx context.Context, prompt Prompt, opts []GenerateOption, restart func(), yield func(*Chunk, error) bool) {
	request, err := buildRequest(prompt, opts)
	if err != nil {
		yield(nil, err)
		return
	}
	chosenID := request.RequestId == ""
	if chosenID {
		request.RequestId = newRequestID()
	}
	callCtx, cancel, deadline := c.streamTimeout.start(ctx)
	defer cancel()
	gen := c.gen
	for attempt := 1; ; attempt++ {
		yielded, stopped, err := c.generateOnce(callCtx, gen, request, yield)
		if err == nil || stopped {
			return
		}
		if fallback := c.fallback(gen, err); fallback != nil {
			gen = fallback // a replica says why it does not serve, or serves: not a try of its own
			attempt--
			continue
		}
		err = deadline.error(err)
		retry := status.Code(err) == codes.Unavailable && (!yielded || (restart != nil && chosenID)) &&
			attempt < c.retryAttempts && sleepBackoff(callCtx, attempt)
		if !retry {
			yield(nil, err)
			return
		}
		if yielded {
			restart()
			request.RequestId = newRequestID()
		}
	}
}

// generateOnce makes one Generate call for request and yields its chunks: whether it yielded any,
// whether the caller stopped the range, and the error that ended the call (not yielded).
func (c *Client) generateOnce(ctx context.Context, gen pb.GenerationServiceClient, request *pb.GenerationRequest,
	yield func(*Chunk, error) bool) (yielded, stopped bool, err error) {
	stream, err := gen.Generate(ctx)
	if err != nil {
		return false, false, err
	}
	// On io.EOF the call has already ended: Recv returns its status.
	add := &pb.GenerateRequest{Action: &pb.GenerateRequest_Add{Add: request}}
	if err := stream.Send(add); err != nil && !errors.Is(err, io.EOF) {
		return false, false, err
	}
	// Half-close: the server ends the call with OK once the request has ended.
	_ = stream.CloseSend()
	// The request has ended once each of its n sequences has sent its terminal chunk.
	n := int(max(1, request.GetSampling().GetN()))
	ended := make([]bool, n)
	running := n
	for {
		message, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			if running > 0 {
				return yielded, false, newError(codes.Internal, "the Generate stream ended before request %s finished (%d of its %d sequences had not)",
					request.RequestId, running, n)
			}
			return yielded, false, nil
		}
		if err != nil {
			return yielded, false, err
		}
		chunk := chunkFromProto(message.GetChunk())
		if err := rejection(chunk); err != nil {
			return yielded, false, err
		}
		if chunk.RequestID == request.RequestId {
			if chunk.Index >= n { // never from a conforming server
				return yielded, false, newError(codes.Internal, "request %s has %d sequences; got a chunk of sequence %d",
					request.RequestId, n, chunk.Index)
			}
			if ended[chunk.Index] {
				continue // never from a conforming server: nothing follows a sequence's terminal chunk
			}
			if chunk.Finished() {
				ended[chunk.Index] = true
				running--
			}
		}
		yielded = true
		if !yield(chunk, nil) {
			return true, true, nil
		}
	}
}

// sleepBackoff waits before retry number attempt (1, 2, ...): 100 ms doubled each time up to 1 s,
// +-50% jitter, as gRPC's retry policy in serviceConfig. It returns false, without waiting, when
// ctx would end first.
func sleepBackoff(ctx context.Context, attempt int) bool {
	delay := min(retryBaseDelay<<(attempt-1), retryMaxDelay)
	delay = time.Duration(float64(delay) * (0.5 + rand.Float64()))
	if deadline, ok := ctx.Deadline(); ok && time.Until(deadline) <= delay {
		return false
	}
	timer := time.NewTimer(delay)
	defer timer.Stop()
	select {
	case <-timer.C:
		return true
	case <-ctx.Done():
		return false
	}
}

// Submit queues a request (AddRequest) and returns its id without waiting for any output; read
// the outputs with Results. The request runs whether or not anyone reads it; stop it with
// Cancel. Submit retries (3 tries, exponential backoff from 100 ms) when the server answers
// ErrUnavailable or ErrResourceExhausted, which mean nothing was queued; the id is chosen
// client-side (unless WithRequestID), so a retry never queues a request twice. These retries are
// Submit's own rather than gRPC's retry policy: a try whose answer was lost after the request
// was queued makes the next try fail with ErrAlreadyExists, which Submit reports as success.
func (c *Client) Submit(ctx context.Context, prompt Prompt, opts ...GenerateOption) (string, error) {
	request, err := buildRequest(prompt, opts)
	if err != nil {
		return "", err
	}
	if request.RequestId == "" {
		request.RequestId = newRequestID()
	}
	callCtx, cancel, deadline := c.timeout.start(ctx)
	defer cancel()
	message := &pb.AddRequestRequest{Request: request}
	for attempt := 0; ; attempt++ {
		response, err := unary(c, func(gen pb.GenerationServiceClient) (*pb.AddRequestResponse, error) {
			return gen.AddRequest(callCtx, message)
		})
		if err == nil {
			return response.GetRequestId(), nil
		}
		var e *Error
		errors.As(deadline.error(err), &e)
		if attempt > 0 && e.Code == codes.AlreadyExists {
			return request.RequestId, nil // the previous attempt queued it; its answer was lost
		}
		if (e.Code != codes.Unavailable && e.Code != codes.ResourceExhausted) || attempt == retryAttempts-1 {
			return "", e
		}
		if !sleepBackoff(callCtx, attempt+1) {
			return "", e
		}
	}
}

// Results streams the outputs of a request (StreamResults) from token index fromIndex on: pass
// 0 for everything, or the number of tokens already received to resume after a broken
// connection. The first chunk's TokenIndex is fromIndex. The sequence ends after the chunk with
// the terminal status; an unknown or expired id yields ErrNotFound. For a request of
// WithN(n > 1), it yields every sequence's chunks, interleaved (Chunk.Index says whose), each
// from its own token fromIndex on, and ends once every sequence has sent its terminal chunk.
// Breaking out of the loop stops reading but does not cancel the request (use Cancel). The call
// ends at ctx's deadline, or after the client's stream timeout when ctx has none
// (WithStreamTimeout). Each range reads the outputs again from fromIndex (reading changes
// nothing on the server).
func (c *Client) Results(ctx context.Context, requestID string, fromIndex int) iter.Seq2[*Chunk, error] {
	return func(yield func(*Chunk, error) bool) {
		from, err := nonNegativeUint32("fromIndex", fromIndex)
		if err != nil {
			yield(nil, err)
			return
		}
		callCtx, cancel, deadline := c.streamTimeout.start(ctx)
		defer cancel()
		message := &pb.StreamResultsRequest{RequestId: requestID, FromTokenIndex: from}
		stream, err := unary(c, func(gen pb.GenerationServiceClient) (grpc.ServerStreamingClient[pb.StreamResultsResponse], error) {
			return gen.StreamResults(callCtx, message)
		})
		if err != nil {
			yield(nil, deadline.error(err))
			return
		}
		for {
			message, err := stream.Recv()
			if errors.Is(err, io.EOF) {
				return
			}
			if err != nil {
				yield(nil, deadline.error(err))
				return
			}
			if !yield(chunkFromProto(message.GetChunk()), nil) {
				return
			}
		}
	}
}

// Cancel cancels a request (all its sequences, with WithN(n > 1); CancelSequence cancels one):
// it stops at the next engine step and frees its KV cache. It
// returns true if the request was live, false if it had already ended or is unknown (Cancel is
// idempotent, so it is retried on ErrUnavailable: see WithRetryAttempts; a retry after a lost
// answer returns false for the request it cancelled).
func (c *Client) Cancel(ctx context.Context, requestID string) (bool, error) {
	callCtx, cancel, deadline := c.timeout.start(ctx)
	defer cancel()
	response, err := unary(c, func(gen pb.GenerationServiceClient) (*pb.CancelResponse, error) {
		return gen.Cancel(callCtx, &pb.CancelRequest{RequestId: requestID})
	})
	if err != nil {
		return false, deadline.error(err)
	}
	return response.GetCancelled(), nil
}

// CancelSequence cancels one sequence of a request of WithN(n > 1), index 0 to n - 1: that
// sequence ends with RequestCancelled (FinishCancelled) at the next engine step, and the others
// run on; the request ends once they have. Cancel cancels every sequence. It returns true if the
// sequence was live, false if it had already ended or the request or the index is unknown (it is
// retried on ErrUnavailable, as Cancel is).
func (c *Client) CancelSequence(ctx context.Context, requestID string, index int) (bool, error) {
	i, err := nonNegativeUint32("CancelSequence: index", index)
	if err != nil {
		return false, err
	}
	callCtx, cancel, deadline := c.timeout.start(ctx)
	defer cancel()
	response, err := unary(c, func(gen pb.GenerationServiceClient) (*pb.CancelResponse, error) {
		return gen.Cancel(callCtx, &pb.CancelRequest{RequestId: requestID, Index: &i})
	})
	if err != nil {
		return false, deadline.error(err)
	}
	return response.GetCancelled(), nil
}

// ModelInfo describes the served model (retried on ErrUnavailable: see WithRetryAttempts).
func (c *Client) ModelInfo(ctx context.Context) (*ModelInfo, error) {
	callCtx, cancel, deadline := c.timeout.start(ctx)
	defer cancel()
	response, err := unary(c, func(gen pb.GenerationServiceClient) (*pb.GetModelInfoResponse, error) {
		return gen.GetModelInfo(callCtx, &pb.GetModelInfoRequest{})
	})
	if err != nil {
		return nil, deadline.error(err)
	}
	return modelInfoFromProto(response), nil
}
