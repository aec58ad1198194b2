"""Delivers each request's outputs to whoever asked for them, in O(1) per output.

Outputs are routed per request: `get(request_id)` pops that request's own queue and never touches
another request's outputs (the reference implementation re-queues everyone else's results). A
callback registered for a request receives its outputs on the caller's asyncio loop instead: a step's
outputs reach each loop in one call, in order, so a step of 64 streaming requests wakes a server's loop
once, not 64 times (every `call_soon_threadsafe` writes to the loop's self-pipe, which the loop then reads).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

from engine.request import GenerationOutput

ResultHandler = Callable[[GenerationOutput], object]

logger = logging.getLogger(__name__)


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

    def publish(self, outputs: Sequence[GenerationOutput]) -> None:
        """Routes outputs in order: each to its request's handler, else to its request's queue."""
        deliveries: dict[asyncio.AbstractEventLoop, list[tuple[ResultHandler, GenerationOutput]]] = {}
        with self._cond:
            queued = False
            for output in outputs:
                handler = self._handlers.get(output.request_id)
                if handler is None:
                    self._queues.setdefault(output.request_id, deque()).append(output)
                    self._arrivals.append(output.request_id)
                    queued = True
                    continue
                loop, callback = handler
                if output.is_finished():
                    del self._handlers[output.request_id]
                    self._queues.pop(output.request_id, None)
                deliveries.setdefault(loop, []).append((callback, output))
            # Scheduled under the lock, as `register_handler` flushes a queue: a request's outputs reach its
            # loop in the order the engine made them.
            for loop, batch in deliveries.items():
                _call_soon(loop, batch)
            if queued:
                self._cond.notify_all()

    def register_handler(
        self, request_id: str, callback: ResultHandler, loop: asyncio.AbstractEventLoop
    ) -> None:
        """Routes this request's outputs to `callback` on `loop`, first flushing any already queued."""
        with self._cond:
            pending = self._queues.get(request_id, deque())
            finished = any(output.is_finished() for output in pending)
            _call_soon(loop, [(callback, output) for output in pending])
            pending.clear()
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


def _call_soon(loop: asyncio.AbstractEventLoop, batch: list[tuple[ResultHandler, GenerationOutput]]) -> None:
    if batch and not loop.is_closed():
        loop.call_soon_threadsafe(_deliver, batch)


def _deliver(batch: list[tuple[ResultHandler, GenerationOutput]]) -> None:
    """Runs on the handlers' loop: a handler that fails is logged and keeps no output from the others."""
    for callback, output in batch:
        try:
            callback(output)
        except Exception:
            logger.exception("the result handler of request %s failed", output.request_id)
