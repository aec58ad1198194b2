"""The asyncio twin of :mod:`cbserve_client.session`: many requests on one Generate stream whose chunks the
server batches, :class:`AsyncGenerateSession`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import grpc.aio

from cbserve_client._call import DEFAULT_TIMEOUT, Timeout
from cbserve_client._channel import AsyncCloseable
from cbserve_client._convert import CompletionsBuilder, Prompt, num_sequences
from cbserve_client._generated.cbserve.v1 import generation_pb2, types_pb2
from cbserve_client._session_routes import (
    HALF_CLOSE,
    Outbox,
    RequestProgress,
    Routes,
    add_request,
    cancel_request,
    closed_error,
    ended_error,
)
from cbserve_client._types import Chunk, Completion
from cbserve_client.errors import CbserveError

__all__ = ["AsyncGenerateSession", "AsyncSessionStream"]


class AsyncSessionStream(AsyncCloseable, AsyncIterator[Chunk]):
    """The chunks of one request of an :class:`AsyncGenerateSession`, as they come; as
    :class:`cbserve_client.SessionStream`, with ``cancel()`` / ``await aclose()`` / ``async with``."""

    def __init__(self, session: AsyncGenerateSession, progress: RequestProgress) -> None:
        #: The id of the request this stream follows.
        self.request_id = progress.request_id
        self._session = session
        self._progress = progress
        # Filled by the session's reader task: the request's chunks, then the error that ended the session if
        # it ended first.
        self.inbox: asyncio.Queue[types_pb2.GenerationChunk | CbserveError] = asyncio.Queue()

    def __aiter__(self) -> AsyncSessionStream:
        return self

    async def __anext__(self) -> Chunk:
        if self._progress.done:
            raise StopAsyncIteration
        try:
            item = await asyncio.wait_for(self.inbox.get(), self._progress.time_left())
        except TimeoutError:
            self.cancel()
            raise self._progress.deadline_error() from None
        return self._progress.take(item)

    def cancel(self) -> None:
        """Cancels the request unless it has ended (no-op then)."""
        if self._progress.stop():
            self._session.cancel(self.request_id)

    async def aclose(self) -> None:
        self.cancel()


class AsyncGenerateSession(AsyncCloseable):
    """The asyncio twin of :class:`cbserve_client.GenerateSession`, made by :meth:`AsyncClient.session`
    inside a running event loop: ``stream()`` returns an :class:`AsyncSessionStream` at once;
    ``generate()`` and ``generate_n()`` are awaited; ``await aclose()`` (or leaving ``async with``) ends
    the call and cancels the unfinished requests. A task of the session reads its call; grpc.aio's own
    task sends the session's messages."""

    def __init__(
        self,
        open_call: Callable[[Callable[[], AsyncIterator[generation_pb2.GenerateRequest]]], Any],
        to_error: Callable[[grpc.RpcError], CbserveError],
        stream_timeout: float | None,
    ) -> None:
        """As :class:`cbserve_client.GenerateSession`'s, with the messages as an async iterator."""
        loop = asyncio.get_running_loop()
        self._outbox = Outbox()
        self._outbox_changed = asyncio.Event()
        self._routes: Routes[AsyncSessionStream] = Routes()
        self._closed = False
        self._to_error = to_error
        self._stream_timeout = stream_timeout
        self._call = open_call(self._messages)
        self._reader = loop.create_task(self._read())

    def _messages(self) -> AsyncIterator[generation_pb2.GenerateRequest]:
        """The messages of a new try of the session's call: every one the session sent, then each it sends."""
        call = self._outbox.new_call()
        self._outbox_changed.set()  # an earlier try's messages end
        return self._send(call)

    async def _send(self, call: int) -> AsyncIterator[generation_pb2.GenerateRequest]:
        while True:
            while not self._outbox.ready(call):
                self._outbox_changed.clear()
                await self._outbox_changed.wait()
            message = self._outbox.take(call)
            if message is None:
                return
            yield message

    def _put(self, message: object) -> None:
        self._outbox.put(message)
        self._outbox_changed.set()

    async def _read(self) -> None:
        error: CbserveError
        try:
            while (response := await self._call.read()) is not grpc.aio.EOF:
                self._outbox.answered()
                for chunk in response.chunks:
                    stream = self._routes.get(chunk.request_id)
                    if stream is not None:
                        stream.inbox.put_nowait(chunk)
            error = ended_error()
        except grpc.RpcError as exc:
            error = closed_error() if self._closed else self._to_error(exc)
        except asyncio.CancelledError:  # grpc.aio's read of a call cancelled here, by aclose()
            error = closed_error()
        for stream in self._routes.end(error):
            stream.inbox.put_nowait(error)

    def stream(
        self, prompt: Prompt, *, timeout: Timeout = DEFAULT_TIMEOUT, **sampling: Any
    ) -> AsyncSessionStream:
        """Queues a request on the session and returns its chunks' async iterator at once; as
        :meth:`cbserve_client.GenerateSession.stream`."""
        add, progress = add_request(prompt, timeout, self._stream_timeout, sampling, self._routes.forget)
        stream = AsyncSessionStream(self, progress)
        self._routes.add(progress.request_id, stream)
        self._put(add)
        return stream

    async def generate(
        self, prompt: Prompt, *, timeout: Timeout = DEFAULT_TIMEOUT, **sampling: Any
    ) -> Completion:
        """Generates a completion on the session and returns it whole; as :meth:`AsyncClient.generate`."""
        num_sequences(sampling, many=False)
        [completion] = await self._complete(prompt, 1, timeout, sampling)
        return completion

    async def generate_n(
        self, prompt: Prompt, n: int, *, timeout: Timeout = DEFAULT_TIMEOUT, **sampling: Any
    ) -> list[Completion]:
        """``n`` completions of ``prompt`` in one request, by ``index``; as :meth:`AsyncClient.generate_n`."""
        sampling = {**sampling, "n": n}
        return await self._complete(prompt, num_sequences(sampling, many=True), timeout, sampling)

    async def _complete(
        self, prompt: Prompt, n: int, timeout: Timeout, sampling: dict[str, Any]
    ) -> list[Completion]:
        async with self.stream(prompt, timeout=timeout, **sampling) as stream:
            return await CompletionsBuilder(stream.request_id, n, sampling).collect_async(stream)

    def cancel(self, request_id: str) -> None:
        """Asks the server to cancel one request of the session (idempotent)."""
        self._put(cancel_request(request_id))

    async def aclose(self) -> None:
        """Ends the call: the server cancels the session's unfinished requests. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._put(HALF_CLOSE)
        self._call.cancel()
        await self._reader
