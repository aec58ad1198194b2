"""What the sync and asyncio Generate sessions share: the stream's options, which request each chunk goes
to, and when a request's chunks have all come."""

from __future__ import annotations

import threading
import time
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

S = TypeVar("S")


def closed_error() -> CancelledError:
    return CancelledError(grpc.StatusCode.CANCELLED, "the session was closed")


def ended_error() -> CancelledError:
    return CancelledError(grpc.StatusCode.CANCELLED, "the session's call ended")


def cancel_request(request_id: str) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(cancel=generation_pb2.GenerateCancel(request_id=request_id))


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
