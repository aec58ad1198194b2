package cbserve

import (
	"context"
	"errors"
	"io"
	"iter"
	"sync"

	"google.golang.org/grpc/codes"

	pb "github.com/cbserve/cbserve/sdk/go/gen/cbserve/v1"
)

// Session carries many requests on one Generate call whose chunks the server sends batched: one
// message for all the chunks of an engine step (GenerateStreamOptions.BatchChunks), where Stream
// costs a message per request and step, and a call per request. It is for a process that keeps
// many requests in flight at one server (a batch job, an RL rollout). Make one with
// Client.Session; it is safe for concurrent use.
//
// Every request of a session goes to the one replica its call reached, and none is retried: use
// Stream to spread requests over replicas. When the call fails (the server stops, the connection
// drops), every unfinished request yields the error. Close ends the call: the server cancels the
// unfinished requests and frees their KV blocks, and they yield ErrCanceled.
type Session struct {
	client *Client
	stream pb.GenerationService_GenerateClient
	cancel context.CancelFunc
	sendMu sync.Mutex // a gRPC stream takes one Send at a time

	mu     sync.Mutex
	inbox  map[string]*sessionInbox // the open requests, by id
	err    error                    // why the call ended, once it has
	closed bool
	done   chan struct{} // closed when the reader has ended
}

// sessionInbox holds the chunks of one request of a session that its reader has not taken yet:
// the session's reader never waits for a slow one.
type sessionInbox struct {
	mu     sync.Mutex
	chunks []*pb.GenerationChunk
	err    error
	ready  chan struct{} // holds a signal once chunks or err are there
}

func newSessionInbox() *sessionInbox { return &sessionInbox{ready: make(chan struct{}, 1)} }

func (b *sessionInbox) signal() {
	select {
	case b.ready <- struct{}{}:
	default:
	}
}

func (b *sessionInbox) push(chunks ...*pb.GenerationChunk) {
	b.mu.Lock()
	b.chunks = append(b.chunks, chunks...)
	b.mu.Unlock()
	b.signal()
}

func (b *sessionInbox) fail(err error) {
	b.mu.Lock()
	b.err = err
	b.mu.Unlock()
	b.signal()
}

// take waits until chunks or the session's error are there, or ctx is done, and returns what is
// there: the chunks first; the error once no chunk is left.
func (b *sessionInbox) take(ctx context.Context) ([]*pb.GenerationChunk, error) {
	for {
		b.mu.Lock()
		chunks, err := b.chunks, b.err
		b.chunks = nil
		b.mu.Unlock()
		if len(chunks) > 0 {
			return chunks, nil
		}
		if err != nil {
			return nil, err
		}
		select {
		case <-b.ready:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
}

// Session opens a Generate call for many requests whose chunks the server sends batched (see
// Session). ctx bounds the whole session; the client's stream timeout does not (each request's
// does). The call goes to a replica as Stream's does: one whose health says SERVING, else any
// replica, which says why it does not serve, or serves. Close it when done.
func (c *Client) Session(ctx context.Context) (*Session, error) {
	ctx, cancel := context.WithCancel(ctx)
	stream, err := unary(c, func(gen pb.GenerationServiceClient) (pb.GenerationService_GenerateClient, error) {
		return gen.Generate(ctx)
	})
	if err != nil {
		cancel()
		return nil, convertError(ctx, err)
	}
	options := &pb.GenerateRequest{Action: &pb.GenerateRequest_Options{
		Options: &pb.GenerateStreamOptions{BatchChunks: true},
	}}
	// On io.EOF the call has already ended: the reader gets its status.
	if err := stream.Send(options); err != nil && !errors.Is(err, io.EOF) {
		cancel()
		return nil, convertError(ctx, err)
	}
	s := &Session{client: c, stream: stream, cancel: cancel, inbox: map[string]*sessionInbox{}, done: make(chan struct{})}
	go s.read(ctx)
	return s, nil
}

func (s *Session) read(ctx context.Context) {
	defer close(s.done)
	for {
		message, err := s.stream.Recv()
		if err != nil {
			s.mu.Lock()
			switch {
			case s.closed:
				err = newError(codes.Canceled, "the session was closed")
			case errors.Is(err, io.EOF):
				err = newError(codes.Canceled, "the session's call ended")
			default:
				err = convertError(ctx, err)
			}
			s.err = err
			open := s.inbox
			s.inbox = nil
			s.mu.Unlock()
			for _, inbox := range open {
				inbox.fail(err)
			}
			return
		}
		s.mu.Lock()
		for _, chunk := range message.GetChunks() {
			if inbox := s.inbox[chunk.GetRequestId()]; inbox != nil {
				inbox.push(chunk)
			}
		}
		s.mu.Unlock()
	}
}

func (s *Session) send(message *pb.GenerateRequest) {
	s.sendMu.Lock()
	defer s.sendMu.Unlock()
	// A send fails only once the call has ended, which the reader reports to every request.
	_ = s.stream.Send(message)
}

// open registers a request's inbox; it fails once the session's call has ended, or for an id in use.
func (s *Session) open(requestID string) (*sessionInbox, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.err != nil {
		return nil, s.err
	}
	if _, used := s.inbox[requestID]; used {
		return nil, newError(codes.InvalidArgument, "request id %q is in use by a request of this session", requestID)
	}
	inbox := newSessionInbox()
	s.inbox[requestID] = inbox
	return inbox, nil
}

func (s *Session) forget(requestID string) {
	s.mu.Lock()
	delete(s.inbox, requestID)
	s.mu.Unlock()
}

// Stream sends a request on the session and yields its chunks as Client.Stream does, with the
// same options, until the request's last chunk. A refused request yields its *Error; the session
// and its other requests go on. Breaking out of the loop, cancelling ctx, or reaching its deadline
// (or the client's stream timeout, WithStreamTimeout) cancels the request on the server. Nothing is
// retried. The sequence is single-use, like Client.Stream's.
func (s *Session) Stream(ctx context.Context, prompt Prompt, opts ...GenerateOption) iter.Seq2[*Chunk, error] {
	return singleUse(func(yield func(*Chunk, error) bool) { s.generate(ctx, prompt, opts, yield) })
}

// generate sends a request on the session and yields its chunks, as Stream does.
func (s *Session) generate(ctx context.Context, prompt Prompt, opts []GenerateOption, yield func(*Chunk, error) bool) {
	request, err := buildRequest(prompt, opts)
	if err != nil {
		yield(nil, err)
		return
	}
	if request.RequestId == "" {
		request.RequestId = newRequestID()
	}
	id := request.RequestId
	inbox, err := s.open(id)
	if err != nil {
		yield(nil, err)
		return
	}
	defer s.forget(id)
	callCtx, cancel, deadline := s.client.streamTimeout.start(ctx)
	defer cancel()
	s.send(&pb.GenerateRequest{Action: &pb.GenerateRequest_Add{Add: request}})
	cancelRequest := func() {
		s.send(&pb.GenerateRequest{Action: &pb.GenerateRequest_Cancel{Cancel: &pb.GenerateCancel{RequestId: id}}})
	}
	// The request has ended once each of its n sequences has sent its terminal chunk.
	n := int(max(1, request.GetSampling().GetN()))
	ended := make([]bool, n)
	for running := n; running > 0; {
		messages, err := inbox.take(callCtx)
		if err != nil {
			if callCtx.Err() != nil {
				cancelRequest()
				err = deadline.error(convertError(callCtx, err))
			}
			yield(nil, err)
			return
		}
		for _, message := range messages {
			chunk := chunkFromProto(message)
			if err := rejection(chunk); err != nil {
				yield(nil, err)
				return
			}
			if chunk.Index < n && !ended[chunk.Index] && chunk.Finished() {
				ended[chunk.Index] = true
				running--
			}
			if !yield(chunk, nil) {
				if running > 0 {
					cancelRequest()
				}
				return
			}
		}
	}
}

// Generate generates a completion on the session and returns it whole, as Client.Generate does
// (but never retried); WithN(n > 1) is refused likewise.
func (s *Session) Generate(ctx context.Context, prompt Prompt, opts ...GenerateOption) (*Completion, error) {
	if err := refuseManySequences(opts); err != nil {
		return nil, err
	}
	return collectCompletion(func(_ func(), yield func(*Chunk, error) bool) { s.generate(ctx, prompt, opts, yield) })
}

// Close ends the session's call: the server cancels its unfinished requests, which yield
// ErrCanceled. It waits for the session's reader to stop, and always returns nil.
func (s *Session) Close() error {
	s.mu.Lock()
	s.closed = true
	s.mu.Unlock()
	s.cancel()
	<-s.done
	return nil
}
