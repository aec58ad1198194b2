"""Delivers each request's outputs to whoever asked for them, in O(1) per output.

Outputs are routed per request: `get(request_id)` pops that request's own queue and never touches
another request's outputs (the reference implementation re-queues everyone else's results). A
callback registered for a request receives its outputs on the caller's asyncio loop instead.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable

from engine.request import GenerationOutput

ResultHandler = Callable[[GenerationOutput], object]


class OutputRouter:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._queues: dict[str, deque[GenerationOutput]] = {}
        # Arrival order across requests, for `get()` without an id. Ids whose outputs were already taken
        # by id are skipped lazily, so both kinds of consumer stay O(1) amortised.
        self._arrivals: deque[str] = deque()
        self._handlers: dict[str, tuple[asyncio.AbstractEventLoop, ResultHandler]] = {}

    def open(self, request_id: str) -> None:
        with self._cond:
            self._queues.setdefault(request_id, deque())

    def publish(self, output: GenerationOutput) -> None:
        with self._cond:
            handler = self._handlers.get(output.request_id)
            if handler is not None:
                loop, callback = handler
                if output.is_finished():
                    del self._handlers[output.request_id]
                    self._queues.pop(output.request_id, None)
                _call_soon(loop, callback, output)
                return
            self._queues.setdefault(output.request_id, deque()).append(output)
            self._arrivals.append(output.request_id)
            self._cond.notify_all()

    def register_handler(
        self, request_id: str, callback: ResultHandler, loop: asyncio.AbstractEventLoop
    ) -> None:
        """Routes this request's outputs to `callback` on `loop`, first flushing any already queued."""
        with self._cond:
            pending = self._queues.get(request_id, deque())
            finished = False
            while pending:
                output = pending.popleft()
                finished = finished or output.is_finished()
                _call_soon(loop, callback, output)
            if finished:
                self._queues.pop(request_id, None)
            else:
                self._handlers[request_id] = (loop, callback)

    def get(self, request_id: str | None = None, timeout: float | None = None) -> GenerationOutput | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                output = self._pop(request_id)
                if output is not None:
                    return output
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                self._cond.wait(remaining)

    def has_pending(self, request_id: str | None = None) -> bool:
        with self._cond:
            if request_id is not None:
                return bool(self._queues.get(request_id))
            return any(self._queues.values())

    def wake_all(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _pop(self, request_id: str | None) -> GenerationOutput | None:
        if request_id is not None:
            queue = self._queues.get(request_id)
            if not queue:
                return None
            output = queue.popleft()
            if output.is_finished() and not queue:
                del self._queues[request_id]
            return output
        while self._arrivals:
            arrived = self._arrivals.popleft()
            queue = self._queues.get(arrived)
            if queue:
                output = queue.popleft()
                if output.is_finished() and not queue:
                    del self._queues[arrived]
                return output
        return None


def _call_soon(loop: asyncio.AbstractEventLoop, callback: ResultHandler, output: GenerationOutput) -> None:
    if loop.is_closed():
        return
    loop.call_soon_threadsafe(callback, output)
