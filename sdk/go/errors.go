package cbserve

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"strings"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Error is the error every call of this package returns: the gRPC status code of the failure
// and its description. Test it against the sentinel errors with [errors.Is]:
//
//	if errors.Is(err, cbserve.ErrInvalidArgument) { ... }
//
// or get the code with [errors.As] (or google.golang.org/grpc/status.Code, which also works).
type Error struct {
	// Code is the gRPC status code.
	Code codes.Code
	// Message is the server's (or gRPC's, or this package's) description of the failure.
	Message string

	cause error
}

// Sentinel errors, one per status code a call can end with (INTERNAL, UNKNOWN and DATA_LOSS
// share ErrInternal: a caller handles them alike), as the Python and Java SDKs have one exception
// type per code. An *Error matches the sentinel of its code with [errors.Is].
var (
	// ErrInvalidArgument: a malformed request (empty prompt, token id out of range, bad sampling
	// bound, ...). Retrying it unchanged fails again.
	ErrInvalidArgument = &Error{Code: codes.InvalidArgument, Message: "invalid argument"}
	// ErrNotFound: an unknown or expired request id (Results).
	ErrNotFound = &Error{Code: codes.NotFound, Message: "not found"}
	// ErrAlreadyExists: the request id is already used by a live request.
	ErrAlreadyExists = &Error{Code: codes.AlreadyExists, Message: "already exists"}
	// ErrResourceExhausted: the server's request queue is full; nothing was queued.
	ErrResourceExhausted = &Error{Code: codes.ResourceExhausted, Message: "resource exhausted"}
	// ErrUnavailable: the server is unreachable, loading, stopping or stopped; nothing was
	// queued. (A call that waits on a paused engine past its deadline fails with
	// ErrDeadlineExceeded instead.)
	ErrUnavailable = &Error{Code: codes.Unavailable, Message: "unavailable"}
	// ErrUnauthenticated: a missing or wrong bearer token (admin calls).
	ErrUnauthenticated = &Error{Code: codes.Unauthenticated, Message: "unauthenticated"}
	// ErrPermissionDenied: the credentials are valid but not allowed this call (e.g. a proxy's
	// or a mesh's authorization policy).
	ErrPermissionDenied = &Error{Code: codes.PermissionDenied, Message: "permission denied"}
	// ErrFailedPrecondition: the call cannot run in the current state: admin Start or
	// UpdateWeights on an engine that lost a tensor-parallel rank, ResetPrefixCache with requests
	// in flight (without abort), or ranging a Stream sequence a second time. Retrying it unchanged
	// fails again (ResetPrefixCache succeeds once the requests have ended).
	ErrFailedPrecondition = &Error{Code: codes.FailedPrecondition, Message: "failed precondition"}
	// ErrUnimplemented: the server does not implement the call (an older server, or a proxy
	// that does not route it).
	ErrUnimplemented = &Error{Code: codes.Unimplemented, Message: "unimplemented"}
	// ErrAborted: the server gave up a call midway (a weight transfer from a trainer that failed,
	// on the raw weight-sync RPCs); what it changed is in the message.
	ErrAborted = &Error{Code: codes.Aborted, Message: "aborted"}
	// ErrOutOfRange: a value past the end of what the server holds (codes.OutOfRange).
	ErrOutOfRange = &Error{Code: codes.OutOfRange, Message: "out of range"}
	// ErrCanceled: the call was cancelled (usually: its context was). Such an error also matches
	// [context.Canceled] when the caller's context was cancelled.
	ErrCanceled = &Error{Code: codes.Canceled, Message: "canceled"}
	// ErrDeadlineExceeded: the call's deadline passed. Such an error also matches
	// [context.DeadlineExceeded] when the caller's context expired.
	ErrDeadlineExceeded = &Error{Code: codes.DeadlineExceeded, Message: "deadline exceeded"}
	// ErrInternal: a server-side failure (INTERNAL, UNKNOWN or DATA_LOSS).
	ErrInternal = &Error{Code: codes.Internal, Message: "internal error"}
)

func sentinelFor(code codes.Code) *Error {
	switch code {
	case codes.InvalidArgument:
		return ErrInvalidArgument
	case codes.NotFound:
		return ErrNotFound
	case codes.AlreadyExists:
		return ErrAlreadyExists
	case codes.ResourceExhausted:
		return ErrResourceExhausted
	case codes.Unavailable:
		return ErrUnavailable
	case codes.Unauthenticated:
		return ErrUnauthenticated
	case codes.PermissionDenied:
		return ErrPermissionDenied
	case codes.FailedPrecondition:
		return ErrFailedPrecondition
	case codes.Unimplemented:
		return ErrUnimplemented
	case codes.Aborted:
		return ErrAborted
	case codes.OutOfRange:
		return ErrOutOfRange
	case codes.Canceled:
		return ErrCanceled
	case codes.DeadlineExceeded:
		return ErrDeadlineExceeded
	case codes.Internal, codes.Unknown, codes.DataLoss:
		return ErrInternal
	}
	return nil
}

// Error returns "cbserve: CODE: message".
func (e *Error) Error() string {
	if e.Message == "" {
		return fmt.Sprintf("cbserve: %s", e.Code)
	}
	return fmt.Sprintf("cbserve: %s: %s", e.Code, e.Message)
}

// Is reports whether target is the sentinel error of e's code.
func (e *Error) Is(target error) bool {
	s := sentinelFor(e.Code)
	return s != nil && target == s
}

// Unwrap returns the underlying error: the gRPC status error, or the caller's context error
// ([context.Canceled], [context.DeadlineExceeded]) when that is what ended the call.
func (e *Error) Unwrap() error { return e.cause }

// GRPCStatus returns e as a gRPC status, so that google.golang.org/grpc/status.FromError and
// status.Code understand it.
func (e *Error) GRPCStatus() *status.Status { return status.New(e.Code, e.Message) }

// contextError is the context's error when it is what ended a call with code: gRPC can report a
// passed deadline a moment before the context's own timer marks it done, so a deadline already
// behind the clock counts too.
func contextError(ctx context.Context, code codes.Code) error {
	if ctx == nil || (code != codes.Canceled && code != codes.DeadlineExceeded) {
		return nil
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	if deadline, ok := ctx.Deadline(); ok && code == codes.DeadlineExceeded && !time.Now().Before(deadline) {
		return context.DeadlineExceeded
	}
	return nil
}

// notServingPick is in grpc-go's message of a call that found every replica NOT_SERVING.
const notServingPick = "health check failed. status=NOT_SERVING"

// notServing is the message of a call that found no replica serving (and could not ask one why):
// gRPC's own says only that a health check failed.
const notServing = "no replica is serving: each one connected reports NOT_SERVING on grpc.health.v1 " +
	"(its model loading, a drain or stop under way, asleep, or its weights incomplete)"

// grpcErrorPrefix is how grpc-go prints a status error; gRPC nests one inside the description of
// another (a health check's failure inside a connection's), and an *Error shows the description only.
var grpcErrorPrefix = regexp.MustCompile(`rpc error: code = [A-Za-z]+ desc = `)

// newError builds an *Error of this package (client-side failures).
func newError(code codes.Code, format string, args ...any) *Error {
	return &Error{Code: code, Message: fmt.Sprintf(format, args...)}
}

// convertError maps an error from gRPC (or a context error) to an *Error; nil stays nil. ctx is
// the call's context: when it is done, its error becomes the cause, so errors.Is(err,
// context.Canceled) holds for a call its caller cancelled.
func convertError(ctx context.Context, err error) error {
	if err == nil {
		return nil
	}
	var e *Error
	if errors.As(err, &e) {
		return err
	}
	var code codes.Code
	var message string
	var withStatus interface{ GRPCStatus() *status.Status }
	if errors.As(err, &withStatus) {
		// The innermost status, not status.FromError's: that one's message is the whole chain's
		// text, which nests gRPC's "rpc error: code = ... desc = ..." and whatever wrapped it, such
		// as grpc-go's retries' "max retries exhausted: failed after 4 attempts: ". The chain stays
		// the cause, for errors.Unwrap.
		s := withStatus.GRPCStatus()
		code, message = s.Code(), s.Message()
	} else {
		s := status.FromContextError(err)
		code, message = s.Code(), s.Message()
	}
	message = grpcErrorPrefix.ReplaceAllString(message, "")
	if code == codes.Unavailable && strings.Contains(message, notServingPick) {
		// Every connection is up, but health checking (NewClient's) takes each out of rotation.
		message = notServing
	}
	cause := err
	if ctxErr := contextError(ctx, code); ctxErr != nil {
		causes := []error{err, ctxErr}
		if c := context.Cause(ctx); c != ctx.Err() {
			causes = append(causes, c)
		}
		cause = errors.Join(causes...)
	}
	return &Error{Code: code, Message: message, cause: cause}
}
