"""What happens to the prefix cache, as events a router can mirror: stored, removed, all cleared.

A router that routes by prefix (SMG's cache-aware policy) keeps an index of which blocks each replica
holds. It learns them from these events, in the order the block pool made the changes:

- `BlockStored`: a full block became reusable under `block_hash`, extending the chain at `parent_hash`
  (None for a prompt's first block), holding `token_ids` (`page_size` of them);
- `BlockRemoved`: that block was evicted (its memory reused for another request);
- `AllBlocksCleared`: every cached block was dropped at once (weights updated, cache flushed, a failed step).

A block that a request still holds stays cached; only eviction (or a clear) ends its life in the index.
Recording is off until someone subscribes, so an engine nobody watches pays nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.kv.prefix_hash import BlockHash


@dataclass(frozen=True)
class BlockStored:
    block_hash: BlockHash
    parent_hash: BlockHash | None
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class BlockRemoved:
    block_hash: BlockHash


@dataclass(frozen=True)
class AllBlocksCleared:
    """Every cached block dropped at once: the index of this replica starts empty again."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventLog:
    """The events since the last `take`, recorded only while `enabled`."""

    def __init__(self) -> None:
        self.enabled = False
        self._events: list[KVCacheEvent] = []

    def record(self, event: KVCacheEvent) -> None:
        if self.enabled:
            self._events.append(event)

    def take(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events
