"""`LoopListeners`: who hears from the loop thread besides each request's caller: exit handlers (the loop
ended, for whatever reason) and KV event listeners (the prefix cache changed, for a router that routes
by prefix). The manager keeps one across the loops it makes; each loop calls it from its thread.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from engine.engine_core import EngineCore
from engine.kv.events import KVCacheEvent

logger = logging.getLogger(__name__)


class LoopListeners:
    def __init__(self) -> None:
        self._exit_handlers: list[Callable[[], None]] = []
        self._kv_event_listeners: list[Callable[[list[KVCacheEvent]], None]] = []

    @property
    def wants_kv_events(self) -> bool:
        """Whether the cache must record its changes (it records none until a listener exists)."""
        return bool(self._kv_event_listeners)

    def add_exit_handler(self, callback: Callable[[], None]) -> None:
        self._exit_handlers.append(callback)

    def add_kv_event_listener(self, listener: Callable[[list[KVCacheEvent]], None]) -> None:
        """`listener(events)` must be quick and must not raise: it runs on the loop thread."""
        self._kv_event_listeners.append(listener)

    def loop_ended(self) -> None:
        for handler in list(self._exit_handlers):
            handler()

    def publish_kv_events(self, engine: EngineCore) -> None:
        """Hands the cache's changes since the last call, in order, to every listener."""
        if not self._kv_event_listeners:  # nothing is recorded then: skip the per-iteration call
            return
        events = engine.take_kv_events()
        if not events:
            return
        for listener in list(self._kv_event_listeners):
            try:
                listener(events)
            except Exception:  # a listener's bug must not stop generation
                logger.exception("a KV event listener failed")
