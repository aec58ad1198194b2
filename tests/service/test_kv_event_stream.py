"""The SubscribeKvEvents stream: numbering, replay after a cursor, snapshots, restarts and load heartbeats."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2

from engine import AllBlocksCleared, BlockRemoved, BlockStored
from service import kv_event_stream
from service.kv_event_stream import KvEventStream, StreamAborted, block_hash_int64

BLOCK_SIZE = 4


def _digest(number: int) -> bytes:
    return number.to_bytes(32, "big")


def _stored(number: int, parent: int | None) -> BlockStored:
    return BlockStored(
        _digest(number), _digest(parent) if parent is not None else None, (number,) * BLOCK_SIZE
    )


def _load() -> common_pb2.EngineLoad:
    return common_pb2.EngineLoad(
        running_requests=1, waiting_requests=0, token_usage=0.25, max_running_requests=8
    )


def _stream(history_batches: int = 16) -> KvEventStream:
    return KvEventStream(BLOCK_SIZE, _load, history_batches=history_batches)


async def _take(batches: AsyncIterator[common_pb2.KvEventBatch], count: int) -> list[common_pb2.KvEventBatch]:
    taken = []
    async for batch in batches:
        taken.append(batch)
        if len(taken) == count:
            break
    return taken


def _take_now(stream: KvEventStream, start: int, count: int, before_first: bool = True):
    async def run() -> list[common_pb2.KvEventBatch]:
        batches = stream.subscribe(start, before_first)
        try:
            return await asyncio.wait_for(_take(batches, count), timeout=5)
        finally:
            await batches.aclose()

    return asyncio.run(run())


def _live_blocks(batches: list[common_pb2.KvEventBatch]) -> dict[int, tuple[int | None, tuple[int, ...]]]:
    """What a gateway's index holds after applying `batches` in order."""
    live: dict[int, tuple[int | None, tuple[int, ...]]] = {}
    for batch in batches:
        for event in batch.events:
            kind = event.WhichOneof("data")
            if kind == "stored":
                parent = (
                    event.stored.parent_block_hash if event.stored.HasField("parent_block_hash") else None
                )
                for block in event.stored.blocks:
                    assert parent is None or parent in live, "a block stored before its parent"
                    live[block.block_hash] = (parent, tuple(block.token_ids))
                    parent = block.block_hash
            elif kind == "removed":
                for block_hash in event.removed.block_hashes:
                    del live[block_hash]
            else:
                live.clear()
    return live


def test_batches_are_numbered_from_one_and_carry_block_tokens_parents_and_load() -> None:
    stream = _stream()
    stream.publish([_stored(1, None), _stored(2, 1)])
    stream.publish([BlockRemoved(_digest(2))])
    first, second = _take_now(stream, 0, 2)
    assert (first.sequence_number, second.sequence_number) == (1, 2)
    child = first.events[1].stored
    assert child.parent_block_hash == block_hash_int64(_digest(1))
    assert list(child.blocks[0].token_ids) == [2] * BLOCK_SIZE and child.blocks[0].block_size == BLOCK_SIZE
    assert list(second.events[0].removed.block_hashes) == [block_hash_int64(_digest(2))]
    assert first.load.running_requests == 1 and first.load.max_running_requests == 8
    assert second.load.sample == first.load.sample + 1


def test_a_cursor_gets_only_the_batches_after_it() -> None:
    stream = _stream()
    for number in range(1, 5):
        stream.publish([_stored(number, None)])
    (after_two,) = _take_now(stream, 2, 1)
    assert after_two.sequence_number == 3


def test_a_cursor_older_than_the_history_gets_a_snapshot_of_the_live_blocks() -> None:
    stream = _stream(history_batches=2)
    stream.publish([_stored(1, None), _stored(2, 1), _stored(3, 2)])
    stream.publish([_stored(10, None)])
    stream.publish([BlockRemoved(_digest(10))])
    stream.publish([AllBlocksCleared(), _stored(2, None), _stored(3, 2)])
    stream.publish([_stored(1, None)])  # re-stored after its would-be child: a snapshot still starts with it
    everything = {
        block_hash_int64(_digest(2)): (None, (2,) * BLOCK_SIZE),
        block_hash_int64(_digest(3)): (block_hash_int64(_digest(2)), (3,) * BLOCK_SIZE),
        block_hash_int64(_digest(1)): (None, (1,) * BLOCK_SIZE),
    }
    for cursor in (0, 1):
        (snapshot,) = _take_now(stream, cursor, 1)
        assert snapshot.HasField("snapshot") and snapshot.snapshot.count == 1
        assert snapshot.sequence_number == 5, "a snapshot ends at the current sequence"
        assert snapshot.events[0].WhichOneof("data") == "cleared"
        assert _live_blocks([snapshot]) == everything


def test_a_large_snapshot_comes_in_chunks_numbered_up_to_the_current_sequence(monkeypatch) -> None:
    monkeypatch.setattr(kv_event_stream, "SNAPSHOT_CHUNK_BLOCKS", 2)
    stream = _stream(history_batches=1)
    stream.publish([_stored(1, None), _stored(2, 1), _stored(3, 2)])
    stream.publish([_stored(4, None), _stored(5, 4)])
    stream.publish([_stored(6, None)])
    chunks = _take_now(stream, 0, 3)
    assert [chunk.sequence_number for chunk in chunks] == [1, 2, 3]
    assert [chunk.snapshot.index for chunk in chunks] == [0, 1, 2]
    assert len(_live_blocks(chunks)) == 6


def test_a_cursor_past_the_last_batch_means_the_server_restarted() -> None:
    stream = _stream()
    stream.publish([_stored(1, None)])
    with pytest.raises(StreamAborted) as caught:
        _take_now(stream, 7, 1)
    assert caught.value.code == grpc.StatusCode.DATA_LOSS
    assert "subscribe again from 0" in caught.value.message


def test_an_idle_stream_sends_load_only_heartbeats_repeating_the_last_sequence() -> None:
    stream = _stream()
    stream.publish([_stored(1, None)])
    batch, heartbeat = _take_now(stream, 0, 2)
    assert batch.sequence_number == 1 and not batch.load.load_only
    assert heartbeat.load.load_only and heartbeat.sequence_number == 1 and not heartbeat.events
    assert heartbeat.load.token_usage == 0.25 and heartbeat.load.sample == batch.load.sample + 1


def test_load_records_before_the_first_batch_only_when_asked() -> None:
    (heartbeat,) = _take_now(_stream(), 0, 1, before_first=True)
    assert heartbeat.sequence_number == 0 and heartbeat.load.load_only

    async def nothing_within(seconds: float) -> None:
        batches = _stream().subscribe(0, False)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(_take(batches, 1), timeout=seconds)
        await batches.aclose()

    asyncio.run(nothing_within(0.5))


def test_a_batch_published_from_the_engine_thread_reaches_a_waiting_subscriber() -> None:
    stream = _stream()

    async def run() -> common_pb2.KvEventBatch:
        batches = stream.subscribe(0, False)
        publisher = threading.Timer(0.2, stream.publish, args=([_stored(1, None)],))
        publisher.start()
        try:
            (batch,) = await asyncio.wait_for(_take(batches, 1), timeout=5)
            return batch
        finally:
            publisher.join()
            await batches.aclose()

    batch = asyncio.run(run())
    assert batch.sequence_number == 1 and batch.events[0].WhichOneof("data") == "stored"
