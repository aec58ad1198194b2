"""Call plumbing shared by the sync and async clients: metadata, trace context, retries."""

from __future__ import annotations

import asyncio
import enum
import random
import re
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

import grpc
import grpc.aio

from cbserve_client.errors import AlreadyExistsError, CbserveError, DeadlineExceededError, from_rpc_error

T = TypeVar("T")

#: The metadata of one call, as gRPC takes it. A value is bytes only under a key ending in "-bin".
Metadata = tuple[tuple[str, str | bytes], ...]
#: What a caller may pass as ``metadata=``: (key, value) pairs, or a mapping of them.
MetadataArg = Sequence[tuple[str, str | bytes]] | Mapping[str, str | bytes]
#: Turns a grpc.RpcError into the CbserveError a client raises (from_rpc_error, plus what the client knows).
ErrorMapper = Callable[[grpc.RpcError], CbserveError]

#: Codes on which AddRequest is retried: the server queued nothing, so trying again is safe.
RETRYABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED})
RETRY_ATTEMPTS = 3
RETRY_BASE_DELAY_S = 0.1


class _Default(enum.Enum):
    TIMEOUT = "default timeout"


#: Sentinel for "the client's default timeout" (None means no deadline).
DEFAULT_TIMEOUT = _Default.TIMEOUT
Timeout = float | None | _Default

#: Default deadline of unary calls, in seconds.
DEFAULT_TIMEOUT_S = 60.0
#: Default deadline of streaming calls (generate, stream, results), in seconds: a stalled server
#: cannot hold a call forever, and a generation that runs longer needs a larger one.
DEFAULT_STREAM_TIMEOUT_S = 600.0


def resolve_timeout(timeout: Timeout, default: float | None) -> float | None:
    return default if isinstance(timeout, _Default) else timeout


def explain_deadline(error: CbserveError, timeout: float | None) -> CbserveError:
    """``error``, with the deadline that passed and the knobs that set it when it is DEADLINE_EXCEEDED
    on a streaming call."""
    if not isinstance(error, DeadlineExceededError) or timeout is None:
        return error
    explained = DeadlineExceededError(
        error.code,
        f"{error.details} (the call's deadline of {timeout:g} s passed; pass timeout= to the call, or "
        "stream_timeout= to the client, for a longer one, None for none)",
    )
    explained.__cause__ = error.__cause__
    return explained


_NOT_LOADED: Any = object()
_propagate: Any = _NOT_LOADED


def _load_propagate() -> Any:
    """opentelemetry.propagate if importable (imported once, lazily), else None."""
    global _propagate
    if _propagate is _NOT_LOADED:
        try:
            from opentelemetry import propagate
        except ImportError:
            _propagate = None
        else:
            _propagate = propagate
    return _propagate


def trace_metadata() -> list[tuple[str, str]]:
    """W3C trace-context headers (traceparent, tracestate, baggage) of the current OpenTelemetry
    context, as gRPC metadata; empty when opentelemetry is not installed or no span is active."""
    propagate = _load_propagate()
    if propagate is None:
        return []
    carrier: dict[str, str] = {}
    try:
        propagate.inject(carrier)
    except Exception:  # tracing must never break a call
        return []
    return [(key.lower(), str(value)) for key, value in carrier.items()]


# gRPC's rule for metadata keys; it refuses others with only "Invalid metadata".
_METADATA_KEY = re.compile(r"[0-9a-z_.-]+")


def check_metadata(metadata: MetadataArg) -> Metadata:
    """The caller's ``metadata=`` as gRPC takes it; ValueError naming the entry gRPC would refuse."""
    pairs = metadata.items() if isinstance(metadata, Mapping) else metadata
    checked: list[tuple[str, str | bytes]] = []
    for pair in pairs:
        if not isinstance(pair, tuple) or len(pair) != 2:
            raise ValueError(f"metadata must be (key, value) pairs or a dict, got {pair!r}")
        key, value = pair
        if not isinstance(key, str) or not _METADATA_KEY.fullmatch(key) or key.startswith("grpc-"):
            raise ValueError(
                f"metadata key {key!r}: gRPC takes lowercase letters, digits, '-', '_' and '.', "
                "not starting with 'grpc-' (its own)"
            )
        binary = key.endswith("-bin") and isinstance(value, bytes)
        if not binary and not (isinstance(value, str) and value.isascii() and value.isprintable()):
            raise ValueError(
                f"metadata value of {key!r}: printable ASCII text, or bytes under a key ending in "
                f"'-bin', got {value!r}"
            )
        checked.append((key, value))
    return tuple(checked)


def call_metadata(token: str | None, extra: MetadataArg = ()) -> Metadata:
    """Metadata for one call: bearer token, trace context, then the caller's pairs."""
    items: list[tuple[str, str | bytes]] = []
    if token:
        items.append(("authorization", f"Bearer {token}"))
    items.extend(trace_metadata())
    items.extend(check_metadata(extra))
    return tuple(items)


def backoff_delay(
    attempt: int, base: float = RETRY_BASE_DELAY_S, rng: Callable[[], float] = random.random
) -> float:
    """Delay before retry number ``attempt`` (0-based): exponential, with +-50% jitter."""
    return float(base * (2**attempt) * (0.5 + rng()))


def _remaining(deadline: float | None) -> float | None:
    if deadline is None:
        return None
    return max(0.0, deadline - time.monotonic())


def call_with_retry(
    fn: Callable[[float | None], T],
    *,
    timeout: float | None,
    attempts: int = RETRY_ATTEMPTS,
    base_delay: float = RETRY_BASE_DELAY_S,
    sleep: Callable[[float], None] | None = None,
    rng: Callable[[], float] | None = None,
    on_already_exists: Callable[[], T] | None = None,
    to_error: ErrorMapper = from_rpc_error,
) -> T:
    """Calls ``fn(timeout_left)``, retrying on UNAVAILABLE / RESOURCE_EXHAUSTED only.

    ``timeout`` bounds all attempts together. ``on_already_exists``, when given, turns an
    ALREADY_EXISTS on a retry into a success: the previous attempt did queue the request (its
    answer was lost), which a client-chosen request id lets us recognise.
    Raises ``to_error`` of the last grpc.RpcError.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    for attempt in range(attempts):
        try:
            return fn(_remaining(deadline))
        except grpc.RpcError as exc:
            error = to_error(exc)
        if attempt > 0 and on_already_exists is not None and isinstance(error, AlreadyExistsError):
            return on_already_exists()
        if error.code not in RETRYABLE_CODES or attempt == attempts - 1:
            raise error
        delay = backoff_delay(attempt, base_delay, rng or random.random)
        left = _remaining(deadline)
        if left is not None and left <= delay:
            raise error
        (sleep or time.sleep)(delay)
    raise AssertionError("unreachable")  # pragma: no cover


async def acall_with_retry(
    fn: Callable[[float | None], Awaitable[T]],
    *,
    timeout: float | None,
    attempts: int = RETRY_ATTEMPTS,
    base_delay: float = RETRY_BASE_DELAY_S,
    sleep: Callable[[float], Awaitable[None]] | None = None,
    rng: Callable[[], float] | None = None,
    on_already_exists: Callable[[], T] | None = None,
    to_error: ErrorMapper = from_rpc_error,
) -> T:
    """The asyncio twin of :func:`call_with_retry`."""
    deadline = None if timeout is None else time.monotonic() + timeout
    for attempt in range(attempts):
        try:
            return await fn(_remaining(deadline))
        except grpc.RpcError as exc:
            error = to_error(exc)
        if attempt > 0 and on_already_exists is not None and isinstance(error, AlreadyExistsError):
            return on_already_exists()
        if error.code not in RETRYABLE_CODES or attempt == attempts - 1:
            raise error
        delay = backoff_delay(attempt, base_delay, rng or random.random)
        left = _remaining(deadline)
        if left is not None and left <= delay:
            raise error
        await (sleep or asyncio.sleep)(delay)
    raise AssertionError("unreachable")  # pragma: no cover


class GenerationRetry:
    """Whether a Generate call (generate, generate_n, stream) that failed is tried again, and when.

    A call that fails with UNAVAILABLE before its first token is tried again, as a new call (which
    round_robin sends to the next ready replica), up to ``attempts`` tries within the call's deadline,
    with :func:`backoff_delay` between them. That is safe: the caller has no output of the request, and
    the request runs nowhere any more. Either the server refused it (the model still loading, the server
    draining, stopped or asleep), or the connection broke (a replica killed: "Stream removed",
    "Connection reset by peer"), which ends the request with the server that died, or, on one that lives,
    with the stream (the server cancels a Generate stream's requests when the stream ends).
    gRPC's own retryPolicy would stop at the server's first message, a "queued" status sent the moment
    the request is taken, and so would not retry a replica killed while the request waits or prefills.

    After the first token nothing is retried: the request has run on that replica, a retry would run it
    again from its prompt, and a request that crashed its replica would go on to crash the next.
    """

    def __init__(self, start: Callable[[float | None], Any], attempts: int, timeout: float | None) -> None:
        #: Opens the call anew, with the time left (None: no deadline); returns the gRPC call.
        self.start = start
        self.attempts = attempts
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.tries = 1
        self.output_seen = False

    def saw(self, token_ids: Sequence[int], finished: bool) -> None:
        """Records a chunk the caller receives: after one with a token (or the end), no more retries."""
        if token_ids or finished:
            self.output_seen = True

    def delay(self, error: CbserveError, rng: Callable[[], float] = random.random) -> float | None:
        """Seconds to wait before trying again a call that failed with ``error``, or None to raise it."""
        if error.code != grpc.StatusCode.UNAVAILABLE or self.output_seen or self.tries >= self.attempts:
            return None
        delay = backoff_delay(self.tries - 1, rng=rng)
        left = _remaining(self.deadline)
        if left is not None and left <= delay:
            return None
        self.tries += 1
        return delay

    def time_left(self) -> float | None:
        return _remaining(self.deadline)


def call_once(fn: Callable[[], T], to_error: ErrorMapper = from_rpc_error) -> T:
    """Calls ``fn()``, raising ``to_error`` of a grpc.RpcError (the matching CbserveError)."""
    try:
        return fn()
    except grpc.RpcError as exc:
        raise to_error(exc) from exc


async def acall_once(fn: Callable[[], Awaitable[T]], to_error: ErrorMapper = from_rpc_error) -> T:
    """The asyncio twin of :func:`call_once`."""
    try:
        return await fn()
    except grpc.RpcError as exc:
        raise to_error(exc) from exc


def make_channel(
    target: str,
    credentials: grpc.ChannelCredentials | None,
    options: Sequence[tuple[str, Any]],
    interceptors: Sequence[Any] = (),
) -> grpc.Channel:
    """A channel to ``target``, through ``interceptors`` (gRPC's four sync kinds), first one outermost."""
    if credentials is not None:
        channel = grpc.secure_channel(target, credentials, options=list(options))
    else:
        channel = grpc.insecure_channel(target, options=list(options))
    return grpc.intercept_channel(channel, *interceptors) if interceptors else channel


class _UnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    def __init__(self, interceptor: Any) -> None:
        self.interceptor = interceptor

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await self.interceptor.intercept_unary_unary(continuation, details, request)


class _UnaryStream(grpc.aio.UnaryStreamClientInterceptor):  # type: ignore[misc]
    def __init__(self, interceptor: Any) -> None:
        self.interceptor = interceptor

    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await self.interceptor.intercept_unary_stream(continuation, details, request)


class _StreamUnary(grpc.aio.StreamUnaryClientInterceptor):  # type: ignore[misc]
    def __init__(self, interceptor: Any) -> None:
        self.interceptor = interceptor

    async def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await self.interceptor.intercept_stream_unary(continuation, details, requests)


class _StreamStream(grpc.aio.StreamStreamClientInterceptor):  # type: ignore[misc]
    def __init__(self, interceptor: Any) -> None:
        self.interceptor = interceptor

    async def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await self.interceptor.intercept_stream_stream(continuation, details, requests)


_AIO_KINDS = (
    (grpc.aio.UnaryUnaryClientInterceptor, _UnaryUnary),
    (grpc.aio.UnaryStreamClientInterceptor, _UnaryStream),
    (grpc.aio.StreamUnaryClientInterceptor, _StreamUnary),
    (grpc.aio.StreamStreamClientInterceptor, _StreamStream),
)


def _one_per_kind(interceptor: Any) -> list[Any]:
    """``interceptor`` as grpc.aio applies it to every kind of call it implements. grpc.aio files an
    interceptor under the first of the four kinds it is an instance of only (unlike the sync API), so
    an object that implements several is passed as one delegate per kind."""
    kinds = [delegate for kind, delegate in _AIO_KINDS if isinstance(interceptor, kind)]
    return [delegate(interceptor) for delegate in kinds] if len(kinds) > 1 else [interceptor]


def make_aio_channel(
    target: str,
    credentials: grpc.ChannelCredentials | None,
    options: Sequence[tuple[str, Any]],
    interceptors: Sequence[Any] = (),
) -> grpc.aio.Channel:
    """An asyncio channel to ``target``, through ``interceptors`` (``grpc.aio.ClientInterceptor`` s)."""
    chain = [delegate for interceptor in interceptors for delegate in _one_per_kind(interceptor)] or None
    if credentials is not None:
        return grpc.aio.secure_channel(target, credentials, options=list(options), interceptors=chain)
    return grpc.aio.insecure_channel(target, options=list(options), interceptors=chain)


__all__ = [
    "DEFAULT_STREAM_TIMEOUT_S",
    "DEFAULT_TIMEOUT",
    "DEFAULT_TIMEOUT_S",
    "RETRYABLE_CODES",
    "GenerationRetry",
    "Metadata",
    "MetadataArg",
    "Timeout",
    "acall_once",
    "acall_with_retry",
    "backoff_delay",
    "call_metadata",
    "call_once",
    "call_with_retry",
    "check_metadata",
    "explain_deadline",
    "make_aio_channel",
    "make_channel",
    "resolve_timeout",
    "trace_metadata",
]
