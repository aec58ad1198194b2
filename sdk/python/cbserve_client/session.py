"""Many requests on one Generate stream whose chunks the server batches: :class:`GenerateSession`."""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from cbserve_client._call import DEFAULT_TIMEOUT, Timeout
from cbserve_client._channel import Closeable
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

__all__ = ["GenerateSession", "SessionStream"]


class SessionStream(Closeable, Iterator[Chunk]):
    """The chunks of one request of a :class:`GenerateSession`, as they come.

    Iteration ends after the request's last chunk (every sequence's, with ``n`` > 1). ``close()`` (or
    leaving a ``with`` block) before that cancels the request on the server; the session goes on. A stream
    nobody reads still takes its request's chunks until the request ends: the session holds it till then.
    """

    def __init__(self, session: GenerateSession, progress: RequestProgress) -> None:
        #: The id of the request this stream follows.
        self.request_id = progress.request_id
        self._session = session
        self._progress = progress
        # Filled by the session's reader thread: the request's chunks, then the error that ended the session
        # if it ended first.
        self.inbox: queue.SimpleQueue[types_pb2.GenerationChunk | CbserveError] = queue.SimpleQueue()

    def __iter__(self) -> SessionStream:
        return self

    def __next__(self) -> Chunk:
        if self._progress.done:
            raise StopIteration
        try:
            item = self.inbox.get(timeout=self._progress.time_left())
        except queue.Empty:
            self.close()
            raise self._progress.deadline_error() from None
        return self._progress.take(item)

    def close(self) -> None:
        """Cancels the request unless it has ended (no-op then)."""
        if self._progress.stop():
            self._session.cancel(self.request_id)

    cancel = close


class GenerateSession(Closeable):
    """Requests on one ``Generate`` call, whose chunks the server sends batched: one message for all the
    chunks of an engine step (``GenerateStreamOptions.batch_chunks``), where :meth:`Client.stream` costs a
    message per request and step, and a call per request. Made by :meth:`Client.session`.

    For a process that keeps many requests in flight at one server (a batch job, an RL rollout). Every
    request of a session goes to the one replica its call reached; spread requests over replicas with
    :meth:`Client.stream`, which opens a call per request.

    Any thread may call :meth:`stream` and :meth:`generate`. A thread of the session reads the call and
    hands each chunk to its request's :class:`SessionStream`, whose queue holds the chunks its reader has not
    taken yet. When the call fails (the server stops, the connection drops), every unfinished request's
    stream raises the error. ``close()`` (or leaving a ``with`` block) ends the call: the server cancels its
    unfinished requests and frees their KV blocks, and their streams raise :class:`CancelledError`.
    """

    def __init__(
        self,
        open_call: Callable[[Callable[[], Iterator[generation_pb2.GenerateRequest]]], Any],
        to_error: Callable[[grpc.RpcError], CbserveError],
        stream_timeout: float | None,
    ) -> None:
        """``open_call(messages)`` opens the session's call, each try of it with ``messages()``'s messages
        (the client's rule for a call no replica serves may open it twice: see ``ServingFirstCall``)."""
        self._outbox = Outbox()
        self._outbox_changed = threading.Condition()
        self._routes: Routes[SessionStream] = Routes()
        self._closed = False
        self._to_error = to_error
        self._stream_timeout = stream_timeout
        self._call = open_call(self._messages)
        self._reader = threading.Thread(target=self._read, name="cbserve-session-reader", daemon=True)
        self._reader.start()

    def _messages(self) -> Iterator[generation_pb2.GenerateRequest]:
        """The messages of a new try of the session's call: every one the session sent, then each it sends."""
        with self._outbox_changed:
            call = self._outbox.new_call()
            self._outbox_changed.notify_all()
        return self._send(call)

    def _send(self, call: int) -> Iterator[generation_pb2.GenerateRequest]:
        while True:
            with self._outbox_changed:
                self._outbox_changed.wait_for(lambda: self._outbox.ready(call))
                message = self._outbox.take(call)
            if message is None:
                return
            yield message

    def _put(self, message: object) -> None:
        with self._outbox_changed:
            self._outbox.put(message)
            self._outbox_changed.notify_all()

    def _read(self) -> None:
        error: CbserveError
        answered = False
        try:
            for response in self._call:
                if not answered:
                    with self._outbox_changed:
                        self._outbox.answered()
                    answered = True
                for chunk in response.chunks:
                    stream = self._routes.get(chunk.request_id)
                    if stream is not None:
                        stream.inbox.put(chunk)
            error = ended_error()
        except grpc.RpcError as exc:
            error = closed_error() if self._closed else self._to_error(exc)
        for stream in self._routes.end(error):
            stream.inbox.put(error)

    def stream(self, prompt: Prompt, *, timeout: Timeout = DEFAULT_TIMEOUT, **sampling: Any) -> SessionStream:
        """Queues a request on the session and returns its chunks' iterator at once.

        ``prompt`` and the sampling keyword arguments are those of :meth:`Client.stream`. ``timeout``: seconds
        after which the stream cancels the request and raises :class:`DeadlineExceededError` (default: the
        client's ``stream_timeout``; None for none). A request the server refuses raises its error from the
        stream's first ``next``; the session and its other requests go on. Raises the session's error if its
        call has already ended, and ValueError for a ``request_id`` that a request of this session still uses.
        """
        add, progress = add_request(prompt, timeout, self._stream_timeout, sampling, self._routes.forget)
        stream = SessionStream(self, progress)
        self._routes.add(progress.request_id, stream)
        self._put(add)
        return stream

    def generate(self, prompt: Prompt, *, timeout: Timeout = DEFAULT_TIMEOUT, **sampling: Any) -> Completion:
        """Generates a completion on the session and returns it whole; as :meth:`Client.generate`."""
        num_sequences(sampling, many=False)
        [completion] = self._complete(prompt, 1, timeout, sampling)
        return completion

    def generate_n(
        self, prompt: Prompt, n: int, *, timeout: Timeout = DEFAULT_TIMEOUT, **sampling: Any
    ) -> list[Completion]:
        """``n`` completions of ``prompt`` in one request, by ``index``; as :meth:`Client.generate_n`."""
        sampling = {**sampling, "n": n}
        return self._complete(prompt, num_sequences(sampling, many=True), timeout, sampling)

    def _complete(
        self, prompt: Prompt, n: int, timeout: Timeout, sampling: dict[str, Any]
    ) -> list[Completion]:
        with self.stream(prompt, timeout=timeout, **sampling) as stream:
            return CompletionsBuilder(stream.request_id, n, sampling).collect(stream)

    def cancel(self, request_id: str) -> None:
        """Asks the server to cancel one request of the session (idempotent)."""
        self._put(cancel_request(request_id))

    def close(self) -> None:
        """Ends the call: the server cancels the session's unfinished requests. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._put(HALF_CLOSE)
        self._call.cancel()
        if self._reader is not threading.current_thread():
            self._reader.join()

    def __del__(self) -> None:
        call = getattr(self, "_call", None)
        if call is not None:
            with contextlib.suppress(Exception):
                call.cancel()
