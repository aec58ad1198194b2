package cbserve

import (
	"context"
	"errors"
	"io"
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
	timeout clientTimeout
	target  string
}

// NewAdmin returns a client of the admin service at target, authenticated with token (the
// server's CBSERVE_ADMIN_TOKEN or --admin-token-file). Like NewClient, it does not wait for the
// connection. Admin calls act on the one replica that serves them: give it one replica's admin
// address (a target of several would spread Pause, Stop and Status over them). Its connection
// is not health checked: admin calls reach a replica in any state. Close it when done.
func NewAdmin(target, token string, opts ...Option) (*Admin, error) {
	if token != "" {
		opts = append(opts[:len(opts):len(opts)], WithBearerToken(token))
	}
	conn, cfg, err := newConn(target, false, opts)
	if err != nil {
		return nil, err
	}
	return &Admin{conn: conn, admin: pb.NewAdminServiceClient(conn), timeout: cfg.unaryDeadline(), target: target}, nil
}

// DialAdmin is NewAdmin, but first fails with ErrCanceled or ErrDeadlineExceeded if ctx is
// already done; it does not wait for a connection either.
//
// Deprecated: use NewAdmin, as NewClient replaces Dial.
func DialAdmin(ctx context.Context, target, token string, opts ...Option) (*Admin, error) {
	if err := ctx.Err(); err != nil {
		return nil, convertError(ctx, err)
	}
	return NewAdmin(target, token, opts...)
}

// Target returns the address the admin client was dialled with (CheckWeights names replicas by
// it).
func (a *Admin) Target() string { return a.target }

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
type PauseOption struct {
	apply func(*pb.PauseRequest)
}

// WithPauseMode sets how the engine pauses (default PauseKeep).
func WithPauseMode(mode PauseMode) PauseOption {
	return PauseOption{func(r *pb.PauseRequest) {
		switch mode {
		case PauseWait:
			r.Mode = pb.PauseMode_PAUSE_MODE_WAIT
		case PauseAbort:
			r.Mode = pb.PauseMode_PAUSE_MODE_ABORT
		default:
			r.Mode = pb.PauseMode_PAUSE_MODE_KEEP
		}
	}}
}

// WithLease caps how long the pause may be held: the server drops it after d even if the lease
// was not released (it also has its own maximum, --max-pause-lease).
func WithLease(d time.Duration) PauseOption {
	return PauseOption{func(r *pb.PauseRequest) {
		s := d.Seconds()
		r.LeaseS = &s
	}}
}

// PauseLease is one hold on the engine's pause, from Admin.Pause: the engine stays paused while
// a lease is held. The hold ends when Release is called, the Pause call's context is done, the
// server's lease expires, or the connection breaks (so a crashed client cannot freeze the
// server); Held and Done tell when. Pauses nest: the engine resumes when its last holder lets go.
// The fields describe the hold when the engine paused.
type PauseLease struct {
	// Holders is the number of holds on the pause when the engine paused, this one included.
	Holders int
	// LeaseExpiresAt is when the server drops this hold unless it is released first (the zero
	// time if the server sent none): the wire's lease_expires_at, as Python's and Java's name it.
	LeaseExpiresAt time.Time
	// ExpiresAt is LeaseExpiresAt.
	//
	// Deprecated: use LeaseExpiresAt, the name every SDK gives it.
	ExpiresAt time.Time
	// WeightVersion is the version of the weights served when the engine paused.
	WeightVersion uint64
	// CancelledRequests is, with PauseAbort, the number of requests the pause cancelled.
	CancelledRequests int

	cancel context.CancelFunc
	done   chan struct{} // closed once the hold has ended
}

// Held reports whether the lease still holds the engine paused: false once released, or once the
// server ended the hold (lease expired, connection lost, context done).
func (l *PauseLease) Held() bool {
	select {
	case <-l.done:
		return false
	default:
		return true
	}
}

// Done returns a channel closed when the hold ends, however it ends.
func (l *PauseLease) Done() <-chan struct{} { return l.done }

// Release ends the hold: it ends the Pause call, and the server resumes the engine (if this was
// its last holder) as soon as it sees the call end. It returns once the call has ended on this
// side; it is idempotent and safe to call from several goroutines.
func (l *PauseLease) Release() {
	l.cancel()
	<-l.done
}

// watch reads the Pause stream until the hold ends: the server's last message (paused = false,
// the lease expired), the call's end, or a broken connection.
func (l *PauseLease) watch(stream grpc.ServerStreamingClient[pb.PauseResponse]) {
	defer close(l.done)
	defer l.cancel()
	for {
		message, err := stream.Recv()
		if err != nil || !message.GetPaused() {
			return
		}
	}
}

// Pause pauses the engine and returns a lease that holds it paused until Release is called, ctx
// is done, or the lease expires (see PauseLease). It opens the Pause stream and returns once the
// server reports the engine paused (bounded by ctx, and by the default timeout when ctx has no
// deadline). Requests added while paused are queued and run after the release. Always release
// the lease (Release is idempotent): defer lease.Release().
func (a *Admin) Pause(ctx context.Context, opts ...PauseOption) (*PauseLease, error) {
	request := &pb.PauseRequest{Mode: pb.PauseMode_PAUSE_MODE_KEEP}
	for _, opt := range opts {
		if opt.apply != nil {
			opt.apply(request)
		}
	}
	// The stream outlives the wait (it holds the lease), so the client's timeout bounds the wait
	// with a timer that cancels the call, not with a deadline on the call.
	callCtx, cancel := context.WithCancel(ctx)
	deadline := a.timeout.of(ctx)
	var timer *time.Timer
	if !deadline.fromContext && !deadline.deadline.IsZero() {
		timer = time.AfterFunc(time.Until(deadline.deadline), cancel)
	}
	notPaused := func() error {
		err := deadline.error(newError(codes.DeadlineExceeded, "the engine did not pause"))
		var e *Error
		if errors.As(err, &e) {
			e.Message = "the engine did not pause before " + e.Message
		}
		return err
	}
	fail := func(err error) (*PauseLease, error) {
		if timer != nil && !timer.Stop() && ctx.Err() == nil {
			err = notPaused()
		}
		cancel()
		return nil, err
	}
	stream, err := a.admin.Pause(callCtx, request)
	if err != nil {
		return fail(deadline.error(err))
	}
	first, err := stream.Recv()
	if errors.Is(err, io.EOF) {
		return fail(newError(codes.Internal, "the Pause stream ended before the engine was paused"))
	}
	if err != nil {
		return fail(deadline.error(err))
	}
	if !first.GetPaused() {
		return fail(newError(codes.Internal, "the server's first Pause message says the engine is not paused"))
	}
	if timer != nil && !timer.Stop() { // the timer fired as the answer came: the call is cancelled
		cancel()
		return nil, notPaused()
	}
	lease := &PauseLease{
		Holders:           int(first.GetHolders()),
		WeightVersion:     first.GetWeightVersion(),
		CancelledRequests: int(first.GetCancelledRequests()),
		cancel:            cancel,
		done:              make(chan struct{}),
	}
	if first.GetLeaseExpiresAt() != nil {
		lease.LeaseExpiresAt = first.GetLeaseExpiresAt().AsTime()
		lease.ExpiresAt = lease.LeaseExpiresAt
	}
	go lease.watch(stream)
	return lease, nil
}

// StopOption configures Admin.Stop.
type StopOption struct {
	apply func(*pb.StopRequest)
}

// WithDrainTimeout bounds, for a graceful stop, how long in-flight requests may run before the
// rest are failed (default: the server's). The call's default deadline is extended by d.
func WithDrainTimeout(d time.Duration) StopOption {
	return StopOption{func(r *pb.StopRequest) {
		s := d.Seconds()
		r.DrainTimeoutS = &s
	}}
}

// Stop stops the engine: gracefully (in-flight requests finish, new ones fail with
// ErrUnavailable), or with hard = true by failing every pending request at once. It returns
// once the engine has stopped; stopping a stopped engine does nothing (AlreadyStopped).
func (a *Admin) Stop(ctx context.Context, hard bool, opts ...StopOption) (*StopResult, error) {
	request := &pb.StopRequest{Hard: hard}
	for _, opt := range opts {
		if opt.apply != nil {
			opt.apply(request)
		}
	}
	timeout := a.timeout
	if timeout.d > 0 && request.DrainTimeoutS != nil {
		timeout.d += time.Duration(request.GetDrainTimeoutS() * float64(time.Second))
	}
	callCtx, cancel, deadline := timeout.start(ctx)
	defer cancel()
	response, err := a.admin.Stop(callCtx, request)
	if err != nil {
		return nil, deadline.error(err)
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
	callCtx, cancel, deadline := a.timeout.start(ctx)
	defer cancel()
	response, err := a.admin.Start(callCtx, &pb.StartRequest{})
	if err != nil {
		return false, deadline.error(err)
	}
	return !response.GetAlreadyRunning(), nil
}

// PrefixCacheReset is what Admin.ResetPrefixCache did.
type PrefixCacheReset struct {
	// DroppedBlocks is the number of reusable prefix blocks forgotten.
	DroppedBlocks int
	// AbortedRequests is the number of requests cancelled first (with abort).
	AbortedRequests int
}

// ResetPrefixCache drops every reusable prefix block (TRL's reset_prefix_cache, verl's
// clear_kv_cache, slime's flush_cache), so that no later request reuses KV computed before the
// call: by weights a sync just replaced, say. Only an idle server is reset: with requests in
// flight (queued or running) it fails with ErrFailedPrecondition and drops nothing, unless abort
// is true, which cancels them first (each ends FinishCancelled).
func (a *Admin) ResetPrefixCache(ctx context.Context, abort bool) (*PrefixCacheReset, error) {
	callCtx, cancel, deadline := a.timeout.start(ctx)
	defer cancel()
	response, err := a.admin.ResetPrefixCache(callCtx, &pb.ResetPrefixCacheRequest{Abort: abort})
	if err != nil {
		return nil, deadline.error(err)
	}
	return &PrefixCacheReset{
		DroppedBlocks:   int(response.GetDroppedBlocks()),
		AbortedRequests: int(response.GetAbortedRequests()),
	}, nil
}

// WeightsChecksum returns a digest of the weights the server holds (slime's check_weights),
// computed on its device between two engine steps, with the weight version it is of; with
// perTensor, each tensor's digest too, to find which differ. Equal weights give equal digests on
// any device: ChecksumOf computes the same of Tensors, and CheckWeights compares replicas. The
// call takes as long as the server needs to read its whole model once.
func (a *Admin) WeightsChecksum(ctx context.Context, perTensor bool) (*WeightsChecksum, error) {
	callCtx, cancel, deadline := a.timeout.start(ctx)
	defer cancel()
	response, err := a.admin.GetWeightsChecksum(callCtx, &pb.GetWeightsChecksumRequest{PerTensor: perTensor})
	if err != nil {
		return nil, deadline.error(err)
	}
	checksum := &WeightsChecksum{
		Digest:        response.GetDigest(),
		Algorithm:     response.GetAlgorithm(),
		WeightVersion: response.GetWeightVersion(),
		NumTensors:    int(response.GetNumTensors()),
		Tensors:       make(map[string]TensorChecksum, len(response.GetTensors())),
	}
	for _, tensor := range response.GetTensors() {
		checksum.Tensors[tensor.GetName()] = TensorChecksum{
			Name: tensor.GetName(), Digest: tensor.GetDigest(), DType: tensor.GetDtype(), Shape: tensor.GetShape(),
		}
	}
	return checksum, nil
}

// Status reports the engine's state and counters (retried on ErrUnavailable: see
// WithRetryAttempts).
func (a *Admin) Status(ctx context.Context) (*Status, error) {
	callCtx, cancel, deadline := a.timeout.start(ctx)
	defer cancel()
	response, err := a.admin.GetStatus(callCtx, &pb.GetStatusRequest{})
	if err != nil {
		return nil, deadline.error(err)
	}
	return statusFromProto(response), nil
}
