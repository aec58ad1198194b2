"""asyncio client of the cbserve GenerationService, on ``grpc.aio``.

Create and use an :class:`AsyncClient` inside a running event loop::

    async with AsyncClient("localhost:50051") as client:
        completion = await client.generate("Hello", max_new_tokens=16)
        async for chunk in client.stream("Hello", max_new_tokens=16):
            print(chunk.text, end="")
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from types import TracebackType
from typing import Any, TypeVar

import grpc
import grpc.aio

from cbserve_client._call import (
    DEFAULT_STREAM_TIMEOUT_S,
    DEFAULT_TIMEOUT,
    DEFAULT_TIMEOUT_S,
    GenerationRetry,
    Metadata,
    MetadataArg,
    Timeout,
    acall_once,
    acall_with_retry,
    call_metadata,
    explain_deadline,
    make_aio_channel,
    resolve_timeout,
)
from cbserve_client._channel import AsyncCloseable
from cbserve_client._connection import (
    DEFAULT_KEEPALIVE_TIMEOUT_S,
    DEFAULT_LOAD_BALANCING,
    DEFAULT_RETRY_ATTEMPTS,
    ChannelSettings,
    channel_options,
    channel_target,
    describe_target,
    explain_unreachable,
    no_replica_serving,
)
from cbserve_client._convert import (
    CompletionsBuilder,
    Prompt,
    build_request,
    cancel_message,
    chunk_from_proto,
    model_info_from_proto,
    num_sequences,
    rejection_error,
    with_request_id,
)
from cbserve_client._generated.cbserve.v1 import generation_pb2, generation_pb2_grpc, types_pb2
from cbserve_client._types import Chunk, Completion, ModelInfo
from cbserve_client.aio_session import AsyncGenerateSession
from cbserve_client.errors import CancelledError, CbserveError, from_rpc_error

__all__ = ["AsyncChunkStream", "AsyncClient"]

T = TypeVar("T")


class _FirstStatusCall:
    """A grpc.aio Generate call whose failed read reports the status the call ended with first.

    A write that fails because the call has already ended (a server refused it before reading the request,
    or round_robin failed it at once for want of a serving replica) makes grpc.aio replace the call's status
    with INTERNAL "Internal error from Core" (grpc/grpc#36066), and the read that follows reports that
    instead of the server's reason. grpc.aio runs a done callback once, when the first status is set, so the
    status read there is the real one."""

    def __init__(self, call: Any) -> None:
        self._call = call
        self._ended = False
        self._ended_with: grpc.aio.AioRpcError | None = None  # None once ended: it ended with OK
        call.add_done_callback(self._keep_first_status)

    def _keep_first_status(self, call: Any) -> None:
        # The status accessors are coroutines, but return without waiting once the call has ended: run
        # here, before anything else can replace the status. Had one waited, nothing is kept and the read
        # reports grpc.aio's status.
        try:
            _status_error(call).send(None)
        except StopIteration as read:
            self._ended, self._ended_with = True, read.value

    async def read(self) -> Any:
        try:
            return await self._call.read()
        except grpc.RpcError as exc:
            if not self._ended:
                raise
            if self._ended_with is None:  # a late write's failure after the server's OK: all was read
                return grpc.aio.EOF
            raise self._ended_with from exc

    async def write(self, message: Any) -> None:
        await self._call.write(message)

    async def done_writing(self) -> None:
        await self._call.done_writing()

    def cancel(self) -> bool:
        return bool(self._call.cancel())


async def _status_error(call: Any) -> grpc.aio.AioRpcError | None:
    """The error an ended ``call``'s read raises for its status, or None if it ended with OK."""
    code = await call.code()
    if code == grpc.StatusCode.OK:
        return None
    return grpc.aio.AioRpcError(
        code,
        await call.initial_metadata(),
        await call.trailing_metadata(),
        await call.details(),
        await call.debug_error_string(),
    )


class _ServingFirstCall:
    """The asyncio twin of ``_channel.ServingFirstCall``: a streaming call opened again on the channel
    to any replica when its first read fails because no replica serves."""

    def __init__(self, open_on: Callable[[Any], Any], stub: Any, fallback_stub: Callable[[], Any]) -> None:
        self._open_on = open_on
        self._fallback_stub = fallback_stub
        self._call = open_on(stub)
        self._read_any = False

    async def read(self) -> Any:
        try:
            message = await self._call.read()
        except grpc.RpcError as exc:
            if self._read_any or not no_replica_serving(exc):
                raise
            self._call = self._open_on(self._fallback_stub())
            message = await self._call.read()
        self._read_any = True
        return message

    def cancel(self) -> bool:
        return bool(self._call.cancel())


class AsyncChunkStream(AsyncCloseable, AsyncIterator[Chunk]):
    """An async iterator over a streaming call's chunks.

    ``await aclose()`` / ``cancel()`` (or leaving an ``async with`` block) cancels the RPC: for
    :meth:`AsyncClient.stream` the server then cancels the request; for
    :meth:`AsyncClient.results` only the reading stops.
    """

    def __init__(
        self,
        call: Any,
        extract: Callable[[Any], types_pb2.GenerationChunk],
        request_id: str,
        *,
        timeout: float | None = None,
        raise_rejections: bool = False,
        to_error: Callable[[grpc.RpcError], CbserveError] = from_rpc_error,
        retry: GenerationRetry | None = None,
    ) -> None:
        self._call = call
        self._extract = extract
        self._timeout = timeout
        self._to_error = to_error
        self._retry = retry
        self._raise_rejections = raise_rejections
        self._cancelled = False
        #: The id of the request this stream follows.
        self.request_id = request_id

    def __aiter__(self) -> AsyncChunkStream:
        return self

    async def __anext__(self) -> Chunk:
        while True:
            try:
                message = await self._call.read()
            except grpc.RpcError as exc:
                error = self._to_error(exc)
                if await self._try_again(error):
                    continue
                raise explain_deadline(error, self._timeout) from exc
            except asyncio.CancelledError:
                if self._cancelled:  # our own cancel(): report it like the sync client does
                    raise CancelledError(grpc.StatusCode.CANCELLED, "the stream was cancelled") from None
                raise
            if message is grpc.aio.EOF:
                raise StopAsyncIteration
            chunk = chunk_from_proto(self._extract(message))
            rejection = rejection_error(chunk) if self._raise_rejections else None
            if rejection is not None:
                self._call.cancel()
                if await self._try_again(rejection):
                    continue
                self._cancelled = True
                raise rejection
            if self._retry is not None:
                self._retry.saw(chunk.token_ids, chunk.finished)
            return chunk

    async def _try_again(self, error: CbserveError) -> bool:
        """Opens the call anew when ``error`` allows another try (see GenerationRetry)."""
        delay = None if self._retry is None or self._cancelled else self._retry.delay(error)
        if self._retry is None or delay is None:
            return False
        await asyncio.sleep(delay)
        if self._cancelled:
            return False
        self._call = self._retry.start(self._retry.time_left())
        return True

    def cancel(self) -> None:
        """Cancels the RPC (no-op once it has completed)."""
        self._cancelled = True
        self._call.cancel()

    async def aclose(self) -> None:
        self.cancel()


class AsyncClient:
    """The asyncio twin of :class:`cbserve_client.Client` (same arguments, same calls, awaited), except
    that ``interceptors`` are ``grpc.aio`` ones (``grpc.aio.UnaryUnaryClientInterceptor`` and the other
    three kinds)."""

    def __init__(
        self,
        target: str | Sequence[str],
        *,
        credentials: grpc.ChannelCredentials | None = None,
        token: str | None = None,
        timeout: float | None = DEFAULT_TIMEOUT_S,
        stream_timeout: float | None = DEFAULT_STREAM_TIMEOUT_S,
        load_balancing: str = DEFAULT_LOAD_BALANCING,
        retry_attempts: int = DEFAULT_RETRY_ATTEMPTS,
        keepalive_s: float | None = None,
        keepalive_timeout_s: float = DEFAULT_KEEPALIVE_TIMEOUT_S,
        options: Sequence[tuple[str, Any]] = (),
        interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
    ) -> None:
        settings = ChannelSettings(load_balancing, retry_attempts, keepalive_s, keepalive_timeout_s)
        self.target = describe_target(target)
        self.timeout = timeout
        self.stream_timeout = stream_timeout
        self._token = token
        self._retry_attempts = retry_attempts
        resolved = channel_target(target)

        def open_channel(health_check: bool) -> grpc.aio.Channel:
            channel_settings = dataclasses.replace(settings, health_check=health_check)
            return make_aio_channel(
                resolved, credentials, channel_options(channel_settings, options), interceptors
            )

        self._open_channel = open_channel
        self._channel = open_channel(settings.health_check)
        self._stub: Any = generation_pb2_grpc.GenerationServiceStub(self._channel)
        self._any_replica_channel: grpc.aio.Channel | None = None
        self._any_replica_stub: Any = None

    async def close(self) -> None:
        """Closes the channel (in-flight calls are cancelled)."""
        await self._channel.close()
        if self._any_replica_channel is not None:
            await self._any_replica_channel.close()

    def _stub_to_any_replica(self) -> Any:
        """A stub of a channel like the client's but without health checking (see
        ``Client._serving_first``); made on first use."""
        if self._any_replica_stub is None:
            self._any_replica_channel = self._open_channel(False)
            self._any_replica_stub = generation_pb2_grpc.GenerationServiceStub(self._any_replica_channel)
        return self._any_replica_stub

    async def _serving_first(self, invoke: Callable[[Any], Awaitable[T]]) -> T:
        """The asyncio twin of ``Client._serving_first``."""
        try:
            return await invoke(self._stub)
        except grpc.RpcError as exc:
            if not no_replica_serving(exc):
                raise
        return await invoke(self._stub_to_any_replica())

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    def _metadata(self, extra: MetadataArg = ()) -> Metadata:
        """One call's metadata: the token, the trace context and the caller's ``extra``."""
        return call_metadata(self._token, extra)

    def _error(self, exc: grpc.RpcError) -> CbserveError:
        """The CbserveError for ``exc``; a call that reached no server says which target and what to check."""
        return explain_unreachable(from_rpc_error(exc), self.target, "--port, 50051 by default")

    async def generate(
        self,
        prompt: Prompt,
        *,
        timeout: Timeout = DEFAULT_TIMEOUT,
        metadata: MetadataArg = (),
        **sampling: Any,
    ) -> Completion:
        """Generates a completion for ``prompt`` and returns it whole (see ``Client.generate``)."""
        num_sequences(sampling, many=False)
        [completion] = await self._generate(prompt, 1, timeout, metadata, sampling)
        return completion

    async def generate_n(
        self,
        prompt: Prompt,
        n: int,
        *,
        timeout: Timeout = DEFAULT_TIMEOUT,
        metadata: MetadataArg = (),
        **sampling: Any,
    ) -> list[Completion]:
        """Samples ``n`` completions of ``prompt`` in one request (see ``Client.generate_n``)."""
        sampling = {**sampling, "n": n}
        return await self._generate(prompt, num_sequences(sampling, many=True), timeout, metadata, sampling)

    async def _generate(
        self, prompt: Prompt, n: int, timeout: Timeout, metadata: MetadataArg, sampling: dict[str, Any]
    ) -> list[Completion]:
        async with self.stream(prompt, timeout=timeout, metadata=metadata, **sampling) as stream:
            return await CompletionsBuilder(stream.request_id, n, sampling).collect_async(stream)

    def stream(
        self,
        prompt: Prompt,
        *,
        timeout: Timeout = DEFAULT_TIMEOUT,
        metadata: MetadataArg = (),
        **sampling: Any,
    ) -> AsyncChunkStream:
        """Starts generating; returns an async iterator over the output chunks (see ``Client.stream``).

        Cancelling the iterator (``cancel()``, ``aclose()``, leaving ``async with``) cancels the RPC
        and thus the request. Tried again like ``Client.stream`` when it fails before its first token.
        """
        request = build_request(prompt, **with_request_id(sampling))
        deadline, call_metadata = resolve_timeout(timeout, self.stream_timeout), self._metadata(metadata)

        def start(left: float | None) -> Any:
            def open_on(stub: Any) -> Any:
                messages = iter([generation_pb2.GenerateRequest(add=request)])
                return _FirstStatusCall(stub.Generate(messages, timeout=left, metadata=call_metadata))

            return _ServingFirstCall(open_on, self._stub, self._stub_to_any_replica)

        return AsyncChunkStream(
            start(deadline),
            _generate_chunk,
            request.request_id,
            timeout=deadline,
            raise_rejections=True,
            to_error=self._error,
            retry=GenerationRetry(start, self._retry_attempts, deadline),
        )

    def session(self, *, metadata: MetadataArg = ()) -> AsyncGenerateSession:
        """Opens one ``Generate`` call for many requests, whose chunks the server sends batched (see
        ``Client.session``): ``async with client.session() as session:`` then ``session.stream(...)`` or
        ``await session.generate(...)`` from any task. Call it inside the running event loop."""
        call_metadata = self._metadata(metadata)

        def open_call(messages: Callable[[], AsyncIterator[generation_pb2.GenerateRequest]]) -> Any:
            return _ServingFirstCall(
                lambda stub: _FirstStatusCall(stub.Generate(messages(), metadata=call_metadata)),
                self._stub,
                self._stub_to_any_replica,
            )

        return AsyncGenerateSession(open_call, self._error, self.stream_timeout)

    async def submit(
        self,
        prompt: Prompt,
        *,
        timeout: Timeout = DEFAULT_TIMEOUT,
        metadata: MetadataArg = (),
        **sampling: Any,
    ) -> str:
        """Queues a request (``AddRequest``) and returns its id; retried like ``Client.submit``."""
        request = build_request(prompt, **with_request_id(sampling))
        message = generation_pb2.AddRequestRequest(request=request)
        call_metadata = self._metadata(metadata)

        async def attempt(left: float | None) -> str:
            response = await self._serving_first(
                lambda stub: stub.AddRequest(message, timeout=left, metadata=call_metadata)
            )
            return str(response.request_id)

        return await acall_with_retry(
            attempt,
            timeout=resolve_timeout(timeout, self.timeout),
            on_already_exists=lambda: request.request_id,
            to_error=self._error,
        )

    def results(
        self,
        request_id: str,
        from_index: int = 0,
        *,
        timeout: Timeout = DEFAULT_TIMEOUT,
        metadata: MetadataArg = (),
    ) -> AsyncChunkStream:
        """Streams a request's outputs from token index ``from_index`` on (``StreamResults``)."""
        message = generation_pb2.StreamResultsRequest(request_id=request_id, from_token_index=from_index)
        deadline = resolve_timeout(timeout, self.stream_timeout)
        call_metadata = self._metadata(metadata)
        call = _ServingFirstCall(
            lambda stub: stub.StreamResults(message, timeout=deadline, metadata=call_metadata),
            self._stub,
            self._stub_to_any_replica,
        )
        return AsyncChunkStream(call, _results_chunk, request_id, timeout=deadline, to_error=self._error)

    async def cancel(
        self,
        request_id: str,
        *,
        index: int | None = None,
        timeout: Timeout = DEFAULT_TIMEOUT,
        metadata: MetadataArg = (),
    ) -> bool:
        """Cancels a request, or with ``index`` only that sequence of it (``n`` > 1). Returns True if it
        was live, False if it had already ended."""
        message = cancel_message(request_id, index)
        deadline, call_metadata = resolve_timeout(timeout, self.timeout), self._metadata(metadata)
        response = await acall_once(
            lambda: self._serving_first(
                lambda stub: stub.Cancel(message, timeout=deadline, metadata=call_metadata)
            ),
            self._error,
        )
        return bool(response.cancelled)

    async def model_info(
        self, *, timeout: Timeout = DEFAULT_TIMEOUT, metadata: MetadataArg = ()
    ) -> ModelInfo:
        """Describes the served model."""
        message = generation_pb2.GetModelInfoRequest()
        deadline, call_metadata = resolve_timeout(timeout, self.timeout), self._metadata(metadata)
        response = await acall_once(
            lambda: self._serving_first(
                lambda stub: stub.GetModelInfo(message, timeout=deadline, metadata=call_metadata)
            ),
            self._error,
        )
        return model_info_from_proto(response)


def _generate_chunk(message: generation_pb2.GenerateResponse) -> types_pb2.GenerationChunk:
    return message.chunk


def _results_chunk(message: generation_pb2.StreamResultsResponse) -> types_pb2.GenerationChunk:
    return message.chunk
