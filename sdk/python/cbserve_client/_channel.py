"""What the synchronous clients share: one channel, the caller's token and default timeout; and the `with`
support of the objects that close (`Closeable`, `AsyncCloseable`)."""

from __future__ import annotations

import dataclasses
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
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
    no_replica_serving,
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


class AsyncCloseable(ABC):
    """`async with` support for an object with an `aclose()`: leaving the block closes it."""

    @abstractmethod
    async def aclose(self) -> None: ...

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()


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
        resolved = channel_target(target)

        def open_channel(health_check: bool) -> grpc.Channel:
            channel_settings = dataclasses.replace(settings, health_check=health_check)
            return make_channel(
                resolved, credentials, channel_options(channel_settings, options), interceptors
            )

        self._open_channel = open_channel
        self._channel = open_channel(settings.health_check)
        self._any_replica_channel: grpc.Channel | None = None
        self._lock = threading.Lock()

    def _channel_to_any_replica(self) -> grpc.Channel:
        """A channel like the client's but without health checking, which sends a call to a replica
        that does not serve; made on first use."""
        with self._lock:
            if self._any_replica_channel is None:
                self._any_replica_channel = self._open_channel(False)
            return self._any_replica_channel

    def close(self) -> None:
        self._channel.close()
        with self._lock:
            if self._any_replica_channel is not None:
                self._any_replica_channel.close()

    def _metadata(self, extra: MetadataArg = ()) -> Metadata:
        """One call's metadata: the token, the trace context and the caller's ``extra``."""
        return call_metadata(self._token, extra)

    def _error(self, exc: grpc.RpcError) -> CbserveError:
        """The CbserveError for ``exc``; a call that reached no server says which target and what to check."""
        return explain_unreachable(from_rpc_error(exc), self.target, self.port_flag)


class ServingFirstCall:
    """A streaming call that follows the client's rule for a call no replica serves: opened with
    ``open_on(stub)``, and when its first read fails because every replica reports NOT_SERVING, opened
    again with ``open_on(fallback_stub())``, a stub of the channel to any replica (see
    ``Client._serving_first``). ``cancel()`` may come from another thread than the reads: a call opened
    again after it is cancelled at once."""

    def __init__(self, open_on: Callable[[Any], Any], stub: Any, fallback_stub: Callable[[], Any]) -> None:
        self._open_on = open_on
        self._fallback_stub = fallback_stub
        self._call = open_on(stub)
        self._read_any = False
        self._cancelled = False

    def __iter__(self) -> ServingFirstCall:
        return self

    def __next__(self) -> Any:
        try:
            message = next(self._call)
        except grpc.RpcError as exc:
            if self._read_any or self._cancelled or not no_replica_serving(exc):
                raise
            self._call = self._open_on(self._fallback_stub())
            if self._cancelled:  # set before cancel() read self._call: that was the failed call
                self._call.cancel()
            message = next(self._call)
        self._read_any = True
        return message

    def cancel(self) -> bool:
        self._cancelled = True
        return bool(self._call.cancel())
