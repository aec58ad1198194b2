"""Exceptions raised by the cbserve client, one per gRPC status code.

Every public call of :class:`~cbserve_client.Client`, :class:`~cbserve_client.AsyncClient` and
:class:`~cbserve_client.AdminClient` converts :class:`grpc.RpcError` into these (the original error
is kept as ``__cause__``). Each status code has its own class, a subclass of :class:`CbserveError`,
except that UNKNOWN and DATA_LOSS raise :class:`InternalError` with INTERNAL: all three are a failure
of the server's, for which a caller does the same.
"""

from __future__ import annotations

from typing import Any

import grpc

__all__ = [
    "AbortedError",
    "AlreadyExistsError",
    "CancelledError",
    "CbserveError",
    "DeadlineExceededError",
    "FailedPreconditionError",
    "FleetError",
    "InternalError",
    "InvalidArgumentError",
    "NotFoundError",
    "OutOfRangeError",
    "PermissionDeniedError",
    "ResourceExhaustedError",
    "UnauthenticatedError",
    "UnavailableError",
    "UnimplementedError",
    "WeightsMismatchError",
    "error_from_code",
    "from_rpc_error",
]


class CbserveError(Exception):
    """A failed cbserve call.

    Attributes:
        code: the gRPC status code.
        details: the server's (or gRPC's) description of the failure.
    """

    def __init__(self, code: grpc.StatusCode, details: str = "") -> None:
        self.code = code
        self.details = details
        super().__init__(f"{code.name}: {details}" if details else code.name)


class InvalidArgumentError(CbserveError):
    """INVALID_ARGUMENT: the request is malformed (bad prompt, out-of-range sampling parameter, ...)."""


class NotFoundError(CbserveError):
    """NOT_FOUND: unknown (or expired) request id."""


class AlreadyExistsError(CbserveError):
    """ALREADY_EXISTS: the request id is already used by a live request."""


class ResourceExhaustedError(CbserveError):
    """RESOURCE_EXHAUSTED: the server's request queue is full; nothing was queued."""


class UnavailableError(CbserveError):
    """UNAVAILABLE: the server is unreachable, stopping, stopped, or paused past the deadline."""


class UnauthenticatedError(CbserveError):
    """UNAUTHENTICATED: missing or wrong bearer token (admin calls)."""


class PermissionDeniedError(CbserveError):
    """PERMISSION_DENIED: the credentials are valid but not allowed this call (cbserve itself never
    answers it: a proxy's or a service mesh's authorization policy does)."""


class CancelledError(CbserveError):
    """CANCELLED: the call was cancelled (by this client or the server)."""


class DeadlineExceededError(CbserveError):
    """DEADLINE_EXCEEDED: the call's deadline (timeout) passed before it completed."""


class AbortedError(CbserveError):
    """ABORTED: a weight-update group could not be joined, or a transfer over it failed midway (a
    member left, a broadcast failed); the message says which. Form a new group and push again."""


class OutOfRangeError(CbserveError):
    """OUT_OF_RANGE: a value past the end of a valid range (cbserve sends INVALID_ARGUMENT for bad
    request values; a proxy may send this)."""


class UnimplementedError(CbserveError):
    """UNIMPLEMENTED: the server does not have the call: an older server, a proxy that does not route
    it, or the wrong port (an AdminClient on the generation port says so)."""


class FailedPreconditionError(CbserveError):
    """FAILED_PRECONDITION: the server's state does not allow the call now (a prefix-cache reset with
    requests in flight, a weight update over a group the server is not in, ...); the message says what
    to do."""


class InternalError(CbserveError):
    """INTERNAL, UNKNOWN or DATA_LOSS: a server-side failure."""


_BY_CODE: dict[grpc.StatusCode, type[CbserveError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExistsError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
    grpc.StatusCode.CANCELLED: CancelledError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPreconditionError,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
    grpc.StatusCode.ABORTED: AbortedError,
    grpc.StatusCode.OUT_OF_RANGE: OutOfRangeError,
    grpc.StatusCode.UNIMPLEMENTED: UnimplementedError,
    grpc.StatusCode.INTERNAL: InternalError,
    grpc.StatusCode.UNKNOWN: InternalError,
    grpc.StatusCode.DATA_LOSS: InternalError,
}

_BY_NUMBER: dict[int, grpc.StatusCode] = {code.value[0]: code for code in grpc.StatusCode}


def error_from_code(code: grpc.StatusCode | int, details: str = "") -> CbserveError:
    """Builds the exception for a status code (a :class:`grpc.StatusCode` or its number)."""
    if isinstance(code, int):
        code = _BY_NUMBER.get(code, grpc.StatusCode.UNKNOWN)
    return _BY_CODE.get(code, CbserveError)(code, details)


def from_rpc_error(error: grpc.RpcError) -> CbserveError:
    """Maps a :class:`grpc.RpcError` (sync or ``grpc.aio``) to the matching :class:`CbserveError`."""
    code_fn = getattr(error, "code", None)
    details_fn = getattr(error, "details", None)
    code = code_fn() if callable(code_fn) else None
    details = details_fn() if callable(details_fn) else None
    if not isinstance(code, grpc.StatusCode):
        code = grpc.StatusCode.UNKNOWN
    mapped = error_from_code(code, details if isinstance(details, str) else str(error))
    mapped.__cause__ = error
    return mapped


class FleetError(CbserveError):
    """A call of an :class:`~cbserve_client.AdminFleet` that failed on some replicas.

    Attributes:
        failures: the error of each replica that failed, by target.
        results: what each replica that succeeded returned, by target.
        code: the first failure's status code.
    """

    def __init__(self, failures: dict[str, CbserveError], results: dict[str, Any]) -> None:
        self.failures = failures
        self.results = results
        first = next(iter(failures.values()))
        listed = "; ".join(f"{target}: {error}" for target, error in failures.items())
        super().__init__(
            first.code, f"{len(failures)} of {len(failures) + len(results)} replicas failed: {listed}"
        )


class WeightsMismatchError(Exception):
    """:meth:`~cbserve_client.AdminFleet.check_weights` found replicas whose weights differ from the
    reference (the expected digest, or else the first replica's).

    Attributes:
        reference: what the others were compared with: "expected" or a replica's target.
        checksums: each replica's :class:`~cbserve_client.WeightsChecksum`, by target.
        differing: for each replica that differs, the names of the tensors whose digests differ from
            the reference's (a name held by one side only included), in name order.
    """

    def __init__(
        self, reference: str, checksums: dict[str, Any], differing: dict[str, tuple[str, ...]]
    ) -> None:
        self.reference = reference
        self.checksums = checksums
        self.differing = differing
        shown = 5
        parts = []
        for target, names in differing.items():
            listed = ", ".join(names[:shown]) + (
                f" and {len(names) - shown} more" if len(names) > shown else ""
            )
            version = checksums[target].weight_version
            parts.append(f"{target} (weight_version {version}) in {len(names)} tensors: {listed}")
        against = "the expected weights" if reference == "expected" else reference
        super().__init__(
            f"{len(differing)} of {len(checksums)} replicas hold other weights than {against}: "
            + "; ".join(parts)
        )
