"""What the synchronous clients share: one channel, the caller's token and default timeout."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from types import TracebackType
from typing import Any, Self, TypeAlias

import grpc

from cbserve_client._call import Metadata, MetadataArg, call_metadata, make_channel
from cbserve_client._connection import (
    DEFAULT_SETTINGS,
    ChannelSettings,
    channel_options,
    channel_target,
    describe_target,
    explain_unreachable,
)
from cbserve_client.errors import CbserveError, from_rpc_error

#: A client interceptor of gRPC's sync API, of any of its four kinds.
Interceptor: TypeAlias = (
    grpc.UnaryUnaryClientInterceptor
    | grpc.UnaryStreamClientInterceptor
    | grpc.StreamUnaryClientInterceptor
    | grpc.StreamStreamClientInterceptor
)


class Closeable(ABC):
    """`with` support for an object with a `close()`: leaving the block closes it."""

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class ChannelOwner(Closeable):
    """Owns one gRPC channel; `close()` (or leaving a `with` block) closes it, which cancels in-flight
    streams and releases an open pause."""

    #: The server's flag for the port this client calls, and its default (for error messages).
    port_flag = "--port, 50051 by default"

    def __init__(
        self,
        target: str | Sequence[str],
        credentials: grpc.ChannelCredentials | None,
        token: str | None,
        timeout: float | None,
        options: Sequence[tuple[str, Any]],
        settings: ChannelSettings = DEFAULT_SETTINGS,
        interceptors: Sequence[Interceptor] = (),
    ) -> None:
        self.target = describe_target(target)
        self.timeout = timeout
        self._token = token
        self._retry_attempts = settings.retry_attempts
        self._channel = make_channel(
            channel_target(target), credentials, channel_options(settings, options), interceptors
        )

    def close(self) -> None:
        self._channel.close()

    def _metadata(self, extra: MetadataArg = ()) -> Metadata:
        """One call's metadata: the token, the trace context and the caller's ``extra``."""
        return call_metadata(self._token, extra)

    def _error(self, exc: grpc.RpcError) -> CbserveError:
        """The CbserveError for ``exc``; a call that reached no server says which target and what to check."""
        return explain_unreachable(from_rpc_error(exc), self.target, self.port_flag)
