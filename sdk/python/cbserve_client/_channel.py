"""What the synchronous clients share: one channel, the caller's token and default timeout."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from types import TracebackType
from typing import Any, Self

import grpc

from cbserve_client._call import call_metadata, make_channel
from cbserve_client._connection import (
    DEFAULT_SETTINGS,
    ChannelSettings,
    channel_options,
    channel_target,
    describe_target,
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

    def __init__(
        self,
        target: str | Sequence[str],
        credentials: grpc.ChannelCredentials | None,
        token: str | None,
        timeout: float | None,
        options: Sequence[tuple[str, Any]],
        settings: ChannelSettings = DEFAULT_SETTINGS,
    ) -> None:
        self.target = describe_target(target)
        self.timeout = timeout
        self._token = token
        self._channel = make_channel(channel_target(target), credentials, channel_options(settings, options))

    def close(self) -> None:
        self._channel.close()

    def _metadata(self) -> tuple[tuple[str, str], ...]:
        return call_metadata(self._token)
