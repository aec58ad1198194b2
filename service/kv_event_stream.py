"""The prefix cache's events as the gateways' `SubscribeKvEvents` stream (smg-grpc-proto's common.proto).

The engine reports blocks stored, removed and cleared (engine.kv.events); this module numbers them into
`KvEventBatch`es, one batch per engine iteration that changed the cache, and serves each subscriber:

- a cursor (`start_sequence_number`: the last batch the subscriber applied) still in the bounded
  history gets every batch after it;
- a cursor of 0 gets the whole history when it reaches back to the first batch, and otherwise, like a
  cursor older than the history, a snapshot: chunks numbered up to the current sequence, the first
  starting with a clear, then one store per live block, parents before children;
- a cursor past the last batch this process numbered (a subscriber that saw another process's stream:
  the server restarted) ends the call with DATA_LOSS, on which a gateway clears the replica and
  subscribes again from 0.

Every batch carries the engine's load (`EngineLoad`), and while nothing is stored or removed the stream
sends `load_only` batches, repeating the last sequence sent: when the load changed (checked every
`LOAD_TICK_S`), or after `HEARTBEAT_S` of silence (`IDLE_HEARTBEAT_S` once two heartbeats in a row
carried the same load and no request is in flight), so the gateway keeps the replica's load current and
knows it lives. The telemetry (cache hit rate, token counts, queues) rides on heartbeats and a stream's
first record only, as common.proto asks.

Block hashes are the engine's SHA-256 chain folded to its last eight bytes, big-endian and signed, as
vLLM's servicer folds a raw digest into the proto's int64. The gateway hashes token ids itself and keeps
these as names, so what must be exact is each block's tokens and its parent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

import grpc
from smg_grpc_proto.generated import common_pb2

from engine import BlockRemoved, BlockStored, KVCacheEvent

logger = logging.getLogger(__name__)

# Batches kept for subscribers that resume; older cursors get a snapshot instead.
HISTORY_BATCHES = 4096
# Live blocks per snapshot chunk.
SNAPSHOT_CHUNK_BLOCKS = 512
LOAD_TICK_S = 0.1
HEARTBEAT_S = 1.0
IDLE_HEARTBEAT_S = 5.0


def block_hash_int64(digest: bytes) -> int:
    """A block hash as the proto's int64: the digest's last eight bytes, big-endian, signed."""
    return int.from_bytes(digest[-8:], "big", signed=True)


@dataclass(frozen=True)
class _LiveBlock:
    parent_hash: int | None
    token_ids: tuple[int, ...]


class StreamAborted(Exception):
    """The subscriber's cursor cannot be served; the call ends with `code`."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class KvEventStream:
    """The numbered batches of one engine's prefix-cache events, shared by every subscriber.

    `publish` runs on the engine's loop thread, `subscribe` on the server's event loop; both take
    `_lock`, under which the sequence, the history and the live blocks always agree.
    """

    def __init__(
        self,
        block_size: int,
        load: Callable[[], common_pb2.EngineLoad],
        history_batches: int = HISTORY_BATCHES,
    ) -> None:
        self.block_size = block_size
        self._load = load
        self._lock = threading.Lock()
        self._sequence = 0
        self._history: deque[common_pb2.KvEventBatch] = deque(maxlen=history_batches)
        # Insertion order: a block is stored after the parent it extends (a re-stored parent is
        # reordered when a snapshot is built).
        self._live: dict[int, _LiveBlock] = {}
        self._next_event_id = 1
        self._wakeups: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()

    @property
    def sequence_number(self) -> int:
        with self._lock:
            return self._sequence

    @property
    def num_live_blocks(self) -> int:
        with self._lock:
            return len(self._live)

    # ------------------------------------------------------------------ the engine's side

    def publish(self, events: Sequence[KVCacheEvent]) -> None:
        """Numbers one iteration's events as a batch and wakes the subscribers."""
        if not events:
            return
        with self._lock:
            self._sequence += 1
            batch = common_pb2.KvEventBatch(sequence_number=self._sequence, timestamp=time.time())
            batch.events.extend(self._record(event) for event in events)
            self._history.append(batch)
            wakeups = list(self._wakeups)
        for loop, wakeup in wakeups:
            if not loop.is_closed():
                loop.call_soon_threadsafe(wakeup.set)

    def _record(self, event: KVCacheEvent) -> common_pb2.KvCacheEvent:
        """With `_lock` held: `event` applied to the live blocks, as the wire carries it."""
        event_id, self._next_event_id = self._next_event_id, self._next_event_id + 1
        if isinstance(event, BlockStored):
            block_hash = block_hash_int64(event.block_hash)
            parent = block_hash_int64(event.parent_hash) if event.parent_hash is not None else None
            self._live[block_hash] = _LiveBlock(parent, event.token_ids)
            return common_pb2.KvCacheEvent(
                event_id=event_id, stored=self._stored(block_hash, parent, event.token_ids)
            )
        if isinstance(event, BlockRemoved):
            block_hash = block_hash_int64(event.block_hash)
            self._live.pop(block_hash, None)
            removed = common_pb2.KvBlocksRemoved(
                block_hashes=[block_hash],
                tier=common_pb2.KV_CACHE_TIER_DEVICE,
                group_idx=0,
                locality=common_pb2.KV_CACHE_LOCALITY_LOCAL,
            )
            return common_pb2.KvCacheEvent(event_id=event_id, removed=removed)
        self._live.clear()
        return common_pb2.KvCacheEvent(event_id=event_id, cleared=common_pb2.KvCacheCleared())

    def _stored(
        self, block_hash: int, parent: int | None, token_ids: tuple[int, ...]
    ) -> common_pb2.KvBlocksStored:
        stored = common_pb2.KvBlocksStored(
            blocks=[
                common_pb2.KvBlock(block_hash=block_hash, token_ids=token_ids, block_size=self.block_size)
            ],
            tier=common_pb2.KV_CACHE_TIER_DEVICE,
            group_idx=0,
            kv_cache_spec_kind="full_attention",
            locality=common_pb2.KV_CACHE_LOCALITY_LOCAL,
        )
        if parent is not None:
            stored.parent_block_hash = parent
        return stored

    # ------------------------------------------------------------------ a subscriber's side

    async def subscribe(
        self, start_sequence_number: int, load_records_before_first_batch: bool
    ) -> AsyncIterator[common_pb2.KvEventBatch]:
        """The batches after `start_sequence_number`, then live ones and load heartbeats, until the
        caller stops iterating. Raises StreamAborted for a cursor past this process's last batch."""
        wakeup = (asyncio.get_running_loop(), asyncio.Event())
        with self._lock:
            self._wakeups.add(wakeup)
        records = _LoadRecords(self._load)
        try:
            with self._lock:
                batches, cursor = self._catch_up(start_sequence_number)
            for batch in batches:
                yield records.attach(batch)
            while True:
                with self._lock:
                    batches, cursor = self._since(cursor)
                if batches:
                    for batch in batches:
                        yield records.attach(batch)
                    continue
                heartbeat = records.heartbeat(cursor - 1, load_records_before_first_batch)
                if heartbeat is not None:
                    yield heartbeat
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wakeup[1].wait(), LOAD_TICK_S)
                wakeup[1].clear()
        finally:
            with self._lock:
                self._wakeups.discard(wakeup)

    def _catch_up(self, last_applied: int) -> tuple[list[common_pb2.KvEventBatch], int]:
        """With `_lock` held: what a new subscriber gets first, and the sequence it continues from."""
        if last_applied > self._sequence:
            raise StreamAborted(
                grpc.StatusCode.DATA_LOSS,
                f"start_sequence_number {last_applied} is past this server's last KV event batch "
                f"({self._sequence}): it restarted; subscribe again from 0",
            )
        first_kept = self._history[0].sequence_number if self._history else self._sequence + 1
        if first_kept > last_applied + 1:  # the batches right after the cursor are gone
            return self._snapshot(), self._sequence + 1
        return self._since(last_applied + 1)

    def _since(self, cursor: int) -> tuple[list[common_pb2.KvEventBatch], int]:
        """With `_lock` held: the kept batches from `cursor` on; a subscriber that fell behind the
        history gets a snapshot."""
        if cursor > self._sequence:
            return [], cursor
        first_kept = self._history[0].sequence_number
        if cursor < first_kept:
            logger.warning(
                "a KV event subscriber fell %d batches behind: sending a snapshot", first_kept - cursor
            )
            return self._snapshot(), self._sequence + 1
        # Sequences are consecutive, so the batches wanted are the last ones: index from the end rather
        # than copy the whole history (this runs for every subscriber after every batch).
        kept = len(self._history)
        wanted = self._sequence - cursor + 1
        return [self._history[index] for index in range(kept - wanted, kept)], self._sequence + 1

    def _snapshot(self) -> list[common_pb2.KvEventBatch]:
        """With `_lock` held: the live blocks as chunks numbered up to the current sequence."""
        blocks = self._parents_first()
        if self._sequence == 0:
            return []
        num_chunks = min(self._sequence, max(1, -(-len(blocks) // SNAPSHOT_CHUNK_BLOCKS)))
        per_chunk = -(-len(blocks) // num_chunks) if blocks else 0
        now = time.time()
        chunks = []
        for index in range(num_chunks):
            batch = common_pb2.KvEventBatch(
                sequence_number=self._sequence - num_chunks + 1 + index,
                timestamp=now,
                snapshot=common_pb2.KvSnapshotChunk(index=index, count=num_chunks, blocks=len(blocks)),
            )
            if index == 0:
                batch.events.append(common_pb2.KvCacheEvent(cleared=common_pb2.KvCacheCleared()))
            for block_hash, block in blocks[index * per_chunk : (index + 1) * per_chunk]:
                stored = self._stored(block_hash, block.parent_hash, block.token_ids)
                batch.events.append(common_pb2.KvCacheEvent(stored=stored))
            chunks.append(batch)
        return chunks

    def _parents_first(self) -> list[tuple[int, _LiveBlock]]:
        ordered: list[tuple[int, _LiveBlock]] = []
        placed: set[int] = set()
        for block_hash in self._live:
            chain = []
            current: int | None = block_hash
            while current is not None and current in self._live and current not in placed:
                chain.append(current)
                placed.add(current)
                current = self._live[current].parent_hash
            ordered.extend((each, self._live[each]) for each in reversed(chain))
        return ordered


class _LoadRecords:
    """One stream's load records: numbered, on every batch, and as heartbeats while nothing happens."""

    def __init__(self, load: Callable[[], common_pb2.EngineLoad]) -> None:
        self._load = load
        self._sample = 0
        self._last_sent_at = time.monotonic()
        self._last_core: tuple[object, ...] | None = None
        self._unchanged_heartbeats = 0
        self._sent_any = False

    def attach(self, batch: common_pb2.KvEventBatch) -> common_pb2.KvEventBatch:
        sent = common_pb2.KvEventBatch()
        sent.CopyFrom(batch)
        sent.load.CopyFrom(self._record(load_only=False, telemetry=not self._sent_any))
        self._sent_any = True
        return sent

    def heartbeat(self, last_sequence: int, before_first_batch: bool) -> common_pb2.KvEventBatch | None:
        """A `load_only` batch when one is due, else None."""
        if last_sequence == 0 and not before_first_batch:
            return None
        record = self._load()
        # While requests are in flight the record carries the engine's silence, which the gateway judges
        # against its wedge bound: it goes out every HEARTBEAT_S however still the rest is.
        idle = self._unchanged_heartbeats >= 2 and not record.HasField("engine_silence_ms")
        interval = IDLE_HEARTBEAT_S if idle else HEARTBEAT_S
        changed = _core(record) != self._last_core
        if self._sent_any and not changed and time.monotonic() - self._last_sent_at < interval:
            return None
        self._unchanged_heartbeats = 0 if changed else self._unchanged_heartbeats + 1
        batch = common_pb2.KvEventBatch(sequence_number=last_sequence, timestamp=time.time())
        batch.load.CopyFrom(self._numbered(record, load_only=True, telemetry=True))
        self._sent_any = True
        return batch

    def _record(self, load_only: bool, telemetry: bool) -> common_pb2.EngineLoad:
        return self._numbered(self._load(), load_only, telemetry)

    def _numbered(
        self, record: common_pb2.EngineLoad, load_only: bool, telemetry: bool
    ) -> common_pb2.EngineLoad:
        self._sample += 1
        record.sample = self._sample
        record.load_only = load_only
        if not telemetry:
            for name in ("cache_hit_rate", "num_used_tokens", "max_total_num_tokens", "queues"):
                record.ClearField(name)
        self._last_core = _core(record)
        self._last_sent_at = time.monotonic()
        return record


def _core(record: common_pb2.EngineLoad) -> tuple[object, ...]:
    """The routing inputs of a record: a heartbeat goes out early when these change."""
    return (
        record.running_requests,
        record.waiting_requests,
        round(record.token_usage, 4),
        record.waiting_uncached_tokens,
        record.prefill_pending_tokens,
    )
