package cbserve

import (
	"context"
	"errors"
	"io"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"

	pb "github.com/cbserve/cbserve/sdk/go/gen/cbserve/v1"
)

// Admin is a connection to a cbserve server's AdminService (on its own port, e.g.
// "127.0.0.1:50052"). Every call carries the admin bearer token; a missing or wrong one fails
// with ErrUnauthenticated. It is safe for concurrent use.
type Admin struct {
	conn    *grpc.ClientConn
	admin   pb.AdminServiceClient
	timeout time.Duration
}

// DialAdmin returns a client of the admin service at target, authenticated with token (the
// server's CBSERVE_ADMIN_TOKEN or --admin-token-file). Like Dial, it does not wait for the
// connection. Close it when done.
func DialAdmin(ctx context.Context, target, token string, opts ...Option) (*Admin, error) {
	if token != "" {
		opts = append(opts[:len(opts):len(opts)], WithBearerToken(token))
	}
	conn, cfg, err := dial(ctx, target, opts)
	if err != nil {
		return nil, err
	}
	return &Admin{conn: conn, admin: pb.NewAdminServiceClient(conn), timeout: cfg.timeout}, nil
}

// Close closes the connection (a pause still held is released).
func (a *Admin) Close() error { return a.conn.Close() }

// PauseMode says how Pause pauses the engine.
type PauseMode int

const (
	// PauseKeep stops stepping at once: in-flight requests keep their KV cache and continue
	// after the release (the default).
	PauseKeep PauseMode = iota
	// PauseWait schedules no new request and waits for the in-flight ones to finish first.
	PauseWait
	// PauseAbort cancels every in-flight and queued request, then pauses.
	PauseAbort
)

// PauseOption configures Admin.Pause.
type PauseOption func(*pb.PauseRequest)

// WithPauseMode sets how the engine pauses (default PauseKeep).
func WithPauseMode(mode PauseMode) PauseOption {
	return func(r *pb.PauseRequest) {
		switch mode {
		case PauseWait:
			r.Mode = pb.PauseMode_PAUSE_MODE_WAIT
		case PauseAbort:
			r.Mode = pb.PauseMode_PAUSE_MODE_ABORT
		default:
			r.Mode = pb.PauseMode_PAUSE_MODE_KEEP
		}
	}
}

// WithLease caps how long the pause may be held: the server drops it after d even if release
// was not called (it also has its own maximum, --max-pause-lease).
func WithLease(d time.Duration) PauseOption {
	return func(r *pb.PauseRequest) {
		s := d.Seconds()
		r.LeaseS = &s
	}
}

// Pause pauses the engine and holds it paused until release is called, ctx is done, or the
// lease expires. It opens the Pause stream and returns once the server reports the engine
// paused (bounded by ctx and by the default timeout). Requests added while paused are queued
// and run after the release; pauses nest (the engine resumes when its last holder lets go).
// Always call release (it is idempotent). release returns at once: it ends the Pause call, and
// the server resumes the engine as soon as it sees the call end.
func (a *Admin) Pause(ctx context.Context, opts ...PauseOption) (release func(), err error) {
	request := &pb.PauseRequest{Mode: pb.PauseMode_PAUSE_MODE_KEEP}
	for _, opt := range opts {
		opt(request)
	}
	callCtx, cancel := context.WithCancel(ctx)
	var timer *time.Timer
	if _, ok := ctx.Deadline(); !ok && a.timeout > 0 {
		timer = time.AfterFunc(a.timeout, cancel)
	}
	fail := func(err error) (func(), error) {
		if timer != nil && !timer.Stop() && ctx.Err() == nil {
			err = newError(codes.DeadlineExceeded, "the engine did not pause within %s", a.timeout)
		}
		cancel()
		return nil, err
	}
	stream, err := a.admin.Pause(callCtx, request)
	if err != nil {
		return fail(convertError(ctx, err))
	}
	first, err := stream.Recv()
	if errors.Is(err, io.EOF) {
		return fail(newError(codes.Internal, "the Pause stream ended before the engine was paused"))
	}
	if err != nil {
		return fail(convertError(ctx, err))
	}
	if !first.GetPaused() {
		return fail(newError(codes.Internal, "the server's first Pause message says the engine is not paused"))
	}
	if timer != nil && !timer.Stop() { // the timer fired as the answer came: the call is cancelled
		cancel()
		return nil, newError(codes.DeadlineExceeded, "the engine did not pause within %s", a.timeout)
	}
	var once sync.Once
	return func() { once.Do(cancel) }, nil
}

// StopOption configures Admin.Stop.
type StopOption func(*pb.StopRequest)

// WithDrainTimeout bounds, for a graceful stop, how long in-flight requests may run before the
// rest are failed (default: the server's). The call's default deadline is extended by d.
func WithDrainTimeout(d time.Duration) StopOption {
	return func(r *pb.StopRequest) {
		s := d.Seconds()
		r.DrainTimeoutS = &s
	}
}

// Stop stops the engine: gracefully (in-flight requests finish, new ones fail with
// ErrUnavailable), or with hard = true by failing every pending request at once. It returns
// once the engine has stopped; stopping a stopped engine does nothing (AlreadyStopped).
func (a *Admin) Stop(ctx context.Context, hard bool, opts ...StopOption) (*StopResult, error) {
	request := &pb.StopRequest{Hard: hard}
	for _, opt := range opts {
		opt(request)
	}
	timeout := a.timeout
	if timeout > 0 && request.DrainTimeoutS != nil {
		timeout += time.Duration(request.GetDrainTimeoutS() * float64(time.Second))
	}
	callCtx, cancel := withTimeout(ctx, timeout)
	defer cancel()
	response, err := a.admin.Stop(callCtx, request)
	if err != nil {
		return nil, convertError(ctx, err)
	}
	return &StopResult{
		DrainedRequests: int(response.GetDrainedRequests()),
		FailedRequests:  int(response.GetFailedRequests()),
		AlreadyStopped:  response.GetAlreadyStopped(),
	}, nil
}

// Start starts the engine again after a Stop (same model and weights, empty caches). It returns
// false if the engine was already running.
func (a *Admin) Start(ctx context.Context) (started bool, err error) {
	callCtx, cancel := withTimeout(ctx, a.timeout)
	defer cancel()
	response, err := a.admin.Start(callCtx, &pb.StartRequest{})
	if err != nil {
		return false, convertError(ctx, err)
	}
	return !response.GetAlreadyRunning(), nil
}

// Status reports the engine's state and counters.
func (a *Admin) Status(ctx context.Context) (*Status, error) {
	callCtx, cancel := withTimeout(ctx, a.timeout)
	defer cancel()
	response, err := a.admin.GetStatus(callCtx, &pb.GetStatusRequest{})
	if err != nil {
		return nil, convertError(ctx, err)
	}
	return statusFromProto(response), nil
}
