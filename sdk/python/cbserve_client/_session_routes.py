"""What the sync and asyncio Generate sessions share: the stream's options, the messages a session sends
(kept until the server answers, for the call to be opened again on another channel), which request each
chunk goes to, and when a request's chunks have all come."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import grpc

from cbserve_client._call import Timeout, resolve_timeout
from cbserve_client._convert import (
    Prompt,
    build_request,
    chunk_from_proto,
    num_sequences,
    rejection_error,
    with_request_id,
)
from cbserve_client._generated.cbserve.v1 import generation_pb2, types_pb2
from cbserve_client._types import Chunk
from cbserve_client.errors import CancelledError, CbserveError, DeadlineExceededError

# A session's first message: every chunk that is ready at once comes in one GenerateResponse.
BATCHED_CHUNKS = generation_pb2.GenerateRequest(
    options=generation_pb2.GenerateStreamOptions(batch_chunks=True)
)

# Ends a session's outgoing messages (the client half-closes the call).
HALF_CLOSE = object()

S = TypeVar("S")


def closed_error() -> CancelledError:
    return CancelledError(grpc.StatusCode.CANCELLED, "the session was closed")


def ended_error() -> CancelledError:
    return CancelledError(grpc.StatusCode.CANCELLED, "the session's call ended")


def cancel_request(request_id: str) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(cancel=generation_pb2.GenerateCancel(request_id=request_id))


class Outbox:
    """The messages a session sends, in order, to the call that sends them: its stream options first, then
    each add, cancel and the half-close (:data:`HALF_CLOSE`), as they are put.

    A call opened by the client's rule for calls no replica serves (``ServingFirstCall``) may fail at once
    and be opened again on the channel to any replica: until the server has answered (:meth:`answered`),
    the outbox keeps the messages the call took, and a new call (:meth:`new_call`) takes them again. The
    call it replaces takes nothing more. Not thread-safe: the sync session guards it with a lock."""

    def __init__(self) -> None:
        self._pending: deque[object] = deque([BATCHED_CHUNKS])
        self._taken: list[object] | None = []  # None once the server has answered
        self._call = 0  # the number of the call that takes the messages

    def put(self, message: object) -> None:
        self._pending.append(message)

    def new_call(self) -> int:
        """The number of a new call, which takes every message from the first on; an earlier call's
        :meth:`take` then gives nothing."""
        if self._taken:
            self._pending.extendleft(reversed(self._taken))
            self._taken.clear()
        self._call += 1
        return self._call

    def answered(self) -> None:
        """The server has answered: the call is not opened again, and what it took is not kept."""
        self._taken = None

    def ready(self, call: int) -> bool:
        """Whether :meth:`take` gives call number ``call`` an answer without waiting."""
        return call != self._call or bool(self._pending)

    def take(self, call: int) -> generation_pb2.GenerateRequest | None:
        """The next message of call number ``call``; None once it has no more to send (the half-close was
        taken, or a new call replaced it). Call only when :meth:`ready`."""
        if call != self._call:
            return None
        message = self._pending.popleft()
        if self._taken is not None:
            self._taken.append(message)
        if message is HALF_CLOSE:
            return None
        assert isinstance(message, generation_pb2.GenerateRequest)
        return message


class RequestProgress:
    """How far one request of a session has come: its sequences that finished, and its deadline.
    ``on_done`` runs once, when the request's stream has ended."""

    def __init__(
        self, request_id: str, sequences: int, timeout: float | None, on_done: Callable[[str], None]
    ) -> None:
        self.request_id = request_id
        self.sequences = sequences
        self.timeout = timeout
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.finished: set[int] = set()
        # True once the request's last chunk, a refusal or the session's error has been taken, or the
        # stream was closed.
        self.done = False
        self._on_done = on_done

    def stop(self) -> bool:
        """Ends the stream early; True if it had not ended, so that the request must be cancelled."""
        if self.done:
            return False
        self._end()
        return True

    def _end(self) -> None:
        self.done = True
        self._on_done(self.request_id)

    def time_left(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def deadline_error(self) -> DeadlineExceededError:
        return DeadlineExceededError(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            f"request {self.request_id} did not end within its timeout of {self.timeout:g} s; it was "
            "cancelled (pass timeout= to the call, or stream_timeout= to the client, for a longer one, None "
            "for none)",
        )

    def take(self, item: types_pb2.GenerationChunk | CbserveError) -> Chunk:
        """The chunk ``item`` carries. Raises the session's error, or the request's refusal."""
        if isinstance(item, CbserveError):
            self._end()
            raise item
        chunk = chunk_from_proto(item)
        rejection = rejection_error(chunk)
        if rejection is not None:
            self._end()
            raise rejection
        if chunk.finished:
            self.finished.add(chunk.index)
            if len(self.finished) >= self.sequences:
                self._end()
        return chunk


def add_request(
    prompt: Prompt,
    timeout: Timeout,
    stream_timeout: float | None,
    sampling: dict[str, Any],
    on_done: Callable[[str], None],
) -> tuple[generation_pb2.GenerateRequest, RequestProgress]:
    """A session's add message for ``prompt`` and its request's progress; raises what the request's
    checks raise (see ``build_request``)."""
    request = build_request(prompt, **with_request_id(sampling))
    sequences = num_sequences(sampling, many=True)
    progress = RequestProgress(
        request.request_id, sequences, resolve_timeout(timeout, stream_timeout), on_done
    )
    return generation_pb2.GenerateRequest(add=request), progress


class Routes(Generic[S]):
    """The open requests of a session by id, for its reader to hand each chunk to its stream. Thread-safe.
    Once the session's call has ended, it holds the error that ended it, and takes no request."""

    def __init__(self) -> None:
        self._streams: dict[str, S] = {}
        self._lock = threading.Lock()
        self._error: CbserveError | None = None

    def add(self, request_id: str, stream: S) -> None:
        """Raises the session's error once its call has ended, and ValueError for an id in use."""
        with self._lock:
            if self._error is not None:
                raise self._error
            if request_id in self._streams:
                raise ValueError(f"request_id {request_id!r} is in use by a request of this session")
            self._streams[request_id] = stream

    def get(self, request_id: str) -> S | None:
        return self._streams.get(request_id)

    def forget(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)

    def end(self, error: CbserveError) -> list[S]:
        """Records why the session's call ended; returns the streams still open, which it forgets."""
        with self._lock:
            self._error = error
            streams, self._streams = list(self._streams.values()), {}
        return streams
